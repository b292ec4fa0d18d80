"""The SLM's 2-bit weights as INT2 blocks (hyco/quant/int2_blocks.py): the transform keeps every int and
scale bit-exact and its proof catches a flipped int or a wrong scale; onnxruntime CPU (plain, and
through the project's CPU sessions) and the torch executor compute what the INT4 containers
computed, exactly; the ladder's deployable graphs carry them, proven against their INT4 twins; the
recipe setting is checked. The simulator's side is tests/test_htp_int2.py (slow tier)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from hyco.base.errors import ProofFailed
from hyco.formats.int4 import pack_int4
from hyco.qnn.int2_probe import PROBE_TOLERANCE_CODES, TwoBitDecision, decide
from hyco.quant.int2_blocks import (
    INT2_IR_VERSION,
    INT2_OPSET,
    block_weights,
    pack_int2,
    prove_int2_blocks,
    to_int2_blocks,
    unpack_int2,
)

ROWS = 5


def layer(k: int = 64, n: int = 24, *, transposed: bool = False, seed: int = 0, ints=None):
    """x [ROWS, K] times a per-channel INT4 weight holding ints in [-2, 1] (a 2-bit weight in its
    container): stored [K, N] with DQ axis 1 feeding MatMul (calibrate's deployable layout), or
    `transposed`, [N, K] with DQ axis 0 -> Transpose -> MatMul (convert's)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-2, 2, (k, n)).astype(np.int8) if ints is None else ints
    scale = (0.01 + 0.02 * rng.random(n)).astype(np.float32)
    stored = w.T.copy() if transposed else w
    inits = [helper.make_tensor("w.ints", TensorProto.INT4, list(stored.shape), pack_int4(stored), raw=True),
             numpy_helper.from_array(scale, "w.scale"),
             helper.make_tensor("w.zero", TensorProto.INT4, [n], pack_int4(np.zeros(n, np.int8)), raw=True)]
    nodes = [helper.make_node("DequantizeLinear", ["w.ints", "w.scale", "w.zero"], ["wd"], axis=0 if transposed else 1)]
    if transposed:
        nodes.append(helper.make_node("Transpose", ["wd"], ["wt"], perm=[1, 0]))
    nodes.append(helper.make_node("MatMul", ["x", "wt" if transposed else "wd"], ["y"]))
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def copy(model):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def cpu(model, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so).run(None, {"x": x})[0]


def x_rows(k: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, k)).astype(np.float32)


def test_int2_packing_is_onnx_layout():
    values = np.random.default_rng(0).integers(-2, 2, 1003).astype(np.int8)
    raw = pack_int2(values)
    assert np.array_equal(unpack_int2(raw, values.size), values)
    t = helper.make_tensor("t", TensorProto.INT2, [values.size], raw, raw=True)
    assert np.array_equal(numpy_helper.to_array(t).astype(np.int8), values)  # onnx's own unpacking


@pytest.mark.parametrize("transposed", [False, True])
def test_the_transform_is_bit_exact_and_onnxruntime_computes_the_same(transposed):
    source = layer(transposed=transposed)
    blocked = copy(source)
    report = to_int2_blocks(blocked, {"w.ints"}, 16)
    assert report["rewritten"] == ["w.ints"] and report["kept_in_int4"] == {}
    # ONNX holds a float32 scale per block: 2 + 32 / 16 bits a weight here, as many as INT4
    assert report["int2_block_bytes"] > report["int4_container_bytes"] == 64 * 24 // 2
    inits = {t.name: t for t in blocked.graph.initializer}
    dq = blocked.graph.node[0]
    attrs = {a.name: a.i for a in dq.attribute}
    assert inits["w.ints"].data_type == TensorProto.INT2 and list(inits["w.ints"].dims) == list(
        {t.name: t for t in source.graph.initializer}["w.ints"].dims)
    # blocks along K: [K/B, N] for [K, N] ints, [N, K/B] for convert's [N, K]
    assert attrs == {"axis": 1 if transposed else 0, "block_size": 16}
    assert list(inits[dq.input[1]].dims) == ([24, 4] if transposed else [4, 24])
    assert inits[dq.input[2]].data_type == TensorProto.INT2 and not numpy_helper.to_array(inits[dq.input[2]]).any()
    assert "w.scale" not in inits and "w.zero" not in inits  # per-channel tensors no node reads are gone
    assert blocked.opset_import[0].version == INT2_OPSET and blocked.ir_version == INT2_IR_VERSION
    onnx.checker.check_model(blocked, full_check=True)
    assert prove_int2_blocks(source, blocked) == {"weights": 1, "all_equal": True}
    x = x_rows(64)
    assert np.array_equal(cpu(source, x), cpu(blocked, x))  # same ints, same scales: the same floats


def test_a_weight_whose_input_dim_is_off_the_block_grid_stays_in_int4():
    source = layer(k=40)
    blocked = copy(source)
    report = to_int2_blocks(blocked, {"w.ints"}, 16)
    assert report["rewritten"] == [] and "40" in report["kept_in_int4"]["w.ints"]
    assert blocked.SerializeToString() == source.SerializeToString()  # untouched, opset too
    other = copy(source)
    assert to_int2_blocks(other, {"another.ints"}, 8)["rewritten"] == []  # not a 2-bit weight: untouched
    shifted = layer()  # a zero point that is not 0 (INT2 blocks carry zeros): stays as it is
    zero = next(t for t in shifted.graph.initializer if t.name == "w.zero")
    zero.CopyFrom(helper.make_tensor("w.zero", TensorProto.INT4, [24], pack_int4(np.ones(24, np.int8)), raw=True))
    assert to_int2_blocks(shifted, {"w.ints"}, 16)["kept_in_int4"] == {"w.ints": "its zero point is not 0"}
    shared = layer()  # ints two nodes read: a per-channel INT2 reader would compute wrong on the HTP
    shared.graph.node.append(helper.make_node("DequantizeLinear", ["w.ints", "w.scale", "w.zero"], ["w2"], axis=1))
    assert "read by 2 nodes" in to_int2_blocks(shared, {"w.ints"}, 16)["kept_in_int4"]["w.ints"]


def test_a_weight_listed_as_2_bit_with_wider_ints_is_refused():
    ints = np.random.default_rng(0).integers(-2, 2, (32, 8)).astype(np.int8)
    ints[3, 5] = 3
    with pytest.raises(ProofFailed, match=r"holds 3 at \(3, 5\), outside \[-2, 1\]"):
        to_int2_blocks(layer(k=32, n=8, ints=ints), {"w.ints"}, 16)


def _mutate(blocked, name: str, change) -> onnx.ModelProto:
    out = copy(blocked)
    t = next(t for t in out.graph.initializer if t.name == name)
    t.CopyFrom(change(t))
    return out


def test_the_proof_catches_a_flipped_int_a_wrong_scale_and_a_zero_point():
    source = layer()
    blocked = copy(source)
    to_int2_blocks(blocked, {"w.ints"}, 16)

    def flip(t):
        values = unpack_int2(t.raw_data, int(np.prod(t.dims))).copy()
        values[100] = 1 if values[100] != 1 else 0
        return helper.make_tensor(t.name, TensorProto.INT2, list(t.dims), pack_int2(values), raw=True)

    def nudge(t):  # one block's scale one ulp off its channel's
        s = numpy_helper.to_array(t).copy()
        s[2, 7] = np.nextafter(s[2, 7], np.float32(1))
        return numpy_helper.from_array(s, t.name)

    def offset(t):
        z = np.zeros(tuple(t.dims), np.int8)
        z[0, 0] = 1
        return helper.make_tensor(t.name, TensorProto.INT2, list(t.dims), pack_int2(z), raw=True)

    with pytest.raises(ProofFailed, match="w.ints: the INT2 ints differ"):
        prove_int2_blocks(source, _mutate(blocked, "w.ints", flip))
    with pytest.raises(ProofFailed, match="w.ints: a block's scale is not its channel's"):
        prove_int2_blocks(source, _mutate(blocked, "w.ints_block_scale", nudge))
    with pytest.raises(ProofFailed, match="zero points are not all 0"):
        prove_int2_blocks(source, _mutate(blocked, "w.ints_block_zero", offset))


def test_cpu_sessions_and_the_torch_executor_compute_int2_blocks_exactly(tmp_path):
    """hyco.qnn.ort's sessions multiply INT2 blocks packed (MatMulNBits, as INT4) and the torch executor
    spreads the block scales: each equals its own run of the INT4 containers."""
    import shutil

    from hyco.qnn.ort import ort_session
    from hyco.quant.int4_matmul import fuse_int4_matmuls
    from hyco.quant.qdq_torch import TorchGraph

    source = layer(k=128, n=32)
    blocked = copy(source)
    to_int2_blocks(blocked, {"w.ints"}, 32)
    for name, model in (("int4.onnx", source), ("int2.onnx", blocked)):
        onnx.save(model, str(tmp_path / name))
    x = x_rows(128)
    fused = [ort_session(tmp_path / n).run(None, {"x": x})[0] for n in ("int4.onnx", "int2.onnx")]
    torch = [TorchGraph(tmp_path / n).run(["y"], {"x": x})[0] for n in ("int4.onnx", "int2.onnx")]
    assert np.array_equal(fused[0], fused[1]) and np.array_equal(torch[0], torch[1])
    model = onnx.load(str(tmp_path / "int2.onnx"))
    fused_count, folder = fuse_int4_matmuls(model, tmp_path)  # packed, not dequantized each pass
    assert fused_count == 1 and any(n.op_type == "MatMulNBits" for n in model.graph.node)
    shutil.rmtree(folder)


def test_cpu_sessions_return_to_the_graphs_own_opset_once_int2_is_multiplied_packed(tmp_path):
    """onnxruntime's CPU EP has no RandomUniformLike past opset 21 (hyco.quant.perturb adds it): a CPU
    session's copy whose INT2 blocks were all fused drops back to the opset the graph had."""
    from hyco.qnn.ort import session_for
    from hyco.quant.int2_blocks import OPSET_BEFORE

    source = layer()
    blocked = copy(source)
    to_int2_blocks(blocked, {"w.ints"}, 16)
    assert {p.key: p.value for p in blocked.metadata_props}[OPSET_BEFORE] == "21,10"
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    blocked.graph.initializer.append(zero)
    blocked.graph.output[0].name = "y_noisy"
    blocked.graph.node.extend([helper.make_node("RandomUniformLike", ["y"], ["u"], seed=1.0),
                               helper.make_node("Mul", ["u", "zero"], ["u0"]),
                               helper.make_node("Add", ["y", "u0"], ["y_noisy"])])
    x = x_rows(64)
    assert np.array_equal(session_for(blocked, tmp_path).run(None, {"x": x})[0], cpu(source, x))


def test_the_recipe_decides_and_says_why(monkeypatch):
    import hyco.qnn.int2_probe as int2

    kept = decide("int4-containers", 64, 87)
    assert kept == TwoBitDecision("int4-containers", None, "int4-containers", kept.why) and "recipe asks" in kept.why
    forced = decide("int2-blocks", 32, 87)
    assert (forced.encoding, forced.block_size, forced.probe) == ("int2-blocks", 32, None)
    monkeypatch.setattr(int2, "qnn_version", lambda: None)  # no onnxruntime-qnn: auto cannot probe
    fallback = decide("auto", 64, 87)
    assert fallback.encoding == "int4-containers" and "not installed" in fallback.why
    wrong = {"right": False, "max_codes": 5e4, "tolerance_codes": 512}  # what INT2 per channel measures
    monkeypatch.setattr(int2, "qnn_version", lambda: "a release")
    monkeypatch.setattr(int2, "_probes", {("a release", 87, 64): wrong})
    refused = decide("auto", 64, 87)
    assert refused.encoding == "int4-containers" and "50000 output codes" in refused.why and refused.probe == wrong


def test_the_probe_holds_int2_to_calibrates_matmul_tolerance():
    from hyco.calibrate.htp import Tap, op_tolerance

    assert PROBE_TOLERANCE_CODES == op_tolerance(Tap("y", "s", "z", "uint16", "MatMul"))


@pytest.mark.parametrize("value, said", [("two_bit_weights=int3", "export.two_bit_weights must be one of"),
                                         ("int2_block_size=24", "export.int2_block_size must be a multiple of 16")])
def test_a_bad_setting_is_refused_naming_it(value, said):
    from hyco.base.errors import HycoError
    from hyco.config.recipe import load_recipe

    with pytest.raises(HycoError, match=said):
        load_recipe("tiny", [f"export.{value}"])


def test_a_bad_setting_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "hyco.pipeline.cli", "plan", "tiny", "--set", "export.int2_block_size=24"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "export.int2_block_size must be a multiple of 16, but got 24" in done.stderr


def test_the_ladders_deployable_graphs_carry_proven_int2_blocks(tiny_calibrated):
    """The ladder's SLM graphs ship as the probe decided (io_spec says which and why); in INT2
    blocks every one is proven against its parity twin's INT4 container, onnxruntime computes the
    twin's INT4 graph rewritten here exactly as it was, and the encodings name the container."""
    import json

    from hyco.calibrate.prepare import load_graph

    from hyco.npu.io_spec import read_io_spec

    out = tiny_calibrated / "calibrate"
    specs = read_io_spec(out / "io_spec.json")
    said = specs["tree.qdq.onnx"].meta["two_bit_weights"]
    if said["encoding"] != "int2-blocks":
        pytest.skip(f"this machine ships INT4 containers: {said['why']}")
    encodings = json.loads((out / "encodings.json").read_text())["graphs"]
    for name in ("tree.qdq.onnx",):  # the ladder's SLM: tree-only
        twin, deployed = load_graph(out / name.replace(".qdq", ".parity.qdq")), load_graph(out / name)
        held = specs[name].meta["two_bit_weights"]
        assert held["rewritten"] and held["kept_in_int4"] == {} and set(block_weights(deployed)) == set(held["rewritten"])
        assert prove_int2_blocks(twin, deployed, (out, out))["weights"] == len(held["rewritten"])
        params = {p["name"]: p for p in encodings[name]["param_encodings"]}
        assert all((params[w]["bw"], params[w]["container_bw"], params[w]["block_size"]) == (2, 2, held["block_size"])
                   for w in held["rewritten"])
    assert load_graph(out / "tree.parity.qdq.onnx").opset_import[0].version < INT2_OPSET  # twins keep INT4


def test_a_real_graph_rewritten_computes_what_its_int4_containers_did(tiny_calibrated, tmp_path):
    """The ladder's tree parity twin (INT4 containers), rewritten to INT2 blocks: onnxruntime CPU
    returns the same floats, plain and through the project's CPU sessions."""
    from hyco.calibrate.prepare import load_graph, save_streamed
    from hyco.calibrate.stage import convert_weight_bits

    from hyco.qnn.ort import ort_session
    from hyco.quant.int2_blocks import two_bit_names

    source = tiny_calibrated / "calibrate" / "tree.parity.qdq.onnx"
    model = load_graph(source)
    report = to_int2_blocks(model, two_bit_names(convert_weight_bits(tiny_calibrated / "convert")), 64, source.parent)
    assert report["rewritten"] and not report["kept_in_int4"]
    save_streamed(model, source.parent, tmp_path / "tree.int2.onnx")
    sessions = [ort_session(p, rewrites=r) for p in (source, tmp_path / "tree.int2.onnx") for r in (False, True)]
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sessions[0].get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feeds[i.name] = ((rng.standard_normal(shape) * 0.1).astype(np.float32) if "float" in i.type
                         else np.zeros(shape, np.int64) if "int64" in i.type else rng.integers(0, 200, shape).astype(
                             np.uint8 if "uint8" in i.type else np.uint16))
    outs = [s.run(None, feeds) for s in sessions]
    for plain, packed in ((0, 2), (1, 3)):
        assert all(np.array_equal(a, b) for a, b in zip(outs[plain], outs[packed], strict=True))


def test_export_refuses_graphs_holding_another_encoding(tiny_calibrated):
    """export ships the 2-bit weights as its own settings say, and calibrate's graphs must hold them
    so: one line naming the graph and both encodings otherwise."""
    from hyco.export.stage import shipped_two_bit

    from hyco.base.errors import HycoError
    from hyco.config.recipe import ExportConfig
    from hyco.npu.io_spec import read_io_spec

    out = tiny_calibrated / "calibrate"
    held = read_io_spec(out / "io_spec.json")["tree.qdq.onnx"].meta["two_bit_weights"]["encoding"]
    other = "int2-blocks" if held == "int4-containers" else "int4-containers"
    with pytest.raises(HycoError, match=r"tree.qdq.onnx: holds the 2-bit weights as .* but export ships them as"):
        shipped_two_bit(out, ExportConfig(two_bit_weights=other))


def test_calibrates_section_follows_the_export_keys_that_shape_its_graphs():
    from hyco.calibrate import stage

    from hyco.config.recipe import load_recipe

    base = stage.section(load_recipe("tiny"))
    for key, value in (("two_bit_weights", "int4-containers"), ("int2_block_size", 32), ("soc_model", 69)):
        assert stage.section(load_recipe("tiny", [f"export.{key}={value}"])) != base, key
    assert stage.section(load_recipe("tiny", ["export.smoke_rounds=1"])) == base  # other export keys: no rerun
