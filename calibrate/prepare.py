"""Graph passes the HTP needs before (and around) onnxruntime's QDQ quantizer.

Each pass takes an `onnx.ModelProto` (weights loaded) and returns a new one; none changes
what the graph computes on onnxruntime's CPU EP (tests/test_calibrate.py runs each pass on a
convert graph and compares every output). Integer weights stay bit-exact: a pass moves or
re-lays ints, it never dequantizes them. The passes are what neither onnxruntime's
`get_qnn_qdq_config` + `quantize` nor aimet-onnx does (platform notes, "From the project's
float graphs to the HTP"):

- `fold_shape_subgraphs`: the exporter computes Reshape targets at run time
  (Constant -> Unsqueeze -> Concat); with graph optimisations off QNN refuses them
  ("Dynamic shape is not supported yet"). Fold every small all-constant subgraph.
- `fold_weight_transposes`: DQ(ints [out, in], axis 0) -> Transpose -> MatMul becomes
  DQ(ints [in, out], axis 1) -> MatMul (the quantizer otherwise re-quantizes the weight after
  its Transpose, and the HTP wants the weight as the FullyConnected operand).
- `explicit_weight_zero_points`: without an explicit zero point INT4 weights compute wrong
  numbers on the HTP (error 12.8 on outputs of 3.3).
- `srq_int8_as_uint16` (trap: "standalone DQ op with per-channel quantization" when an int8
  SRQ activation feeds an INT4 MatMul): after each int8 SRQ pair, requantize losslessly to
  uint16 with scale s/256 and zero point 32768 (every int8 code lands on the uint16 grid).
- `gelu_tanh_as_sigmoid` (trap: the HTP's Tanh returns garbage in some graph contexts):
  1 + tanh(u) = 2 * sigmoid(2u), exact in real arithmetic.
- `softcap_as_sigmoid` (trap: on the soc-87 HTP a 16-bit Tanh in a 16-row tensor computes garbage
  in rows 2..15 when a Mul or Div consumes it, by thousands of codes, at every input range tried;
  1, 2, 5, 8, 15, 17, 32, 33, 48, 64 and 128 rows were right; a Div in the Mul's place fixed one
  graph and not the next; the Sigmoid was right at every row count): the softcap
  c tanh(x / c) as 2c sigmoid(2x / c) - c, exact in real arithmetic, so no Tanh is left in a graph.
- `log_softmax_as_exp_sum` (trap: the HTP's 16-bit LogSoftmax kernel is off by up to 745 output
  codes, 0.14 nats, on the tiny graphs' 1,345-way rows, against ~2 codes for every other op):
  x - m - log(sum(exp(x - m))), m = max(x), written out; each piece is an op the HTP computes
  to 1-3 codes.
- `split_kv_row_outputs`: the new K/V rows leave as uint8 codes but are attended over inside
  the pass at 16 bits (their own Transpose per use, so each can carry its own encoding).
- `drop_outputs`: the deployable graphs return only what the runtime reads (no full logits).
- `strip_input_qdq`: qat's step graph carries hand-written uint16 QDQ on its inputs; the
  quantizer gets the float graph and the same ranges as overrides instead.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from hyco.base.errors import HycoError
from hyco.npu.io_spec import Role, role_of
from hyco.quant.onnx_graph import consumers as graph_consumers
from hyco.quant.onnx_graph import loaded

FOLD_MAX_ELEMENTS = 4096  # fold constant subgraphs up to this size (shapes, small tables; never weights)
QDQ = ("QuantizeLinear", "DequantizeLinear")
INT_WEIGHT_TYPES = (TensorProto.INT4, TensorProto.INT8, TensorProto.UINT4, TensorProto.UINT8, TensorProto.INT2)


def _unique(graph: onnx.GraphProto, base: str) -> str:
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


def _int_array(t: onnx.TensorProto) -> np.ndarray:
    """Integer initializer -> int8 numpy (INT4 / INT2 unpacked), raw data loaded."""
    if t.data_type == TensorProto.INT4:
        from hyco.formats.int4 import unpack_int4

        return unpack_int4(t.raw_data, int(np.prod(t.dims))).reshape(tuple(t.dims))
    if t.data_type == TensorProto.INT2:
        from hyco.quant.int2_blocks import unpack_int2

        return unpack_int2(t.raw_data, int(np.prod(t.dims))).reshape(tuple(t.dims))
    return numpy_helper.to_array(t)


def _int_tensor(name: str, values: np.ndarray, data_type: int) -> onnx.TensorProto:
    if data_type == TensorProto.INT4:
        from hyco.formats.int4 import pack_int4

        return helper.make_tensor(name, TensorProto.INT4, values.shape, pack_int4(values), raw=True)
    return numpy_helper.from_array(values, name)


def _transposed_ints(name: str, t: onnx.TensorProto) -> onnx.TensorProto:
    """A 2-D integer initializer's transpose (INT4: nibble by nibble, never unpacked)."""
    if t.data_type == TensorProto.INT4:
        from hyco.formats.int4 import transpose_int4

        rows, cols = t.dims
        return helper.make_tensor(name, TensorProto.INT4, [cols, rows], transpose_int4(t.raw_data, (rows, cols)), raw=True)
    return _int_tensor(name, _int_array(t).T.copy(), t.data_type)


