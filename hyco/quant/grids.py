"""Integer grids of quantized tensors (value = scale * (code - zero_point)), shared by the stages
that choose them (qat's step graph inputs, calibrate's boundary overrides) and the host code that
feeds a graph's float inputs.

Why a grid must hold the ends of its range: a graph input quantized on the HTP does not saturate.
A value above the grid's top wraps around (cos = 1.0, just above a calibrated grid's top, came
back as -1.0 on the simulator), where onnxruntime's QuantizeLinear clamps. So an input
whose range is known by construction (rotary tables, LUT rows, masks) gets a grid that holds that
whole range, and the host clamps every float input to its grid before a pass (`clamp_to_grid`), so
a value beyond a calibrated range (the MTP's hidden state above its p99.99) saturates on both.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

UINT16_TOP = 65535


def uint16_grid(lo: float, hi: float) -> tuple[float, int]:
    """(scale, zero_point) of a uint16 grid on which every value of [lo, hi] (widened to hold 0)
    lies, both ends included, in float32 as QuantizeLinear computes: the zero point is rounded up
    (onnxruntime rounds it to nearest, which can leave the top half a step outside, as it does for
    [-1, 1]) and the scale then grown until the top is reached."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = max(hi - lo, 1e-8) / UINT16_TOP
    zero = min(UINT16_TOP, math.ceil(-lo / scale - 1e-9)) if lo < 0 else 0
    if zero < UINT16_TOP:
        scale = max(scale, hi / (UINT16_TOP - zero))
    if zero > 0:
        scale = max(scale, -lo / zero)
    s = np.float32(scale)
    while (np.float32(UINT16_TOP - zero) * s < np.float32(hi)) or (np.float32(-zero) * s > np.float32(lo)):
        s = np.nextafter(s, np.float32(np.inf))
    return float(s), int(zero)


def grid_range(quant: dict[str, Any]) -> tuple[float, float]:
    """The real interval a grid ({"dtype", "scale", "zero_point"}) represents."""
    info = np.iinfo(quant["dtype"])
    s, z = float(quant["scale"]), int(quant["zero_point"])
    return (info.min - z) * s, (info.max - z) * s


def clamp_to_grid(x: np.ndarray, quant: dict[str, Any] | None) -> np.ndarray:
    """A float input clamped into its grid's interval (unchanged without a grid)."""
    if quant is None:
        return x
    lo, hi = grid_range(quant)
    return np.clip(x, np.float32(lo), np.float32(hi)).astype(x.dtype, copy=False)
