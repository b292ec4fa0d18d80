"""StaticGemma -> ONNX (opset 21) with integer weight initializers, streamed to external data.

torch's TorchScript exporter traces the graph only (`export_params=False`: the weights become
named graph inputs and the exporter serializes none of them). `finalize` then turns each of
those inputs into an initializer, one tensor at a time, into the external-data file: each
IntLinear's ints go in, converted from the checkpoint's packed bytes, as an INT8 initializer
feeding a per-channel DequantizeLinear (constant folding off, so nothing is folded to float),
or, for 2- and 4-bit linears, as INT4 (int2 values travel in INT4 containers: the HTP computes
wrong numbers on ONNX INT2; their 2-bit width goes to encodings.json). The exporter stops at opset
20, which has no INT4, so the opset is raised to 21, whose changes over 20 only widen types.
Each graph is checked with `onnx.checker.check_model(full_check=True)`.

Memory: the module's packed ints (the checkpoint's bytes) are the only full copy of the
weights alive while the graphs are traced and written; the exporter holds the graph structure
only, and `finalize` holds one tensor's bytes at a time (measured by bench/bench_convert.py,
held by tests/test_convert.py and tests/test_convert_memory.py).
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from hyco.convert.int4_matmul import fuse_int4_matmuls, shares_repacks
from hyco.convert.static_model import IntLinear, StaticGemma

from hyco.io_spec import GraphSpec
from hyco.onnx_graph import consumers as graph_consumers
from hyco.workers import cpu_threads

OPSET = 21
EXPORT_OPSET = 20  # the TorchScript exporter's maximum


def pack_int4(ints: np.ndarray) -> bytes:
    """ONNX INT4 raw data: two's-complement nibbles, element 2k in the low nibble of byte k."""
    flat = ints.astype(np.int8).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    nibbles = flat.view(np.uint8) & 0x0F
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()


# a byte of ONNX INT4 -> its low / high nibble's signed value
_NIBBLE = np.where(np.arange(16) >= 8, np.arange(16) - 16, np.arange(16)).astype(np.int8)
INT4_LOW, INT4_HIGH = _NIBBLE[np.arange(256) & 15], _NIBBLE[np.arange(256) >> 4]


def unpack_int4(raw: bytes, count: int) -> np.ndarray:
    """ONNX INT4 raw data -> `count` int8 values, through the nibble tables (10x the int16 route)."""
    b = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty(2 * b.size, np.int8)
    out[0::2], out[1::2] = INT4_LOW[b], INT4_HIGH[b]
    return out[:count]