def _run_node(node: onnx.NodeProto, values: dict[str, np.ndarray], opset: int) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    inputs = [helper.make_tensor_value_info(x, helper.np_dtype_to_tensor_dtype(values[x].dtype), values[x].shape)
              for x in node.input if x]
    outputs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in node.output]
    g = helper.make_graph([node], "fold", inputs, outputs)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, {x: values[x] for x in node.input if x})


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def fold_shape_subgraphs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant nodes become initializers, then every node whose inputs are all small
    constants is evaluated once and replaced by its (small) outputs. Q/DQ never fold, and
    nothing that reads an integer weight does, so the ints stay ints."""
    model = _copy(model)
    graph = model.graph
    opset = _opset(model)
    small: dict[str, np.ndarray] = {}
    for t in graph.initializer:
        if t.data_type not in INT_WEIGHT_TYPES and int(np.prod(t.dims)) <= FOLD_MAX_ELEMENTS:
            small[t.name] = numpy_helper.to_array(t)
    kept, new_inits = [], []
    for node in graph.node:
        if node.op_type == "Constant":
            value = numpy_helper.to_array(next(a.t for a in node.attribute if a.name == "value"))
            new_inits.append(numpy_helper.from_array(value, node.output[0]))
            if value.size <= FOLD_MAX_ELEMENTS:
                small[node.output[0]] = value
            continue
        foldable = (node.op_type not in QDQ and node.input and all((x in small) for x in node.input if x)
                    and node.domain in ("", "ai.onnx"))
        if foldable:
            outs = _run_node(node, small, opset)
            if all(np.asarray(o).size <= FOLD_MAX_ELEMENTS for o in outs):
                for name, value in zip(node.output, outs, strict=True):
                    value = np.asarray(value)
                    small[name] = value
                    new_inits.append(numpy_helper.from_array(value, name))
                continue
        kept.append(node)
    used = {x for n in kept for x in n.input} | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(t for t in new_inits if t.name in used)
    _prune_initializers(graph)
    return model


def fold_weight_transposes(model: onnx.ModelProto, folder=None, weights: WeightFile | None = None) -> onnx.ModelProto:
    """DQ(ints [out, in], scale, axis 0) -> Transpose(perm 1, 0) -> MatMul  =>
    DQ(ints^T [in, out], scale, axis 1) -> MatMul. The transposed ints are the same integers.
    A weight on disk (`load_graph`) is read from `folder`; with `weights`, each transposed weight
    goes there as it is made (one weight in memory at a time)."""
    model = _copy(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers = graph_consumers(graph)
    producer = {o: n for n in graph.node for o in n.output}
    drop, replace = set(), {}
    for node in list(graph.node):
        if node.op_type != "Transpose" or [a.ints for a in node.attribute if a.name == "perm"] != [[1, 0]]:
            continue
        dq = producer.get(node.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        if len(consumers.get(dq.output[0], [])) != 1:
            continue
        ints_t = inits[dq.input[0]]
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        if len(ints_t.dims) != 2 or axis != 0:
            continue
        new_ints = _transposed_ints(_unique(graph, ints_t.name + "_t"), loaded(ints_t, folder))
        graph.initializer.append(weights.put(new_ints) if weights is not None else new_ints)
        new_inputs = [new_ints.name, *dq.input[1:]]
        replace[node.output[0]] = helper.make_node("DequantizeLinear", new_inputs, [node.output[0]],
                                                   name=(dq.name or "dq") + "_t", axis=1)
        drop.add(dq.output[0])
    # nodes are keyed by their first output's name (unique in a valid graph; protobuf wrappers
    # have no stable identity)
    kept = [replace.get(n.output[0], n) for n in graph.node if n.output[0] not in drop]
    del graph.node[:]
    graph.node.extend(kept)
    _prune_initializers(graph)
    return model


def explicit_weight_zero_points(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every DequantizeLinear of an integer initializer gets an all-zero zero point of the
    ints' type and the scale's shape."""
    model = _copy(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits or (len(node.input) > 2 and node.input[2]):
            continue
        ints_t, scale_t = inits[node.input[0]], inits[node.input[1]]
        if ints_t.data_type not in INT_WEIGHT_TYPES:
            continue
        shape = tuple(scale_t.dims)
        zero = _int_tensor(_unique(graph, node.input[0] + "_zero"), np.zeros(shape, np.int8), ints_t.data_type) \
            if ints_t.data_type == TensorProto.INT4 else \
            numpy_helper.from_array(np.zeros(shape, helper.tensor_dtype_to_np_dtype(ints_t.data_type)),
                                    _unique(graph, node.input[0] + "_zero"))
        graph.initializer.append(zero)
        inits[zero.name] = zero
        while len(node.input) < 3:
            node.input.append("")
        node.input[2] = zero.name
    return model


def srq_int8_as_uint16(model: onnx.ModelProto) -> onnx.ModelProto:
    """After each activation DequantizeLinear of int8 codes (the checkpoint's SRQ), insert a
    uint16 QuantizeLinear/DequantizeLinear with scale s/256 and zero point 32768: an int8 code
    c maps to the uint16 code 32768 + 256 c exactly, so the values are unchanged, and the
    consumers read a uint16 activation (the HTP refuses an int8 activation into an INT4
    FullyConnected, and a same-scale requant was off by 0.35 there)."""
    model = _copy(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers = graph_consumers(graph)
    producer = {o: n for n in graph.node for o in n.output}
    out = []
    for node in graph.node:
        out.append(node)
        if node.op_type != "DequantizeLinear" or node.input[0] in inits:
            continue
        q = producer.get(node.input[0])
        zero = inits.get(node.input[2]) if len(node.input) > 2 else None
        if q is None or q.op_type != "QuantizeLinear" or zero is None or zero.data_type != TensorProto.INT8:
            continue
        scale = float(numpy_helper.to_array(inits[node.input[1]]))
        base = node.output[0]
        s_name, z_name = _unique(graph, base + "_u16_scale"), _unique(graph, base + "_u16_zero")
        graph.initializer.extend([numpy_helper.from_array(np.array(scale / 256.0, np.float32), s_name),
                                  numpy_helper.from_array(np.array(32768, np.uint16), z_name)])
        q16, dq16 = _unique(graph, base + "_u16"), _unique(graph, base + "_u16_dq")
        for c in consumers.get(base, []):
            for j, x in enumerate(c.input):
                if x == base:
                    c.input[j] = dq16
        out.append(helper.make_node("QuantizeLinear", [base, s_name, z_name], [q16], name=q16 + "_q"))
        out.append(helper.make_node("DequantizeLinear", [q16, s_name, z_name], [dq16], name=dq16))
        for o in graph.output:
            if o.name == base:
                raise ValueError(f"SRQ output {base} is a graph output; not supported")
    del graph.node[:]
    graph.node.extend(out)
    return model


def gelu_tanh_as_sigmoid(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add(1, Tanh(u)) -> Mul(Sigmoid(Mul(u, 2)), 2): GELU's 1 + tanh(u) as 2 sigmoid(2u).
    (The softcap's Tanh is `softcap_as_sigmoid`'s: it is not followed by + 1.)"""
    model = _copy(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers = graph_consumers(graph)
    producer = {o: n for n in graph.node for o in n.output}

    def is_one(name: str) -> bool:
        t = inits.get(name)
        return t is not None and int(np.prod(t.dims)) == 1 and float(numpy_helper.to_array(t).reshape(-1)[0]) == 1.0

    two = _unique(graph, "gelu_two")
    graph.initializer.append(numpy_helper.from_array(np.array(2.0, np.float32), two))
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop = set()
    for node in graph.node:
        if node.op_type != "Add":
            continue
        a, b = node.input
        tanh_in = b if is_one(a) else a if is_one(b) else None
        t = producer.get(tanh_in) if tanh_in else None
        if t is None or t.op_type != "Tanh" or len(consumers.get(t.output[0], [])) != 1:
            continue
        u, base = t.input[0], node.output[0]
        doubled, sig = _unique(graph, base + "_2u"), _unique(graph, base + "_sigmoid")
        replace[base] = [helper.make_node("Mul", [u, two], [doubled], name=doubled),
                         helper.make_node("Sigmoid", [doubled], [sig], name=sig),
                         helper.make_node("Mul", [sig, two], [base], name=base + "_x2")]
        drop.add(t.output[0])
    _splice(graph, replace, drop)
    return model


def drop_outputs(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """Remove graph outputs and the nodes only they needed."""
    model = _copy(model)
    graph = model.graph
    kept_outputs = [o for o in graph.output if o.name not in names]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    _prune_nodes(graph)
    return model


def strip_input_qdq(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, tuple[float, int]]]:
    """Graph input -> Q -> DQ -> consumers  =>  input -> consumers. Returns the removed
    (scale, zero point) per input, to hand to the quantizer as overrides."""
    model = _copy(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    consumers = graph_consumers(graph)
    params, drop, rename = {}, set(), {}
    for q in graph.node:
        if q.op_type != "QuantizeLinear" or q.input[0] not in inputs:
            continue
        dqs = consumers.get(q.output[0], [])
        if len(dqs) != 1 or dqs[0].op_type != "DequantizeLinear":
            continue
        params[q.input[0]] = (float(numpy_helper.to_array(inits[q.input[1]])), int(numpy_helper.to_array(inits[q.input[2]])))
        rename[dqs[0].output[0]] = q.input[0]
        drop |= {q.output[0], dqs[0].output[0]}
    kept = [n for n in graph.node if n.output[0] not in drop]
    for n in kept:
        for j, x in enumerate(n.input):
            if x in rename:
                n.input[j] = rename[x]
    del graph.node[:]
    graph.node.extend(kept)
    _prune_initializers(graph)
    return model, params


# --- helpers ------------------------------------------------------------------------------


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _prune_nodes(graph: onnx.GraphProto) -> None:
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(list(graph.node)):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed |= {x for x in node.input if x}
    del graph.node[:]
    graph.node.extend(reversed(kept))
    _prune_initializers(graph)


def _prune_initializers(graph: onnx.GraphProto) -> None:
    used = {x for n in graph.node for x in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _splice(graph: onnx.GraphProto, replace: dict[str, list[onnx.NodeProto]], drop: set[str]) -> None:
    """Each node whose output is in `replace` becomes those nodes, in its place (so the order stays
    topological); nodes whose output is in `drop` go; unused initializers too."""
    out = []
    for node in graph.node:
        if node.output[0] in drop:
            continue
        out.extend(replace.get(node.output[0], [node]))
    del graph.node[:]
    graph.node.extend(out)
    _prune_initializers(graph)


def softcap_as_sigmoid(model: onnx.ModelProto) -> onnx.ModelProto:
    """Mul(Tanh(u), c) with c a constant whose entries all equal one number (the softcap, which
    convert writes as a vector) -> Sub(Mul(Sigmoid(Mul(u, 2)), 2c), c): c tanh(u) as
    2c sigmoid(2u) - c. Both QNN encodings are fixed and equally fine (Tanh [-1, 1) at 1/32768,
    Sigmoid [0, 1) at 1/65536), so the rewrite costs no resolution; what it buys is that the HTP's
    Tanh, wrong in 16-row tensors (module docstring), never runs."""
    model = _copy(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers = graph_consumers(graph)
    producer = {o: n for n in graph.node for o in n.output}
    replace: dict[str, list[onnx.NodeProto]] = {}
    drop = set()
    for node in graph.node:
        if node.op_type != "Mul":
            continue
        tanh_side = [j for j, x in enumerate(node.input) if x in producer and producer[x].op_type == "Tanh"]
        if len(tanh_side) != 1 or node.input[1 - tanh_side[0]] not in inits:
            continue
        t = producer[node.input[tanh_side[0]]]
        c = numpy_helper.to_array(inits[node.input[1 - tanh_side[0]]])
        if len(consumers.get(t.output[0], [])) != 1 or c.size == 0 or not np.all(c == c.flat[0]) or c.flat[0] == 0:
            continue
        base = node.output[0]
        names = {k: _unique(graph, f"softcap_{k}") for k in ("two", "two_c", "c")}
        # 2c and c keep the constant's shape (convert's vector): the HTP fuses an op by a scalar
        # constant into the log-softmax after it with the wrong range (`tests/htp_rules.py`)
        for k, v in (("two", np.array(2.0)), ("two_c", 2.0 * c), ("c", c)):
            graph.initializer.append(numpy_helper.from_array(np.asarray(v, np.float32), names[k]))
        doubled, sig, scaled = (_unique(graph, base + suffix) for suffix in ("_2u", "_sigmoid", "_x2c"))
        replace[base] = [helper.make_node("Mul", [t.input[0], names["two"]], [doubled], name=doubled),
                         helper.make_node("Sigmoid", [doubled], [sig], name=sig),
                         helper.make_node("Mul", [sig, names["two_c"]], [scaled], name=scaled),
                         helper.make_node("Sub", [scaled, names["c"]], [base], name=base + "_minus_c")]
        drop.add(t.output[0])
    _splice(graph, replace, drop)
    return model


def log_softmax_as_exp_sum(model: onnx.ModelProto) -> onnx.ModelProto:
    """LogSoftmax(x) -> (x - m) - Log(ReduceSum(Exp(x - m))), m = ReduceMax(x), on the same axis;
    the output keeps its name. Trap: the HTP's 16-bit LogSoftmax kernel differs from the exact
    value by up to 745 output codes (0.14 nats) on 1,345-way rows, ~146 codes on average; the
    written-out form's ops each stay within 1-3 codes there (the sum is an integer reduction)."""
    model = _copy(model)
    graph = model.graph
    out = []
    for node in graph.node:
        if node.op_type != "LogSoftmax":
            out.append(node)
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        x, y = node.input[0], node.output[0]
        axes = _unique(graph, y + "_axes")
        graph.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), axes))
        top, shifted, exp, total, log = (_unique(graph, y + s) for s in ("_max", "_shifted", "_exp", "_sum", "_log"))
        out += [helper.make_node("ReduceMax", [x, axes], [top], name=top, keepdims=1),
                helper.make_node("Sub", [x, top], [shifted], name=shifted),
                helper.make_node("Exp", [shifted], [exp], name=exp),
                helper.make_node("ReduceSum", [exp, axes], [total], name=total, keepdims=1),
                helper.make_node("Log", [total], [log], name=log),
                helper.make_node("Sub", [shifted, log], [y], name=y + "_log_softmax")]
    del graph.node[:]
    graph.node.extend(out)
    return model


