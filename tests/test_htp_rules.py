"""The HTP graph rules themselves (tests/htp_rules.py) on hand-built graphs: each rule fires on
the pattern it forbids and stays quiet on the legal rewrite. test_convert.py and test_qat.py hold
tree.onnx, prefill.onnx and mtp_step.onnx to them."""

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).parent))
from htp_rules import htp_violations  # noqa: E402


def _save(tmp_path, nodes, inits, name):
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    path = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_rules_fire_on_forbidden_patterns_and_pass_the_legal_rewrite(tmp_path):
    bad = _save(tmp_path, [
        helper.make_node("Pow", ["x", "two"], ["sq"], name="pow"),  # x**2 instead of x*x
        helper.make_node("Reciprocal", ["sq"], ["inv"], name="recip"),  # not fed by a Sqrt
        helper.make_node("Add", ["inv", "mask"], ["masked"], name="mask_add"),
        helper.make_node("Mul", ["masked", "scale"], ["scaled"], name="scale"),
        helper.make_node("LogSoftmax", ["scaled"], ["y"], name="lsm"),
    ], {"two": 2.0, "scale": 0.5, "mask": np.full((2, 4), -1e9)}, "bad")
    found = htp_violations(bad)
    assert len(found) == 5, found
    assert any("Pow" in v for v in found) and any("not fed by a Sqrt" in v for v in found)
    assert any("Reciprocal vs 0 Sqrt" in v for v in found)
    assert any("LogSoftmax lsm" in v for v in found) and any("constant mask" in v for v in found)
    good = _save(tmp_path, [
        helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
        helper.make_node("Sqrt", ["sq"], ["root"], name="sqrt"),
        helper.make_node("Reciprocal", ["root"], ["inv"], name="recip"),
        helper.make_node("Mul", ["x", "inv"], ["normed"], name="norm"),
        helper.make_node("LogSoftmax", ["normed"], ["y"], name="lsm"),
    ], {}, "good")
    assert htp_violations(good) == []
