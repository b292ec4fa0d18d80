"""StaticGemma -> ONNX (opset 21) with integer weight initializers, streamed to external data.

torch's TorchScript exporter traces the graph only (`export_params=False`: the weights become
named graph inputs and the exporter serializes none of them). `finalize` then turns each of
those inputs into an initializer, one tensor at a time, into the external-data file: each
IntLinear's ints go in, converted from the checkpoint's packed bytes, as an INT8 initializer
feeding a per-channel DequantizeLinear (constant folding off, so nothing is folded to float),
or, for 2- and 4-bit linears, as INT4 (int2 values travel in INT4 containers here: ONNX INT2 per
channel computes wrong numbers on the HTP; calibrate's deployable graphs hold them as INT2 blocks
where export.two_bit_weights says so, hyco/quant/int2_blocks.py; their 2-bit width goes to
encodings.json). The exporter stops at opset
20, which has no INT4, so the opset is raised to 21, whose changes over 20 only widen types.
Each graph is checked with `onnx.checker.check_model(full_check=True)`.

Memory: the module's packed ints (the checkpoint's bytes) are the only full copy of the
weights alive while the graphs are traced and written; the exporter holds the graph structure
only, and `finalize` holds one tensor's bytes at a time (measured by bench/bench_convert.py,
held by tests/test_convert.py and tests/test_convert_memory.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from hyco.convert.static_model import IntLinear, StaticGemma

from hyco.base.compat_torch import onnx_shape_inference_without
from hyco.formats.int4 import pack_int4
from hyco.npu.io_spec import GraphSpec

OPSET = 21
EXPORT_OPSET = 20  # the TorchScript exporter's maximum


def int_linears(static: StaticGemma) -> dict[str, IntLinear]:
    """Initializer name of each IntLinear's ints (the exporter names buffers by module path)."""
    return {f"{name}.ints": m for name, m in static.named_modules() if isinstance(m, IntLinear)}


EXTERNAL_THRESHOLD = 1024  # bytes: smaller tensors stay inside the .onnx file


def _int2_to_int4_table() -> np.ndarray:
    """uint8 [256, 2]: one Gemma int2 byte (four values + 2, first in bits [1:0]) -> the two
    ONNX INT4 bytes holding the same four values (two's-complement nibbles, low nibble first)."""
    b = np.arange(256, dtype=np.uint8)
    nib = [(((b >> (2 * k)) & 3).astype(np.int16) - 2).astype(np.uint8) & 0x0F for k in range(4)]
    return np.stack([nib[0] | (nib[1] << 4), nib[2] | (nib[3] << 4)], axis=-1).astype(np.uint8)


INT2_TO_INT4 = _int2_to_int4_table()


def _int2_pairs_table() -> np.ndarray:
    """uint32 [65536]: two Gemma int2 bytes read as one little-endian uint16 -> their four ONNX
    INT4 bytes as one little-endian uint32. One lookup per two bytes, from a table that stays in
    cache: about ten times the [256, 2] table's speed on a graph's 2-bit weights."""
    pair = INT2_TO_INT4.copy().view("<u2").reshape(-1).astype(np.uint32)
    both = np.arange(65536)
    return (pair[both & 0xFF] | (pair[both >> 8] << 16)).astype("<u4")


INT2_PAIRS_TO_INT4 = _int2_pairs_table()


def int2_to_int4_bytes(packed: np.ndarray) -> bytes:
    """Gemma int2 bytes -> ONNX INT4 bytes (`INT2_TO_INT4`), two input bytes per lookup."""
    flat = packed.reshape(-1)
    even = flat[:flat.size - flat.size % 2]
    out = np.take(INT2_PAIRS_TO_INT4, even.view("<u2"), mode="clip").tobytes()
    return out + INT2_TO_INT4[flat[even.size:]].tobytes()


