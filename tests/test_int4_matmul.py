"""CPU sessions multiply INT4 weights with onnxruntime's MatMulNBits (hyco/quant/int4_matmul.py).

The proofs: the repacked weight holds the checkpoint's integers bit for bit (unpacked back,
tensor by tensor, both layouts, odd and block-unaligned widths); a fused session's outputs are
within the fp32 summation bound of the exact product, as the DequantizeLinear -> MatMul session's
are; what cannot be fused exactly (zero points, INT8, fp16 scales, block scales, shared or tapped
weights) is left as it is; the session's temporary folder is gone once it has loaded."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

U = 2.0**-24  # fp32 unit roundoff


def unpacked(b: np.ndarray, k: int) -> np.ndarray:
    """MatMulNBits' B [N, blocks, size / 2] -> the signed integers [N, K] it stands for."""
    flat = b.reshape(b.shape[0], -1)
    values = np.stack([flat & 0x0F, flat >> 4], axis=-1).reshape(b.shape[0], -1).astype(np.int16) - 8
    return values[:, :k].astype(np.int8)


@pytest.mark.parametrize("shape,transposed", [((48, 40), False), ((40, 48), True), ((6, 1536), False),
                                              ((24, 7), False), ((7, 24), True), ((2816, 10), True)])
def test_repacked_weight_holds_the_same_integers(shape, transposed):
    from hyco.formats.int4 import pack_int4
    from hyco.quant.int4_matmul import block_size, matmul_nbits_weight

    ints = np.random.default_rng(sum(shape)).integers(-8, 8, shape).astype(np.int8)
    b = matmul_nbits_weight(pack_int4(ints), shape, transposed)
    n, k = (shape[1], shape[0]) if transposed else shape
    size = block_size(k)
    assert b.dtype == np.uint8 and b.shape == (n, -(-k // size), size // 2)
    np.testing.assert_array_equal(unpacked(b, k), ints.T if transposed else ints)
    assert (unpacked(b, b.shape[1] * size)[:, k:] == 0).all()  # padding is the value 0


@dataclass(frozen=True)
class WeightForm:
    """How `weight_graph`'s weight is stored and read: its integer type, a zero point (per channel,
    or one for the tensor), its scales' type, a second reader of the dequantized weight (`tap`)
    and whether its bytes sit in external data."""

    dtype: int = TensorProto.INT4
    zero_point: int | None = None
    zero_point_scalar: bool = False
    scale_dtype: type = np.float32
    tap: bool = False
    external: bool = True


def weight_graph(folder: Path, n: int, k: int, lead: list[int], transposed: bool, seed: int,
                 form: WeightForm = WeightForm()) -> tuple[Path, np.ndarray, np.ndarray]:
    """x [*lead, K] @ dequantized weight -> y, saved with its weights as external data; returns
    the path, the integers [N, K] and the scales [N]."""
    from hyco.formats.int4 import pack_int4

    dtype, zero_point, scale_dtype, tap, external = form.dtype, form.zero_point, form.scale_dtype, form.tap, form.external
    rng = np.random.default_rng(seed)
    lo = -8 if dtype == TensorProto.INT4 else -128
    ints = rng.integers(lo, -lo, (n, k)).astype(np.int8)
    scale = (rng.random(n) * 0.05 + 0.005).astype(scale_dtype)
    stored = ints.T if transposed else ints
    if dtype == TensorProto.INT4 and external:  # raw bytes, as convert writes them
        weight = helper.make_tensor("w.ints", dtype, list(stored.shape), pack_int4(stored), raw=True)
    else:  # typed fields (int32_data)
        weight = helper.make_tensor("w.ints", dtype, list(stored.shape), stored.reshape(-1).tolist())
    inits = [weight, numpy_helper.from_array(scale, "w.scale")]
    dq_inputs = ["w.ints", "w.scale"]
    if zero_point is not None:  # typed fields (int32_data), per channel or one for the tensor
        per_tensor = form.zero_point_scalar
        inits.append(helper.make_tensor("w.zero", dtype, [] if per_tensor else [n], [zero_point] * (1 if per_tensor else n)))
        dq_inputs.append("w.zero")
        if per_tensor:
            inits[1] = numpy_helper.from_array(scale[:1].reshape(()), "w.scale")
    nodes = [helper.make_node("DequantizeLinear", dq_inputs, ["w"], axis=1 if transposed else 0, name="dq")]
    b = "w"
    if not transposed:
        nodes.append(helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0], name="t"))
        b = "wt"
    outputs = ["y"]
    if tap:  # onnxruntime's calibrator reading the dequantized weight
        nodes.append(helper.make_node("ReduceMax", [b], ["tap"], keepdims=0, name="tap"))
        outputs.append("tap")
    nodes.append(helper.make_node("MatMul", ["x", b], ["y"], name="mm"))
    elem = TensorProto.FLOAT16 if scale_dtype == np.float16 else TensorProto.FLOAT
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [*lead, k])],
                          [helper.make_tensor_value_info(o, elem, None) for o in outputs], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    path = folder / "g.onnx"
    onnx.save(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
              location="g.onnx.data", size_threshold=0)
    return path, ints, scale


