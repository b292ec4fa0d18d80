"""`io_spec.json`: every input and output of a static graph, in one place.

convert/ and qat/ write it beside their graphs; the runtime builds its feeds from it rather
than from hard-coded names. Shapes are fixed (static graphs); dtypes use numpy names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hyco.base.errors import HycoError
from hyco.base.files import write_json
from hyco.base.loading import read_json


class Role(enum.Enum):
    """What a graph tensor is to the host that feeds and reads it."""

    KV_RING = "KV ring in"  # k_ring_L / v_ring_L: the host's ring, fed every pass
    NEW_KV = "new KV out"  # new_k_L / new_v_L: this pass's rows, written into the ring
    MASK = "mask"  # mask_full / mask_sliding: additive attention masks
    ROPE = "rope"  # cos_* / sin_*: rotary rows from the host's tables
    TOPK = "top-k"  # topk_logprobs / topk_indices / topk_ids
    LOGITS = "logits"
    ROWS = "rows"  # everything else: token and per-layer rows, hidden states, parity taps


_ROLE_PREFIXES = ((("k_ring_", "v_ring_"), Role.KV_RING), (("new_k_", "new_v_"), Role.NEW_KV),
                  (("mask_",), Role.MASK), (("cos_", "sin_"), Role.ROPE), (("topk_",), Role.TOPK),
                  (("logits",), Role.LOGITS))


def role_of(name: str) -> Role:
    """The role of a graph tensor, from the names convert and qat give their graphs' tensors."""
    return next((role for prefixes, role in _ROLE_PREFIXES if name.startswith(prefixes)), Role.ROWS)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: "float32", "int64", "uint8", ...
    meaning: str
    # Quantized graphs (calibrate/): {"dtype": "uint8"|"uint16", "scale": float, "zero_point": int} of the
    # tensor's grid (value = scale * (code - zero_point)); None for float graphs. A uint8/uint16 `dtype`
    # means the graph itself takes/returns the codes; a float dtype with `quant` means the graph
    # quantizes/dequantizes at its boundary on that grid.
    quant: dict[str, Any] | None = None

    def zeros(self) -> np.ndarray:
        return np.zeros(self.shape, dtype=self.dtype)

    @property
    def role(self) -> Role:
        return role_of(self.name)

    @property
    def takes_codes(self) -> bool:
        """The graph itself takes or returns this tensor's integer codes (not float values)."""
        return self.quant is not None and self.dtype in ("uint8", "uint16")

    def to_codes(self, values: np.ndarray) -> np.ndarray:
        """Float values -> codes on the tensor's grid, as ONNX QuantizeLinear computes them
        (float32 division, round half to even, saturate to the code type)."""
        q, info = self.quant, np.iinfo(self.dtype)
        codes = np.rint(np.asarray(values, np.float32) / np.float32(q["scale"])) + q["zero_point"]
        return np.clip(codes, info.min, info.max).astype(self.dtype)

    def from_codes(self, codes: np.ndarray) -> np.ndarray:
        """Codes -> float32 values, as ONNX DequantizeLinear computes them."""
        q = self.quant
        return (np.asarray(codes).astype(np.float32) - np.float32(q["zero_point"])) * np.float32(q["scale"])

    def check(self, array: np.ndarray, graph: str) -> None:
        if tuple(array.shape) != self.shape or str(array.dtype) != self.dtype:
            raise HycoError(f"{graph}: input {self.name!r} must be {self.dtype}{list(self.shape)}, "
                            f"but got {array.dtype}{list(array.shape)}")


@dataclass(frozen=True)
class GraphSpec:
    graph: str  # file name of the graph, e.g. "tree.onnx"
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def input(self, name: str) -> TensorSpec:
        return _find(self.inputs, name, self.graph)

    def output(self, name: str) -> TensorSpec:
        return _find(self.outputs, name, self.graph)

    def example_inputs(self) -> dict[str, np.ndarray]:
        return {t.name: t.zeros() for t in self.inputs}

    def check_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        names = {t.name for t in self.inputs}
        missing, extra = names - set(feeds), set(feeds) - names
        if missing or extra:
            raise HycoError(f"{self.graph}: feeds missing {sorted(missing)}, unexpected {sorted(extra)}")
        for t in self.inputs:
            t.check(feeds[t.name], self.graph)

    def to_dict(self) -> dict[str, Any]:
        tensor = lambda t: {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "meaning": t.meaning,
                            **({"quant": t.quant} if t.quant is not None else {})}
        return {"graph": self.graph, "inputs": [tensor(t) for t in self.inputs],
                "outputs": [tensor(t) for t in self.outputs], "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GraphSpec:
        tensor = lambda t: TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t["meaning"], t.get("quant"))
        return cls(d["graph"], tuple(map(tensor, d["inputs"])), tuple(map(tensor, d["outputs"])), d.get("meta", {}))


def _find(tensors: tuple[TensorSpec, ...], name: str, graph: str) -> TensorSpec:
    for t in tensors:
        if t.name == name:
            return t
    raise HycoError(f"{graph}: no tensor named {name!r} (has: {', '.join(t.name for t in tensors)})")


def write_io_spec(path: Path, graphs: list[GraphSpec]) -> Path:
    return write_json(path, {"version": 1, "graphs": [g.to_dict() for g in graphs]})


def read_io_spec(path: Path) -> dict[str, GraphSpec]:
    data = read_json(path, "io_spec.json")
    try:
        return {g["graph"]: GraphSpec.from_dict(g) for g in data["graphs"]}
    except (KeyError, TypeError) as e:
        raise HycoError(f"{path}: malformed io_spec ({e})") from None


# role -> calibrate's QDQ graph file (calibrate's and the bundle's io_spec.json are keyed by these)
GRAPHS = {"tree": "tree.qdq.onnx", "prefill": "prefill.qdq.onnx", "mtp_step": "mtp_step.qdq.onnx"}
