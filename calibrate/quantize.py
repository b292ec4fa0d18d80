"""16-bit activations, 8-bit KV: onnxruntime's QNN QDQ tooling on a prepared graph.

Why onnxruntime's `get_qnn_qdq_config` + `quantize` and not aimet-onnx's
`QuantizationSimModel.from_onnx_qdq`: both keep the prepared graph's INT4/INT8 weights
bit-exact (platform notes), but onnxruntime's tool is already a dependency (no second
onnxruntime-coupled stack, no slow import), takes explicit per-tensor scale/zero-point
overrides (the MTP inputs' p99.99 ranges, the KV's 1.2 x p99.9, the mask's exact grid), spreads
an 8-bit override through Concat to the new K/V outputs by itself, keeps the SRQ encodings
aimet-onnx drops in front of o_proj, and writes graphs that pass `onnx.checker` full_check.

After quantizing, `matmul_second_input_uint8` writes into the graph the uint16 -> uint8
conversion that onnxruntime-qnn inserts silently in front of a MatMul of two uint16 activations
(attention's QK^T and PV), so the CPU EP computes what the HTP computes; `kv_io_uint8` makes the
deployable graph's KV boundary integer: ring inputs and new K/V outputs are uint8 codes (the host
stores codes; no float ring on the phone).
"""

from __future__ import annotations

import gc
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import onnx
from hyco.calibrate.ort_patches import lean_quantizer
from onnx import TensorProto, helper, numpy_helper

from hyco.quant.onnx_graph import consumers as graph_consumers


class FeedReader:
    """onnxruntime CalibrationDataReader over recorded feed dicts."""

    def __init__(self, feeds: list[dict[str, np.ndarray]], names: set[str]):
        self._iter = iter([{k: v for k, v in f.items() if k in names} for f in feeds])

    def get_next(self):
        return next(self._iter, None)

    def rewind(self):  # pragma: no cover - onnxruntime calls it only for some calibrators
        raise NotImplementedError


def uint8_symmetric(amax: float) -> tuple[float, int]:
    """uint8 scale / zero point for [-amax, amax] (zero point 128: 0 is exact)."""
    return max(float(amax), 1e-6) / 127.0, 128


def mask_qparams(negative: float) -> tuple[float, int]:
    """uint16 grid on which both 0 and `negative` are exact: scale -negative/65535, zero point 65535."""
    return -float(negative) / 65535.0, 65535


HTP_RECIPROCAL_MIN_TOP = 1.0  # a Reciprocal input encoding must reach 1.0
HTP_LOG_MIN_SPAN = 4.0  # a Log output encoding must span 4.0 (uint16 scale >= 4 / 65535, ~2^-14)


def htp_range_overrides(ranges: dict[str, dict[str, list[float]]], overrides: dict) -> dict[str, int]:
    """Widen the encodings the HTP's 16-bit kernels cannot use (measured on the simulator, soc 87),
    as quantizer overrides added to `overrides` (an explicit override already there wins):
    - trap: a Reciprocal whose input encoding tops out below 1.0 returns ~top/x: the input range
      is widened to reach 1.0;
    - trap: a Log whose output encoding spans less than 4.0 returns the encoding's minimum for
      every element (log(sum exp) of the keep set, [0, 3.6] on a peaky drafter: every log-prob
      of a row off by log(sum), up to 2.7 nats; [0, 3.99] fails, [0, 4.0] is exact to 1 code,
      whatever the input range): the output range is widened to span 4.0 (a step of 6.1e-5
      instead of at best 5.5e-5 on the tiny graphs).
    `ranges` is `stage.measure_masks`'s: {"reciprocal_in": {name: [lo, hi]}, "log_out": {...}},
    measured on the calibration feeds. Returns how many tensors each rule widened."""
    widened = {"reciprocal_in": 0, "log_out": 0}
    for name, (lo, hi) in ranges.get("reciprocal_in", {}).items():
        if hi < HTP_RECIPROCAL_MIN_TOP and name not in overrides:
            overrides[name] = [{"rmin": np.array(min(lo, 0.0), np.float32),
                                "rmax": np.array(HTP_RECIPROCAL_MIN_TOP, np.float32)}]
            widened["reciprocal_in"] += 1
    for name, (lo, hi) in ranges.get("log_out", {}).items():
        lo = min(lo, 0.0)
        if hi - lo < HTP_LOG_MIN_SPAN and name not in overrides:
            # the calibrator sees these feeds with the chosen mask value: 1% headroom on top
            overrides[name] = [{"rmin": np.array(lo, np.float32),
                                "rmax": np.array(max(lo + HTP_LOG_MIN_SPAN, 1.01 * hi), np.float32)}]
            widened["log_out"] += 1
    return widened


