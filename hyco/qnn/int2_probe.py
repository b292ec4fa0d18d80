"""How the SLM's 2-bit weights ship, decided on the HTP: `decide` turns the recipe's
`export.two_bit_weights` into the encoding that ships and why. `auto` compiles a one-MatMul
INT2-block graph (`hyco.quant.int2_blocks`' format) for the recipe's SoC and runs it on the HTP
simulator against a float reference (`probe`, once per process and QNN library version).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyco.qnn.contexts import compile_and_run
from hyco.quant.int2_blocks import INT2_IR_VERSION, INT2_OPSET, INT2_RANGE

# What the probe holds the HTP's INT2-block MatMul to: the tolerance calibrate's op-by-op check
# holds every MatMul to (7 top bits of a 16-bit grid: 512 codes, calibrate/htp.py KEPT_BITS).
# Right kernels measured 15-17 codes, INT2 per channel ~60,000.
PROBE_TOLERANCE_CODES = 512
PROBE_ROWS = 33  # the tree graph's rows
PROBE_OUT_FEATURES = 128


@dataclass(frozen=True)
class TwoBitDecision:
    """How the 2-bit weights ship: `encoding` "int2-blocks" (INT2, `block_size` along K) or
    "int4-containers", `asked` the recipe's setting, `why` in words, `probe` what auto measured."""

    encoding: str
    block_size: int | None
    asked: str
    why: str
    probe: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        return f"INT2 blocks of {self.block_size}" if self.encoding == "int2-blocks" else "INT4 containers"


