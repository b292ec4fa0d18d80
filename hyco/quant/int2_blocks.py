"""The SLM's 2-bit weights as ONNX INT2 in blocks along the input dimension, bit-exact.

convert writes every 2-bit weight of the checkpoint in an INT4 container (the ints lie in
[-2, 1]) with a per-channel DequantizeLinear. ONNX INT2 per channel computes wrong numbers on the
HTP, but INT2 with `block_size` along K (opset 25, IR 13) is right there and ~2 bits a weight
(tests/test_htp_int2.py, bench/bench_int2_blocks.py). `to_int2_blocks` rewrites a QDQ graph's 2-bit
weight DequantizeLinears from INT4 containers to INT2 blocks: the same ints, and every block's
scale the channel's own, so nothing about the numbers changes (onnxruntime CPU computes the same
outputs bit for bit). Its proof (`prove_int2_blocks`) reads every rewritten weight back through
onnx's own INT2 unpacking and compares ints, scales and zero points with the INT4 container's,
element by element; it runs wherever the transform runs, and a mismatch raises ProofFailed.

Whether INT2 blocks ship is decided on the HTP itself (`hyco.qnn.int2_probe`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyco.base.errors import ProofFailed
from hyco.quant.onnx_graph import loaded

INT2_OPSET = 25  # ONNX INT2 in DequantizeLinear
INT2_IR_VERSION = 13
INT2_RANGE = (-2, 1)
# --- the transform and its proof -----------------------------------------------------------------


def pack_int2(values: np.ndarray) -> bytes:
    """ONNX INT2 raw data: two's-complement pairs of bits, element 4k in bits [1:0] of byte k."""
    flat = np.asarray(values, np.int8).reshape(-1)
    flat = np.concatenate([flat, np.zeros(-flat.size % 4, np.int8)])
    bits = flat.view(np.uint8) & 0x03
    return (bits[0::4] | (bits[1::4] << 2) | (bits[2::4] << 4) | (bits[3::4] << 6)).astype(np.uint8).tobytes()


def unpack_int2(raw: bytes, count: int) -> np.ndarray:
    """ONNX INT2 raw data -> `count` int8 values (`pack_int2`'s inverse)."""
    b = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty(4 * b.size, np.int8)
    for i in range(4):
        bits = (b >> (2 * i)) & 0x03
        out[i::4] = bits.astype(np.int8) - ((bits & 0x02) << 1).astype(np.int8)
    return out[:count]


def _ints(t) -> np.ndarray:
    """An INT4 / INT2 / INT8 initializer (values in memory) as int8, through onnx's own unpacking."""
    from onnx import numpy_helper

    return numpy_helper.to_array(t).astype(np.int8)


