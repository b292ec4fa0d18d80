"""io_spec's tensor roles and boundary codecs: `to_codes` / `from_codes` are what ONNX
QuantizeLinear / DequantizeLinear compute (onnxruntime CPU is the reference), ties and saturation
included, for the uint8 KV rings and the uint16 grids."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from hyco.npu.io_spec import Role, TensorSpec, role_of


def test_roles_of_the_graph_tensor_names():
    names = {"k_ring_3": Role.KV_RING, "v_ring_0": Role.KV_RING, "new_k_2": Role.NEW_KV, "new_v_11": Role.NEW_KV,
             "mask_full": Role.MASK, "mask_sliding": Role.MASK, "cos_full": Role.ROPE, "sin_sliding": Role.ROPE,
             "topk_logprobs": Role.TOPK, "topk_indices": Role.TOPK, "logits": Role.LOGITS, "embeds": Role.ROWS,
             "per_layer_embeds": Role.ROWS, "hidden": Role.ROWS, "token_embed": Role.ROWS}
    assert {n: role_of(n) for n in names} == names
    assert TensorSpec("new_v_1", (4, 8), "uint8", "new V rows", {"scale": 0.1, "zero_point": 128}).role is Role.NEW_KV


def _onnx_codec(dtype: str, scale: float, zero: int):
    """onnxruntime's own QuantizeLinear -> codes and DequantizeLinear -> values, on a [n] float input."""
    code_type = {"uint8": TensorProto.UINT8, "uint16": TensorProto.UINT16}[dtype]
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "s"),
             numpy_helper.from_array(np.array(zero, dtype), "z")]
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
        "codec", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info("q", code_type, [None]), helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})


@pytest.mark.parametrize("dtype,scale,zero", [("uint8", 0.0371, 128), ("uint8", 0.5, 0), ("uint16", 3.1e-5, 32768),
                                              ("uint16", 1.7e-4, 0)])
def test_boundary_codes_are_onnx_quantize_and_dequantize(dtype, scale, zero):
    top = np.iinfo(dtype).max
    rng = np.random.default_rng(7)
    grid = (np.arange(-zero - 3, top - zero + 3) * np.float32(scale)).astype(np.float32)
    ties = ((np.arange(-zero - 2, top - zero + 2) + 0.5) * np.float32(scale)).astype(np.float32)  # half steps
    wide = rng.uniform(-2.0, 2.0, 4096).astype(np.float32) * np.float32(scale) * top  # saturating ends
    x = np.concatenate([grid, ties, wide])
    spec = TensorSpec("k_ring_0", (x.size,), dtype, "ring", {"scale": scale, "zero_point": zero})
    codes, values = _onnx_codec(dtype, scale, zero)(x)
    ours = spec.to_codes(x)
    assert ours.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ours, codes)
    np.testing.assert_array_equal(spec.from_codes(ours), values)
    assert spec.takes_codes and not TensorSpec("cos_full", (1,), "float32", "rope", {"scale": scale,
                                                                                    "zero_point": zero}).takes_codes
