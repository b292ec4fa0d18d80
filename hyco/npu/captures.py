"""Capture the training inputs: the verifier teacher-forced over prompt + answer.

One safetensors shard per sequence holds every position's hand-off (hyco/npu/handoff.py): the
verifier's input ids, e(x_j), h_j at the recipe's capture point, and K/V of the last full and
last sliding layer, plus `response_start` (the prompt length). Shards are written one at a
time and streamed back one at a time, so memory stays bounded by one sequence.

Drafting position t (input cat(e(x_{t+1}), h_t), predicting x_{t+2}) counts as a response
position when x_{t+1} is an answer token: t >= response_start - 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from hyco.base.console import progress
from hyco.base.errors import HycoError
from hyco.base.loading import load_safetensors
from hyco.npu.handoff import LAYER_TYPES, handoff_states

TENSORS = ("input_ids", "embeds", "hidden", "k_full", "v_full", "k_sliding", "v_sliding")
_KV_NAMES = {"full_attention": ("k_full", "v_full"), "sliding_attention": ("k_sliding", "v_sliding")}


@dataclass(frozen=True)
class Capture:
    id: str
    split: str
    input_ids: torch.Tensor  # [N]
    embeds: torch.Tensor  # [N, Hb]
    hidden: torch.Tensor  # [N, Hb]
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]  # [kv_heads, N, d]
    response_start: int

    @property
    def drafting_positions(self) -> torch.Tensor:
        """t with x_{t+1} an answer token (t <= N - 2)."""
        return torch.arange(max(self.response_start - 1, 0), self.input_ids.shape[0] - 1)


def shard_name(index: int) -> str:
    return f"capture_{index:05d}.safetensors"


def capture_answers(verifier, answers: list[dict], folder: Path, capture_point: str) -> list[dict]:
    """Write one shard per answer into `folder`; return the index rows for captures.json. Under
    `accelerate launch` each process writes its share of the shards (`hyco.base.launch`) and every
    process gets all the rows."""
    from hyco.base.launch import in_order, my_positions

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    mine = my_positions(len(answers))
    for i in progress(mine, desc="qat: capture", unit="seq", disable=None):
        rec = answers[i]
        ids = torch.tensor(rec["prompt_ids"] + rec["answer_ids"], dtype=torch.long)
        if len(rec["answer_ids"]) < 1:
            rows.append((i, None))  # an empty answer has no drafting position
            continue
        states = handoff_states(verifier, ids, capture_point)
        tensors = {"input_ids": states.input_ids, "embeds": states.embeds, "hidden": states.hidden}
        for layer in LAYER_TYPES:
            k_name, v_name = _KV_NAMES[layer]
            tensors[k_name], tensors[v_name] = states.kv[layer]
        name = shard_name(i)
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(folder / name),
                  metadata={"id": str(rec["id"]), "split": rec["split"], "response_start": str(len(rec["prompt_ids"])),
                            "capture_point": capture_point})
        rows.append((i, {"file": name, "id": rec["id"], "split": rec["split"], "tokens": int(ids.shape[0]),
                         "response_start": len(rec["prompt_ids"])}))
    return [row for row in in_order(rows, len(answers), "qat: capture") if row is not None]


def load_capture(path: Path) -> Capture:
    path = Path(path)
    if not path.is_file():
        raise HycoError(f"capture shard not found: {path}")
    tensors, meta = load_safetensors(path)
    missing = [t for t in TENSORS if t not in tensors]
    if missing or "response_start" not in meta:
        raise HycoError(f"{path}: capture shard lacks {missing or ['metadata response_start']}")
    n = tensors["input_ids"].shape[0]
    for name in TENSORS[1:]:
        axis = 0 if name in ("embeds", "hidden") else 1
        if tensors[name].shape[axis] != n:
            raise HycoError(f"{path}: tensor {name!r} has {tensors[name].shape[axis]} positions, but input_ids has {n}")
    return Capture(
        id=meta.get("id", path.stem), split=meta.get("split", "?"), input_ids=tensors["input_ids"],
        embeds=tensors["embeds"], hidden=tensors["hidden"],
        kv={layer: (tensors[k], tensors[v]) for layer, (k, v) in _KV_NAMES.items()},
        response_start=int(meta["response_start"]),
    )


class CaptureSet:
    """The shards of one split, loaded one at a time on access (memory: one sequence)."""

    def __init__(self, folder: Path, rows: list[dict], split: str):
        self.folder = Path(folder)
        self.rows = [r for r in rows if r["split"] == split]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Capture:
        return load_capture(self.folder / self.rows[i]["file"])

    def __iter__(self) -> Iterator[Capture]:
        for i in range(len(self)):
            yield self[i]
