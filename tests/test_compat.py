"""Each private name of transformers, torch and onnxruntime the project reads, run on the installed
release and held to what it must compute: a release that drops or changes one fails here, in one
line naming it, before convert or calibrate meets it."""

from __future__ import annotations

import io

import pytest
import torch

from hyco.base import compat_torch, compat_transformers
from hyco.formats.gemma_quant import int_range, pack, unpack


def test_rms_norm_eps_is_read_from_the_installed_gemma4_norm():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    norm = Gemma4RMSNorm(8, eps=3e-5)
    assert compat_transformers.rms_norm_eps(norm) == pytest.approx(3e-5, rel=0, abs=0)


def test_decomposed_rmsnorm_computes_the_installed_gemma4_norm():
    """convert's RMSNorm (x*x, mean, +eps, Reciprocal(Sqrt)) against transformers' own forward
    (`pow(-0.5)` in 5.24 and 5.25), on values spread over six decades. Tolerance 2 fp32 ulps of the
    output scale: Reciprocal(Sqrt) and pow(-0.5) round differently in the last bit."""
    from hyco.convert.rewrites import decompose_rmsnorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    torch.manual_seed(0)
    for with_scale in (True, False):
        norm = Gemma4RMSNorm(64, eps=1e-6, with_scale=with_scale)
        if with_scale:
            norm.weight.data = torch.randn(64)
        ours = decompose_rmsnorm(norm)
        x = torch.randn(3, 5, 64) * torch.logspace(-3, 3, 5)[None, :, None]
        with torch.no_grad():
            want, got = norm(x), ours(x)
        assert ours.eps == (norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)
        torch.testing.assert_close(got, want, rtol=2.4e-7, atol=2 * torch.finfo(torch.float32).eps
                                   * float(want.abs().max()))


@pytest.mark.parametrize("bits", [2, 4])
def test_transformers_unpack_equals_the_packing(bits):
    lo, hi = int_range(bits)
    ints = torch.randint(lo, hi + 1, (7, 13), dtype=torch.int8, generator=torch.Generator().manual_seed(bits))
    stored = pack(ints, bits)
    assert torch.equal(compat_transformers.unpack_gemma_ints(stored, bits, 13).to(torch.int8), ints)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_transformers_dequantized_weight_is_ints_times_scale(bits):
    from transformers.integrations.gemma_quant import QuantizedLinear

    lo, hi = int_range(bits)
    ints = torch.randint(lo, hi + 1, (6, 10), dtype=torch.int8, generator=torch.Generator().manual_seed(bits))
    module = QuantizedLinear(10, 6, num_bits=bits)
    module.weight.data = pack(ints, bits)
    module.weight_scale.data = torch.rand(6, 1) + 0.5
    want = unpack(pack(ints, bits), bits, 10).float() * module.weight_scale.data
    assert torch.equal(compat_transformers.dequantized_weight(module, torch.float32), want)
    assert torch.equal(compat_transformers.dequantized_weight(module), want)


def test_skeleton_from_config_builds_the_class_from_its_config():
    from accelerate import init_empty_weights
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    config = Gemma4TextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                              hidden_size_per_layer_input=4, vocab_size_per_layer_input=64)
    with init_empty_weights(include_buffers=False):
        model = compat_transformers.skeleton_from_config(Gemma4ForCausalLM, config, dtype=torch.float32)
    assert type(model) is Gemma4ForCausalLM and model.config.hidden_size == 16
    assert next(model.parameters()).device.type == "meta"


def test_persistent_buffers_are_told_apart():
    module = torch.nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("computed", torch.zeros(1), persistent=False)
    assert compat_torch.is_persistent_buffer(module, "kept")
    assert not compat_torch.is_persistent_buffer(module, "computed")
    assert set(module.state_dict()) == {"kept"}


def test_onnx_shape_inference_without_leaves_the_exported_graph_unchanged():
    """The blind shape inference must still export the same graph (it only keeps the values of the
    named parameters from being serialized)."""
    import onnx

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return x @ self.w

    def export(names):
        buffer = io.BytesIO()
        with compat_torch.onnx_shape_inference_without(names), torch.no_grad():
            torch.onnx.export(Tiny().eval(), (torch.ones(2, 4),), buffer, dynamo=False, do_constant_folding=False,
                              opset_version=20, input_names=["x"], output_names=["y"])
        return onnx.load_from_string(buffer.getvalue())

    torch.manual_seed(0)
    plain = export(set())
    torch.manual_seed(0)
    blind = export({"w"})
    assert plain.graph.SerializeToString() == blind.graph.SerializeToString()
    from torch import _C

    assert _C._jit_pass_onnx_graph_shape_type_inference.__name__ != "blind"  # restored


