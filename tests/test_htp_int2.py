"""Whether the HTP takes 2-bit weights: the same per-channel matmul with INT2 and with INT4 weight
codes (both hold the same integers in [-2, 1]), on the HTP (x86 simulator, soc 87) against
onnxruntime CPU. INT2 comes out wrong, so the SLM's 2-bit weights travel in INT4 containers
(bundle.json `footprint.two_bit_weights` says what that costs). If a QNN release fixes INT2 this
test fails: then use it (bit-exact, proven) and drop the containers."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

OUT_SCALE = 0.002  # the output's 16-bit grid step


def matmul_graph(path, weights: np.ndarray, scales: np.ndarray, dtype: int, opset: int) -> None:
    import onnx

    rows, cols = weights.shape
    inits = [helper.make_tensor("w_q", dtype, weights.shape, weights.flatten().tolist()),
             numpy_helper.from_array(scales, "w_s"), helper.make_tensor("w_z", dtype, [cols], [0] * cols),
             numpy_helper.from_array(np.array(0.002, np.float32), "x_s"),
             numpy_helper.from_array(np.array(32768, np.uint16), "x_z"),
             numpy_helper.from_array(np.array(OUT_SCALE, np.float32), "y_s")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_s", "x_z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["m"]),
             helper.make_node("QuantizeLinear", ["m", "y_s", "x_z"], ["mq"]),
             helper.make_node("DequantizeLinear", ["mq", "y_s", "x_z"], ["y"])]
    graph = helper.make_graph(nodes, "w", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, rows])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, cols])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))


def test_the_htp_computes_int2_weights_wrong_and_int4_right(tmp_path):
    import onnxruntime as ort

    from hyco.qnn import session_options

    rng = np.random.default_rng(0)
    weights = rng.integers(-2, 2, (64, 32)).astype(np.int8)  # the 2-bit range, held by both types
    scales = (0.02 + 0.01 * rng.random(32)).astype(np.float32)
    x = (rng.standard_normal((4, 64)) * 0.3).astype(np.float32)
    codes = {}
    for name, dtype, opset in (("int2", TensorProto.INT2, 25), ("int4", TensorProto.INT4, 21)):
        path = tmp_path / f"{name}.onnx"
        matmul_graph(path, weights, scales, dtype, opset)
        cpu = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
        # onnxruntime CPU computes the reference matmul within a couple of output steps
        assert np.abs(cpu - x @ (weights * scales)).max() <= 3 * OUT_SCALE, name
        htp = ort.InferenceSession(str(path), sess_options=session_options(87)).run(None, {"x": x})[0]
        codes[name] = float(np.abs(htp - cpu).max() / OUT_SCALE)
    # INT4: within the 16-bit activation noise of a 64-term sum; INT2: a different computation
    print(f"HTP vs CPU, output steps: {codes}")
    assert codes["int4"] <= 16, codes
    assert codes["int2"] > 50, f"the HTP now computes INT2 weights right ({codes}): use them instead of INT4 containers"