def split_kv_row_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """New K/V rows leave the graph as uint8 codes (the ring's grid) but the pass itself attends
    over them too. The node that makes each `new_k_i` / `new_v_i` output (a Transpose) is
    duplicated: the original feeds only the graph output, the copy (`<name>_rows`) feeds the
    graph's own consumers, so the two can carry different encodings (uint8 out, 16-bit inside,
    where an 8-bit code flip would otherwise move this pass's scores)."""
    model = _copy(model)
    graph = model.graph
    names = [o.name for o in graph.output if role_of(o.name) is Role.NEW_KV]
    producer = {o: n for n in graph.node for o in n.output}
    out = []
    for node in graph.node:
        out.append(node)
        if node.output[0] in names:
            rows = node.output[0] + "_rows"
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = (node.name or node.output[0]) + "_rows"
            copy.output[0] = rows
            out.append(copy)
    del graph.node[:]
    graph.node.extend(out)
    for node in graph.node:
        if node.output[0].endswith("_rows") and node.output[0][:-5] in names:
            continue
        for j, x in enumerate(node.input):
            if x in names and node.output[0] != x:
                node.input[j] = x + "_rows"
    del producer
    return model


def prepare_slm(model: onnx.ModelProto, folder=None, weights: WeightFile | None = None,
                name: str = "the SLM graph") -> onnx.ModelProto:
    """The convert graphs' passes, in order (the same for tree and prefill). `folder`, `weights`:
    a graph whose weights are on disk (`fold_weight_transposes`)."""
    model = fold_shape_subgraphs(model)
    model = fold_weight_transposes(model, folder, weights)
    for step in (explicit_weight_zero_points, srq_int8_as_uint16, gelu_tanh_as_sigmoid, softcap_as_sigmoid,
                 log_softmax_as_exp_sum, split_kv_row_outputs):
        model = step(model)
    return no_tanh_left(model, name)


