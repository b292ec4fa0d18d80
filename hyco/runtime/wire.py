"""The link between server and phone: the 8-bit hand-off and the byte counts the report shows.

The paper (appendix, "hand-off") sends the MTP Drafter's inputs as 8-bit integers: e(x_{t+1})
and h_t once per round, and the K/V rows of the last full and last sliding layer per committed
token. Every row uses hyco/npu/handoff.py's wire format (int8, symmetric, one float16 scale per row),
and the drafter receives the dequantized values, so drafting sees what the phone would see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyco.npu.handoff import dequantize_kv_rows, kv_wire_bytes, quantize_kv_rows
from hyco.runtime.verifier import Handoff


@dataclass(frozen=True)
class WireCount:
    per_round: int  # e and h
    kv: int  # K/V rows of the newly committed tokens
    kv_rows: int  # how many committed tokens those rows cover


def _through_int8(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(1, -1, x.shape[-1]).numpy()
    q, scale = quantize_kv_rows(rows)
    return torch.from_numpy(dequantize_kv_rows(q, scale)).reshape(x.shape)


def send(handoff: Handoff, quantize: bool) -> tuple[Handoff, WireCount]:
    """The hand-off as the phone receives it, and its size on the wire (8-bit even when
    `quantize` is off, since the count is what the link would carry)."""
    hidden_size = handoff.embed.shape[-1]
    per_round = 2 * kv_wire_bytes(1, 1, hidden_size)  # e and h: one int8 row + scale each
    kv_bytes, rows = 0, 0
    for k, v in handoff.new_kv.values():
        kv_bytes += kv_wire_bytes(k.shape[0], k.shape[1], k.shape[2]) + kv_wire_bytes(v.shape[0], v.shape[1], v.shape[2])
        rows = k.shape[1]
    count = WireCount(per_round, kv_bytes, rows)
    if not quantize:
        return handoff, count
    received = Handoff(
        _through_int8(handoff.embed[None])[0],
        _through_int8(handoff.hidden[None])[0],
        {t: (_through_int8(k), _through_int8(v)) for t, (k, v) in handoff.new_kv.items()},
        handoff.position,
    )
    return received, count


def kv_bytes_per_token(kv_shapes: dict[str, tuple[int, int]]) -> int:
    """Bytes per committed token for layer type -> (kv_heads, head_dim): K and V rows of each."""
    return int(sum(2 * kv_wire_bytes(heads, 1, dim) for heads, dim in kv_shapes.values()))


def handoff_bytes_per_round(hidden_size: int) -> int:
    return int(2 * kv_wire_bytes(1, 1, hidden_size))

