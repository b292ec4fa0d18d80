"""onnxruntime's calibrator and QDQ quantizer, patched where they cost minutes and GBs at E2B size,
writing the same graph: every patch of onnxruntime's private functions lives here, applied only
inside `lean_quantizer` and only on the onnxruntime releases they were proven on (PROVEN; pyproject
pins the same range). tests/test_calibrate.py holds the lean quantizer's graph to onnxruntime's
unpatched `quantize`, and `augment_graph_linear`'s graph to onnxruntime's own.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from hyco.calibrate.lookups import QuantizerLookups
from onnx import TensorProto, helper, numpy_helper

from hyco.base.errors import HycoError

PROVEN = ((1, 32), (1, 33))  # onnxruntime >= 1.32, < 1.33: what the patches were proven on


def require_proven_onnxruntime(version: str | None = None) -> None:
    """Refuse an onnxruntime release the patches were not proven on: they replace private functions
    whose names and contracts change between releases, and a silent mismatch would quantize wrong."""
    if version is None:
        import onnxruntime

        version = onnxruntime.__version__
    major_minor = tuple(int(p) for p in version.split(".")[:2])
    if not PROVEN[0] <= major_minor < PROVEN[1]:
        (lo, hi) = (".".join(map(str, v)) for v in PROVEN)
        raise HycoError(f"onnxruntime {version}: calibrate's quantizer patches (hyco.calibrate.ort_patches) were "
                        f"proven on onnxruntime >={lo},<{hi} only; install that range (pyproject pins it)")


@contextmanager
def lean_quantizer(weights: Path, int4_matmul: bool = True, check: bool = False):
    """onnxruntime's calibrator and QDQ quantizer, minus what makes them cost minutes and GBs at
    E2B size, writing the same graph (tests/test_calibrate.py holds `quantize_graph` to
    onnxruntime's unpatched `quantize`, and the augmented graph to its own):
    - the quantizer renames a tensor's readers by scanning every node's inputs in Python, once
      per quantized tensor, and looks initializers up by a full list scan (quadratic in the graph,
      most of a quantize at E2B size); here both come from indexes (`calibrate.lookups`; `check`:
      each answer is also compared with the scan, for the tests);
    - its model is read without weights (it loaded and rewrote every weight: one more copy of the
      model in memory and on disk); the augmented graph's weights are read from `weights`, the
      prepared graph's folder;
    - `augment_graph_linear` builds onnxruntime's augmented graph in linear time (its own rescans
      the node list and value infos per tapped tensor);
    - its session has no CPU memory arena (the arena keeps every pass's high-water mark), each
      weight dequantized just before its MatMul (`drive.cpu_session`), weight taps as constants
      (`constant_weight_taps`) and onnxruntime's priority order."""
    require_proven_onnxruntime()
    patches = _patches(weights, int4_matmul, check)
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in patches if not hasattr(owner, name)]
    if missing:
        raise HycoError(f"onnxruntime has no {', '.join(missing)}: calibrate's quantizer patches do not fit this release")
    originals = [inspect.getattr_static(owner, name) for owner, name, _ in patches]  # a staticmethod as such
    for owner, name, new in patches:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for (owner, name, _), original in zip(patches, originals, strict=True):
            setattr(owner, name, original)


