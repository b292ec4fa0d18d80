"""Split a QDQ graph into parts by decoder-layer ranges, so each part's weights stay under a limit
(devices refuse contexts beyond ~2 GiB); each part becomes its own context, and the runtime
chains them (`ChainedSession`).

A node belongs to the layer its name says (`/layers.N/...`, as the exporter names modules);
a node without one inherits the deepest layer among its inputs' producers (so the final norm and
head join the last part, the embedding-side nodes the first). Layers are packed greedily into
parts. A tensor crossing a boundary leaves its part as the float output of a DequantizeLinear
(the pattern of the graph's own outputs) and enters the next through a QuantizeLinear /
DequantizeLinear pair with that node's scale and zero point (the pattern of the graph's own
inputs): the value sits on that grid, so the requantization is exact and no part starts with a
float op. (Cutting on the integer tensor instead left Q outputs that are also graph outputs,
which the QNN EP refused to group.)
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from hyco.base.errors import HycoError
from hyco.npu.io_spec import GraphSpec, TensorSpec

_LAYER = re.compile(r"layers\.(\d+)[/.]")


def node_layers(model) -> list[int]:
    """Layer index per node (-1: before the first layer), in graph order."""
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output}
    layers: dict[int, int] = {}

    def layer_of(i: int) -> int:
        if i in layers:
            return layers[i]
        stack = [i]
        while stack:  # iterative post-order: graphs are thousands of nodes deep
            j = stack[-1]
            node = model.graph.node[j]
            pending = [producer[x] for x in node.input if x in producer and producer[x] not in layers]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            named = _LAYER.search(node.name)
            inherited = max((layers[producer[x]] for x in node.input if x in producer), default=-1)
            layers[j] = int(named.group(1)) if named else inherited
        return layers[i]

    return [layer_of(i) for i in range(len(model.graph.node))]


def _bytes(t) -> int:
    from onnx import TensorProto, helper

    if t.data_type in (TensorProto.INT4, TensorProto.UINT4):
        return (int(np.prod(t.dims, dtype=np.int64)) + 1) // 2
    if t.data_type in (TensorProto.INT2, TensorProto.UINT2):
        return (int(np.prod(t.dims, dtype=np.int64)) + 3) // 4
    size = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    return int(np.prod(t.dims, dtype=np.int64)) * size


def kv_shared_layers(model) -> set[int]:
    """Layers that attend over another layer's K/V: attention nodes but no k_proj of their own."""
    attends, projects = set(), set()
    for node in model.graph.node:
        named = _LAYER.search(node.name)
        if named and "/attn/" in node.name:
            (projects if "/attn/k_proj" in node.name else attends).add(int(named.group(1)))
    return attends - projects


def plan_parts(model, limit: int, at_least: int = 1) -> list[tuple[int, int]]:
    """Inclusive layer ranges, packed greedily so each part's initializer bytes stay <= limit.

    With `at_least` > 1, that many parts or fewer, as even in bytes as packing allows (parts
    compiled side by side finish together), and a part starts at the first KV-shared layer: the QNN
    compile's graph sequencing grows far faster than the part where the layers owning K/V sit with
    the layers reading it (E2B shapes: 10 KV-shared layers compiled in 50 s beside another compile;
    9 of them with the two owners in 65 s alone; docs/fullsize.md). The parts are shared between
    the owners' layers and the KV-shared ones so that the largest part is smallest (E2B's three
    hold 303, 203 and 237 MB of weights, the first the owners' INT4 layers)."""
    ordered, per_layer, shared = _layer_bytes(model)
    if shared >= limit:
        raise HycoError(f"the weights outside the layers alone hold {shared} bytes, over export.max_context_bytes {limit}")
    budget = limit - shared  # every part's budget reserves the weights outside the layers
    for layer in ordered:
        if per_layer.get(layer, 0) > budget:
            raise HycoError(f"layer {layer} alone holds {per_layer[layer]} weight bytes (+{shared} shared), over "
                            f"export.max_context_bytes {limit}")
    if at_least <= 1:
        ranges = _pack(ordered, per_layer, budget)
    else:  # the owners' layers in k parts, the KV-shared ones in the rest: the k whose largest part is smallest
        first_shared = min(kv_shared_layers(model) & set(ordered), default=None)
        cut = ordered.index(first_shared) if first_shared is not None else 0
        segments = [ordered[:cut], ordered[cut:]] if cut else [ordered]
        counts = [(k, at_least - k) for k in range(1, at_least)] if cut else [(at_least,)]
        best = min(([_smallest_limit(seg, per_layer, n, budget) for seg, n in zip(segments, ks, strict=True)]
                    for ks in counts), key=max)
        ranges = [r for seg, lim in zip(segments, best, strict=True) for r in _pack(seg, per_layer, lim)]
    return [(-1, b) if i == 0 else (a, b) for i, (a, b) in enumerate(ranges)]


