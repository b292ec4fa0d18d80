"""hyco/quant/qdq_torch.py against onnxruntime CPU, op by op, on graphs built here: the torch executor
of check's deployed drafters (the bundle's own graphs: tests/test_check_deployed.py).

Tolerance: integer codes equal exactly (the QuantizeLinear / DequantizeLinear formulas are
written out as ONNX and MLAS define them); floats equal to 1e-6 relative, since only summation
order (MatMul, ReduceMean, Softmax) and MLAS's Exp / Sigmoid approximations may differ in the
last bits."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from hyco.base.errors import HycoError
from hyco.quant.qdq_torch import (
    OPS,
    TorchGraph,
    dequantize,
    fake_quantize,
    grid_bounds,
    quantize,
    torch_device,
)

sys.path.insert(0, str(Path(__file__).parent))
from capture_check import HostCopies  # noqa: E402


def ort_run(path, feeds, names):
    from hyco.qnn.ort import ort_session

    return ort_session(path).run(names, feeds)


def init(name, array, dtype=None):
    if dtype is not None:
        return helper.make_tensor(name, dtype, list(array.shape), array.reshape(-1).tolist())
    return numpy_helper.from_array(array, name)


def qdq(x, scale, zp, dtype, tag):
    """x -> QuantizeLinear -> DequantizeLinear, on a per-tensor grid of `dtype` codes."""
    np_dtype = {TensorProto.UINT16: np.uint16, TensorProto.UINT8: np.uint8, TensorProto.INT8: np.int8}[dtype]
    inits = [init(f"{tag}_s", np.array(scale, np.float32)), init(f"{tag}_z", np.array(zp, np_dtype))]
    nodes = [helper.make_node("QuantizeLinear", [x, f"{tag}_s", f"{tag}_z"], [f"{tag}_q"]),
             helper.make_node("DequantizeLinear", [f"{tag}_q", f"{tag}_s", f"{tag}_z"], [f"{tag}_dq"])]
    return nodes, inits, f"{tag}_dq"


def block_graph(path, rng, rows=7, width=24, vocab=40):
    """A decoder-block-shaped QDQ graph with every op the deployed graphs use: 16-bit activations,
    an INT8 per-channel and an INT4 per-channel weight (DQ -> Transpose -> MatMul), a decomposed
    RMSNorm, a gated sigmoid MLP, softmax attention over a uint8 KV input with a concatenated new
    row, rotary halves (Slice / Neg / Concat), a Gather with a scalar index, and a log-softmax top-k
    head, plus a uint8 code output."""
    nodes, inits = [], []

    def add(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out] if isinstance(out, str) else out, **attrs))
        return out

    def grid(x, scale, tag, dtype=TensorProto.UINT16, zp=32768):
        n, i, out = qdq(x, scale, zp, dtype, tag)
        nodes.extend(n)
        inits.extend(i)
        return out

    w8 = rng.integers(-128, 128, size=(width, width)).astype(np.int8)
    w4 = rng.integers(-8, 8, size=(vocab, width)).astype(np.int8)
    inits += [init("w8", w8), init("w8_s", rng.uniform(0.001, 0.01, width).astype(np.float32)),
              init("w8_z", np.zeros(width, np.int8)),
              init("w4", w4, TensorProto.INT4), init("w4_s", rng.uniform(0.01, 0.05, vocab).astype(np.float32)),
              init("w4_z", np.zeros(vocab, np.int8), TensorProto.INT4),
              init("norm_w", rng.uniform(0.5, 1.5, width).astype(np.float32)),
              init("axes_last", np.array([-1], np.int64)), init("eps", np.array(1e-6, np.float32)),
              init("shape_heads", np.array([0, 2, width // 2], np.int64)), init("shape_back", np.array([0, -1], np.int64)),
              init("lo", np.array([0], np.int64)), init("mid", np.array([width // 4], np.int64)),
              init("hi", np.array([width // 2], np.int64)), init("ax2", np.array([2], np.int64)),
              init("row", np.array(2, np.int64)), init("ax0", np.array([0], np.int64)),
              init("k", np.array([5], np.int64)), init("one", np.array(1.0, np.float32))]
    x = grid("x", 4e-4, "x")
    # RMSNorm decomposed: x * 1/sqrt(mean(x*x) + eps) * w
    sq = grid(add("Mul", [x, x], "sq"), 4e-4, "sq")
    ms = add("ReduceMean", [sq, "axes_last"], "ms", keepdims=1)
    inv = grid(add("Reciprocal", [add("Sqrt", [add("Add", [ms, "eps"], "ms_eps")], "rms")], "inv"), 1e-3, "inv")
    h = grid(add("Mul", [add("Mul", [x, inv], "xn"), "norm_w"], "h"), 4e-4, "h")
    # INT8 projection, 16-bit output
    add("DequantizeLinear", ["w8", "w8_s", "w8_z"], "w8_f", axis=0)
    p = grid(add("MatMul", [h, add("Transpose", ["w8_f"], "w8_t", perm=[1, 0])], "p"), 1e-3, "p")
    # gated MLP with a sigmoid, then a residual
    g = grid(add("Mul", [p, grid(add("Sigmoid", [p], "sig"), 2e-5, "sig")], "g"), 1e-3, "g")
    r = grid(add("Add", [x, g], "r"), 1e-3, "r")
    # heads: Reshape with a 0 dim, rotary halves via Slice / Neg / Concat
    heads = add("Reshape", [r, "shape_heads"], "heads")
    a = add("Slice", [heads, "lo", "mid", "ax2"], "a")
    b = add("Slice", [heads, "mid", "hi", "ax2"], "b")
    rot = grid(add("Concat", [add("Neg", [b], "nb"), a], "rot", axis=2), 1e-3, "rot")
    # attention over a uint8 KV ring plus this step's rows (Unsqueeze, Concat, Transpose, Softmax)
    kv = add("DequantizeLinear", ["kv_ring", "kv_s", "kv_z"], "kv")
    inits += [init("kv_s", np.array(0.02, np.float32)), init("kv_z", np.array(128, np.uint8))]
    keys = add("Concat", [kv, add("Reshape", [rot, "shape_back"], "flat")], "keys", axis=0)
    scores = grid(add("MatMul", [add("Reshape", [rot, "shape_back"], "q"), add("Transpose", [keys], "kt", perm=[1, 0])],
                      "scores"), 2e-3, "scores")
    probs = grid(add("Softmax", [scores], "probs", axis=-1), 2e-5, "probs")
    ctx = grid(add("MatMul", [probs, keys], "ctx"), 1e-3, "ctx")
    add("QuantizeLinear", [ctx, "kv_s", "kv_z"], "kv_codes")
    # a per-layer row by scalar Gather, added in
    pl = add("Gather", ["per_layer", "row"], "pl", axis=1)
    mixed = grid(add("Add", [ctx, pl], "mixed"), 1e-3, "mixed")
    # INT4 head, log-softmax (ReduceMax, Sub, Exp, ReduceSum, Log), top-k
    add("DequantizeLinear", ["w4", "w4_s", "w4_z"], "w4_f", axis=0)
    logits = grid(add("MatMul", [mixed, add("Transpose", ["w4_f"], "w4_t", perm=[1, 0])], "logits"), 2e-3, "logits")
    shifted = add("Sub", [logits, add("ReduceMax", [logits, "axes_last"], "mx", keepdims=1)], "shifted")
    lse = add("Log", [add("ReduceSum", [add("Exp", [shifted], "ex"), "axes_last"], "se", keepdims=1)], "lse")
    logp = add("Div", [add("Sub", [shifted, lse], "lp"), "one"], "logp")
    add("TopK", [logp, "k"], ["topk_logprobs", "topk_indices"], axis=-1, largest=1, sorted=1)
    add("GatherElements", [logits, "topk_indices"], "topk_logits", axis=-1)  # as the chunked top-k gathers
    graph = helper.make_graph(
        nodes, "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width]),
         helper.make_tensor_value_info("kv_ring", TensorProto.UINT8, [9, width]),
         helper.make_tensor_value_info("per_layer", TensorProto.FLOAT, [rows, 3, width])],
        [helper.make_tensor_value_info("topk_logprobs", TensorProto.FLOAT, [rows, 5]),
         helper.make_tensor_value_info("topk_indices", TensorProto.INT64, [rows, 5]),
         helper.make_tensor_value_info("kv_codes", TensorProto.UINT8, [rows, width]),
         helper.make_tensor_value_info("topk_logits", TensorProto.FLOAT, [rows, 5])], inits)
    # IR 10, as the pipeline's graphs: an older onnxruntime (1.30 on the GPU image) reads it too
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def block_feeds(rng, rows=7, width=24):
    return {"x": rng.normal(0, 1, (rows, width)).astype(np.float32),
            "kv_ring": rng.integers(0, 256, (9, width)).astype(np.uint8),
            "per_layer": rng.normal(0, 0.5, (rows, 3, width)).astype(np.float32)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_decoder_block_graph_equals_onnxruntime(tmp_path, seed):
    """Three weight and input draws: top-k ids and the uint8 KV codes equal exactly, log-probs to
    1e-6; the feeds are not degenerate (the top-k ids vary over rows, the codes span the grid)."""
    rng = np.random.default_rng(seed)
    path = block_graph(tmp_path / "block.onnx", rng)
    feeds = block_feeds(rng)
    names = ["topk_logprobs", "topk_indices", "kv_codes", "topk_logits"]
    want = ort_run(path, feeds, names)
    got = TorchGraph(path).run(names, feeds)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[3], want[3])
    assert len(np.unique(want[1][:, 0])) >= 3 and np.ptp(want[2].astype(int)) > 30


def test_quantize_divides_by_the_scale_as_onnxruntime_does(tmp_path):
    """round(x / s) and round(x * (1 / s)) differ at some half-code points: a graph of such
    values equals onnxruntime only when the executor divides (this test fails for a product)."""
    rng = np.random.default_rng(0)
    scale = np.float32(3e-4)
    x = ((rng.integers(0, 60000, 4000) + 0.5) * np.float64(scale)).astype(np.float32)  # near half codes
    x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(-np.inf))])
    divided, multiplied = np.round(x / scale), np.round(x * (np.float32(1) / scale))
    x = x[divided != multiplied][:64]
    assert len(x) >= 8
    model = helper.make_model(helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])], "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(x)])],
        [helper.make_tensor_value_info("q", TensorProto.UINT16, [len(x)])],
        [init("s", np.array(scale)), init("z", np.array(0, np.uint16))]), opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, str(tmp_path / "q.onnx"))
    want = ort_run(tmp_path / "q.onnx", {"x": x}, ["q"])[0]
    got = TorchGraph(tmp_path / "q.onnx").run(["q"], {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    product = torch.clamp(torch.round(torch.from_numpy(x) * (1 / torch.tensor(scale))), 0, 65535).numpy()
    assert (product != want).any()
    np.testing.assert_array_equal(quantize(torch.from_numpy(x), torch.tensor(scale), code_range=(0, 65535)).numpy(), want)


def test_a_quantize_dequantize_pair_runs_as_one_step_with_the_same_values(tmp_path):
    """The block graph's QuantizeLinear -> DequantizeLinear pairs are fused (its equality with
    onnxruntime above runs through them); a value that rounds to code 0 comes out +0.0, as
    onnxruntime's float32(0) * scale does (round alone gives -0.0, and 1/-0.0 is -inf)."""
    graph = TorchGraph(block_graph(tmp_path / "block.onnx", np.random.default_rng(0)))
    ops = [op for op, *_ in graph.steps]
    assert ops.count(OPS["FakeQuantize"]) >= 10 and OPS["QuantizeLinear"] in ops  # kv_codes is a graph output
    x = torch.tensor([-0.3, -0.2, 0.2, 1.6, 2.5, 1000.0])
    one, zero = torch.tensor(1.0), torch.tensor(0, dtype=torch.int32)
    y = fake_quantize(x, one, *grid_bounds(one, zero, code_range=(-128, 127)))
    assert y.tolist() == [0.0, 0.0, 0.0, 2.0, 2.0, 127.0] and not torch.signbit(y[:3]).any()