def int4_raw(m: IntLinear) -> bytes:
    """ONNX INT4 raw data of a 2/4-bit IntLinear, straight from its packed checkpoint bytes:
    Gemma int4 stores value + 8 per nibble (first value low), ONNX the two's-complement nibble
    ((v + 8) ^ 8 == v & 0xF), so each byte is XORed with 0x88; an int2 byte maps through a
    256-entry table to two INT4 bytes. Rows of an odd number of values (packed rows do not line
    up with ONNX's flat nibble stream) go through unpack + pack_int4. One tensor at a time."""
    packed = m.packed.numpy()
    per_byte = 8 // m.bits
    if m.in_features % per_byte == 0 and m.in_features % 2 == 0:
        if m.bits == 4:
            return (packed ^ np.uint8(0x88)).tobytes()
        return int2_to_int4_bytes(packed)
    return pack_int4(m.int_values().numpy())


def int_tensor(name: str, m: IntLinear):
    """The initializer of an IntLinear's ints: INT4 for 2/4 bits (int2 values in INT4
    containers), INT8 for 8 bits; built from the packed bytes, never from an int8 copy."""
    from onnx import TensorProto, helper, numpy_helper

    if m.bits <= 4:
        return helper.make_tensor(name, TensorProto.INT4, m.shape, int4_raw(m), raw=True)
    return numpy_helper.from_array(m.packed.numpy(), name)


def weight_tensor(name: str, value):
    """One initializer from a module tensor (scales, norms, constants), at the tensor's dtype."""
    from onnx import numpy_helper

    return numpy_helper.from_array(value.detach().cpu().numpy(), name)


def export_raw(static: StaticGemma, rows: int, folder: Path, name: str) -> GraphSpec:
    """torch's export of the module for `rows` rows into `folder` (opset 20), without weights:
    every parameter and buffer is a graph input named by its module path; `finalize` writes them."""
    import torch

    spec = static.io_spec(rows, name)
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad(), onnx_shape_inference_without(set(int_linears(static))):
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        # keep_initializers_as_inputs: no deduplication of equal-valued weights (the ints'
        # all-zero stand-ins are equal by value; so would be two layers with the same ints).
        torch.onnx.export(static, static.example_inputs(rows), str(folder / name), dynamo=False,
                          do_constant_folding=False, opset_version=EXPORT_OPSET, export_params=False,
                          keep_initializers_as_inputs=True,
                          input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs])
    return spec


def finalize(raw: Path, path: Path, params: Mapping, linears: Mapping[str, IntLinear]) -> None:
    """Raw export -> weights as initializers (INT4/INT8 ints from each IntLinear's packed bytes,
    other tensors from `params`, the module's state_dict), opset 21, external data beside
    `path` written one tensor at a time, full check."""
    import onnx
    from onnx.external_data_helper import set_external_data

    model = onnx.load(str(raw))
    graph = model.graph
    weights = [i.name for i in graph.input if i.name in params]
    missing = sorted(set(linears) - set(weights))
    if missing:
        raise RuntimeError(f"exporter renamed integer weights (not found: {missing[:3]})")
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    with open(data, "wb") as f:
        for name in weights:
            tensor = int_tensor(name, linears[name]) if name in linears else weight_tensor(name, params[name])
            if len(tensor.raw_data) >= EXTERNAL_THRESHOLD:
                set_external_data(tensor, data.name, offset=f.tell(), length=len(tensor.raw_data))
                f.write(tensor.raw_data)
                tensor.ClearField("raw_data")
            graph.initializer.append(tensor)
    initialized = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in params and i.name not in initialized]
    del graph.input[:]
    graph.input.extend(inputs)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = OPSET
    model.producer_name = "hyco-convert"
    onnx.save_model(model, str(path))
    del model
    data.chmod(0o644)
    onnx.checker.check_model(str(path), full_check=True)


def export_graph(static: StaticGemma, rows: int, path: Path) -> GraphSpec:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hyco-export-") as tmp:
        spec = export_raw(static, rows, Path(tmp), path.name)
        finalize(Path(tmp) / path.name, path, static.state_dict(), int_linears(static))
    return spec