@pytest.mark.parametrize("n,k,lead,transposed", [(64, 40, [1, 33], False), (40, 64, [33], True),
                                                 (96, 1536, [1, 1], False), (1536, 256, [2, 5], True),
                                                 (33, 72, [1, 128], False)])
def test_fused_session_is_within_the_fp32_summation_bound(tmp_path, n, k, lead, transposed):
    """Both sessions' outputs against the exact product (float64 of the same fp32 weights): every
    element within gamma_K * (|x| @ |W|^T), gamma_K = K u / (1 - K u), the textbook bound of an fp32
    dot product of K terms in any order; the fused session reads the same fp32 weight values
    (integer x scale, one rounding, as DequantizeLinear), so only its summation order differs. A
    misplaced nibble, block or scale is off by whole weights, far outside it."""
    import onnxruntime as ort

    from hyco.qnn.ort import ort_session
    from hyco.quant.int4_matmul import fuse_int4_matmuls

    path, ints, scale = weight_graph(tmp_path, n, k, lead, transposed, seed=n + k)
    fused_model = onnx.load(str(path), load_external_data=False)
    count, folder = fuse_int4_matmuls(fused_model, tmp_path)
    assert count == 1 and [node.op_type for node in fused_model.graph.node] == ["MatMulNBits"]
    assert {t.name for t in fused_model.graph.initializer} == {"mm/nbits/B", "mm/nbits/scales"}
    shutil.rmtree(folder)
    x = np.random.default_rng(k).standard_normal([*lead, k]).astype(np.float32)
    w = (ints.astype(np.float32) * scale[:, None]).astype(np.float64)  # the DQ's fp32 values
    exact = x.astype(np.float64) @ w.T
    bound = k * U / (1 - k * U) * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    fused = ort_session(path).run(None, {"x": x})[0]
    assert fused.shape == plain.shape == tuple([*lead, n])
    for name, y in (("plain", plain), ("fused", fused)):
        excess = np.abs(y - exact) - bound
        assert excess.max() <= 0, f"{name}: {excess.max()} over the bound"
    assert np.abs(fused - exact).max() < 0.05 * np.abs(exact).max()  # the bound is not vacuous


@pytest.mark.parametrize("case", ["zero_point", "zero_point_scalar", "int8", "fp16_scale", "tapped", "inline",
                                  "zero_point_0", "zero_point_0_scalar"])
