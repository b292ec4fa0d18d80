"""StaticGemma -> ONNX (opset 21) with integer weight initializers.

torch's TorchScript exporter writes each IntLinear as an INT8 initializer feeding a
per-channel DequantizeLinear (constant folding off, so nothing is folded to float). It stops
at opset 20, which has no INT4, so afterwards the initializers of 2- and 4-bit linears are
re-typed to INT4 (int2 values travel in INT4 containers: the HTP computes wrong numbers on
ONNX INT2; their 2-bit width goes to encodings.json) and the opset is raised to 21, whose
changes over 20 only widen types. Weights go to external data; each graph is checked with
`onnx.checker.check_model(full_check=True)`.
"""

from __future__ import annotations

import warnings
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


def retype_weights(model, bits: dict[str, int]) -> None:
    from onnx import TensorProto, helper, numpy_helper

    by_name = {t.name: i for i, t in enumerate(model.graph.initializer)}
    missing = sorted(set(bits) - set(by_name))
    if missing:
        raise RuntimeError(f"exporter renamed integer weights (not found: {missing[:3]})")
    for name, b in bits.items():
        i = by_name[name]
        if b <= 4:
            ints = numpy_helper.to_array(model.graph.initializer[i])
            tensor = helper.make_tensor(name, TensorProto.INT4, ints.shape, pack_int4(ints), raw=True)
            model.graph.initializer[i].CopyFrom(tensor)


def export_raw(static: StaticGemma, rows: int, folder: Path, name: str) -> GraphSpec:
    """torch's export of the module for `rows` rows into `folder` (opset 20, INT8 weights).
    Separate from `finalize` so the module can be freed before the graphs are rewritten."""
    import torch

    spec = static.io_spec(rows, name)
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(static, static.example_inputs(rows), str(folder / name), dynamo=False,
                          do_constant_folding=False, opset_version=EXPORT_OPSET,
                          input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs])
    return spec


def finalize(raw: Path, path: Path, bits: dict[str, int]) -> None:
    """Raw export -> INT4/INT8 weights, opset 21, external data beside `path`, full check."""
    import onnx

    model = onnx.load(str(raw))
    retype_weights(model, bits)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = OPSET
    model.producer_name = "hyco-convert"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    del model
    data.chmod(0o644)
    onnx.checker.check_model(str(path), full_check=True)


def export_graph(static: StaticGemma, rows: int, path: Path) -> GraphSpec:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hyco-export-") as tmp:
        spec = export_raw(static, rows, Path(tmp), path.name)
        finalize(Path(tmp) / path.name, path, weight_bits(static))
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
