"""The additive mask's value, chosen from the visible scores' spread.

Gemma 4 attends with scaling 1.0 (QK-norm), so raw scores are not small, and the additive
mask shares the Softmax input's 16-bit range on the HTP (so -1e9 is not an option: -1e4
already costs ~0.018 of softmax accuracy there). A masked slot j of a row gets weight
exp(s_j + m) / (sum_visible exp(s_i) + sum_masked exp(s_k + m)), so the row's masked mass is
sigmoid(d + m) with d = logsumexp(masked s) - logsumexp(visible s). `MaskStats` collects,
per attention layer, the visible scores' spread and the worst d over the calibration passes;
`choose_mask` picks the least negative value (a multiple of 10, never above the recipe's
floor) that keeps the worst row's masked mass below `target` even if d grew by `headroom`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

TARGET = 1e-4  # the required bound on softmax weight over masked slots, per row


def _logsumexp(x: np.ndarray, where: np.ndarray) -> np.ndarray:
    x = np.where(where, x.astype(np.float64), -np.inf)
    top = np.max(x, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return (np.log(np.sum(np.exp(x - top), axis=-1)) + top[..., 0])


@dataclass
class LayerMaskStats:
    rows: int = 0
    max_spread: float = 0.0  # widest visible-score span of any row
    max_d: float = -math.inf  # worst logsumexp(masked) - logsumexp(visible)
    max_visible: float = -math.inf
    min_visible: float = math.inf


@dataclass
class MaskStats:
    layers: dict[str, LayerMaskStats] = field(default_factory=dict)

    def add(self, layer: str, scores: np.ndarray, mask: np.ndarray) -> None:
        """`scores`: raw attention scores [..., rows, keys]; `mask`: the additive mask that was
        added to them (broadcastable; 0 = visible)."""
        mask = np.broadcast_to(mask, scores.shape)
        visible = mask == 0
        masked = ~visible
        rows = visible.any(-1)
        vis_max = np.where(visible, scores, -np.inf).max(-1)
        vis_min = np.where(visible, scores, np.inf).min(-1)
        d = _logsumexp(scores, masked) - _logsumexp(scores, visible)
        st = self.layers.setdefault(layer, LayerMaskStats())
        st.rows += int(rows.sum())
        if rows.any():
            st.max_spread = max(st.max_spread, float((vis_max - vis_min)[rows].max()))
            st.max_visible = max(st.max_visible, float(vis_max[rows].max()))
            st.min_visible = min(st.min_visible, float(vis_min[rows].min()))
            dd = d[rows & masked.any(-1)]
            if dd.size:
                st.max_d = max(st.max_d, float(dd.max()))

    def worst_d(self) -> float:
        return max((s.max_d for s in self.layers.values()), default=-math.inf)


def masked_mass(d: float, negative: float) -> float:
    """A row's total softmax weight on masked slots with mask value `negative`."""
    x = d + negative
    return float(1.0 / (1.0 + math.exp(-x))) if x > -700 else 0.0


def choose_mask(stats: MaskStats, floor: float = -50.0, headroom: float = 10.0, target: float = TARGET) -> dict:
    """The mask value and its margin. `floor` is the least negative value allowed (the
    recipe's); `headroom` (nats) is how much worse than the calibration data a row may be."""
    d = stats.worst_d()
    need = math.log(target) - d - headroom if math.isfinite(d) else floor
    negative = min(floor, -10.0 * math.ceil(-need / 10.0))
    worst = masked_mass(d, negative) if math.isfinite(d) else 0.0
    return {"mask_negative": float(negative), "worst_d": d, "max_masked_mass": worst, "target": target,
            "margin_nats": (math.log(target) - (d + negative)) if math.isfinite(d) else math.inf,
            "headroom_nats": headroom,
            "max_visible_spread": max((s.max_spread for s in stats.layers.values()), default=0.0),
            "per_layer": {k: {"rows": s.rows, "max_spread": s.max_spread, "max_d": s.max_d,
                              "masked_mass_at_choice": masked_mass(s.max_d, negative) if math.isfinite(s.max_d) else 0.0}
                          for k, s in stats.layers.items()}}


def softmax_inputs(model) -> list[tuple[str, str, str]]:
    """(layer label, raw scores tensor, mask-side tensor) for every Softmax fed by an Add."""
    producer = {o: n for n in model.graph.node for o in n.output}
    out = []
    for node in model.graph.node:
        if node.op_type != "Softmax":
            continue
        add = producer.get(node.input[0])
        if add is None or add.op_type != "Add":
            continue
        a, b = add.input
        mask_side = b if _reaches_mask(b, producer, model) else a
        scores = a if mask_side == b else b
        label = node.name or node.output[0]
        out.append((label, scores, mask_side))
    return out


def _reaches_mask(name: str, producer, model) -> bool:
    inputs = {i.name for i in model.graph.input}
    seen = [name]
    while seen:
        x = seen.pop()
        if x in inputs:
            return x.startswith("mask")
        node = producer.get(x)
        if node is not None:
            seen.extend(i for i in node.input if i)
    return False