GRIDS = {  # name: scale, zero point, code range, axis (per-axis grids along axis 1 of a [64, 4, 257] x)
    "uint8": (np.float32(0.02), np.uint8(128), (0, 255), 1),
    "int8-symmetric": (np.float32(0.013), None, (-128, 127), 1),
    "uint16": (np.float32(3e-4), np.uint16(31000), (0, 65535), 1),
    "int16": (np.float32(7e-5), np.int16(-5), (-32768, 32767), 1),
    "uint8-per-axis": (np.array([0.02, 0.5, 1e-3, 3.0], np.float32), np.array([0, 17, 128, 255], np.uint8), (0, 255), 1),
    "int8-per-last-axis": (np.linspace(1e-3, 2.0, 257).astype(np.float32), np.arange(257).astype(np.int8), (-128, 127),
                           -1),
}


@pytest.mark.parametrize("addcmul", [False, True], ids=["cpu-tail", "cuda-tail"])
@pytest.mark.parametrize("grid", list(GRIDS))
def test_fake_quantize_equals_quantize_then_dequantize(grid, addcmul):
    """The fused step against the two ops' formulas (each held to onnxruntime above), bit for bit
    and sign of zero included, on values at and beside every half code, out of range both ways,
    zeros of both signs and infinities, per tensor and per axis; with the product and +0.0 as a
    multiply and an add (a CPU's) and as one addcmul (a GPU's, run here on the CPU)."""
    scale, zero_point, code_range, axis = GRIDS[grid]
    rng = np.random.default_rng(len(grid))
    s = np.broadcast_to(scale.reshape([-1 if i == axis % 3 else 1 for i in range(3)]) if scale.ndim else scale,
                        (64, 4, 257)).astype(np.float64)
    codes = rng.integers(code_range[0] - 300, code_range[1] + 300, (64, 4, 257)) + rng.choice([0.0, 0.5, -0.5], (64, 4, 257))
    x = (codes * s).astype(np.float32)
    x = np.stack([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(-np.inf))]).reshape(-1, 4, 257)
    x[0, 0, :4] = [0.0, -0.0, np.inf, -np.inf]
    x[0, 1, :3] = [-1e-30, 1e-30, -0.49 * float(s.flat[0])]
    x, scale_t = torch.from_numpy(x), torch.from_numpy(np.asarray(scale))
    zp = None if zero_point is None else torch.from_numpy(np.asarray(zero_point)).to(torch.int32)
    want = dequantize(quantize(x, scale_t, zp, axis=axis, code_range=code_range), scale_t, zp, axis=axis)
    got = fake_quantize(x, scale_t, *grid_bounds(scale_t, zp, code_range=code_range), axis=axis, addcmul=addcmul)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert (got == 0).any() and got.isfinite().all()  # the zero point and the clamped infinities were met
    low = dequantize(torch.tensor(code_range[0]), scale_t.reshape(-1)[0], None if zp is None else zp.reshape(-1)[0])
    assert (got == low).any() or scale_t.numel() > 1  # the lower clamp was met


