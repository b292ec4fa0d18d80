"""calibrate.lookups: the indexes that answer onnxruntime's quantizer's name scans (issue 13).
Every answer must be the scan's, however the lists were edited in between; the whole-graph
proof is test_calibrate's lean-vs-onnxruntime test, which runs with `check_lookups`."""

import numpy as np
import onnx
import pytest
from hyco.calibrate.lookups import QuantizerLookups
from onnx import helper, numpy_helper


def _graph(n_nodes: int = 6, n_inits: int = 5) -> onnx.GraphProto:
    inits = [numpy_helper.from_array(np.full(2, i, np.float32), f"w{i}") for i in range(n_inits)]
    nodes = [helper.make_node("Add", [f"x{i}", f"w{i % n_inits}"], [f"x{i + 1}"], name=f"add{i}") for i in range(n_nodes)]
    return helper.make_graph(nodes, "g", [], [], initializer=inits)


def _scan_init(graph, name):
    return next((t for t in graph.initializer if t.name == name), None)


def _scan_readers(graph, name):
    return sorted(n.name for n in graph.node if name in n.input)


def test_initializer_answers_follow_appends_and_removals():
    graph, lookups = _graph(), QuantizerLookups()
    for name in ("w0", "w4", "x1", "nope"):
        assert lookups.find_initializer(name, graph.initializer) is _scan_init(graph, name)
    graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "w_new"))
    assert lookups.find_initializer("w_new", graph.initializer) is _scan_init(graph, "w_new")
    # a removal then an append of the same count: same length, the last indexed item moved
    graph.initializer.remove(_scan_init(graph, "w1"))
    graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "w_late"))
    assert lookups.find_initializer("w1", graph.initializer) is None
    assert lookups.find_initializer("w_late", graph.initializer) is _scan_init(graph, "w_late")
    # removing the last item then appending another
    graph.initializer.remove(_scan_init(graph, "w_late"))
    graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "w_last"))
    assert lookups.find_initializer("w_late", graph.initializer) is None
    assert lookups.find_initializer("w_last", graph.initializer) is _scan_init(graph, "w_last")
    # two of a name: the first, as onnxruntime's find_by_name returns
    graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "w0"))
    assert lookups.find_initializer("w0", graph.initializer).dims == [2]


def test_readers_follow_appended_nodes_and_rewritten_inputs():
    graph, lookups = _graph(), QuantizerLookups(check=True)
    assert sorted(n.name for n in lookups.readers("w1", graph.node)) == _scan_readers(graph, "w1") == ["add1"]
    graph.node.append(helper.make_node("QuantizeLinear", ["w1", "s"], ["w1_q"], name="q"))
    assert sorted(n.name for n in lookups.readers("w1", graph.node)) == ["add1", "q"]
    node = next(n for n in graph.node if n.name == "add1")
    node.input[1] = "w1_dq"
    lookups.note_rewrite(node, "w1_dq")  # what the patched replace_node_input reports
    assert [n.name for n in lookups.readers("w1_dq", graph.node)] == ["add1"]
    assert [n.name for n in lookups.readers("w1", graph.node)] == ["q"]
    graph.node.remove(node)  # shrinks: indexed anew
    assert lookups.readers("w1_dq", graph.node) == []


def test_check_mode_catches_an_input_rewritten_behind_the_index():
    """The indexes trust that inputs change only through onnxruntime's replace functions; a
    rewrite they were not told of is what `check` exists to catch (the tests run with it)."""
    graph = _graph()
    for check in (False, True):
        lookups = QuantizerLookups(check=check)
        lookups.readers("w2", graph.node)
        node = next(n for n in graph.node if n.name == "add3")
        node.input[1] = "w2"  # not reported through note_rewrite
        if check:
            with pytest.raises(AssertionError, match="reader index: 'w2'"):
                lookups.readers("w2", graph.node)
        else:
            assert [n.name for n in lookups.readers("w2", graph.node)] == ["add2"]  # stale, silently
        node.input[1] = "w3"


def test_indexes_are_per_list():
    a, b = _graph(), _graph(n_inits=2)
    lookups = QuantizerLookups(check=True)
    assert lookups.find_initializer("w3", a.initializer) is _scan_init(a, "w3")
    assert lookups.find_initializer("w3", b.initializer) is None


def test_a_rewrite_is_noted_only_in_the_index_of_the_nodes_own_graph():
    a, b = _graph(), _graph()
    lookups = QuantizerLookups(check=True)
    lookups.readers("w1", a.node), lookups.readers("w1", b.node)
    node = next(n for n in a.node if n.name == "add1")
    node.input[1] = "w1_dq"
    lookups.note_rewrite(node, "w1_dq")
    assert [n.name for n in lookups.readers("w1_dq", a.node)] == ["add1"]
    assert lookups.readers("w1_dq", b.node) == []  # b's add1 still reads w1