def _attr(node, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


@dataclass
class _Weight:
    """One 2-bit weight DequantizeLinear: its node and the INT4 container's tensors (`loaded` reads
    them when the weight's turn comes: one INT4 weight in memory at a time)."""

    node: Any
    ints: Any
    scale: Any
    zero: Any  # None: no zero point (0)
    channel_axis: int  # the per-channel scale's axis (output features); K is the other one


def _why_not(node, inits: dict, readers: dict[str, int], block_size: int, folder: Path | None) -> str | None:
    """Why a 2-bit weight's DequantizeLinear stays as it is, or None to rewrite it."""
    from onnx import TensorProto

    ints_t = inits[node.input[0]]
    scale_t = inits.get(node.input[1]) if len(node.input) > 1 else None
    zero_t = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if ints_t.data_type != TensorProto.INT4 or len(ints_t.dims) != 2 or scale_t is None or _attr(node, "block_size", 0):
        return "not a 2-D INT4 weight with one scale per output channel"
    channel = _attr(node, "axis", 1) % 2
    if list(scale_t.dims) != [ints_t.dims[channel]]:
        return "not a 2-D INT4 weight with one scale per output channel"
    if readers[node.input[0]] > 1:
        return f"its ints are read by {readers[node.input[0]]} nodes"
    if zero_t is not None and _ints(loaded(zero_t, folder)).any():
        return "its zero point is not 0"
    k = ints_t.dims[1 - channel]
    if k % block_size:
        return f"its input dimension {k} is not a multiple of the block size {block_size}"
    return None


def _candidates(model, two_bit: Collection[str], block_size: int, folder: Path | None):
    """(weights to rewrite, {name: why it stays in INT4}) among the 2-bit weights' DQs."""
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    chosen, kept = [], {}
    for node in model.graph.node:
        name = node.input[0] if node.op_type == "DequantizeLinear" and node.input else None
        if name not in inits or name not in two_bit:
            continue
        why = _why_not(node, inits, readers, block_size, folder)
        if why:
            kept[name] = why
            continue
        zero = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        chosen.append(_Weight(node, inits[name], inits[node.input[1]], zero, _attr(node, "axis", 1) % 2))
    return chosen, kept


def _blocked(w: _Weight, block_size: int):
    """The INT2 ints, block scales and zero points of `w`: the same ints; every block's scale the
    channel's, laid out as DequantizeLinear's blocked axis (K) needs: [K/B, N] for [K, N] ints."""
    from onnx import TensorProto, helper, numpy_helper

    values = _ints(w.ints)
    low, high = INT2_RANGE
    if values.size and (values.min() < low or values.max() > high):
        bad = np.argwhere((values < low) | (values > high))[0]
        raise ProofFailed(f"int2 blocks: {w.ints.name} is listed as 2-bit, but holds {int(values[tuple(bad)])} at "
                          f"{tuple(int(i) for i in bad)}, outside [{low}, {high}]")
    scale = numpy_helper.to_array(w.scale).astype(np.float32)
    blocks = w.ints.dims[1 - w.channel_axis] // block_size
    block_scale = np.tile(scale, (blocks, 1)) if w.channel_axis == 1 else np.repeat(scale[:, None], blocks, axis=1)
    ints = helper.make_tensor(w.ints.name, TensorProto.INT2, list(w.ints.dims), pack_int2(values), raw=True)
    scales = numpy_helper.from_array(np.ascontiguousarray(block_scale), f"{w.ints.name}_block_scale")
    zero = helper.make_tensor(f"{w.ints.name}_block_zero", TensorProto.INT2, list(block_scale.shape),
                              pack_int2(np.zeros(block_scale.shape, np.int8)), raw=True)
    return ints, scales, zero


def prove_weight(name: str, container: tuple, blocked: tuple, block_axis: int, block_size: int) -> None:
    """One weight read back: `blocked` (INT2 ints, block scales, zero points) against `container`
    (INT4 ints, per-channel scales, zero points or None), all in memory. The INT2 ints (onnx's
    own unpacking) equal the container's element by element, every block's scale is bit-equal
    to its channel's, and every zero point on both sides is 0."""
    from onnx import numpy_helper

    (before_t, channel_scale, channel_zero), (ints, block_scale, zero) = container, blocked
    before, after = _ints(before_t), _ints(ints)
    if before.shape != after.shape:
        raise ProofFailed(f"int2 blocks: {name}: INT2 ints of shape {list(after.shape)} for an INT4 container of "
                          f"{list(before.shape)}")
    if not np.array_equal(before, after):
        where = tuple(int(i) for i in np.argwhere(before != after)[0])
        raise ProofFailed(f"int2 blocks: {name}: the INT2 ints differ from the INT4 container's at {where} "
                          f"({int(after[where])} vs {int(before[where])})")
    want = numpy_helper.to_array(channel_scale).astype(np.float32).reshape(-1).view(np.uint32)
    got = numpy_helper.to_array(block_scale).astype(np.float32)
    k = before.shape[block_axis]
    fits = got.ndim == 2 and got.shape[block_axis] * block_size == k
    rows = np.moveaxis(got, block_axis, 0).reshape(got.shape[block_axis], -1).view(np.uint32) if fits else None
    if rows is None or rows.shape[1] != want.size or not (rows == want).all():
        raise ProofFailed(f"int2 blocks: {name}: a block's scale is not its channel's scale bit for bit "
                          f"(block scales {list(got.shape)} for {k} inputs in blocks of {block_size})")
    if _ints(zero).shape != got.shape or _ints(zero).any() or (channel_zero is not None and _ints(channel_zero).any()):
        raise ProofFailed(f"int2 blocks: {name}: zero points are not all 0 (blocks' shape {list(got.shape)})")


def to_int2_blocks(model, two_bit: Collection[str], block_size: int, folder: Path | None = None) -> dict[str, Any]:
    """Rewrite, in place, the DequantizeLinear of every initializer named in `two_bit` (the
    checkpoint's 2-bit weights: convert's encodings.json, the folded transpose's `_t` names too)
    from its INT4 container to INT2 with `block_size` along K, and move the model to opset 25 / IR
    13 if any was rewritten. `folder`: where the model's external data lie. Each weight is proven
    (`prove_weight`) before it replaces the container; a mismatch raises ProofFailed. A weight that
    cannot be rewritten (its K not a multiple of `block_size`, its ints shared) stays in INT4: the
    returned report lists it and why."""
    from onnx import helper

    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, but got {block_size}")
    chosen, kept = _candidates(model, set(two_bit), block_size, folder)
    replace, added, dropped, bytes_before, bytes_after = {}, [], set(), 0, 0
    for ref in chosen:
        w = _Weight(ref.node, *(None if t is None else loaded(t, folder) for t in (ref.ints, ref.scale, ref.zero)),
                    ref.channel_axis)
        blocked = _blocked(w, block_size)
        block_axis = 1 - w.channel_axis
        prove_weight(w.ints.name, (w.ints, w.scale, w.zero), blocked, block_axis, block_size)
        replace[w.ints.name] = blocked[0]
        added += blocked[1:]
        dropped.update(w.node.input[1:])
        del w.node.input[1:]
        w.node.input.extend([blocked[1].name, blocked[2].name])
        del w.node.attribute[:]
        w.node.attribute.extend([helper.make_attribute("axis", block_axis),
                                 helper.make_attribute("block_size", block_size)])
        bytes_before += (int(np.prod(w.ints.dims)) + 1) // 2
        bytes_after += len(blocked[0].raw_data) + blocked[1].ByteSize()
    if chosen:
        _swap_initializers(model, replace, added, dropped)
        _at_least_opset(model, INT2_OPSET, INT2_IR_VERSION)
    return {"block_size": block_size, "rewritten": sorted(w.ints.name for w in chosen), "kept_in_int4": kept,
            "int4_container_bytes": bytes_before, "int2_block_bytes": bytes_after}


def _swap_initializers(model, replace: dict, added: list, dropped: set[str]) -> None:
    """The INT2 tensors in their containers' places, the blocks' scales and zeros added, and the
    per-channel scales and zero points (`dropped`) that no node reads any more removed."""
    graph = model.graph
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    kept = [replace.get(t.name, t) for t in graph.initializer if t.name in read or t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept + added)


OPSET_BEFORE = "hyco.opset_before_int2_blocks"  # metadata: "opset,ir_version" the graph had before


def _at_least_opset(model, opset: int, ir_version: int) -> None:
    """Opset and IR version raised for INT2; what they were is kept in the model's metadata
    (`restore_opset`)."""
    entry = next(e for e in model.opset_import if e.domain in ("", "ai.onnx"))
    if entry.version >= opset:
        return
    model.metadata_props.add(key=OPSET_BEFORE, value=f"{entry.version},{model.ir_version}")
    entry.version = opset
    model.ir_version = max(model.ir_version, ir_version)


def restore_opset(model) -> bool:
    """A CPU session's copy of a graph whose INT2-block weights were all multiplied packed
    (`hyco.quant.int4_matmul`) holds no INT2 any more: back to the opset it had before `to_int2_blocks`
    raised it (in place; whether it did). onnxruntime's CPU EP lacks some ops at the newer opset:
    RandomUniformLike past 21, which `hyco.quant.perturb` adds."""
    from onnx import TensorProto

    before = {p.key: p.value for p in model.metadata_props}.get(OPSET_BEFORE)
    if before is None or any(t.data_type in (TensorProto.INT2, TensorProto.UINT2) for t in model.graph.initializer):
        return False
    opset, ir_version = (int(x) for x in before.split(","))
    next(e for e in model.opset_import if e.domain in ("", "ai.onnx")).version = opset
    model.ir_version = ir_version
    kept = [p for p in model.metadata_props if p.key != OPSET_BEFORE]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    return True


def block_weights(model) -> dict[str, tuple[Any, Any, Any, int, int]]:
    """Every INT2-block weight DequantizeLinear: ints name -> (ints, block scale, zero point
    tensors, blocked axis, block size), not loaded."""
    from onnx import TensorProto

    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits or not _attr(node, "block_size", 0):
            continue
        if inits[node.input[0]].data_type == TensorProto.INT2 and len(node.input) > 2:
            out[node.input[0]] = (inits[node.input[0]], inits[node.input[1]], inits[node.input[2]],
                                  _attr(node, "axis", 1), _attr(node, "block_size", 0))
    return out


def prove_int2_blocks(source, blocked, folders: tuple[Path | None, Path | None] = (None, None)) -> dict[str, Any]:
    """Every INT2-block weight of `blocked` against the INT4 container of the same name in
    `source` (`prove_weight`): raises ProofFailed on the first mismatch, or on a block weight
    `source` does not hold in INT4; returns how many were proven."""
    inits = {t.name: t for t in source.graph.initializer}
    channel = {n.input[0]: (inits[n.input[0]], inits[n.input[1]], inits.get(n.input[2]) if len(n.input) > 2 else None)
               for n in source.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits and len(n.input) > 1}
    proven = 0
    for name, (ints, scale, zero, axis, size) in block_weights(blocked).items():
        if name not in channel:
            raise ProofFailed(f"int2 blocks: {name} has no INT4 container of that name in the source graph")
        container = tuple(None if t is None else loaded(t, folders[0]) for t in channel[name])
        prove_weight(name, container, tuple(loaded(t, folders[1]) for t in (ints, scale, zero)), axis, size)
        proven += 1
    return {"weights": proven, "all_equal": True}


def two_bit_names(weight_bits: dict[str, int]) -> set[str]:
    """The initializers convert's encodings list at 2 bits (`convert_weight_bits`' map)."""
    return {name for name, bits in weight_bits.items() if bits == 2}


# --- the probe and the decision ------------------------------------------------------------------