def test_weights_are_folded_once_and_shared_between_graphs(tmp_path):
    """A weight's DequantizeLinear and Transpose are computed at load: the executor keeps the
    float32 weight, not the ints, and two graphs holding the same weight share one tensor."""
    rng = np.random.default_rng(0)
    first = block_graph(tmp_path / "a.onnx", np.random.default_rng(5))
    second = block_graph(tmp_path / "b.onnx", np.random.default_rng(5))
    shared: dict = {}
    a, b = TorchGraph(first, shared=shared), TorchGraph(second, shared=shared)
    assert "w8" not in a.consts and "w4" not in a.consts
    assert a.consts["w8_t"].dtype == torch.float32 and a.consts["w4_t"].shape == (24, 40)
    assert a.consts["w8_t"] is b.consts["w8_t"] and a.consts["w4_t"] is b.consts["w4_t"]
    assert a.consts["kv_s"] is b.consts["kv_s"]
    assert not {"w8_f", "w4_f"} & {o for _, _, outs, _ in a.steps for o in outs}  # no pass dequantizes a weight
    other = TorchGraph(block_graph(tmp_path / "c.onnx", np.random.default_rng(6)), shared=shared)
    assert other.consts["w8_t"] is not a.consts["w8_t"]  # other weights: their own tensor
    feeds = block_feeds(rng)
    for x, y in zip(a.run(None, feeds), b.run(None, feeds), strict=True):
        np.testing.assert_array_equal(x, y)


