"""The SLM Drafter on convert/'s static graphs through onnxruntime (CPU, optimisations off).

Same interface as `SlmTorch` (start / commit / propose). Feeds come from io_spec.json and
hyco/npu/host.py's numpy pieces (LUT lookup, rotary tables, KV ring, masks), as on the phone:
`prefill.onnx` takes the prompt's last `max_prompt` tokens in fixed-size chunks, `tree.onnx`
takes the committed backlog plus the tree in its fixed rows (padding rows inactive), and only
the backlog's rotated K/V rows are written to the ring afterwards.

A tree-only SLM (no prefill graph: one copy of the weights on the phone) prefills through the
tree graph: the prompt in causal chains of the tree's rows, each writing its K/V rows, as a long
backlog already does. The cost is more passes (ceil(L / tree rows) instead of ceil(L / chunk)).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hyco.base.errors import HycoError
from hyco.npu.host import Rope, SlmHost, tree_ancestors, tree_positions
from hyco.npu.io_spec import read_io_spec
from hyco.qnn.ort import ort_session
from hyco.runtime.tree import DraftTree


class SlmOnnx(SlmHost):
    def __init__(self, convert_dir: Path, *, keep_ids: torch.Tensor | None, max_prompt: int, ring_full: int | None = None,
                 graphs: tuple[str, str] = ("tree.onnx", "prefill.onnx"), open_session=None):
        """`graphs`: the tree and prefill graphs' io_spec keys (a prefill key io_spec does not
        list: a tree-only SLM); `open_session(key)` returns an object with onnxruntime's
        `run(names, feeds)` (default: onnxruntime CPU on that file; hyco/runtime/qnn_backend.py
        passes the QNN HTP context binaries of an export bundle)."""
        convert_dir = Path(convert_dir)
        specs = read_io_spec(convert_dir / "io_spec.json")
        for name in (graphs[0], *(g for g in graphs[1:] if g in specs)):  # no prefill in io_spec: tree-only
            if name not in specs or (open_session is None and not (convert_dir / name).is_file()):
                raise HycoError(f"{convert_dir}: no {name} (run the convert stage first)")
        tree_spec = specs[graphs[0]]
        meta = tree_spec.meta
        if keep_ids is None and meta.get("keep_set"):
            raise HycoError(f"{convert_dir}/io_spec.json: tree.onnx predicts over the keep set {meta['keep_set']}; "
                            "the check needs that keep set (add vocab to the recipe's stages)")
        if keep_ids is not None and meta.get("keep_size") != len(keep_ids):
            raise HycoError(f"{convert_dir}/io_spec.json: tree.onnx restricts to {meta.get('keep_size')} tokens, "
                            f"but the keep set has {len(keep_ids)}")
        full_slots = {r["slots"] for r in meta["rings"] if r["layer_type"] == "full_attention"}
        if ring_full is not None and full_slots and full_slots != {ring_full}:
            raise HycoError(f"{convert_dir}/io_spec.json: tree.onnx has {sorted(full_slots)} full-attention ring slots, "
                            f"but the check expects convert.ring_full {ring_full}")
        self.keep_ids = keep_ids.numpy() if keep_ids is not None else None
        open_session = open_session or (lambda name: ort_session(convert_dir / name))
        keys = {"tree": graphs[0]} | ({"prefill": graphs[1]} if graphs[1] in specs else {})
        super().__init__({role: specs[key] for role, key in keys.items()},
                         {role: open_session(key) for role, key in keys.items()},
                         convert_dir / "luts", Rope.from_json(convert_dir / "rope.json"))
        self.prefill_graph = "prefill" if "prefill" in keys else "tree"
        self.max_prompt = min(max_prompt, int(meta.get("max_prompt", max_prompt)))
        self.committed = 0
        self.backlog: list[int] = []

    @property
    def tree_spec(self):
        return self.specs["tree"]

    @property
    def prefill_spec(self):
        return self.specs[self.prefill_graph]

    def _run(self, graph: str, tokens: list[int], parents: list[int]) -> dict[str, np.ndarray]:
        rows = self.specs[graph].meta["rows"]
        n = len(tokens)
        pad = rows - n
        parents = list(parents) + [-1] * pad
        positions = tree_positions(parents, self.committed)
        feeds = self.feeds(graph, list(tokens) + [0] * pad, positions, tree_ancestors(parents), np.arange(rows) < n)
        session = self.sessions[graph]
        if hasattr(session, "active_rows"):  # smoke's comparing session: padding rows' outputs are never read
            session.active_rows = n
        out = self.run(graph, feeds)
        out["positions"] = positions
        return out

    def _write(self, out: dict[str, np.ndarray], count: int) -> None:
        self.write(out, np.arange(count), out["positions"][:count])
        self.committed += count

    def start(self, prompt: list[int]) -> None:
        kept = prompt[-self.max_prompt:]
        self.committed = len(prompt) - len(kept)
        chunk = self.prefill_spec.meta["rows"]
        for start in range(0, len(kept), chunk):
            piece = kept[start:start + chunk]
            out = self._run(self.prefill_graph, piece, [-1] + list(range(len(piece) - 1)))
            self._write(out, len(piece))

    def commit(self, tokens: list[int]) -> None:
        self.backlog.extend(tokens)

    @property
    def cached(self) -> int:
        """Context tokens whose K/V rows are in the ring (the backlog's are not yet)."""
        return self.committed

    def rewind(self, keep: int, backlog: list[int]) -> None:
        """Keep the first `keep` context rows and run `backlog` in front of the next pass (the
        token bridge's re-tokenized tail). On the phone this is a mask edit: the ring's slots of
        positions >= keep are marked empty (`KVRing.truncate`), nothing is copied."""
        self.ring.truncate(keep)
        self.committed = keep
        self.backlog = list(backlog)

    def propose(self, tree: DraftTree, nodes: list[int], topk: int) -> dict[int, tuple[list[int], list[float]]]:
        rows = self.tree_spec.meta["rows"]
        if len(self.backlog) + len(tree) > rows:  # no room: the backlog takes a pass of its own
            out = self._run("tree", self.backlog, [-1] + list(range(len(self.backlog) - 1)))
            self._write(out, len(self.backlog))
            self.backlog = []
        if len(tree) > rows:
            raise HycoError(f"tree.onnx has {rows} rows, but the tree has {len(tree)} nodes")
        lead = len(self.backlog)
        tokens = self.backlog + tree.tokens
        parents = [i - 1 for i in range(lead)] + [p + lead if p >= 0 else lead - 1 for p in tree.parents]
        out = self._run("tree", tokens, parents)
        self._write(out, lead)
        self.backlog = []
        k = min(topk, out["topk_indices"].shape[-1])
        result = {}
        for node in nodes:
            keep_index = out["topk_indices"][lead + node, :k]
            ids = self.keep_ids[keep_index] if self.keep_ids is not None else keep_index
            result[node] = ([int(i) for i in ids], [float(x) for x in out["topk_logprobs"][lead + node, :k]])
        return result