def _layer_bytes(model) -> tuple[list[int], dict[int, int], int]:
    """(layers in order, weight bytes per layer, bytes of the weights outside every layer). Those
    outside (embedding-side projections) are recomputed in each part that reads them; their nodes
    ride with the first layer."""
    layers = node_layers(model)
    sizes = {t.name: _bytes(t) for t in model.graph.initializer}
    per_layer: dict[int, int] = {}
    owner: dict[str, int] = {}
    for node, layer in zip(model.graph.node, layers, strict=True):
        for x in node.input:
            if x in sizes and x not in owner:
                owner[x] = layer
                per_layer[layer] = per_layer.get(layer, 0) + sizes[x]
    ordered = sorted(set(layers) - {-1}) or [-1]
    shared = per_layer.pop(-1, 0) if ordered[0] != -1 else 0
    return ordered, per_layer, shared


def _pack(layers: list[int], per_layer: dict[int, int], limit: int) -> list[tuple[int, int]]:
    """`layers` packed greedily in order, each range's bytes <= limit (no single layer is over it)."""
    parts, start, total, prev = [], layers[0], 0, layers[0]
    for layer in layers:
        size = per_layer.get(layer, 0)
        if total + size > limit and total:
            parts.append((start, prev))
            start, total = layer, 0
        total += size
        prev = layer
    parts.append((start, prev))
    return parts


def _smallest_limit(layers: list[int], per_layer: dict[int, int], parts: int, high: int) -> int:
    """The smallest limit <= high under which `_pack` makes `parts` ranges or fewer (high if none)."""
    low = max([per_layer.get(layer, 0) for layer in layers] + [1])
    while low < high:  # the packing's range count falls as the limit grows
        mid = (low + high) // 2
        low, high = (low, mid) if len(_pack(layers, per_layer, mid)) <= parts else (mid + 1, high)
    return low


def _spec(model, names: list[str], graph: str, meaning: str, known: dict[str, TensorSpec]) -> tuple[TensorSpec, ...]:
    """Part I/O: the whole graph's own TensorSpec (with its quantization grid) where the tensor is
    a graph input or output, else a float boundary tensor with the shape inference gave."""
    from onnx import helper

    infos = {v.name: v for v in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)}
    out = []
    for name in names:
        if name in known:
            out.append(known[name])
            continue
        if name not in infos:
            raise HycoError(f"{graph}: no shape known for boundary tensor {name!r}")
        tt = infos[name].type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
        out.append(TensorSpec(name, tuple(d.dim_value for d in tt.shape.dim), dtype, meaning))
    return tuple(out)


