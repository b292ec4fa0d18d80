"""StaticGemma -> ONNX (opset 21) with integer weight initializers, streamed to external data.

torch's TorchScript exporter traces the graph only (`export_params=False`: the weights become
named graph inputs and the exporter serializes none of them). `finalize` then turns each of
those inputs into an initializer, one tensor at a time, straight from the module's buffers
into the external-data file: each IntLinear's ints go in as an INT8 initializer feeding a
per-channel DequantizeLinear (constant folding off, so nothing is folded to float), or, for
2- and 4-bit linears, as INT4 (int2 values travel in INT4 containers: the HTP computes wrong
numbers on ONNX INT2; their 2-bit width goes to encodings.json). The exporter stops at opset
20, which has no INT4, so the opset is raised to 21, whose changes over 20 only widen types.
Each graph is checked with `onnx.checker.check_model(full_check=True)`.

Memory: the module's unpacked ints are the only full copy of the weights alive while the
graphs are traced and written; the exporter holds the graph structure only, and `finalize`
holds one tensor's bytes at a time (measured by bench/bench_convert.py, held by a test).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from hyco.convert.static_model import IntLinear, StaticGemma

from hyco.io_spec import GraphSpec

OPSET = 21
EXPORT_OPSET = 20  # the TorchScript exporter's maximum


def pack_int4(ints: np.ndarray) -> bytes:
    """ONNX INT4 raw data: two's-complement nibbles, element 2k in the low nibble of byte k."""
    flat = ints.astype(np.int8).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    nibbles = flat.view(np.uint8) & 0x0F
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_int4(raw: bytes, count: int) -> np.ndarray:
    b = np.frombuffer(raw, dtype=np.uint8)
    nibbles = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(-1)[:count].astype(np.int16)
    return np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.int8)


def int_linears(static: StaticGemma) -> dict[str, IntLinear]:
    """Initializer name of each IntLinear's ints (the exporter names buffers by module path)."""
    return {f"{name}.ints": m for name, m in static.named_modules() if isinstance(m, IntLinear)}


def weight_bits(static: StaticGemma) -> dict[str, int]:
    return {name: m.bits for name, m in int_linears(static).items()}


EXTERNAL_THRESHOLD = 1024  # bytes: smaller tensors stay inside the .onnx file


def weight_tensor(name: str, value, bits: int | None):
    """One initializer from a module tensor: INT4 for 2/4-bit ints, else the tensor's dtype."""
    from onnx import TensorProto, helper, numpy_helper

    array = value.detach().cpu().numpy()
    if bits is not None and bits <= 4:
        return helper.make_tensor(name, TensorProto.INT4, array.shape, pack_int4(array), raw=True)
    return numpy_helper.from_array(array, name)


def export_raw(static: StaticGemma, rows: int, folder: Path, name: str) -> GraphSpec:
    """torch's export of the module for `rows` rows into `folder` (opset 20), without weights:
    every parameter and buffer is a graph input named by its module path; `finalize` writes them."""
    import torch

    spec = static.io_spec(rows, name)
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(static, static.example_inputs(rows), str(folder / name), dynamo=False,
                          do_constant_folding=False, opset_version=EXPORT_OPSET, export_params=False,
                          input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs])
    return spec


def finalize(raw: Path, path: Path, params: Mapping, bits: dict[str, int]) -> None:
    """Raw export -> weights as initializers (INT4/INT8 ints), opset 21, external data beside
    `path` written one tensor at a time from `params` (the module's state_dict), full check."""
    import onnx
    from onnx.external_data_helper import set_external_data

    model = onnx.load(str(raw))
    graph = model.graph
    weights = [i.name for i in graph.input if i.name in params]
    missing = sorted(set(bits) - set(weights))
    if missing:
        raise RuntimeError(f"exporter renamed integer weights (not found: {missing[:3]})")
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    with open(data, "wb") as f:
        for name in weights:
            tensor = weight_tensor(name, params[name], bits.get(name))
            if len(tensor.raw_data) >= EXTERNAL_THRESHOLD:
                set_external_data(tensor, data.name, offset=f.tell(), length=len(tensor.raw_data))
                f.write(tensor.raw_data)
                tensor.ClearField("raw_data")
            graph.initializer.append(tensor)
    inputs = [i for i in graph.input if i.name not in params]
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
        finalize(Path(tmp) / path.name, path, static.state_dict(), weight_bits(static))
    return spec


def ort_session(path: Path, optimize: bool = False):
    """onnxruntime CPU session; graph optimisations off by default, since SRQ rounding is
    sensitive to summation order (the default optimisations flipped a few rounds)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
