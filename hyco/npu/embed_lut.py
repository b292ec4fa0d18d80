"""`embed_lut.safetensors`: the verifier's input embeddings of the kept tokens, 8-bit.

The drafter embeds its own drafted tokens on the phone (the hand-off only carries e(x_{t+1})
for the first step), so it needs e(x) for every token it can draft: the keep set. Rows are
stored as the head consumes them (scaled by sqrt(H)), int8 with one float32 scale per row;
`EmbedLut.rows` is the reader (numpy, no torch: the phone's CPU runs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from hyco.base.errors import HycoError
from hyco.base.loading import load_safetensors
from hyco.npu.handoff import embed_tokens

EMBED_LUT = "embed_lut.safetensors"


@torch.no_grad()
def write_embed_lut(path: Path, verifier, keep_to_vocab: np.ndarray, chunk: int = 4096) -> dict:
    """Quantize e(x) of the kept tokens row by row (in chunks: the table is 86K x H on the real model)."""
    values, scales = [], []
    ids = torch.as_tensor(np.asarray(keep_to_vocab), dtype=torch.long)
    for start in range(0, len(ids), chunk):
        rows = embed_tokens(verifier, ids[start:start + chunk].to(verifier.device)).float().cpu().numpy()
        scale = np.maximum(np.abs(rows).max(axis=1, keepdims=True) / 127.0, 1e-12).astype(np.float32)
        values.append(np.clip(np.rint(rows / scale), -127, 127).astype(np.int8))
        scales.append(scale)
    save_file({"values": np.concatenate(values), "scales": np.concatenate(scales),
               "keep_to_vocab": np.asarray(keep_to_vocab, dtype=np.int32)}, str(path),
              metadata={"format": "int8 rows, float32 scale per row; rows = verifier scaled input embedding"})
    return {"rows": int(len(ids)), "bytes": int(Path(path).stat().st_size)}


@dataclass(frozen=True)
class EmbedLut:
    values: np.ndarray  # int8 [keep, Hb]
    scales: np.ndarray  # float32 [keep, 1]
    keep_to_vocab: np.ndarray  # int32 [keep]

    @classmethod
    def load(cls, path: Path) -> EmbedLut:
        path = Path(path)
        if not path.is_file():
            raise HycoError(f"embedding LUT not found: {path}")
        t, _ = load_safetensors(path, framework="numpy")
        for name, dtype in (("values", np.int8), ("scales", np.float32), ("keep_to_vocab", np.int32)):
            if name not in t or t[name].dtype != dtype:
                raise HycoError(f"{path}: tensor {name!r} must be {np.dtype(dtype).name}")
        if t["scales"].shape != (t["values"].shape[0], 1) or t["keep_to_vocab"].shape != (t["values"].shape[0],):
            raise HycoError(f"{path}: tensor 'scales'/'keep_to_vocab' must have one row per LUT row")
        return cls(t["values"], t["scales"], t["keep_to_vocab"])

    def rows(self, keep_indices) -> np.ndarray:
        """float32 [n, Hb] embeddings of keep indices (what `topk_ids` of the step graph holds)."""
        idx = np.asarray(keep_indices, dtype=np.int64).reshape(-1)
        return self.values[idx].astype(np.float32) * self.scales[idx]