def split_graph(graph: Path, out_dir: Path, limit: int, spec: GraphSpec | None = None,
                at_least: int = 1) -> list[tuple[Path, GraphSpec]]:
    """Write `graph`'s parts (`at_least` of them where the layers allow, `plan_parts`) into
    `out_dir`; returns (part graph, part I/O spec) in run order.

    Only tensors computed by a layer cross a boundary; what hangs off the graph inputs alone
    (their Q/DQ, the per-layer-input slicing) is recomputed in every part that needs it."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model
    from onnx.utils import Extractor

    # weightless: each part reads its own weights just before it is written, so the split holds
    # one part's weights at a time, not the whole graph's (9 GiB at E4B shapes)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(graph), load_external_data=False))
    nodes = list(model.graph.node)
    layers = node_layers(model)
    try:
        ranges = plan_parts(model, limit, at_least)
    except HycoError as e:
        raise HycoError(f"{graph}: {e}") from None
    part_of = [next(p for p, (a, b) in enumerate(ranges) if a <= layer <= b) for layer in layers]
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    graph_inputs = {i.name for i in model.graph.input}
    layered: set[str] = set()  # tensors that depend on a layer's node
    for i in _topological(nodes, producer):
        named = _LAYER.search(nodes[i].name) and nodes[i].input  # a Constant is recomputed, never cut
        if named or any(x in layered for x in nodes[i].input):
            layered.update(nodes[i].output)

    needs: list[set[str]] = [set() for _ in ranges]  # tensors each part takes from earlier parts
    for i, node in enumerate(nodes):
        for x in node.input:
            if x in layered and part_of[producer[x]] < part_of[i]:
                needs[part_of[i]].add(x)
    written: list[tuple[Path, GraphSpec]] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    extractor = Extractor(model)
    last = len(ranges) - 1
    for p in range(len(ranges)):
        later = set().union(*needs[p + 1:]) if p < last else set()
        outputs = sorted(t for t in later if part_of[producer[t]] == p)
        outputs += [o.name for o in model.graph.output
                    if (part_of[producer[o.name]] == p if o.name in layered else p == last)]
        inputs = sorted(needs[p] | _reached_inputs(nodes, producer, outputs, needs[p], graph_inputs))
        part = extractor.extract_model(inputs, outputs)
        _requantize_inputs(part, model, nodes, producer, needs[p])
        name = f"{graph.name.split('.')[0]}.part{p}.onnx"
        path = out_dir / name
        load_external_data_for_model(part, str(graph.parent))
        onnx.save_model(part, str(path), save_as_external_data=True, location=name + ".data")
        known = {t.name: t for t in (*spec.inputs, *spec.outputs)} if spec is not None else {}
        part_spec = GraphSpec(name, _spec(model, [i.name for i in part.graph.input], name, "part input", known),
                              _spec(model, [o.name for o in part.graph.output], name, "part output", known),
                              {"layers": list(ranges[p]), "part": p, "parts": len(ranges)})
        written.append((path, part_spec))
    return written


def _requantize_inputs(part, model, nodes, producer, cut: set[str]) -> None:
    """Each cut input that was a DequantizeLinear output enters through Q -> DQ with that node's
    scale and zero point; its consumers read the requantized tensor."""
    from onnx import helper

    inits = {t.name: t for t in model.graph.initializer}
    added = []
    for name in sorted(cut):
        dq = nodes[producer[name]]
        if dq.op_type != "DequantizeLinear":
            raise HycoError(f"boundary tensor {name!r} is a {dq.op_type} output, not a DequantizeLinear one; "
                            "cannot cut a QDQ graph there")
        params = list(dq.input[1:])
        for x in params:
            if x not in {t.name for t in part.graph.initializer}:
                part.graph.initializer.append(inits[x])
        for node in part.graph.node:
            for k, x in enumerate(node.input):
                if x == name:
                    node.input[k] = f"{name}_requant"
        attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
        added += [helper.make_node("QuantizeLinear", [name, *params], [f"{name}_q"], name=f"{name}_requant_q", **attrs),
                  helper.make_node("DequantizeLinear", [f"{name}_q", *params], [f"{name}_requant"],
                                   name=f"{name}_requant_dq", **attrs)]
    for node in reversed(added):
        part.graph.node.insert(0, node)


def _reached_inputs(nodes, producer, outputs, stops, graph_inputs) -> set[str]:
    """Graph inputs reached walking back from `outputs` without crossing `stops`."""
    found, seen, stack = set(), set(), list(outputs)
    while stack:
        t = stack.pop()
        if t in seen or t in stops:
            continue
        seen.add(t)
        if t in graph_inputs:
            found.add(t)
        elif t in producer:
            stack.extend(nodes[producer[t]].input)
    return found


def _topological(nodes, producer) -> list[int]:
    order, seen = [], set()
    for start in range(len(nodes)):
        stack = [(start, False)]
        while stack:
            i, done = stack.pop()
            if done:
                order.append(i)
                continue
            if i in seen:
                continue
            seen.add(i)
            stack.append((i, True))
            stack.extend((producer[x], False) for x in nodes[i].input if x in producer and producer[x] not in seen)
    return order