def prepare_mtp(model: onnx.ModelProto, name: str = "the MTP step graph") -> tuple[onnx.ModelProto, dict[str, tuple[float, int]]]:
    """qat's step graph: its input QDQ comes off (the ranges go to the quantizer), then the
    same passes as the SLM graphs (most find nothing to do there)."""
    model, params = strip_input_qdq(model)
    for step in (fold_shape_subgraphs, fold_weight_transposes, explicit_weight_zero_points, gelu_tanh_as_sigmoid,
                 softcap_as_sigmoid, log_softmax_as_exp_sum):
        model = step(model)
    return no_tanh_left(model, name), params


def no_tanh_left(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """The graph, or an error naming each Tanh the rewrites did not take (a softcap by unequal
    constants, a Tanh in a new place): the HTP computes 16-row Tanh wrong (`softcap_as_sigmoid`)."""
    left = [f"{n.name or n.output[0]} (input {n.input[0]})" for n in model.graph.node if n.op_type == "Tanh"]
    if left:
        raise HycoError(f"{name}: Tanh the HTP would compute wrong at 16 rows, not rewritten as "
                        f"Sigmoid: {', '.join(left[:4])}")
    return model


# --- weights on disk ------------------------------------------------------------------------
# At E2B size a graph's weights are 1 GB; a pass that only re-wires nodes must not hold them (each
# `_copy` of a loaded model is another GB: preparing a graph held several that way). So graphs
# are read with their integer weights left on disk, passes that need a weight's values read that
# one weight, and saving streams each weight's bytes into the new file one tensor at a time.

INLINE_MAX_BYTES = 1024  # integer tensors from here up stay on disk (as `save` writes them); float ones load


def load_graph(path) -> onnx.ModelProto:
    """`path`'s model with its integer weights left on disk (references resolved against `path`'s
    folder): scales, zero points and every other small or float tensor are in memory."""
    from pathlib import Path

    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        if uses_external_data(t) and (t.data_type not in INT_WEIGHT_TYPES or _external_length(t) < INLINE_MAX_BYTES):
            load_external_data_for_tensor(t, str(path.parent))
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
    return model


def _external_length(t: onnx.TensorProto) -> int:
    info = {e.key: e.value for e in t.external_data}
    return int(info.get("length", 1 << 62))


class WeightFile:
    """`<graph>.data`, written one tensor at a time: `put` moves a tensor's bytes into the file and
    leaves the tensor referring to them there."""

    def __init__(self, graph_path):
        from pathlib import Path

        self.path = Path(str(graph_path) + ".data")
        self.file = open(self.path, "wb")  # noqa: SIM115 - closed by close() / the with block

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def put(self, t: onnx.TensorProto) -> onnx.TensorProto:
        from onnx.external_data_helper import set_external_data

        if not t.HasField("raw_data"):  # typed fields (small tensors onnx.helper made) -> raw bytes
            if t.data_type in (TensorProto.INT4, TensorProto.UINT4, TensorProto.INT2):
                raise ValueError(f"{t.name}: packed tensor without raw_data")  # from_array would not repack it
            t.raw_data = numpy_helper.from_array(numpy_helper.to_array(t)).raw_data
            for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                t.ClearField(field)
        offset = self.file.tell()
        self.file.write(t.raw_data)
        set_external_data(t, self.path.name, offset=offset, length=len(t.raw_data))
        t.data_location = TensorProto.EXTERNAL
        t.ClearField("raw_data")
        return t


def save_streamed(model: onnx.ModelProto, folder, path, check: bool = True, weights: WeightFile | None = None) -> None:
    """Write `model` (its weights on disk under `folder`, `load_graph`) to `path`: every tensor
    still on disk, and every one in memory of 1 KB or more, goes into `<path>.data` one at a time
    (`weights`: that file, already open, holding the tensors a pass wrote there). `model` is left
    referring to the new file."""
    from pathlib import Path

    from onnx.external_data_helper import uses_external_data

    path = Path(path)
    with weights or WeightFile(path) as weights:
        if weights.path != Path(str(path) + ".data"):
            raise ValueError(f"{weights.path} is not {path}'s weights file")
        for t in model.graph.initializer:
            if uses_external_data(t):
                if {e.key: e.value for e in t.external_data}.get("location") != weights.path.name:
                    t.CopyFrom(weights.put(loaded(t, folder)))  # a copy read from `folder`, then moved
            elif len(t.raw_data) >= 1024 or t.ByteSize() >= 1024:
                weights.put(t)
    onnx.save(model, str(path))
    if check:
        onnx.checker.check_model(str(path), full_check=True)


def save(model: onnx.ModelProto, path, check: bool = True) -> None:
    """Write `model` with its weights in `<path>.data` (a copy is written: onnx's external-data
    save rewrites the tensors it is given), then check it whole."""
    from pathlib import Path

    path = Path(path)
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.unlink()
    onnx.save_model(_copy(model), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    if check:
        onnx.checker.check_model(str(path), full_check=True)