def test_onnxruntime_patch_targets_exist_on_the_installed_release(tmp_path):
    """calibrate/ort_patches.py is onnxruntime's compat module: it replaces private functions, guarded
    by version. Every name it replaces exists here, and the guard accepts this release."""
    from hyco.calibrate import ort_patches

    ort_patches.require_proven_onnxruntime()
    missing = [f"{getattr(owner, '__name__', owner)}.{name}"
               for owner, name, _ in ort_patches._patches(tmp_path, True, False) if not hasattr(owner, name)]
    assert missing == []


def test_op_counts_count_the_kernels_not_the_views():
    x, s = torch.randn(4, 6), torch.tensor(0.5)
    with compat_torch.op_counts() as counts:
        y = torch.round(x.reshape(6, 4).t() / s).clamp_(-8.0, 7.0).mul_(s).add_(0.0)
    assert dict(counts) == {"div": 1, "round": 1, "clamp_": 1, "mul_": 1, "add_": 1} and y.shape == (4, 6)


def test_a_small_graph_runs_on_one_thread_with_the_same_outputs(tmp_path):
    """Graphs under SMALL_GRAPH_BYTES of weights get one onnxruntime thread (their ops are too small
    to share), larger ones every core; the outputs do not depend on it."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from hyco.qnn import ort as hyco_ort

    def graph(n: int) -> onnx.ModelProto:
        w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32), "w")
        g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("ReduceMean", ["y"], ["m"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, n])],
                              [helper.make_tensor_value_info("m", TensorProto.FLOAT, None)], initializer=[w])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)

    small, large = graph(64), graph(4200)  # 16 KB and 70 MB of weights
    assert hyco_ort.initializer_bytes(small) == 64 * 64 * 4
    assert hyco_ort.initializer_bytes(large) > hyco_ort.SMALL_GRAPH_BYTES
    seen = []
    real = hyco_ort.session_options

    def spy(*args, **kwargs):
        so = real(*args, **kwargs)
        seen.append(so)
        return so

    hyco_ort.session_options = spy
    try:
        outs = []
        for model in (small, large):
            sess = hyco_ort.session_for(model, tmp_path)
            outs.append(sess.run(None, {"x": np.ones((4, model.graph.initializer[0].dims[0]), np.float32)}))
    finally:
        hyco_ort.session_options = real
    assert [so.intra_op_num_threads for so in seen] == [1, 0]
    assert np.isfinite(outs[1][0]).all()


def test_the_deployed_graphs_compute_the_same_on_one_thread_as_on_every_core(ladder, monkeypatch):
    """The bundle's QDQ graphs (the ladder's), fed the same codes, give the same bytes whether
    onnxruntime runs them on one thread or on every core: one thread changes their speed only."""
    import numpy as np
    import onnx

    from hyco.npu.io_spec import read_io_spec
    from hyco.qnn import ort as hyco_ort

    bundle = ladder / "export" / "bundle"
    specs = read_io_spec(bundle / "io_spec.json")
    rng = np.random.default_rng(0)
    assert set(specs) == {"tree.qdq.onnx", "mtp_step.qdq.onnx"}  # tree-only: the tree graph prefills too
    for key in specs:
        spec, path = specs[key], bundle / "reference" / key
        feeds = {t.name: (rng.uniform(-1, 1, t.shape) if np.dtype(t.dtype).kind == "f"
                          else rng.integers(0, 255, t.shape)).astype(t.dtype) for t in spec.inputs}
        runs = []
        for limit in (hyco_ort.SMALL_GRAPH_BYTES, 0):  # one thread, then every core
            monkeypatch.setattr(hyco_ort, "SMALL_GRAPH_BYTES", limit)
            sess = hyco_ort.session_for(onnx.load(str(path), load_external_data=False), path.parent)
            runs.append(sess.run(None, feeds))
        assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True)), key