def htp_encoding_violations(model: onnx.ModelProto) -> list[str]:
    """The QDQ graph's encodings that `htp_range_overrides` exists to avoid, as readable lines
    (empty: none): a Log output spanning less than HTP_LOG_MIN_SPAN, a Reciprocal input whose top
    is below HTP_RECIPROCAL_MIN_TOP."""
    inits = _inits(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers = graph_consumers(model.graph)

    def grid(q) -> tuple[float, float]:
        scale = float(numpy_helper.to_array(inits[q.input[1]]))
        zero_t = inits[q.input[2]]
        info = np.iinfo(helper.tensor_dtype_to_np_dtype(zero_t.data_type))
        zero = int(numpy_helper.to_array(zero_t))
        return (info.min - zero) * scale, (info.max - zero) * scale

    out = []
    for n in model.graph.node:
        if n.op_type == "Log":
            for q in consumers.get(n.output[0], []):
                if q.op_type == "QuantizeLinear":
                    lo, hi = grid(q)
                    if hi - lo < HTP_LOG_MIN_SPAN * (1 - 1e-6):
                        out.append(f"Log {n.name}: output encoding [{lo:.4g}, {hi:.4g}] spans less than "
                                   f"{HTP_LOG_MIN_SPAN}")
        elif n.op_type == "Reciprocal":
            dq = producer.get(n.input[0])
            if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] not in inits:
                lo, hi = grid(dq)
                if hi < HTP_RECIPROCAL_MIN_TOP * (1 - 1e-6):
                    out.append(f"Reciprocal {n.name}: input encoding tops out at {hi:.4g} < {HTP_RECIPROCAL_MIN_TOP}")
    return out


def quantize_graph(prepared: Path, out: Path, feeds: list[dict[str, np.ndarray]], *, overrides: dict,
                   method: str, percentile: float, activation_bits: int, lean: bool = True,
                   int4_matmul: bool = True, check_lookups: bool = False) -> Path:
    """ORT QDQ quantization of `prepared` (a model file with external data) into `out`. `lean`:
    through `ort_patches.lean_quantizer` (False: onnxruntime's own code paths, for the test that holds the
    two to the same graph); `int4_matmul`: its calibration session multiplies INT4 weights packed
    (`hyco.quant.int4_matmul`; False: as onnxruntime's own session does, bit for bit); `check_lookups`:
    each indexed lookup is also compared with onnxruntime's scan (tests)."""
    from onnxruntime.quantization import CalibrationMethod, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    model = onnx.load(str(prepared), load_external_data=False)
    input_names = {i.name for i in model.graph.input}
    ops = sorted({n.op_type for n in model.graph.node} - {"QuantizeLinear", "DequantizeLinear", "Cast"})
    qtype = QuantType.QUInt16 if activation_bits == 16 else QuantType.QUInt8
    method_enum = CalibrationMethod.Percentile if method == "percentile" else CalibrationMethod.MinMax
    cfg = get_qnn_qdq_config(str(prepared), FeedReader(feeds, input_names), calibrate_method=method_enum,
                             activation_type=qtype, weight_type=qtype, init_overrides=overrides,
                             op_types_to_quantize=ops)
    if method == "percentile":
        cfg.extra_options["CalibPercentile"] = percentile
    cfg.use_external_data_format = True
    Path(f"{out}.data").unlink(missing_ok=True)  # onnx appends external data to an existing file
    with lean_quantizer(Path(prepared).parent, int4_matmul, check_lookups) if lean else nullcontext():
        quantize(str(prepared), str(out), cfg)
    del cfg
    gc.collect()  # the quantizer's model copies sit in reference cycles: free them before the next graph
    # The rewrite adds only nodes and scalar initializers: the graph is read and written without
    # its weights, which stay where the quantizer wrote them (reading them back, copying the model
    # and saving it again held three more copies, GBs at E2B size).
    model = onnx.load(str(out), load_external_data=False)
    model = matmul_second_input_uint8(concat_holds_its_inputs(neg_mirrors_its_input(model)))
    onnx.save_model(model, str(out))
    onnx.checker.check_model(str(out), full_check=True)
    return out