def test_an_op_without_emulation_is_named_at_load(tmp_path):
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Erf", ["x"], ["y"])], "erf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]), opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, str(tmp_path / "erf.onnx"))
    with pytest.raises(HycoError, match=r"erf.onnx: ops \['Erf'\] have no torch emulation"):
        TorchGraph(tmp_path / "erf.onnx")
    with pytest.raises(HycoError, match="no such graph"):
        TorchGraph(tmp_path / "missing.onnx")


def test_unsqueeze_with_negative_axes_and_blocked_grids(tmp_path):
    """Negative Unsqueeze axes count from the output's end (onnxruntime's shapes); a blocked
    DequantizeLinear (INT2-block weights) spreads its scales over the blocks, as onnxruntime does;
    a blocked QuantizeLinear is refused at load, naming the node."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Unsqueeze", ["x", "axes"], ["y"])], "u",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [init("axes", np.array([-1, 0, -3], np.int64))]), opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, str(tmp_path / "u.onnx"))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    want = ort_run(tmp_path / "u.onnx", {"x": x}, ["y"])[0]
    got = TorchGraph(tmp_path / "u.onnx").run(["y"], {"x": x})[0]
    assert got.shape == want.shape == (1, 3, 1, 4, 1)
    np.testing.assert_array_equal(got, want)
    blocked = helper.make_model(helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w", "s"], ["wd"], name="w_dq", axis=0, block_size=2),
         helper.make_node("MatMul", ["x", "wd"], ["y"])], "b",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3])],
        [init("w", np.arange(12, dtype=np.int8).reshape(4, 3) - 6), init("s", np.arange(1, 7, dtype=np.float32).reshape(2, 3))]),
        opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(blocked, str(tmp_path / "b.onnx"))
    np.testing.assert_array_equal(TorchGraph(tmp_path / "b.onnx").run(["y"], {"x": x})[0],
                                  ort_run(tmp_path / "b.onnx", {"x": x}, ["y"])[0])
    quantized = helper.make_model(helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], name="x_q", axis=1, block_size=2)], "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 4])],
        [init("s", np.ones((2, 2), np.float32)), init("z", np.zeros((2, 2), np.uint8))]),
        opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(quantized, str(tmp_path / "q.onnx"))
    with pytest.raises(HycoError, match="q.onnx: x_q quantizes in blocks"):
        TorchGraph(tmp_path / "q.onnx")


def test_the_device_setting(monkeypatch):
    assert torch_device("cpu").type == "cpu"
    with pytest.raises(HycoError, match="deployed_device must be"):
        torch_device("tpu:zero")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch_device("auto").type == "cpu"
    with pytest.raises(HycoError, match="sees no CUDA device"):
        torch_device("cuda")


def test_check_runs_deployed_graphs_by_torch_on_a_gpu_and_by_onnxruntime_without(monkeypatch):
    from hyco.runtime_check.check import deployed_executor

    from hyco.config.recipe import CheckConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert deployed_executor(CheckConfig()) == ("cpu", "cpu")
    assert deployed_executor(CheckConfig(deployed_executor="torch")) == ("torch", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert deployed_executor(CheckConfig()) == ("torch", "cuda")
    assert deployed_executor(CheckConfig(deployed_executor="onnxruntime")) == ("cpu", "cpu")


@pytest.mark.parametrize("graph", ["tree", "mtp_step"])  # the ladder's SLM is tree-only: its tree graph prefills
def test_a_deployed_pass_could_be_captured(tiny_calibrated, graph):
    """What the executor records into a CUDA graph on a GPU (`cuda_graph=True`): a pass of the
    ladder's deployed QDQ graph with its weights and feeds on the meta device and its shapes, axes
    and k on the CPU, as the executor binds them (tests/capture_check.py): nothing reads a device
    value back to the host, nothing is copied onto the device."""
    from hyco.npu.io_spec import GRAPHS, read_io_spec

    folder = tiny_calibrated / "calibrate"
    spec = read_io_spec(folder / "io_spec.json")[GRAPHS[graph]]
    executor = TorchGraph(folder / f"{graph}.qdq.onnx")
    executor.consts = {name: value.to("meta") for name, value in executor.consts.items()}
    feeds = {name: value.to("meta") for name, value in
             executor._feeds({t.name: spec.input(t.name).zeros() for t in spec.inputs}).items()}
    with torch.no_grad(), HostCopies() as watch:
        env = executor._forward(feeds)
    assert not watch.seen
    assert all(env[n].device.type == "meta" and tuple(env[n].shape) == spec.output(n).shape for n in executor.outputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the executor's CUDA path needs one")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_the_block_graph_on_cuda_equals_onnxruntime(tmp_path, cuda_graph):
    """The executor on CUDA, eager and replayed as a CUDA graph (three passes: capture, then
    replays with new feeds), against onnxruntime CPU. Floats to 1e-5 (ten times the CPU's
    bound: a GPU's fp32 reductions run in another order); the top-k ids exact; a uint8 KV code may differ by one where a GPU's summation order moves a value
    across a rounding boundary, at no more than 1 in 1,000 codes."""
    rng = np.random.default_rng(0)
    path = block_graph(tmp_path / "block.onnx", rng)
    names = ["topk_logprobs", "topk_indices", "kv_codes", "topk_logits"]
    executor = TorchGraph(path, device="cuda", cuda_graph=cuda_graph)
    for _ in range(3):
        feeds = block_feeds(rng)
        want = ort_run(path, feeds, names)
        got = executor.run(names, feeds)
        np.testing.assert_array_equal(got[1], want[1])
        codes = np.abs(got[2].astype(int) - want[2].astype(int))
        assert codes.max() <= 1 and (codes > 0).mean() <= 1e-3
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert (executor.cuda_graph is not None) == cuda_graph


def test_a_refused_capture_leaves_the_graph_eager_with_the_reason(tmp_path, monkeypatch):
    """Where CUDA refuses to capture a pass (a host read in a later release's op, say), the graph
    runs eager from then on and says why, instead of stopping a check hours in. The refusal is
    planted here (this machine has no GPU; the CUDA test below plants a real one): the outputs
    are the eager pass's, and no second capture is tried."""
    rng = np.random.default_rng(0)
    path = block_graph(tmp_path / "block.onnx", rng)
    names, feeds = ["topk_logprobs", "topk_indices", "kv_codes"], block_feeds(rng)
    want = TorchGraph(path).run(names, feeds)
    graph = TorchGraph(path)
    graph.use_cuda_graph = True  # as on CUDA
    tries = []

    def refuse(staged):
        tries.append(staged)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")

    monkeypatch.setattr(graph, "_capture", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert graph.mode == "CUDA graph replayed"
    for _ in range(2):
        for got, expected in zip(graph.run(names, feeds), want, strict=True):
            np.testing.assert_array_equal(got, expected)
    assert len(tries) == 1
    assert graph.mode == ("eager (CUDA graph capture failed: RuntimeError: CUDA error: operation not permitted when "
                          "stream is capturing)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the executor's CUDA path needs one")
def test_a_host_read_in_a_pass_falls_back_to_eager_on_cuda(tmp_path):
    """A step that reads a device value back (`.item()`) cannot be captured: the executor says so
    in `mode` and its eager outputs still equal onnxruntime's (bounds as above)."""
    rng = np.random.default_rng(0)
    path = block_graph(tmp_path / "block.onnx", rng)
    executor = TorchGraph(path, device="cuda", cuda_graph=True)
    op, ins, outs, attrs = executor.steps[0]
    executor.steps[0] = (lambda i, a: op(i, a) + 0 * float(i[0].flatten()[0].item()), ins, outs, attrs)
    names, feeds = ["topk_logprobs", "topk_indices"], block_feeds(rng)
    got, want = executor.run(names, feeds), ort_run(path, feeds, names)
    assert executor.mode.startswith("eager (CUDA graph capture failed: ")
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