def test_what_is_not_fused(tmp_path, case):
    """Non-zero zero points, INT8 weights, fp16 scales and a weight something else reads stay as
    they are (the session still runs them); all-zero zero points (onnxruntime's quantizer writes
    them) and inline weights are fused all the same."""
    import onnxruntime as ort

    from hyco.qnn.ort import ort_session
    from hyco.quant.int4_matmul import fuse_int4_matmuls

    kwargs = {"zero_point": {"zero_point": 1}, "zero_point_0": {"zero_point": 0},
              "zero_point_scalar": {"zero_point": 3, "zero_point_scalar": True},
              "zero_point_0_scalar": {"zero_point": 0, "zero_point_scalar": True}, "int8": {"dtype": TensorProto.INT8},
              "fp16_scale": {"scale_dtype": np.float16}, "tapped": {"tap": True},
              "inline": {"external": False}}[case]
    path, _, _ = weight_graph(tmp_path, 24, 32, [1, 4], False, seed=1, form=WeightForm(**kwargs))
    model = onnx.load(str(path), load_external_data=False)
    count, folder = fuse_int4_matmuls(model, tmp_path)
    assert count == (1 if case in ("inline", "zero_point_0", "zero_point_0_scalar") else 0) and (folder is None) == (count == 0)
    if folder is not None:
        shutil.rmtree(folder)
    x = np.random.default_rng(2).standard_normal([1, 4, 32]).astype(np.float16 if case == "fp16_scale" else np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    ours = ort_session(path).run(None, {"x": x})
    for a, b in zip(plain, ours, strict=True):
        if count:
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(b, a)


def test_session_folder_is_removed_and_nothing_written_beside_the_graph(tmp_path, monkeypatch):
    from hyco.qnn.ort import ort_session

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    graph = tmp_path / "graph"
    graph.mkdir()
    path, _, _ = weight_graph(graph, 40, 64, [1, 3], False, seed=5)
    before = sorted(p.name for p in graph.iterdir())
    session = ort_session(path)
    assert list(scratch.iterdir()) == [] and sorted(p.name for p in graph.iterdir()) == before
    assert [o.name for o in session.get_outputs()] == ["y"]
    session.run(None, {"x": np.ones((1, 3, 64), np.float32)})  # the weights were read at load


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_weights_file_names_file_and_tensor(tmp_path, monkeypatch, damage):
    from hyco.base.errors import HycoError
    from hyco.quant.int4_matmul import fuse_int4_matmuls

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    path, _, _ = weight_graph(tmp_path, 24, 32, [1, 4], False, seed=1)
    data = tmp_path / "g.onnx.data"
    if damage == "missing":
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(HycoError, match=r"g\.onnx\.data: .*tensor 'w\.(ints|scale)'"):
        fuse_int4_matmuls(onnx.load(str(path), load_external_data=False), tmp_path)
    assert list(scratch.iterdir()) == []  # no half-written session folder left


@pytest.mark.parametrize("shape", [(2, 2), (40, 48), (1536, 256), (7, 24), (24, 7), (5, 3)])
def test_int4_transpose_nibble_by_nibble_is_the_transposed_integers(shape):
    from hyco.formats.int4 import pack_int4, transpose_int4, unpack_int4

    ints = np.random.default_rng(shape[0] * 31 + shape[1]).integers(-8, 8, shape).astype(np.int8)
    out = transpose_int4(pack_int4(ints), shape)
    assert out == pack_int4(ints.T.copy())
    np.testing.assert_array_equal(unpack_int4(out, ints.size).reshape(shape[::-1]), ints.T)


@pytest.mark.parametrize("shape", [(40, 48), (7, 24), (1536, 256), (6, 2)])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_int4_extremes_from_packed_bytes_equal_the_unpacked_ones(shape, axis):
    """calibrate's constant weight taps read per-channel integer extremes byte by byte (nibble
    tables); they equal numpy's min/max over the unpacked integers, also for a peaky weight whose
    extremes sit in a single nibble."""
    from hyco.calibrate.ort_patches import int_extremes

    from hyco.formats.int4 import pack_int4

    rng = np.random.default_rng(shape[0] + 7 * shape[1])
    for ints in (rng.integers(-8, 8, shape).astype(np.int8), np.zeros(shape, np.int8)):
        ints[rng.integers(shape[0]), rng.integers(shape[1])] = -8  # a lone extreme
        ints[rng.integers(shape[0]), rng.integers(shape[1])] = 7
        tensor = helper.make_tensor("w", TensorProto.INT4, list(shape), pack_int4(ints), raw=True)
        lo, hi = int_extremes(tensor, axis)
        others = None if axis is None else 1 - axis
        np.testing.assert_array_equal(lo, ints.min(axis=others))
        np.testing.assert_array_equal(hi, ints.max(axis=others))


def test_shared_repacks_repack_each_weight_once_and_change_no_output(tmp_path, monkeypatch):
    """Inside `shared_repacks(folder)`, sessions over a weights file in that folder read one
    folder in which each weight was repacked once; a graph elsewhere gets a folder of its own
    (gone once its session loaded); outputs are bit-equal to a session of its own; the shared
    folder is gone after the block."""
    from hyco.qnn.ort import ort_session
    from hyco.quant import int4_matmul

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    path, _, _ = weight_graph(tmp_path, 40, 64, [1, 3], False, seed=7)
    x = np.random.default_rng(3).standard_normal((1, 3, 64)).astype(np.float32)
    alone = ort_session(path).run(None, {"x": x})[0]
    calls = []
    real = int4_matmul.matmul_nbits_weight
    monkeypatch.setattr(int4_matmul, "matmul_nbits_weight", lambda *a: calls.append(a[1]) or real(*a))
    other = tmp_path / "other"
    other.mkdir()
    elsewhere, _, _ = weight_graph(other, 40, 64, [1, 3], False, seed=7)
    with int4_matmul.shared_repacks(tmp_path) as folder:
        outs = [ort_session(path).run(None, {"x": x})[0] for _ in range(3)]
        assert list(scratch.iterdir()) == [folder]  # one folder, no per-session ones
        outs.append(ort_session(elsewhere).run(None, {"x": x})[0])  # not a shared source: its own folder
        assert list(scratch.iterdir()) == [folder]  # (removed once its session loaded)
        size = (folder / int4_matmul.FUSED_DATA).stat().st_size
        assert size == 40 * 64 // 2  # the repacked weight, once (the scales are in the graph)
    assert calls == [(40, 64)] * 2  # once for the shared source's three sessions, once for the other
    assert not folder.exists() and list(scratch.iterdir()) == []
    for out in outs:
        np.testing.assert_array_equal(out, alone)


def test_a_nested_block_shares_its_own_folder_s_repacks_while_it_lasts(tmp_path, monkeypatch):
    """calibrate's stage block shares convert's weights; the HTP bound's nested block over the
    deployed graph's folder adds that folder: its sessions repack once, and after the nested
    block a session there repacks again (into a folder of its own)."""
    from hyco.qnn.ort import ort_session
    from hyco.quant import int4_matmul

    inner = tmp_path / "inner"
    inner.mkdir()
    path, _, _ = weight_graph(inner, 40, 64, [1, 3], False, seed=7)
    x = np.random.default_rng(3).standard_normal((1, 3, 64)).astype(np.float32)
    calls = []
    real = int4_matmul.matmul_nbits_weight
    monkeypatch.setattr(int4_matmul, "matmul_nbits_weight", lambda *a: calls.append(a[1]) or real(*a))
    with int4_matmul.shared_repacks(tmp_path / "outer") as outer:
        with int4_matmul.shared_repacks(inner) as folder:
            assert folder == outer
            outs = [ort_session(path).run(None, {"x": x})[0] for _ in range(2)]
        assert len(calls) == 1
        outs.append(ort_session(path).run(None, {"x": x})[0])
        assert len(calls) == 2  # no longer a shared source
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_shared_repacks_see_a_rewritten_weights_file(tmp_path):
    """A weights file rewritten in place inside the block (same path, new integers) is read
    again, not served from the first repack."""
    from hyco.qnn.ort import ort_session
    from hyco.quant import int4_matmul

    x = np.random.default_rng(4).standard_normal((1, 2, 32)).astype(np.float32)
    with int4_matmul.shared_repacks(tmp_path):
        path, _, _ = weight_graph(tmp_path, 24, 32, [1, 2], True, seed=1)
        first = ort_session(path).run(None, {"x": x})[0]
        path, ints, scale = weight_graph(tmp_path, 24, 32, [1, 2], True, seed=2)
        second = ort_session(path).run(None, {"x": x})[0]
    expected = x.astype(np.float64) @ (ints.astype(np.float64) * scale[:, None].astype(np.float64)).T
    np.testing.assert_allclose(second, expected, rtol=1e-4, atol=1e-4)
    assert np.abs(first - second).max() > 0.1  # the two weight sets do differ