def transpose_int4(raw: bytes, shape: tuple[int, int]) -> bytes:
    """ONNX INT4 raw data of an [R, C] matrix -> that of its [C, R] transpose, R and C even, byte
    by byte: row 2m of the result takes the low nibbles of rows 2j and 2j + 1, row 2m + 1 their
    high nibbles. 0.04 s per 19 M values; through int8 and back (unpack, .T, pack) 0.25 s."""
    rows, cols = shape
    if rows % 2 or cols % 2:
        return pack_int4(unpack_int4(raw, rows * cols).reshape(rows, cols).T)
    packed = np.frombuffer(raw, np.uint8).reshape(rows, cols // 2)
    even, odd = packed[0::2], packed[1::2]
    out = np.empty((cols, rows // 2), np.uint8)
    out[0::2] = ((even & 0x0F) | (odd << 4)).T
    out[1::2] = ((even >> 4) | (odd & 0xF0)).T
    return out.tobytes()


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
        return INT2_TO_INT4[packed].tobytes()
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


@contextlib.contextmanager
def shape_inference_without(names: set[str]):
    """The TorchScript exporter's ONNX shape inference, blind to the values of `names`.

    The exporter hands every parameter's value to ONNX shape inference, which serializes it into
    a proto: the int stand-ins (zero-stride, one byte each) were expanded to contiguous int8 and
    copied again, 2x the int8 size of each linear at once (+0.8 GB for a 262,144-row output
    layer; measured with VmHWM). Without the values the inputs keep their traced type and shape,
    which is all a DequantizeLinear needs: the exported graph is byte-identical."""
    from torch import _C

    infer = _C._jit_pass_onnx_graph_shape_type_inference

    def blind(graph, params, opset):
        return infer(graph, {k: v for k, v in params.items() if k not in names}, opset)

    _C._jit_pass_onnx_graph_shape_type_inference = blind
    try:
        yield
    finally:
        _C._jit_pass_onnx_graph_shape_type_inference = infer


def export_raw(static: StaticGemma, rows: int, folder: Path, name: str) -> GraphSpec:
    """torch's export of the module for `rows` rows into `folder` (opset 20), without weights:
    every parameter and buffer is a graph input named by its module path; `finalize` writes them."""
    import torch

    spec = static.io_spec(rows, name)
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad(), shape_inference_without(set(int_linears(static))):
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


def late_weight_dequant(model) -> int:
    """Make each weight DequantizeLinear wait for its MatMul's activation (in place; returns how
    many). onnxruntime's CPU EP starts every node whose inputs are all initializers first: all the
    graph's weights were dequantized to fp32 before the first MatMul (25 of 34 weight DQs, 1.06
    of 1.32 GB on a 4-layer E2B-wide tree.onnx; 9.5 GiB on the 35-layer one), so each pass held
    the whole model in fp32. Here the DQ's scale goes through Reshape(scale, Concat(Shape(act)[0:0],
    shape(scale))): the same values, but a data dependency on the activation, so the fp32 weight
    is made just before its MatMul and freed after it. Outputs are bit-identical (same kernels on
    the same values; tests/test_convert.py). For CPU sessions only: the deployed graphs keep
    their plain DQ -> MatMul, which is what the HTP's QDQ matcher expects."""
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


WEIGHT_PATH = frozenset({"Transpose", "Reshape", "QuantizeLinear", "DequantizeLinear", "Cast"})
SHAPE_KEEPING = frozenset({"QuantizeLinear", "DequantizeLinear", "Cast", "Round", "Clip", "Identity"})


def gemm_for_transposed_weights(model) -> int:
    """Replace each Transpose([1, 0]) -> MatMul(x, .) on a dequantized weight by
    Reshape -> Gemm(x2d, W, transB=1) -> Reshape (in place; returns how many). The Transpose
    made a second fp32 copy of every weight each pass: 40% of a CPU pass and the peak's second
    copy (4-layer E2B-wide tree.onnx: 2.2 -> 1.2 s/pass, 1.9 -> 1.4 GB). MLAS packs B the same
    way for both, so the outputs are bit-identical, except in its M == 1 special case (a GEMV
    kernel for a non-transposed B): only MatMuls whose activation has a static row count > 1 are
    rewritten (convert's graphs: 33 or the prefill chunk)."""
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
                int4_matmul: bool = True):
    """onnxruntime CPU session; graph optimisations off by default, since SRQ rounding is
    sensitive to summation order (the default optimisations flipped a few rounds). `arena`
    False: no CPU memory arena (same outputs; see calibrate.drive.cpu_session)."""
    import onnx

    return session_for(onnx.load(str(path), load_external_data=False), Path(path).parent, optimize, arena, providers,
                       int4_matmul=int4_matmul)


def session_for(model, weights_folder: Path, optimize: bool = False, arena: bool = True,
                providers=("CPUExecutionProvider",), priority_order: bool = False, int4_matmul: bool = True):
    """`ort_session` on a weightless in-memory `model` whose external data lies in
    `weights_folder` (rewritten in place). INT4 weights are multiplied packed by onnxruntime's
    MatMulNBits (`convert.int4_matmul`: the same integers and scales, fp32 compute in another
    summation order; 4.2 -> 1.0 s per E2B-shaped tree pass); the other weights are dequantized
    just before use and multiplied untransposed (`late_weight_dequant`,
    `gemm_for_transposed_weights`: same outputs, one fp32 weight at a time); the graph is handed
    over as bytes (`int4_matmul` False: every weight so, for tests that hold a session to
    onnxruntime's own bit for bit). `priority_order`: onnxruntime's
    priority-based node order instead of its default one, which runs side branches that end in a
    graph output (the calibrator's ReduceMin/ReduceMax taps) at the end of the pass, so every
    tapped activation lived until then: a 4-layer E2B-wide prefill calibration pass peaked at
    1.60-1.90 GB, 1.10-1.18 GB in priority order (1.04-1.12 GB for the graph without taps). Same
    kernels on the same inputs: the same outputs."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 3
    so.enable_cpu_mem_arena = arena
    so.intra_op_num_threads = cpu_threads()  # a worker's share of the cores (hyco.workers); 0 elsewhere
    if priority_order:
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    _, fused_folder = fuse_int4_matmuls(model, weights_folder) if int4_matmul else (0, None)
    late_weight_dequant(model)
    gemm_for_transposed_weights(model)
    so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                str(fused_folder or weights_folder))
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=list(providers))
    finally:
        if fused_folder is not None and not shares_repacks(fused_folder):  # the session has read its weights
            shutil.rmtree(fused_folder)