def matmul_graph(weights: np.ndarray, scales: np.ndarray, encoding: str, block_size: int | None,
                 x_scale: float, y_scale: float, rows: int = PROBE_ROWS):
    """x [rows, K] on a uint16 grid, times the [K, N] `weights` (ints) x `scales` (per output
    channel), out on a uint16 grid: a 16-bit-activation layer as calibrate writes it. `encoding`:
    "int4-containers" (INT4, per channel, opset 21), "int2-blocks" (INT2 blocks of `block_size`
    along K, opset 25 / IR 13) or "int2-channel" (INT2 per channel, which the HTP gets wrong)."""
    import ml_dtypes
    from onnx import TensorProto, helper, numpy_helper

    k, n = weights.shape
    if encoding == "int2-blocks":
        block = np.tile(scales.astype(np.float32), (k // block_size, 1))
        w = [numpy_helper.from_array(weights.astype(ml_dtypes.int2), "w_q"), numpy_helper.from_array(block, "w_s"),
             numpy_helper.from_array(np.zeros(block.shape, ml_dtypes.int2), "w_z")]
        dq = helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"], axis=0, block_size=block_size)
    else:
        kind = ml_dtypes.int4 if encoding == "int4-containers" else ml_dtypes.int2
        w = [numpy_helper.from_array(weights.astype(kind), "w_q"), numpy_helper.from_array(scales.astype(np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(n, kind), "w_z")]
        dq = helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"], axis=1)
    grid = [numpy_helper.from_array(np.array(x_scale, np.float32), "x_s"),
            numpy_helper.from_array(np.array(32768, np.uint16), "zp"),
            numpy_helper.from_array(np.array(y_scale, np.float32), "y_s")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_s", "zp"], ["xd"]), dq,
             helper.make_node("MatMul", ["xd", "wd"], ["m"]),
             helper.make_node("QuantizeLinear", ["m", "y_s", "zp"], ["mq"]),
             helper.make_node("DequantizeLinear", ["mq", "y_s", "zp"], ["y"])]
    graph = helper.make_graph(nodes, "one_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], w + grid)
    opset = 21 if encoding == "int4-containers" else INT2_OPSET
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset == 21 else INT2_IR_VERSION
    return model


@dataclass(frozen=True)
class MatMulCase:
    """A seeded layer for `matmul_graph`: 2-bit ints, scales, 16-bit input and output grids that
    hold the input and the float reference, and that reference (float64, from the input's codes)."""

    weights: np.ndarray
    scales: np.ndarray
    x: np.ndarray
    x_scale: float
    y_scale: float
    reference: np.ndarray

    @classmethod
    def draw(cls, k: int, n: int, rows: int = PROBE_ROWS, seed: int = 0) -> MatMulCase:
        rng = np.random.default_rng(seed)
        weights = rng.integers(INT2_RANGE[0], INT2_RANGE[1] + 1, (k, n)).astype(np.int8)
        scales = (0.02 + 0.01 * rng.random(n)).astype(np.float32)
        x = (rng.standard_normal((rows, k)) * 0.3).astype(np.float32)
        x_scale = float(np.abs(x).max() / 32000)
        on_grid = (np.clip(np.rint(x / np.float32(x_scale)) + 32768, 0, 65535) - 32768) * np.float64(np.float32(x_scale))
        reference = on_grid @ (weights.astype(np.float64) * scales.astype(np.float64))
        return cls(weights, scales, x, x_scale, float(np.abs(reference).max() / 32000), reference)

    def codes_off(self, y: np.ndarray) -> float:
        """The largest difference from the float reference, in output grid steps."""
        return float(np.abs(y.astype(np.float64) - self.reference).max() / self.y_scale)


def _probe_job(soc_model: int, block_size: int) -> dict[str, Any]:
    """(A worker's job: HTP results leak between sessions in one process.) One INT2-block layer
    on the HTP against its float reference."""
    import tempfile

    k = block_size * max(1, -(-256 // block_size))
    case = MatMulCase.draw(k, PROBE_OUT_FEATURES)
    model = matmul_graph(case.weights, case.scales, "int2-blocks", block_size, case.x_scale, case.y_scale)
    row = {"soc_model": soc_model, "block_size": block_size, "shape": [PROBE_ROWS, k, PROBE_OUT_FEATURES],
           "tolerance_codes": PROBE_TOLERANCE_CODES}
    with tempfile.TemporaryDirectory(prefix="hyco-int2-probe-") as tmp:
        try:
            run = compile_and_run(model, Path(tmp), soc_model, case.x)
        except Exception as e:  # a refused graph or a QNN error: INT2 blocks are not usable here
            return {**row, "right": False, "error": str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__}
    codes = case.codes_off(run["y"])
    return {**row, "right": codes <= PROBE_TOLERANCE_CODES, "max_codes": round(codes, 2),
            "binary_bytes": run["binary_bytes"]}


_probes: dict[tuple, dict[str, Any]] = {}


def qnn_version() -> str | None:
    try:
        import onnxruntime_qnn
    except ImportError:
        return None
    return getattr(onnxruntime_qnn, "__version__", "unknown")


def probe(soc_model: int, block_size: int) -> dict[str, Any]:
    """Whether the installed QNN libraries compute INT2 blocks of `block_size` right for
    `soc_model` (`_probe_job`, in a worker process), once per process and library version."""
    from hyco.base.workers import in_processes

    version = qnn_version()
    key = (version, soc_model, block_size)
    if key not in _probes:
        if version is None:
            return {"right": False, "error": "onnxruntime-qnn is not installed", "soc_model": soc_model,
                    "block_size": block_size}
        result = in_processes(_probe_job, [(soc_model, block_size)], "probing INT2 blocks on the QNN HTP")[0]
        _probes[key] = {**result, "onnxruntime_qnn": version}
    return _probes[key]


def export_keys(export) -> dict[str, Any]:
    """The export section's keys `decide` reads (an `ExportConfig`): calibrate's graphs follow them."""
    return {"two_bit_weights": export.two_bit_weights, "int2_block_size": export.int2_block_size,
            "soc_model": export.soc_model}


def decide(two_bit_weights: str, int2_block_size: int, soc_model: int) -> TwoBitDecision:
    """The recipe's `export.two_bit_weights` (auto | int2-blocks | int4-containers) as the encoding
    that ships, and why. auto: INT2 blocks where the probe finds them right, else INT4 containers."""
    asked, block_size = two_bit_weights, int2_block_size
    if asked == "int4-containers":
        return TwoBitDecision("int4-containers", None, asked, "the recipe asks for INT4 containers "
                              "(export.two_bit_weights): twice the 2-bit weights' bytes")
    if asked == "int2-blocks":
        return TwoBitDecision("int2-blocks", block_size, asked, f"the recipe asks for INT2 blocks of {block_size} "
                              "(export.two_bit_weights); calibrate's HTP checks and export's smoke run them")
    found = probe(soc_model, block_size)
    if found.get("right"):
        return TwoBitDecision("int2-blocks", block_size, asked, (
            f"auto: a {'x'.join(map(str, found['shape']))} INT2-block MatMul compiled for soc {soc_model} ran on the "
            f"HTP simulator {found['max_codes']:g} output codes from its float reference (tolerance "
            f"{found['tolerance_codes']}; onnxruntime-qnn {found['onnxruntime_qnn']})"), found)
    said = found.get("error") or (f"{found.get('max_codes'):g} output codes from its float reference, over the "
                                  f"tolerance {found.get('tolerance_codes')}")
    return TwoBitDecision("int4-containers", None, asked, f"auto: INT2 blocks of {block_size} are not usable on "
                          f"soc {soc_model} here ({said}): INT4 containers, twice the 2-bit weights' bytes", found)