def _patches(weights: Path, int4_matmul: bool, check: bool) -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) for each onnxruntime function `lean_quantizer` replaces."""
    import onnxruntime.quantization.base_quantizer as base_quantizer
    import onnxruntime.quantization.calibrate as calibrate
    import onnxruntime.quantization.onnx_model as onnx_model
    import onnxruntime.quantization.qdq_quantizer as qdq_quantizer
    from onnxruntime.quantization.quant_utils import add_infer_metadata, generate_identified_filename

    from hyco.qnn.ort import session_for

    def load_weightless(model_path: Path) -> onnx.ModelProto:  # quant_utils.load_model_with_shape_infer
        inferred = generate_identified_filename(Path(model_path), "-inferred")
        onnx.shape_inference.infer_shapes_path(str(model_path), str(inferred))  # the weights stay on disk
        model = onnx.load(str(inferred), load_external_data=False)
        inferred.unlink()
        add_infer_metadata(model)
        return model

    def create_inference_session(self):
        model = onnx.load(self.augmented_model_path, load_external_data=False)
        constant_weight_taps(model, weights)
        self.infer_session = session_for(model, weights, arena=False, providers=self.execution_providers,
                                         priority_order=True, int4_matmul=int4_matmul)

    ort_augment = getattr(calibrate.MinMaxCalibrater, "augment_graph", None)

    def augment_graph(self):
        return ort_augment(self) if self.per_channel else augment_graph_linear(self)

    lookups = QuantizerLookups(check)
    ort_replace_node_input = getattr(onnx_model.ONNXModel, "replace_node_input", None)

    def replace_node_input(node, old_input_name, new_input_name):
        ort_replace_node_input(node, old_input_name, new_input_name)
        lookups.note_rewrite(node, new_input_name)

    def replace_input_of_all_nodes(self, old_input_name, new_input_name):
        for node in lookups.readers(old_input_name, self.model.graph.node):
            replace_node_input(node, old_input_name, new_input_name)

    def get_initializer(self, name):
        return lookups.find_initializer(name, self.model.graph.initializer)

    def find_by_name(item_name, item_list):
        if len(item_list) and isinstance(item_list[0], onnx.TensorProto):  # a graph's initializers
            return lookups.find_initializer(item_name, item_list)
        return next((item for item in item_list if item.name == item_name), None)

    return [(calibrate, "load_model_with_shape_infer", load_weightless),
            (calibrate.CalibraterBase, "create_inference_session", create_inference_session),
            (calibrate.MinMaxCalibrater, "augment_graph", augment_graph),
            (onnx_model.ONNXModel, "replace_node_input", staticmethod(replace_node_input)),
            (onnx_model.ONNXModel, "replace_input_of_all_nodes", replace_input_of_all_nodes),
            (onnx_model.ONNXModel, "get_initializer", get_initializer),
            (onnx_model, "find_by_name", find_by_name), (qdq_quantizer, "find_by_name", find_by_name),
            (base_quantizer, "find_by_name", find_by_name)]



def augment_graph_linear(self) -> None:
    """`MinMaxCalibrater.augment_graph` (onnxruntime, PROVEN), the same graph in linear time.
    onnxruntime inserts each tapped tensor's ReduceMin and then its ReduceMax (each followed by a
    Reshape to [-1]) in front of the first node that reads the tensor, searching the node list
    again for every insertion; the ReduceMax lands in front of the ReduceMin, which reads the
    tensor too. So in front of each node come, for each tensor that node reads first, in the
    calibrator's tensor order: ReduceMax, Reshape, ReduceMin, Reshape; taps of tensors nothing
    reads go last, in the same pattern; the graph outputs gain, per tensor, the ReduceMin's and
    then the ReduceMax's. Per-tensor ranges only (`lean_quantizer` keeps onnxruntime's for
    per_channel)."""
    import uuid

    graph = self.model.graph
    tensors, value_infos = self.select_tensors_to_calibrate(self.model)
    reshape_shape = numpy_helper.from_array(np.array([-1], dtype=np.int64), str(uuid.uuid4()))
    graph.initializer.append(reshape_shape)
    first_reader: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for x in node.input:
            first_reader.setdefault(x, i)
    taps: dict[int, list] = {}
    outputs = []
    for tensor in tensors:
        if tensor not in value_infos:
            raise ValueError(f"Unable to guess tensor type for tensor {tensor!r}, "
                             "running shape inference before quantization may resolve this issue.")
        elem_type = value_infos[tensor].type.tensor_type.elem_type
        nodes = []
        for op in ("ReduceMax", "ReduceMin"):
            reduced = f"{tensor}_{op}"
            nodes += [helper.make_node(op, [tensor], [reduced + "_Reshape"], keepdims=1, name=reduced),
                      helper.make_node("Reshape", [reduced + "_Reshape", reshape_shape.name], [reduced],
                                       name=reduced + "_Reshape")]
        taps.setdefault(first_reader.get(tensor, len(graph.node)), []).extend(nodes)
        outputs += [helper.make_tensor_value_info(f"{tensor}_{op}", elem_type, [None]) for op in ("ReduceMin", "ReduceMax")]
    augmented = []
    for i, node in enumerate(graph.node):
        augmented += taps.get(i, [])
        augmented.append(node)
    augmented += taps.get(len(graph.node), [])
    del graph.node[:]
    graph.node.extend(augmented)
    graph.output.extend(outputs)
    onnx.save(self.model, self.augmented_model_path)  # weightless (`lean_quantizer`): references only


def int_extremes(ints: onnx.TensorProto, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Smallest and largest integer of a loaded integer initializer, per index of `axis` (None:
    of the whole tensor). A 2-D INT4 one with even dims is read byte by byte through nibble
    tables (unpacking E2B's INT4 weights to int8 cost seconds of each graph's calibration)."""
    from hyco.calibrate.prepare import _int_array

    from hyco.formats.int4 import INT4_HIGH, INT4_LOW

    if ints.data_type == TensorProto.INT4 and len(ints.dims) == 2 and ints.dims[0] % 2 == 0 and ints.dims[1] % 2 == 0:
        b = np.frombuffer(ints.raw_data, np.uint8).reshape(ints.dims[0], ints.dims[1] // 2)
        low, high = INT4_LOW[b], INT4_HIGH[b]  # columns 2m and 2m + 1
        if axis is None:
            return min(low.min(), high.min()), max(low.max(), high.max())
        if axis == 0:
            return np.minimum(low.min(1), high.min(1)), np.maximum(low.max(1), high.max(1))
        lo, hi = np.empty(ints.dims[1], np.int8), np.empty(ints.dims[1], np.int8)
        lo[0::2], lo[1::2], hi[0::2], hi[1::2] = low.min(0), high.min(0), low.max(0), high.max(0)
        return lo, hi
    q = _int_array(ints)
    if axis is None:
        return q.min(), q.max()
    others = tuple(i for i in range(q.ndim) if i != axis)
    return q.min(axis=others), q.max(axis=others)


def constant_weight_taps(model: onnx.ModelProto, folder: Path) -> int:
    """The calibrator's ReduceMin/ReduceMax taps on a weight DequantizeLinear's output, as constants
    (in place; returns how many). onnxruntime runs those taps late in a pass, so every fp32 weight
    stayed alive until its tap ran (bench/bench_fullsize.py measures the peak). A weight's range is
    the same every pass, so it is computed once here, exactly: DequantizeLinear is (q - z) * s in
    float32, monotonic in q for each channel's s, so each channel's extremes are the products at
    its extreme codes. The weights are read from `folder` one at a time; the model stays weightless."""
    from hyco.quant.onnx_graph import loaded

    graph = model.graph
    inits = {t.name: t for t in model.graph.initializer}

    def extremes(dq) -> tuple[np.float32, np.float32]:
        ints = loaded(inits[dq.input[0]], folder)
        s = numpy_helper.to_array(loaded(inits[dq.input[1]], folder)).astype(np.float32)
        z = numpy_helper.to_array(loaded(inits[dq.input[2]], folder)).astype(np.int32) \
            if len(dq.input) > 2 and dq.input[2] else np.int32(0)
        axis = None if s.ndim == 0 else next((a.i for a in dq.attribute if a.name == "axis"), 1) % len(ints.dims)
        q_lo, q_hi = int_extremes(ints, axis)
        ends = [(np.asarray(e, np.int32) - z).astype(np.float32) * s for e in (q_lo, q_hi)]
        return min(e.min() for e in ends), max(e.max() for e in ends)

    weight_dq = {n.output[0]: n for n in graph.node
                 if n.op_type == "DequantizeLinear" and all(x in inits for x in n.input if x)
                 and inits[n.input[1]].data_type == TensorProto.FLOAT
                 and not any(a.name == "block_size" and a.i for a in n.attribute)}
    ranges, nodes, replaced = {}, [], 0
    for node in graph.node:
        # ORT's per-tensor taps only: the whole tensor (no axes), keepdims 1
        if node.op_type in ("ReduceMin", "ReduceMax") and node.input[0] in weight_dq and len(node.input) == 1 \
                and all(a.name == "keepdims" and a.i == 1 for a in node.attribute):
            dq = weight_dq[node.input[0]]
            if dq.output[0] not in ranges:
                ranges[dq.output[0]] = extremes(dq)
            lo, hi = ranges[dq.output[0]]
            rank = len(inits[dq.input[0]].dims)
            const = numpy_helper.from_array(np.full([1] * rank, lo if node.op_type == "ReduceMin" else hi, np.float32),
                                            f"{node.output[0]}/constant")
            graph.initializer.append(const)
            nodes.append(helper.make_node("Identity", [const.name], [node.output[0]], name=node.name))
            replaced += 1
            continue
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return replaced