def neg_mirrors_its_input(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every Neg between a uint16 DequantizeLinear and QuantizeLinear gets its input's grid mirrored
    (same scale, zero point 65535 - z): -s (c - z) = s ((65535 - c) - (65535 - z)), so the Neg is
    exact. A calibrated grid of its own clipped negated values it had not seen, which the HTP,
    folding the Neg into the Concat that reads it (rotary's rotate-half), did not clip."""
    m, inits, producer, consumers = _graph_maps(model)
    for node in m.graph.node:
        if node.op_type != "Neg":
            continue
        dq = producer.get(node.input[0])
        q = _single_quantize(consumers.get(node.output[0], []))
        grid = _uint16_grid_of(dq, inits) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and grid is not None:
            _regrid(m.graph, q, consumers, grid["scale"], 65535 - grid["zero_point"], "_mirror")
    _prune_unused_initializers(m.graph)
    return m


def concat_holds_its_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every Concat of uint16 activations gets an output grid the HTP computes as the CPU does:
    - inputs on one grid (a K/V ring's 16-bit twin and the new rows): that grid, exactly, so the
      Concat moves codes and nothing is requantized. With a calibrated output grid of its own the
      HTP was 473-1,038 codes off on a few elements (mean 0.1) of a full layer's V Concat, on an SLM
      trained at a shape unlike the fixture's, where the CPU and a small graph of the same encodings
      agreed to one code: the requantizing kernel is wrong in some graph context, not on a range.
    - inputs on different grids (rotary's rotate-half, a mirrored Neg beside its input): a grid
      that holds them all (`hyco.quant.grids.uint16_grid` over their union and its own). A calibrated
      output grid holds only the values seen, so the CPU clipped input values (a K/V ring's, whose
      grid reaches beyond the calibration passes' rings) that the HTP, requantizing each input its
      own way, did not."""
    from hyco.quant.grids import grid_range, uint16_grid

    m, inits, producer, consumers = _graph_maps(model)
    for node in m.graph.node:
        q = _single_quantize(consumers.get(node.output[0], []))
        if node.op_type != "Concat" or q is None or _uint16_grid_of(q, inits) is None:
            continue
        dqs = [producer.get(x) for x in node.input]
        grids = [_uint16_grid_of(d, inits) if d is not None and d.op_type == "DequantizeLinear" else None for d in dqs]
        if not all(grids):
            continue
        if all(g == grids[0] for g in grids):
            if _uint16_grid_of(q, inits) != grids[0]:
                _regrid(m.graph, q, consumers, grids[0]["scale"], grids[0]["zero_point"], "_shared")
            continue
        ranges = [grid_range(g) for g in grids]
        lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
        out_lo, out_hi = grid_range(_uint16_grid_of(q, inits))
        if out_lo > lo or out_hi < hi:
            _regrid(m.graph, q, consumers, *uint16_grid(min(lo, out_lo), max(hi, out_hi)), "_holding")
    _prune_unused_initializers(m.graph)
    return m


def _graph_maps(model: onnx.ModelProto):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m, _inits(m), {o: n for n in m.graph.node for o in n.output}, graph_consumers(m.graph)


def _single_quantize(readers: list) -> onnx.NodeProto | None:
    return readers[0] if len(readers) == 1 and readers[0].op_type == "QuantizeLinear" else None


def _uint16_grid_of(node: onnx.NodeProto, inits: dict) -> dict | None:
    """A Quantize/DequantizeLinear's uint16 grid; None for another type or a non-constant one."""
    zero = inits.get(node.input[2]) if len(node.input) > 2 else None
    if zero is None or zero.data_type != TensorProto.UINT16 or node.input[1] not in inits:
        return None
    return {"dtype": "uint16", "scale": float(numpy_helper.to_array(inits[node.input[1]])),
            "zero_point": int(numpy_helper.to_array(zero))}


def _regrid(graph: onnx.GraphProto, q: onnx.NodeProto, consumers: dict, scale: float, zero: int, tag: str) -> None:
    """`q` and the DequantizeLinears reading it move to the grid (scale, zero) (new initializers)."""
    s_name, z_name = q.output[0] + tag + "_scale", q.output[0] + tag + "_zero"
    graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), s_name),
                              numpy_helper.from_array(np.array(zero, np.uint16), z_name)])
    for n in [q, *consumers.get(q.output[0], [])]:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            n.input[1], n.input[2] = s_name, z_name


def _prune_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {x for n in graph.node for x in n.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)


def uint8_convert_qparams(scale: float, zero_point: int) -> tuple[np.float32, np.uint8]:
    """The uint8 grid onnxruntime-qnn converts a uint16 (scale, zero point) tensor to: the same
    real range [(0 - z) s, (65535 - z) s] over 256 codes (its matmul_op_builder's InsertConvertOp
    with qnn_utils' GetQuantParams: range widened to hold 0, scale in double, zero point rounded
    half to even)."""
    lo, hi = (0 - zero_point) * float(scale), (65535 - zero_point) * float(scale)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    hi = max(hi, lo + 1e-4)
    step = (hi - lo) / 255.0
    zero = float(np.clip(0.0 - lo / step, 0, 255))
    return np.float32(step), np.uint8(np.round(zero))  # numpy rounds half to even


def matmul_second_input_uint8(model: onnx.ModelProto) -> onnx.ModelProto:
    """Trap: the HTP has no uint16 x uint16 MatMul, so onnxruntime-qnn converts the second input of
    a MatMul whose two inputs are uint16 activations to uint8 over the same range, silently
    (matmul_op_builder.cc, "Workaround that inserts a QNN Convert op before input[1]"); the CPU EP
    keeps 16 bits. In attention (QK^T, PV) that put the simulator ~50 output codes (mean) off the
    CPU EP on the same graph, growing layer by layer. This pass writes that conversion into the
    graph as a uint8 QuantizeLinear/DequantizeLinear pair on the MatMul's second input, with the
    grid the EP would choose: onnxruntime-qnn then sees a uint16 x uint8 MatMul and inserts
    nothing, the HTP computes what it computed before, and the CPU EP now computes the same."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = _inits(m)
    producer = {o: n for n in g.node for o in n.output}

    def uint16_activation(name: str):
        dq = producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] in inits or len(dq.input) < 3:
            return None
        zero = inits.get(dq.input[2])
        return dq if zero is not None and zero.data_type == TensorProto.UINT16 else None

    out = []
    taken = {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    for node in g.node:
        if node.op_type == "MatMul" and uint16_activation(node.input[0]) and uint16_activation(node.input[1]):
            dq = uint16_activation(node.input[1])
            scale, zero = uint8_convert_qparams(float(numpy_helper.to_array(inits[dq.input[1]])),
                                                int(numpy_helper.to_array(inits[dq.input[2]])))
            base, k = node.input[1] + "_as_uint8", 0
            while base in taken:
                k += 1
                base = f"{node.input[1]}_as_uint8_{k}"
            taken |= {base, base + "_q", base + "_scale", base + "_zero"}
            g.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), base + "_scale"),
                                  numpy_helper.from_array(np.array(zero, np.uint8), base + "_zero")])
            out += [helper.make_node("QuantizeLinear", [node.input[1], base + "_scale", base + "_zero"], [base + "_q"],
                                     name=base + "_q"),
                    helper.make_node("DequantizeLinear", [base + "_q", base + "_scale", base + "_zero"], [base],
                                     name=base)]
            node.input[1] = base
        out.append(node)
    del g.node[:]
    g.node.extend(out)
    return m


# --- reading quantization params back --------------------------------------------------------


def _inits(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def boundary_qparams(model: onnx.ModelProto) -> dict[str, dict]:
    """Scale / zero point / dtype at each graph input (its QuantizeLinear) and output (the
    DequantizeLinear that produces it, or the QuantizeLinear itself for integer outputs)."""
    inits = _inits(model)
    out = {}

    def params(node) -> dict:
        zero = inits[node.input[2]]
        return {"dtype": helper.tensor_dtype_to_np_dtype(zero.data_type).name,
                "scale": float(numpy_helper.to_array(inits[node.input[1]])),
                "zero_point": int(numpy_helper.to_array(zero))}

    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    # an input that first goes through a data-movement op (Unsqueeze...) is quantized after it
    origin = {i: i for i in inputs}
    for node in model.graph.node:
        if node.op_type in ("Unsqueeze", "Reshape", "Squeeze", "Transpose") and node.input[0] in origin:
            origin[node.output[0]] = origin[node.input[0]]
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] in origin:
            out.setdefault(origin[node.input[0]], params(node))
        if node.op_type in ("DequantizeLinear", "QuantizeLinear") and node.output[0] in outputs and node.input[0] not in inits:
            out[node.output[0]] = params(node)
        if node.op_type == "DequantizeLinear" and node.input[0] in inputs:
            out[node.input[0]] = params(node)
    return out


def kv_io_uint8(model: onnx.ModelProto, inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    """Ring inputs: drop their QuantizeLinear (the host feeds uint8 codes). New K/V outputs:
    the graph returns the QuantizeLinear's codes; the DequantizeLinear stays for the graph's
    own consumers (the Concat with the ring)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    rename = {}  # tensor -> the name its consumers read instead
    drop = set()  # first output names of the nodes to remove
    for node in g.node:
        if node.op_type == "QuantizeLinear" and node.input[0] in inputs:
            rename[node.output[0]] = node.input[0]
            drop.add(node.output[0])
    out_of = {}  # new K/V output -> (its QuantizeLinear's output tensor)
    for node in g.node:
        if node.op_type == "DequantizeLinear" and node.output[0] in outputs:
            out_of[node.output[0]] = node.input[0]
    for name in out_of:
        rename[name] = name + "_dq"  # the graph's own consumers read the dequantized rows
    kept = []
    for node in g.node:
        if node.output[0] in drop:
            continue
        for j, x in enumerate(node.input):
            if x in rename:
                node.input[j] = rename[x]
        for j, x in enumerate(node.output):
            if node.op_type == "DequantizeLinear" and x in out_of:
                node.output[j] = x + "_dq"
            elif node.op_type == "QuantizeLinear" and x in out_of.values():
                node.output[j] = next(k for k, v in out_of.items() if v == x)
        if node.op_type == "DequantizeLinear" and node.input[0] in out_of.values():
            node.input[0] = next(k for k, v in out_of.items() if v == node.input[0])
        kept.append(node)
    del g.node[:]
    g.node.extend(kept)
    for vi in list(g.input) + list(g.output):
        if vi.name in inputs or vi.name in outputs:
            vi.type.tensor_type.elem_type = TensorProto.UINT8
    return m


def encodings(model: onnx.ModelProto, weight_bits: dict[str, int]) -> dict:
    """AIMET encodings (1.0.0 layout) of a QDQ graph: every QuantizeLinear's tensor as an
    activation encoding, every integer weight DequantizeLinear as a per-channel param encoding
    (bw = the checkpoint's width; container_bw the type that holds it: 2-bit ints in INT2 blocks
    or INT4 containers, `hyco.quant.int2_blocks`)."""
    inits = _inits(model)
    acts, params, seen = [], [], set()
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in seen:
            zero = inits[node.input[2]]
            np_type = helper.tensor_dtype_to_np_dtype(zero.data_type)
            scale = float(numpy_helper.to_array(inits[node.input[1]]))
            zp = int(numpy_helper.to_array(zero))
            info = np.iinfo(np_type)
            acts.append({"name": node.input[0], "bw": int(info.bits), "dtype": "INT", "enc_type": "PER_TENSOR",
                         "is_sym": bool(info.min < 0 and zp == 0), "scale": [scale], "offset": [-zp],
                         "min": scale * (info.min - zp), "max": scale * (info.max - zp)})
            seen.add(node.input[0])
        elif node.op_type == "DequantizeLinear" and node.input[0] in inits:
            params.append(_param_encoding(node, inits, weight_bits))
    return {"version": "1.0.0", "activation_encodings": acts, "param_encodings": params}


CONTAINER_BITS = {TensorProto.INT2: 2, TensorProto.INT4: 4, TensorProto.UINT4: 4}


def _param_encoding(node, inits: dict, weight_bits: dict[str, int]) -> dict:
    """A weight DequantizeLinear's per-channel encoding. An INT2-block weight (`hyco.quant.int2_blocks`)
    carries its channel's scale in every block: written once per channel, with its block size."""
    ints = inits[node.input[0]]
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
    scale = _scale_bits(inits[node.input[1]], axis if block else None).view(np.float32)
    container = CONTAINER_BITS.get(ints.data_type, 8)
    row = {"name": node.input[0], "bw": int(weight_bits.get(node.input[0], container)), "container_bw": container,
           "dtype": "INT", "enc_type": "PER_CHANNEL", "is_sym": True, "scale": [float(s) for s in scale],
           "offset": [0] * len(scale), "axis": 1 - axis if block else axis}
    return {**row, "block_size": block, "block_axis": axis} if block else row


def _weight_refs(model: onnx.ModelProto) -> dict[str, tuple[onnx.TensorProto, onnx.TensorProto, int, int | None]]:
    """Every integer weight feeding a DequantizeLinear: name -> (ints, scale, the scale's channel
    axis, the blocked axis of an INT2-block weight or None), not unpacked."""
    inits = _inits(model)
    out = {}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
            continue
        ints_t = inits[node.input[0]]
        if ints_t.data_type not in (TensorProto.INT4, TensorProto.INT8, TensorProto.INT2):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        blocked = any(a.name == "block_size" and a.i for a in node.attribute)
        # blocks run along K (`hyco.quant.int2_blocks`): the channels are the other axis of a 2-D weight
        channel = 1 - axis if blocked else axis
        out[node.input[0].removesuffix("_t")] = (ints_t, inits[node.input[1]], channel, axis if blocked else None)
    return out


def _unpack_weight(ints_t: onnx.TensorProto, scale_t: onnx.TensorProto, axis: int,
                   block_axis: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    return _oriented_ints(ints_t, axis), _scale_bits(scale_t, block_axis), axis


def _oriented_ints(ints_t: onnx.TensorProto, axis: int) -> np.ndarray:
    """A loaded integer weight as [out, in] int8 (a view: axis 1 is stored [in, out])."""
    from hyco.calibrate.prepare import _int_array

    values = _int_array(ints_t)
    return values.T if values.ndim == 2 and axis == 1 else values


def _scale_bits(scale_t: onnx.TensorProto, block_axis: int | None = None) -> np.ndarray:
    """A weight's scales as bits, per channel; an INT2-block weight's blocks collapse to their
    channel's scale where every block along `block_axis` holds the same (else all of them, which
    then equal no per-channel source)."""
    scale = numpy_helper.to_array(scale_t).astype(np.float32)
    if block_axis is not None and scale.ndim == 2:
        rows = np.moveaxis(scale, block_axis, 0).reshape(scale.shape[block_axis], -1)
        scale = rows[0] if (rows == rows[0]).all() else rows
    return scale.reshape(-1).view(np.uint32)


def weight_ints(model: onnx.ModelProto, folder: Path | None = None) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """Every integer weight feeding a DequantizeLinear: name -> (ints as [out, in] int8, scale bytes, axis)."""
    return {name: _unpack_weight(*ref) for name, ref in _weight_refs(model).items()}


def _same_packed_int4(a: onnx.TensorProto, a_axis: int, b: onnx.TensorProto, b_axis: int) -> bool | None:
    """Whether two loaded 2-D INT4 weights hold the same [out, in] integers, compared as packed
    bytes (every nibble a value when both dims are even: equal bytes are equal integers), the
    one transposed first where their layouts differ (convert's [N, K] vs the deployable [K, N]);
    None where that does not apply. Unpacking both E2B graphs' 2 G weights to int8 and comparing
    transposed views is much slower."""
    from hyco.formats.int4 import transpose_int4

    if a.data_type != TensorProto.INT4 or b.data_type != TensorProto.INT4 or len(a.dims) != 2 or len(b.dims) != 2:
        return None
    if a.dims[0] % 2 or a.dims[1] % 2:
        return None
    if a_axis == b_axis and list(a.dims) == list(b.dims):
        return a.raw_data == b.raw_data
    if a_axis != b_axis and list(a.dims) == list(b.dims)[::-1]:
        return transpose_int4(a.raw_data, tuple(a.dims)) == b.raw_data
    return None


def weights_bitexact(source: onnx.ModelProto, quantized: onnx.ModelProto, folders=(None, None)) -> dict:
    """Every source weight's ints and scales equal in the QDQ graph (bit for bit). One weight
    read and unpacked at a time (all of them unpacked at once is twice each graph's INT4 bytes);
    `folders`: where each model's weights on disk are (`prepare.load_graph`)."""
    from hyco.quant.onnx_graph import loaded

    a, b = _weight_refs(source), _weight_refs(quantized)
    rows = {}
    for name, (ints_t, scale_t, axis, block_axis) in a.items():
        other = b.get(name)
        if other is None:
            rows[name] = False
            continue
        a_ints, b_ints = loaded(ints_t, folders[0]), loaded(other[0], folders[1])
        same = _same_packed_int4(a_ints, axis, b_ints, other[2])
        if same is None:
            same = np.array_equal(_oriented_ints(a_ints, axis), _oriented_ints(b_ints, other[2]))
        rows[name] = bool(same and np.array_equal(_scale_bits(loaded(scale_t, folders[0]), block_axis),
                                                  _scale_bits(loaded(other[1], folders[1]), other[3])))
    return {"weights": len(a), "equal": sum(rows.values()), "all_equal": bool(rows) and all(rows.values()),
            "missing_or_different": sorted(k for k, v in rows.items() if not v)[:10]}
