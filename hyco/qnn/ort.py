"""onnxruntime CPU sessions on the project's graphs, the one builder every stage uses: graph
optimisations off (SRQ rounding is sensitive to summation order), INT4 weights multiplied packed
(`hyco.quant.int4_matmul`), INT8 weights dequantized once for the session's life, the others just
before their MatMul and multiplied untransposed; the rewrites here touch only the session's
in-memory copy of the graph, and the outputs keep onnxruntime's own bits (INT4 aside)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from hyco.base.workers import cpu_threads, spins
from hyco.quant.int2_blocks import restore_opset
from hyco.quant.int4_matmul import fuse_int4_matmuls, shares_repacks
from hyco.quant.onnx_graph import consumers as graph_consumers


def late_weight_dequant(model) -> int:
    """Make each weight DequantizeLinear wait for its MatMul's activation (in place; returns how
    many). onnxruntime's CPU EP starts every node whose inputs are all initializers first: the
    graph's weights were dequantized to fp32 before the first MatMul, so each pass held the whole
    model in fp32 (GBs at E2B size). Here the DQ's scale goes through Reshape(scale,
    Concat(Shape(act)[0:0], shape(scale))): the same values, but a data dependency on the
    activation, so the fp32 weight is made just before its MatMul and freed after it. Outputs are
    bit-identical (same kernels on the same values; tests/test_convert.py). For CPU sessions only:
    the deployed graphs keep their plain DQ -> MatMul, which is what the HTP's QDQ matcher
    expects."""
    from onnx import TensorProto, helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers = graph_consumers(graph)
    producer = {out: node for node in graph.node for out in node.output}
    position = _topological_positions(graph)
    nodes, moved = [], 0
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits and node.input[1] in inits:
            act = _matmul_activation(node, consumers)
            if act is not None and not _depends_on(act, node, producer, position):
                tag, scale = f"{node.name or node.output[0]}/late", inits[node.input[1]]
                shape = helper.make_tensor(f"{tag}/scale_shape", TensorProto.INT64, [len(scale.dims)], list(scale.dims))
                graph.initializer.append(shape)
                nodes += [helper.make_node("Shape", [act], [f"{tag}/none"], start=0, end=0, name=f"{tag}/Shape"),
                          helper.make_node("Concat", [f"{tag}/none", shape.name], [f"{tag}/shape"], axis=0,
                                           name=f"{tag}/Concat"),
                          helper.make_node("Reshape", [node.input[1], f"{tag}/shape"], [f"{tag}/scale"],
                                           name=f"{tag}/Reshape")]
                node.input[1] = f"{tag}/scale"
                moved += 1
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return moved


def _topological_positions(graph) -> dict[int, int]:
    """id(node) -> its place in a topological order (Kahn's; a saved graph need not be sorted)."""
    producer = {out: node for node in graph.node for out in node.output}
    waiting = {id(n): sum(1 for i in n.input if i in producer) for n in graph.node}
    users: dict[int, list] = {}
    for node in graph.node:
        for name in node.input:
            if name in producer:
                users.setdefault(id(producer[name]), []).append(node)
    ready = [n for n in graph.node if waiting[id(n)] == 0]
    position: dict[int, int] = {}
    while ready:
        node = ready.pop()
        position[id(node)] = len(position)
        for user in users.get(id(node), []):
            waiting[id(user)] -= 1
            if waiting[id(user)] == 0:
                ready.append(user)
    return position


def _depends_on(tensor: str, node, producer, position) -> bool:
    """Whether `tensor` is computed from `node`'s output: then making `node` wait for it would
    close a cycle. Walks back from `tensor`, never past nodes that come before `node`."""
    stack, seen, floor = [tensor], set(), position[id(node)]
    while stack:
        source = producer.get(stack.pop())
        if source is None or id(source) in seen or position[id(source)] < floor:
            continue
        if source is node:
            return True
        seen.add(id(source))
        stack.extend(source.input)
    return False


def _matmul_activation(dq, consumers) -> str | None:
    """The other input of the MatMul/Gemm a weight DQ feeds (DQ -> Transpose -> MatMul in
    convert's graphs), or None. Side consumers are allowed (onnxruntime's calibrator taps the
    Transpose with ReduceMin/ReduceMax), as long as one path of layout ops leads on."""
    out = dq.output[0]
    for _ in range(8):
        users = consumers.get(out, [])
        for node in users:
            if node.op_type in ("MatMul", "Gemm"):
                others = [name for name in node.input if name != out]
                return others[0] if others else None
        onward = [node for node in users if node.op_type in WEIGHT_PATH]
        if len(onward) != 1:
            return None
        out = onward[0].output[0]
    return None


# fp32 bytes a session may hold in INT8 weights dequantized once (`dequantize_int8_weights`): E2B's
# per-layer-input projections and gates take 165 MB, E4B's 330 MB
HELD_FP32_BYTES = 384 * 1024**2
HELD_MIN_BYTES = 16 * 1024


def dequantize_int8_weights(model, weights_folder: Path, budget: int = HELD_FP32_BYTES) -> dict[str, np.ndarray]:
    """Dequantize each 8-bit weight once, for the session's life, instead of on every pass
    (in place; returns name -> the fp32 array the session must be handed as an initializer).
    onnxruntime's per-axis DequantizeLinear runs about 100 M elements a second on one core: on
    an E2B tree pass its 41 M INT8 weights took 0.1-0.2 s. A DQ -> Transpose([1, 0]) pair folds
    into the transposed array, which is what the Transpose made each pass. numpy computes what
    the kernel does, float(int - zero) times the scale in fp32, so the values are the same bits.
    Only matrices of `HELD_MIN_BYTES` and more in fp32 whose DQ feeds no graph output, in graph
    order while `budget` fp32 bytes hold them; the rest stay with `late_weight_dequant`."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers = graph_consumers(graph)
    outputs = {o.name for o in graph.output}
    held: dict[str, np.ndarray] = {}
    replaced: dict[int, object] = {}
    spent = 0
    for node in graph.node:
        if (node.op_type != "DequantizeLinear" or any(name not in inits for name in node.input)
                or inits[node.input[0]].data_type not in (TensorProto.INT8, TensorProto.UINT8)
                or any(a.name == "block_size" and a.i for a in node.attribute)):
            continue
        weight = inits[node.input[0]]
        size = 4 * int(np.prod(weight.dims))
        if len(weight.dims) < 2 or size < HELD_MIN_BYTES or spent + size > budget:
            continue  # a constant of a few values (8-bit activation grids quantize those too) costs nothing a pass
        folded, out = [node], node.output[0]
        users = consumers.get(out, [])
        if (len(users) == 1 and users[0].op_type == "Transpose" and out not in outputs
                and [list(a.ints) for a in users[0].attribute if a.name == "perm"] in ([[1, 0]], [])):
            folded, out = [node, users[0]], users[0].output[0]
        if out in outputs:
            continue
        ints = numpy_helper.to_array(weight, str(weights_folder)).astype(np.float32)
        scale = numpy_helper.to_array(inits[node.input[1]], str(weights_folder)).astype(np.float32)
        zero = (numpy_helper.to_array(inits[node.input[2]], str(weights_folder)).astype(np.float32)
                if len(node.input) > 2 and node.input[2] else np.float32(0))
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1) % max(ints.ndim, 1)
        shape = [1] * ints.ndim
        if scale.ndim:
            shape[axis] = -1
        values = (ints - zero.reshape(shape)) * scale.reshape(shape)
        values = np.ascontiguousarray(values.T if len(folded) == 2 else values, dtype=np.float32)
        # the array reaches its MatMul through an Identity (an alias, no copy): a constant B would be
        # prepacked by onnxruntime, whose packed product is not the same bits as the unpacked one
        name = f"{out}/held"
        held[name] = values
        placeholder = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=values.shape,
                                  data_location=TensorProto.EXTERNAL)
        placeholder.external_data.add(key="location", value="held-by-the-session")
        graph.initializer.append(placeholder)
        replaced[id(node)] = helper.make_node("Identity", [name], [out], name=f"{out}/held")
        replaced.update({id(n): None for n in folded[1:]})
        spent += size
    if held:
        kept = [replaced.get(id(n), n) for n in graph.node]
        del graph.node[:]
        graph.node.extend(n for n in kept if n is not None)
        used = {name for n in graph.node for name in n.input} | outputs
        kept_inits = [t for t in graph.initializer if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(kept_inits)
    return held


WEIGHT_PATH = frozenset({"Transpose", "Reshape", "QuantizeLinear", "DequantizeLinear", "Cast"})
SHAPE_KEEPING = frozenset({"QuantizeLinear", "DequantizeLinear", "Cast", "Round", "Clip", "Identity"})


def gemm_for_transposed_weights(model) -> int:
    """Replace each Transpose([1, 0]) -> MatMul(x, .) on a dequantized weight by
    Reshape -> Gemm(x2d, W, transB=1) -> Reshape (in place; returns how many). The Transpose
    made a second fp32 copy of every weight each pass: a large share of a CPU pass's time and
    the peak's second copy. MLAS packs B the same way for both, so the outputs are bit-identical,
    except in its M == 1 special case (a GEMV kernel for a non-transposed B): only MatMuls whose
    activation has a static row count > 1 are rewritten (convert's graphs: 33 or the prefill
    chunk)."""
    from onnx import TensorProto, helper, shape_inference

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim]
              for v in (*shape_inference.infer_shapes(model, data_prop=True).graph.value_info, *graph.input)}
    producer = {out: node for node in graph.node for out in node.output}
    consumers = graph_consumers(graph)
    replaced: dict[str, list] = {}
    for node in graph.node:
        users = consumers.get(node.output[0], [])
        dq = producer.get(node.input[0]) if node.input else None
        if (node.op_type != "Transpose" or [list(a.ints) for a in node.attribute] != [[1, 0]] or len(users) != 1
                or users[0].op_type != "MatMul" or users[0].input[1] != node.output[0]
                or dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits):
            continue
        matmul, x = users[0], users[0].input[0]
        rows, known = shapes.get(x, []), x
        while (not rows or 0 in rows) and known in producer and producer[known].op_type in SHAPE_KEEPING:
            known = producer[known].input[0]  # the SRQ round trip before o_proj: same shape
            rows = shapes.get(known, [])
        if not rows or 0 in rows or int(np.prod(rows[:-1])) < 2:
            continue
        out_features, in_features = inits[dq.input[0]].dims
        tag = f"{matmul.name or matmul.output[0]}/gemm"
        flat = helper.make_tensor(f"{tag}/x2d_shape", TensorProto.INT64, [2], [-1, in_features])
        width = helper.make_tensor(f"{tag}/out_features", TensorProto.INT64, [1], [out_features])
        graph.initializer.extend([flat, width])
        replaced[matmul.output[0]] = [
            helper.make_node("Shape", [x], [f"{tag}/lead"], end=-1, name=f"{tag}/Shape"),
            helper.make_node("Concat", [f"{tag}/lead", width.name], [f"{tag}/y_shape"], axis=0, name=f"{tag}/Concat"),
            helper.make_node("Reshape", [x, flat.name], [f"{tag}/x2d"], name=f"{tag}/Reshape_x"),
            helper.make_node("Gemm", [f"{tag}/x2d", node.input[0]], [f"{tag}/y2d"], transB=1, name=f"{tag}/Gemm"),
            helper.make_node("Reshape", [f"{tag}/y2d", f"{tag}/y_shape"], [matmul.output[0]], name=f"{tag}/Reshape_y")]
        replaced[node.output[0]] = []
    nodes = [new for node in graph.node for new in replaced.get(node.output[0], [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    return sum(1 for v in replaced.values() if v)


def ort_session(path: Path, optimize: bool = False, arena: bool = True, providers=("CPUExecutionProvider",),
                int4_matmul: bool = True, rewrites: bool = True):
    """onnxruntime CPU session; graph optimisations off by default, since SRQ rounding is
    sensitive to summation order (the default optimisations flipped a few rounds). `arena`
    False: no CPU memory arena (same outputs; see calibrate.drive.cpu_session). `rewrites` False:
    the graph exactly as on disk (no packed INT4 products, no late dequantization), for a session
    held to onnxruntime's own plain one; onnxruntime reads the file itself, so a graph with its
    weights inside is not copied into a proto and its bytes first."""
    import onnx
    import onnxruntime as ort

    if not rewrites:
        return ort.InferenceSession(str(path), session_options(optimize, arena), providers=list(providers))
    return session_for(onnx.load(str(path), load_external_data=False), Path(path).parent, optimize, arena, providers,
                       int4_matmul=int4_matmul)


# A graph this small runs faster on one thread: handing each of its thousands of small ops to a
# pool costs more than the op (the tiny tree graph: 9.2 ms a pass on 2 threads, 4.9 on one). The
# outputs are the same bit for bit (onnxruntime splits its kernels' work by outputs, not sums).
SMALL_GRAPH_BYTES = 64 * 1024**2


def initializer_bytes(model) -> int:
    """The weights' bytes of an ONNX model, held inline or named in its external data."""
    total = 0
    for t in model.graph.initializer:
        external = {e.key: e.value for e in t.external_data}
        if external:  # a length not recorded: counted as large, so such a graph keeps every core
            total += int(external.get("length", SMALL_GRAPH_BYTES))
        else:
            total += len(t.raw_data) or 4 * len(t.float_data) or 8 * len(t.int64_data) or 4 * len(t.int32_data)
    return total


def session_options(optimize: bool = False, arena: bool = True, priority_order: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 3
    so.enable_cpu_mem_arena = arena
    so.intra_op_num_threads = cpu_threads()  # a worker's share of the cores (hyco.base.workers); 0 elsewhere
    if not spins():
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if priority_order:
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return so


def session_for(model, weights_folder: Path, optimize: bool = False, arena: bool = True,
                providers=("CPUExecutionProvider",), priority_order: bool = False, int4_matmul: bool = True,
                hold_int8: bool = True):
    """`ort_session` on a weightless in-memory `model` whose external data lies in
    `weights_folder` (rewritten in place). INT4 weights are multiplied packed by onnxruntime's
    MatMulNBits (`convert.int4_matmul`: the same integers and scales, fp32 compute in another
    summation order; several times faster on an E2B-shaped tree pass); INT8 weights are
    dequantized once (`dequantize_int8_weights`: the same bits); the other weights are
    dequantized just before use and multiplied untransposed (`late_weight_dequant`,
    `gemm_for_transposed_weights`: same outputs, one fp32 weight at a time); the graph is handed
    over as bytes (`hold_int8` False: INT8 weights dequantized every pass, as a bench compares;
    `int4_matmul` False: every weight so, for tests that hold a session to
    onnxruntime's own bit for bit). `priority_order`: onnxruntime's
    priority-based node order instead of its default one, which runs side branches that end in a
    graph output (the calibrator's ReduceMin/ReduceMax taps) at the end of the pass, so every
    tapped activation lived until then: in priority order a calibration pass peaks close to the
    graph without taps. Same kernels on the same inputs: the same outputs."""
    import onnxruntime as ort

    so = session_options(optimize, arena, priority_order)
    if not cpu_threads() and initializer_bytes(model) < SMALL_GRAPH_BYTES:
        so.intra_op_num_threads = 1
    _, fused_folder = fuse_int4_matmuls(model, weights_folder) if int4_matmul else (0, None)
    restore_opset(model)  # its INT2-block weights multiplied packed: no INT2 left, the graph's own opset
    held = dequantize_int8_weights(model, fused_folder or weights_folder) if int4_matmul and hold_int8 else {}
    late_weight_dequant(model)
    gemm_for_transposed_weights(model)
    so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                str(fused_folder or weights_folder))
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in held.values()]
    if held:  # onnxruntime reads these arrays in place: the session keeps them alive
        so.add_external_initializers(list(held), values)
    try:
        session = ort.InferenceSession(model.SerializeToString(), so, providers=list(providers))
        session.hyco_held_weights = (held, values)
        return session
    finally:
        if fused_folder is not None and not shares_repacks(fused_folder):  # the session has read its weights
            shutil.rmtree(fused_folder)
