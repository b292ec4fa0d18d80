"""calibrate/: QDQ graphs for the QNN HTP (16-bit activations, 8-bit KV), on the tiny family.

The stage's run is conftest's `tiny_calibrated` (vocab, convert, qat, calibrate on the
undistilled tiny family, HTP check off there); the preparation passes, the mask choice, the
HTP acceptance and the bad inputs are tested on their own.
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from hyco.calibrate import prepare
from hyco.calibrate.masks import MaskStats, choose_mask, masked_mass
from hyco.calibrate.quantize import weights_bitexact

from hyco.base.errors import HycoError
from hyco.npu.io_spec import read_io_spec
from hyco.pipeline.artifacts import Phases
from hyco.qnn.ort import ort_session
from hyco.quant.grids import grid_range

GRAPHS = ("tree.qdq.onnx", "mtp_step.qdq.onnx")  # the ladder's: export.slm_graphs tree-only, the tree graph prefills


def random_feeds(spec, seed=0, negative=-50.0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for t in spec.inputs:
        x = rng.standard_normal(t.shape).astype(np.float32)
        if t.name.startswith("mask_"):
            x = np.where(rng.random(t.shape) < 0.5, 0.0, negative).astype(np.float32)
            x[..., -1] = 0.0  # every row sees at least one key
        feeds[t.name] = x
    return feeds


def run(model: onnx.ModelProto, feeds: dict, tmp: Path, check: bool = True) -> dict:
    prepare.save(model, tmp / "m.onnx", check=check)
    sess = ort_session(tmp / "m.onnx")
    names = [o.name for o in sess.get_outputs()]
    inputs = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in inputs}), strict=True))


# --- preparation passes: each changes no output on the CPU EP ------------------------------------


SLM_PASSES = ["fold_shape_subgraphs", "fold_weight_transposes", "explicit_weight_zero_points", "srq_int8_as_uint16",
              "gelu_tanh_as_sigmoid", "softcap_as_sigmoid", "log_softmax_as_exp_sum", "split_kv_row_outputs"]


@pytest.mark.parametrize("step", SLM_PASSES)
def test_slm_pass_changes_no_output(tiny_calibrated, tmp_path, step):
    """Each pass applied after the ones before it (their order in `prepare_slm`): outputs equal to
    1e-5 (GELU's 2 sigmoid(2u) differs from 1 + tanh(u) by float rounding only; the others are
    exact), top-k ids identical, and the integer weights and scales bit-exact."""
    convert = tiny_calibrated / "convert"
    spec = read_io_spec(convert / "io_spec.json")["tree.onnx"]
    feeds = random_feeds(spec)
    order = SLM_PASSES
    source = onnx.load(str(convert / "tree.onnx"))
    before = source
    for name in order[:order.index(step)]:
        before = getattr(prepare, name)(before)
    after = getattr(prepare, step)(before)
    a, b = run(before, feeds, tmp_path), run(after, feeds, tmp_path)
    assert a.keys() == b.keys()
    if step in ("softcap_as_sigmoid", "log_softmax_as_exp_sum"):
        # 2c sigmoid(2u) - c and c tanh(u), and the written-out log-softmax, differ by float rounding only:
        # log-probs within 1e-5; an id may swap only between two log-probs that close
        assert np.abs(a["topk_logprobs"] - b["topk_logprobs"]).max() <= 1e-5
        for r, j in np.argwhere(a["topk_indices"] != b["topk_indices"]):
            mine = np.flatnonzero(a["topk_indices"][r] == b["topk_indices"][r, j])
            assert mine.size and abs(a["topk_logprobs"][r, mine[0]] - a["topk_logprobs"][r, j]) <= 2e-5, (step, r, j)
        for k in a:
            if k.startswith("new_") or k == "logits":
                assert np.abs(a[k] - b[k]).max() <= 1e-5 * (1 + np.abs(a[k]).max()), (step, k)
    elif step == "gelu_tanh_as_sigmoid":
        # 2 sigmoid(2u) and 1 + tanh(u) differ by float rounding (~1e-7), which the checkpoint's
        # 8-bit SRQ rounding downstream turns into a whole code step wherever a value sits on a
        # rounding tie (platform notes), and from there on the two graphs' tensors differ by
        # more than rounding. So: the first rewritten site (same upstream in both graphs) equals
        # the original's; every site computes 1 + tanh(u) of its own input u (numpy, float32);
        # and the graph outputs agree on nearly every row.
        sites = [(n.input[0], n.output[0].removesuffix("_2u")) for n in after.graph.node if n.name.endswith("_2u")]
        assert len(sites) >= 2
        for m, names in ((before, [t for _, t in sites[:1]]), (after, [x for site in sites for x in site])):
            m.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in names)
        a, b = run(before, feeds, tmp_path, check=False), run(after, feeds, tmp_path, check=False)
        first = sites[0][1]
        assert np.abs(a[first] - b[first]).max() <= 1e-6 * (1 + np.abs(a[first]).max()), first
        for u, t in sites:
            want = 1 + np.tanh(b[u].astype(np.float32))
            assert np.abs(b[t] - want).max() <= 1e-6 * (1 + np.abs(want).max()), t
        same = (a["topk_indices"] == b["topk_indices"]).all(-1)
        assert same.mean() >= 0.9
    else:
        for k in a:
            if a[k].dtype.kind == "f":
                assert np.abs(a[k] - b[k]).max() <= 1e-5, (step, k)
            else:
                assert np.array_equal(a[k], b[k]), (step, k)
    assert weights_bitexact(source, after)["all_equal"]
    # the pass did something on this graph
    ops = lambda m: sorted(n.op_type for n in m.graph.node)
    changed = {"fold_shape_subgraphs": lambda: "Constant" not in ops(after) and len(after.graph.node) < len(before.graph.node),
               "fold_weight_transposes": lambda: ops(after).count("Transpose") < ops(before).count("Transpose"),
               "explicit_weight_zero_points": lambda: all(len(n.input) == 3 and n.input[2] for n in after.graph.node
                                                          if n.op_type == "DequantizeLinear"),
               "srq_int8_as_uint16": lambda: ops(after).count("QuantizeLinear") > ops(before).count("QuantizeLinear"),
               "gelu_tanh_as_sigmoid": lambda: "Sigmoid" in ops(after),
               "softcap_as_sigmoid": lambda: "Tanh" in ops(before) and "Tanh" not in ops(after),
               "log_softmax_as_exp_sum": lambda: "LogSoftmax" in ops(before) and "LogSoftmax" not in ops(after),
               "split_kv_row_outputs": lambda: ops(after).count("Transpose") > ops(before).count("Transpose")}
    assert changed[step]()


def _qdq_matmul(weight_b: bool = False, rows: int = 6) -> onnx.ModelProto:
    """a [2, rows, 16] @ b [2, 16, 12] with every tensor on a uint16 grid (b an initializer if
    `weight_b`), as onnxruntime's QDQ quantizer writes attention's QK^T."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits = [], []

    def qdq(x, scale, zero, name):
        inits.extend([numpy_helper.from_array(np.array(scale, np.float32), name + "_s"),
                      numpy_helper.from_array(np.array(zero, np.uint16), name + "_z")])
        nodes.extend([helper.make_node("QuantizeLinear", [x, name + "_s", name + "_z"], [name + "_q"]),
                      helper.make_node("DequantizeLinear", [name + "_q", name + "_s", name + "_z"], [name + "_dq"])])
        return name + "_dq"

    a = qdq("a", 3.0 / 32768, 32768, "aq")
    graph_inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, rows, 16])]
    if weight_b:
        codes = np.random.default_rng(1).integers(20000, 45000, (2, 16, 12)).astype(np.uint16)
        inits.extend([numpy_helper.from_array(codes, "bq"), numpy_helper.from_array(np.array(2.5e-4, np.float32), "bs"),
                      numpy_helper.from_array(np.array(31000, np.uint16), "bz")])
        nodes.append(helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["b_dq"]))
        b = "b_dq"
    else:
        b = qdq("b", 2.0 / 32768, 30000, "bq")
        graph_inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 16, 12]))
    nodes.append(helper.make_node("MatMul", [a, b], ["y"]))
    y = qdq("y", 24.0 / 65535, 32768, "yq")
    graph = helper.make_graph(nodes, "qk", graph_inputs, [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _matmul_feeds(rows: int = 6) -> dict:
    rng = np.random.default_rng(0)
    return {"a": (rng.standard_normal((2, rows, 16)) * 0.9).astype(np.float32),
            "b": (rng.standard_normal((2, 16, 12)) * 0.5 - 0.3).astype(np.float32)}


def test_uint8_convert_grid_is_onnxruntime_qnns():
    """The grid the QNN EP converts a uint16 (scale, zero point) to: the same real range, 256 codes,
    zero point rounded half to even (matmul_op_builder's InsertConvertOp + GetQuantParams)."""
    from hyco.calibrate.quantize import uint8_convert_qparams

    scale, zero = uint8_convert_qparams(1e-4, 32768)  # [-3.2768, 3.2767]: zero at 127.5 -> 128 (even)
    assert np.isclose(scale, 6.5535 / 255, rtol=1e-6) and zero == 128
    scale, zero = uint8_convert_qparams(1e-4, 0)  # [0, 6.5535]: zero point 0
    assert np.isclose(scale, 6.5535 / 255, rtol=1e-6) and zero == 0


def test_matmul_second_input_uint8_makes_the_cpu_compute_16x8(tmp_path):
    """On the CPU EP the pass turns a uint16 x uint16 activation MatMul into uint16 x uint8 on the
    EP's grid: the output equals numpy's 16x8 product to one output code and moves off the 16x16
    one; a MatMul by a weight is left alone."""
    from hyco.calibrate.quantize import matmul_second_input_uint8, uint8_convert_qparams

    feeds = _matmul_feeds()
    model = _qdq_matmul()
    after = matmul_second_input_uint8(model)
    assert [n.op_type for n in after.graph.node].count("QuantizeLinear") == 4
    a, b = run(model, feeds, tmp_path, check=False)["yq_dq"], run(after, feeds, tmp_path, check=False)["yq_dq"]

    def grid(x, scale, zero, top):
        return (np.clip(np.round(x / scale) + zero, 0, top) - zero) * scale

    qa, qb = grid(feeds["a"], 3.0 / 32768, 32768, 65535), grid(feeds["b"], 2.0 / 32768, 30000, 65535)
    s8, z8 = uint8_convert_qparams(np.float32(2.0 / 32768), 30000)
    expected = grid(qa @ grid(qb, float(s8), int(z8), 255), 24.0 / 65535, 32768, 65535)
    step = 24.0 / 65535
    assert np.abs(b - expected).max() <= 1.01 * step
    assert np.abs(a - b).max() >= 5 * step  # the 16x16 product is somewhere else
    weight = _qdq_matmul(weight_b=True)
    assert len(matmul_second_input_uint8(weight).graph.node) == len(weight.graph.node)


@pytest.mark.slow
def test_matmul_second_input_uint8_changes_nothing_on_the_htp_and_makes_cpu_agree(tmp_path):
    """What the pass claims, on the simulator: the HTP computes the same before and after it (it
    only writes down the conversion onnxruntime-qnn inserts anyway), and after it the CPU EP
    computes what the HTP computes (to 2 output codes); before it the two were apart."""
    from hyco.calibrate import htp
    from hyco.calibrate.quantize import matmul_second_input_uint8

    if reason := htp.qnn_available():
        pytest.skip(reason)
    feeds = _matmul_feeds(rows=16)
    step = 24.0 / 65535
    out = {}
    for case, model in (("before", _qdq_matmul(rows=16)), ("after", matmul_second_input_uint8(_qdq_matmul(rows=16)))):
        (tmp_path / case).mkdir()
        prepare.save(model, tmp_path / case / "m.onnx", check=False)
        name = model.graph.output[0].name
        out[case] = (ort_session(tmp_path / case / "m.onnx").run([name], feeds)[0],
                     _htp_outputs(tmp_path / case / "m.onnx", feeds, tmp_path / case)[name])
    (cpu_before, htp_before), (cpu_after, htp_after) = out["before"], out["after"]
    assert np.abs(htp_before - htp_after).max() <= 1.01 * step
    assert np.abs(cpu_after - htp_after).max() <= 2.01 * step
    assert np.abs(cpu_before - htp_before).max() >= 5 * step


def test_kl_is_never_negative_on_a_clipped_log_prob_grid():
    """A 16-bit log-prob output floors the deep tail; the floored tail carries more mass than the
    reference, and a KL on the raw codes went negative. Renormalized, it is >= 0 and 0 on equal rows."""
    from hyco.calibrate.evaluate import kl_rows, log_softmax

    ref = log_softmax(np.random.default_rng(0).normal(0, 6, (16, 1345)))
    clipped = np.maximum(ref, -12.0)  # a grid whose floor is -12 nats
    raw = (np.exp(ref) * (ref - clipped)).sum(-1)
    assert (raw < 0).any()  # the old formula
    assert (kl_rows(ref, clipped) >= 0).all() and np.allclose(kl_rows(ref, ref), 0, atol=1e-12)


def test_srq_requant_is_exact_on_every_code():
    """An int8 code c requantized to uint16 with scale s/256, zero point 32768 gives back c * s
    exactly, for all 256 codes (what makes the SRQ rewrite lossless)."""
    s = np.float32(0.0371)
    codes = np.arange(-128, 128, dtype=np.float32)
    values = codes * s
    q16 = np.clip(np.round(values / (s / np.float32(256))) + 32768, 0, 65535)
    assert np.array_equal(((q16 - 32768) * (s / np.float32(256))).astype(np.float32), values)


def test_mtp_pass_strips_input_qdq_with_ranges(tiny_calibrated, tmp_path):
    """qat's step graph without its input QDQ: the ranges come back for the quantizer, and on
    inputs already on their uint16 grid the outputs are unchanged."""
    qat = tiny_calibrated / "qat"
    spec = read_io_spec(qat / "io_spec.json")["mtp_step.onnx"]
    model = onnx.load(str(qat / "mtp_step.onnx"))
    stripped, params = prepare.prepare_mtp(model)
    assert set(params) == {t.name for t in spec.inputs}
    feeds = random_feeds(spec, negative=spec.meta["mask_negative"])
    for name, (scale, zero) in params.items():  # snap the feeds onto each input's grid
        feeds[name] = ((np.clip(np.round(feeds[name] / scale) + zero, 0, 65535) - zero) * scale).astype(np.float32)
    a, b = run(model, feeds, tmp_path), run(stripped, feeds, tmp_path)
    assert np.array_equal(a["topk_ids"], b["topk_ids"])
    assert np.abs(a["topk_logprobs"] - b["topk_logprobs"]).max() <= 1e-4
    assert weights_bitexact(model, stripped)["all_equal"]


def test_mtp_policy_keeps_qats_grids_and_puts_the_mask_on_calibrates(tiny_calibrated):
    """The step graph's policy table: every input, and every tensor that only moves an input's values
    (cos / sin through the shared layer's Unsqueeze, the rings through its Transpose), keeps the grid
    qat trained the head on, except the masks, whose grid follows calibrate's mask value; the report
    lists both graphs' rules."""
    from hyco.calibrate.quantize import mask_qparams
    from hyco.calibrate.stage import MTP_POLICY, PolicyInputs, apply_policy, moved_copies

    from hyco.npu.io_spec import Role, role_of

    qat = tiny_calibrated / "qat"
    prepared, grids = prepare.prepare_mtp(onnx.load(str(qat / "mtp_step.onnx")))
    negative = -123.0  # not qat's mask value: the masks must move, nothing else
    overrides, _ = apply_policy(MTP_POLICY, PolicyInputs(prepared, [], [], None, negative, grids))
    source = {t: name for name in grids for t in moved_copies(prepared.graph, name)}
    assert set(overrides) == set(source) > set(grids) and any(role_of(n) is Role.MASK for n in grids)
    assert {"cos_full", "k_full"} <= {source[t] for t in set(source) - set(grids)}  # moved copies were pinned
    for name, (grid,) in overrides.items():
        want = mask_qparams(negative) if role_of(source[name]) is Role.MASK else grids[source[name]]
        assert (float(grid["scale"]), int(grid["zero_point"])) == (np.float32(want[0]), want[1]), name
    report = json.loads((tiny_calibrated / "calibrate" / "report.json").read_text())
    assert [r["graphs"] for r in report["policy"]] == ["tree, prefill"] * 3 + ["mtp_step"] * 2 + ["every graph"] * 6
    assert "| mtp_step | every input" in (tiny_calibrated / "calibrate" / "summary.md").read_text()


# --- masks ---------------------------------------------------------------------------------------


def softmax_masked_mass(scores, mask):
    x = (scores + mask).astype(np.float64)
    w = np.exp(x - x.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return (w * (mask != 0)).sum(-1)


def test_mask_value_covers_rows_whose_visible_scores_span_more_than_50():
    """Rows with visible scores spanning 80 and masked slots scoring above every visible one:
    -50 leaves far more than 1e-4 of the weight on masked slots; the chosen value, measured on
    these rows, keeps every row below 1e-4 (checked with a real softmax, not the bound)."""
    rng = np.random.default_rng(0)
    rows, keys = 64, 40
    scores = rng.uniform(-40, 40, (2, rows, keys)).astype(np.float32)
    mask = np.where(rng.random((rows, keys)) < 0.4, -50.0, 0.0).astype(np.float32)
    mask[:, 0] = 0.0
    scores[..., 0] = 40.0  # the top visible score
    scores[:, mask == -50.0] = 85.0 + rng.uniform(0, 5, (2, int((mask == -50.0).sum())))  # masked slots score high
    spread = np.where(mask == 0, scores, np.nan)
    assert (np.nanmax(spread, -1) - np.nanmin(spread, -1)).max() > 50
    assert softmax_masked_mass(scores, mask).max() > 1e-4  # -50 is not safe here
    stats = MaskStats()
    stats.add("layer", scores, mask)
    choice = choose_mask(stats, floor=-50.0, headroom=0.0)
    negative = choice["mask_negative"]
    assert negative < -50.0 and choice["margin_nats"] >= 0
    mass = softmax_masked_mass(scores, np.where(mask < 0, negative, 0.0).astype(np.float32))
    assert mass.max() < 1e-4
    assert mass.max() <= choice["max_masked_mass"] * 1.01 + 1e-12  # the stats' bound is the worst row
    # and a floor that already suffices is kept
    assert choose_mask(stats, floor=-500.0, headroom=0.0)["mask_negative"] == -500.0
    assert masked_mass(0.0, -math.log(1e4)) == pytest.approx(1 / (1 + 1e4))


# --- the stage on the tiny family ----------------------------------------------------------------


def test_stage_outputs(tiny_calibrated):
    """Files, io_spec (uint8 KV codes with one grid per ring and its new rows, every other
    boundary tensor's grid), no logits in the deployable graphs, weights bit-exact, the mask
    margin on the calibration data, and the report's fields."""
    out = tiny_calibrated / "calibrate"
    for name in (*GRAPHS, "io_spec.json", "encodings.json", "report.json", "summary.md", "sqnr.png"):
        assert (out / name).is_file(), name
    specs = read_io_spec(out / "io_spec.json")
    assert set(specs) == set(GRAPHS)
    report = json.loads((out / "report.json").read_text())
    enc = json.loads((out / "encodings.json").read_text())
    assert enc["version"] == "1.0.0" and set(enc["graphs"]) == set(GRAPHS)
    for name in GRAPHS:
        onnx.checker.check_model(str(out / name), full_check=True)
        model = onnx.load(str(out / name), load_external_data=False)
        spec = specs[name]
        assert [o.name for o in model.graph.output] == [t.name for t in spec.outputs]
        assert "logits" not in {o.name for o in model.graph.output}
        for t in spec.inputs:
            if t.dtype == "float32":
                assert t.quant and t.quant["dtype"] == "uint16", (name, t.name)
        for t in spec.outputs:
            assert t.dtype == "int64" or t.quant, (name, t.name)
        rings = [t for t in spec.inputs if t.name.startswith(("k_ring_", "v_ring_"))]
        for ring in rings:
            new = spec.output(ring.name.replace("_ring_", "_").replace("k_", "new_k_", 1) if ring.name.startswith("k")
                              else ring.name.replace("v_ring_", "new_v_"))
            assert ring.dtype == new.dtype == "uint8" and ring.quant == new.quant, ring.name
        if name != "mtp_step.qdq.onnx":
            assert rings
        r = report["graphs"][name]
        assert r["weights_bitexact"]["all_equal"] and r["weights_bitexact"]["weights"] > 0
        assert r["mask_margin"]["max_masked_mass"] < 1e-4
        assert spec.meta["mask_negative"] == r["mask_margin"]["mask_negative"]
        assert 0.0 <= r["top1_agreement"] <= 1.0 and r["kl"] >= 0 and r["rows"] > 0
        if name == "tree.qdq.onnx":  # tree-only: its prompt passes and its rounds' are also reported apart
            prompt, rounds = r["prefill_passes"], r["round_passes"]
            assert prompt["passes"] > 0 and rounds["passes"] > 0 and prompt["rows"] + rounds["rows"] == r["rows"]
            assert prompt["kl"] >= 0 and r["fidelity_floor"]["prefill_passes_kl"] == prompt["kl"]
            # the pooled KL is the rows' mean: it lies between the two parts'
            assert min(prompt["kl"], rounds["kl"]) - 1e-12 <= r["kl"] <= max(prompt["kl"], rounds["kl"]) + 1e-12
        else:
            assert "prefill_passes" not in r
        assert r["sqnr_db"] and all(v > 0 for v in r["sqnr_db"].values())
        assert r["htp_encoding_traps"] == [], (name, r["htp_encoding_traps"])
        # the HTP-vs-CPU bounds (also export's smoke bounds): per-op code noise carried through the
        # graph; the ladder runs no simulator, so the noise is the per-op tolerance
        b = report["htp_bounds"][{"tree.qdq.onnx": "tree", "prefill.qdq.onnx": "prefill", "mtp_step.qdq.onnx": "mtp"}[name]]
        assert spec.meta["htp_logprob_bound"] == r["htp_logprob_bound"] == b["bound"] == b["perturbed_max"] > 0
        assert b["amplitude"] == "op_tolerance" and "no simulator" in b["basis"]
        kv = spec.meta["htp_kv_step_bound"]
        assert (kv is None) == (name == "mtp_step.qdq.onnx") and (kv is None or kv >= 2.0), kv
        assert b["passes"] >= 1 and b["draws"] == 2 and spec.meta["htp_op_kept_bits"]["other"] == 10
        # inputs whose range is known hold all of it (the HTP wraps a value beyond its grid)
        for t in spec.inputs:
            if t.name.startswith(("cos_", "sin_")):
                lo, hi = grid_range(t.quant)
                assert np.float32(lo) <= -1.0 and np.float32(hi) >= 1.0, (name, t)
                assert np.rint(np.float32(1.0) / np.float32(t.quant["scale"])) + t.quant["zero_point"] <= 65535, (name, t)
    # int2/int4 weights are recorded with their checkpoint width in INT4 containers
    params = [p for g in enc["graphs"].values() for p in g["param_encodings"]]
    assert params and all(p["bw"] <= p["container_bw"] for p in params)


def test_deployable_graph_equals_parity_twin(tiny_calibrated):
    """The deployable graph (uint8 KV codes in and out, no logits) computes what its parity twin
    (float I/O) computes: same top-k, new K/V codes equal to the twin's rows on the same grid."""
    out = tiny_calibrated / "calibrate"
    spec = read_io_spec(out / "io_spec.json")["tree.qdq.onnx"]
    from hyco.calibrate.evaluate import to_codes

    feeds = random_feeds(spec, negative=spec.meta["mask_negative"])
    for t in spec.inputs:  # rings on their grid
        if t.quant and t.dtype == "uint8":
            q = t.quant
            feeds[t.name] = ((np.clip(np.round(feeds[t.name] / q["scale"]) + q["zero_point"], 0, 255)
                              - q["zero_point"]) * q["scale"]).astype(np.float32)
    twin, deploy = ort_session(out / "tree.parity.qdq.onnx"), ort_session(out / "tree.qdq.onnx")
    names = [o.name for o in deploy.get_outputs()]
    a = dict(zip(names, twin.run(names, feeds), strict=True))
    b = dict(zip(names, deploy.run(names, to_codes(feeds, spec)), strict=True))
    assert np.array_equal(a["topk_indices"], b["topk_indices"])
    assert np.array_equal(a["topk_logprobs"], b["topk_logprobs"])
    for t in spec.outputs:
        if t.dtype == "uint8":
            q = t.quant
            assert np.array_equal(((b[t.name].astype(np.float32) - q["zero_point"]) * q["scale"]).astype(np.float32),
                                  a[t.name])


def test_ring_16_bit_twin_holds_every_uint8_code_exactly(tiny_calibrated):
    """Each uint8 ring input is converted to 16 bits on the grid every uint8 code lands on
    exactly (scale / 256, zero point 256 x z): no ring value is clipped on the CPU EP that the
    HTP (which converts the codes straight into its Concat) keeps."""
    out = tiny_calibrated / "calibrate"
    model = onnx.load(str(out / "tree.qdq.onnx"), load_external_data=False)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
             if t.data_location != onnx.TensorProto.EXTERNAL}  # the small ones: scales, zero points
    consumers = {}
    for n in model.graph.node:
        for x in n.input:
            consumers.setdefault(x, []).append(n)
    rings = [i.name for i in model.graph.input if i.name.startswith(("k_ring_", "v_ring_"))]
    assert rings
    codes = np.arange(256, dtype=np.float64)
    for ring in rings:
        dq = next(n for n in consumers[ring] if n.op_type == "DequantizeLinear")
        q16 = next(n for n in consumers[dq.output[0]] if n.op_type == "QuantizeLinear")
        s8, z8 = float(inits[dq.input[1]]), int(inits[dq.input[2]])
        s16, z16 = float(inits[q16.input[1]]), inits[q16.input[2]]
        assert z16.dtype == np.uint16, ring
        values = (codes - z8) * np.float32(s8)
        c16 = np.clip(np.round(values / s16) + int(z16), 0, 65535)
        assert np.array_equal((c16 - int(z16)) * np.float32(s16), values), ring


def test_every_concat_moves_codes_or_holds_its_inputs(tiny_calibrated):
    """calibrate's Concat rule (`quantize.concat_holds_its_inputs`) in every deployed graph: a
    Concat whose inputs share one uint16 grid outputs on that grid exactly (the HTP's requantizing
    Concat was 473-1,038 codes off on an SLM of another shape); one whose inputs differ outputs on
    a grid holding them all. Every graph has Concats of both kinds (K/V ring + new rows; rotary)."""
    from hyco.calibrate.quantize import _uint16_grid_of

    from hyco.quant.grids import grid_range
    from hyco.quant.onnx_graph import consumers as graph_consumers

    out = tiny_calibrated / "calibrate"
    for name in ("tree.qdq.onnx",):
        model = onnx.load(str(out / name), load_external_data=False)
        inits = {t.name: t for t in model.graph.initializer}
        producer = {o: n for n in model.graph.node for o in n.output}
        readers = graph_consumers(model.graph)
        kinds = {"shared": 0, "held": 0}
        for node in model.graph.node:
            if node.op_type != "Concat":
                continue
            qs = readers.get(node.output[0], [])
            dqs = [producer.get(x) for x in node.input]
            if len(qs) != 1 or qs[0].op_type != "QuantizeLinear" or not all(d is not None and d.op_type == "DequantizeLinear" for d in dqs):
                continue
            grids = [_uint16_grid_of(d, inits) for d in dqs]
            grid = _uint16_grid_of(qs[0], inits)
            if grid is None or not all(grids):
                continue
            if all(g == grids[0] for g in grids):
                assert grid == grids[0], (name, node.name, grid, grids)
                kinds["shared"] += 1
            else:
                lo, hi = grid_range(grid)
                half = grid["scale"] / 2  # float32 scales: an edge may fall short of an input's by rounding
                assert all(lo - half <= grid_range(g)[0] and grid_range(g)[1] <= hi + half for g in grids), (name, node.name)
                kinds["held"] += 1
        assert kinds["shared"] > 0 and kinds["held"] > 0, (name, kinds)


@pytest.mark.slow
def test_htp_accepts_every_node_of_the_tiny_graphs(tiny_calibrated):
    """Every node of each deployable QDQ graph is assigned to QNN HTP (soc 87, CPU fallback
    disabled), each graph opened in its own process."""
    from hyco.calibrate import htp

    reason = htp.qnn_available()
    if reason:
        pytest.skip(reason)
    for name in GRAPHS:
        ops = {n.op_type for n in onnx.load(str(tiny_calibrated / "calibrate" / name), load_external_data=False).graph.node}
        assert "Tanh" not in ops and "Sigmoid" in ops, name  # the softcap and GELU as Sigmoid (policy table)
        result = htp.check_in_subprocess(tiny_calibrated / "calibrate" / name)
        assert result["accepted"], result
        assert result["cpu_nodes"] == 0 and result["per_ep"].get("QNNExecutionProvider", 0) >= result["nodes"], result


def test_a_tanh_the_rewrites_leave_is_refused_with_the_graph_and_node_named():
    """A softcap by unequal constants is no softcap `softcap_as_sigmoid` rewrites; the Tanh left
    would meet the HTP's 16-row trap, so preparation refuses the graph, naming it and the node."""
    from onnx import TensorProto, helper, numpy_helper

    from hyco.base.errors import HycoError

    nodes = [helper.make_node("Tanh", ["x"], ["t"], name="odd_tanh"), helper.make_node("Mul", ["t", "c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 4])],
                              [numpy_helper.from_array(np.array([30, 30, 30, 29], np.float32), "c")])
    model = prepare.softcap_as_sigmoid(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert [n.op_type for n in model.graph.node] == ["Tanh", "Mul"]
    with pytest.raises(HycoError, match=r"convert/tree\.onnx: Tanh .*odd_tanh \(input x\)"):
        prepare.no_tanh_left(model, "convert/tree.onnx")
    del graph.initializer[:]
    graph.initializer.append(numpy_helper.from_array(np.full(4, 30, np.float32), "c"))
    model = prepare.softcap_as_sigmoid(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert prepare.no_tanh_left(model, "convert/tree.onnx") is model
    assert [n.op_type for n in model.graph.node] == ["Mul", "Sigmoid", "Mul", "Sub"]


def _log_sum_exp_graph(path: Path) -> None:
    """x [33, 64] -> Log(ReduceSum(Exp(x))): the written-out log-softmax's denominator."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("ReduceSum", ["e", "axes"], ["s"], keepdims=1),
             helper.make_node("Log", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "lse", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [33, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [33, 1])],
                              [numpy_helper.from_array(np.array([-1], np.int64), "axes")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))


def _htp_outputs(graph: Path, feeds: dict, tmp: Path) -> dict:
    """The graph's outputs on the QNN HTP simulator (soc 87, no CPU fallback), in a fresh process."""
    np.savez(tmp / "feeds.npz", **feeds)
    code = ("import sys, numpy as np; from pathlib import Path; from hyco.calibrate.htp import htp_session; "
            "s = htp_session(Path(sys.argv[1])); f = dict(np.load(sys.argv[2])); names = [o.name for o in s.get_outputs()]; "
            "np.savez(sys.argv[3], **dict(zip(names, s.run(names, f))))")
    proc = subprocess.run([sys.executable, "-c", code, str(graph), str(tmp / "feeds.npz"), str(tmp / "out.npz")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(np.load(tmp / "out.npz"))


@pytest.mark.slow
def test_htp_log_trap_and_the_range_override_that_avoids_it(tmp_path):
    """Trap: on the soc-87 HTP a 16-bit Log whose output encoding spans less than 4.0 returns the
    encoding's minimum for every element. log(sum exp) over 64 logits spanning 4 calibrates to
    [0, ~3.6]: the HTP returns 0 everywhere (what put every log-prob of the distilled family's
    rows 2 nats off the CPU EP). With `htp_range_overrides` (measured ranges -> quantizer
    override) the encoding spans 4.0 and the HTP agrees with the CPU EP to 2 output codes;
    `htp_encoding_violations` flags the first graph and passes the second."""
    from hyco.calibrate import htp
    from hyco.calibrate.quantize import (
        HTP_LOG_MIN_SPAN,
        htp_encoding_violations,
        htp_range_overrides,
        quantize_graph,
    )

    if reason := htp.qnn_available():
        pytest.skip(reason)
    src = tmp_path / "lse.onnx"
    _log_sum_exp_graph(src)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.uniform(-4.0, 0.0, (33, 64)).astype(np.float32)} for _ in range(4)]
    for f in feeds:
        f["x"][:, 0] = 0.0  # the row max, as after the log-softmax's shift
    exact = [np.log(np.exp(f["x"].astype(np.float64)).sum(-1, keepdims=True)) for f in feeds]
    hi = max(float(e.max()) for e in exact)
    assert hi < HTP_LOG_MIN_SPAN  # the calibrated encoding alone would fall into the trap
    results = {}
    for case in ("calibrated", "widened"):
        overrides: dict = {}
        widened = htp_range_overrides({"log_out": {"y": [float(min(e.min() for e in exact)), hi]}}, overrides) \
            if case == "widened" else None
        out = tmp_path / f"{case}.qdq.onnx"
        quantize_graph(src, out, feeds, overrides=overrides, method="minmax", percentile=99.999, activation_bits=16)
        model = onnx.load(str(out))
        violations = htp_encoding_violations(model)
        log_out = next(n.output[0] for n in model.graph.node if n.op_type == "Log")
        scale = next(float(onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == n.input[1])))
                     for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == log_out)
        cpu = ort_session(out).run(["y"], feeds[0])[0]
        folder = tmp_path / case
        folder.mkdir()
        results[case] = (violations, scale, cpu, _htp_outputs(out, feeds[0], folder)["y"], widened)
    violations, scale, cpu, sim, _ = results["calibrated"]
    assert len(violations) == 1 and "Log" in violations[0]
    assert np.abs(cpu - exact[0]).max() <= 2 * scale  # the CPU EP is right on this grid
    assert np.all(sim == sim.reshape(-1)[0]) and np.abs(sim - cpu).max() > 0.5  # the HTP: one value, far off
    violations, scale, cpu, sim, widened = results["widened"]
    assert widened == {"reciprocal_in": 0, "log_out": 1} and violations == []
    assert scale * 65535 >= HTP_LOG_MIN_SPAN * (1 - 1e-6)
    assert np.abs(sim - cpu).max() <= 2 * scale and np.abs(cpu - exact[0]).max() <= 2 * scale


@pytest.mark.slow
def test_simulator_agrees_with_cpu_within_the_bound_undistilled(tiny_calibrated, tmp_path):
    """The stage's own HTP check (`stage.htp_checks`, each graph in its own process) on the
    undistilled family's graphs, one recorded eval pass per graph: every node on QNN, top-k ids
    equal up to swaps within the bound, log-probs within the bound (the graph's own top-k
    log-prob error vs float, io_spec's `htp_logprob_bound`). The distilled family's run is
    test_simulator_agrees_with_cpu_within_the_bound_distilled."""
    from hyco.calibrate import evaluate, htp
    from hyco.calibrate.stage import MTP_GRAPH, OUT_NAMES, check_inputs, htp_checks

    from hyco.config.recipe import CalibrateConfig

    if reason := htp.qnn_available():
        pytest.skip(reason)
    run = tiny_calibrated
    out = run / "calibrate"
    inputs = check_inputs(run / "convert", run / "qat", run / "vocab", run / "answers")
    inputs["slm_graphs"] = {"tree": "tree.onnx"}  # the ladder's SLM: tree-only, the tree graph prefills
    prepared, _ = prepare.prepare_mtp(onnx.load(str(run / "qat" / MTP_GRAPH)))
    prepare.save(prepared, tmp_path / "mtp.prepared.onnx")
    io = read_io_spec(out / "io_spec.json")
    specs = {g: io[name] for g, name in OUT_NAMES.items() if name in io}
    assert set(specs) == {"tree", "mtp"}
    config = CalibrateConfig(eval_prompts=1, max_new_tokens=8, sqnr_passes=1, mtp_positions=1, mtp_steps=2,
                             max_kl=None, min_sqnr_db=None)
    fidelity = evaluate.run_all(run / "convert", run / "qat", out, inputs, config, specs["tree"].meta["mask_negative"],
                                specs["mtp"].meta["mask_negative"], tmp_path)
    results = htp_checks(out, specs, fidelity["htp_feeds"], passes=1)
    report = {}
    for g, r in results.items():
        s = r["simulator_vs_cpu"]
        assert r["accepted"] and r["cpu_nodes"] == 0, (g, r)
        assert s["bound"] == specs[g].meta["htp_logprob_bound"] > 0
        assert s["within_bound"] and s["id_mismatches"] == 0, (g, s)
        report[g] = (s["max_abs_logprob_diff"], s["bound"], s["top1_equal_rows"], s["rows"])
    print("undistilled simulator vs CPU (max |dlogprob|, bound, top-1 equal, rows):", report)


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_slm_sqnr_from_the_fidelity_sessions_equals_fresh_sessions(tiny_calibrated, tmp_path, monkeypatch):
    """Fidelity's SLM SQNR runs the float driver's picked feeds through the fidelity sessions
    themselves (they also return the layer outputs; issue 13: four session creations less). The
    figures equal `evaluate.sqnr`'s, which opens a fresh session per graph, on the same feeds."""
    from hyco.calibrate import evaluate
    from hyco.calibrate.stage import PARITY_NAMES, SLM_GRAPHS, check_inputs

    from hyco.config.recipe import CalibrateConfig

    run = tiny_calibrated
    out = run / "calibrate"
    inputs = check_inputs(run / "convert", run / "qat", run / "vocab", run / "answers")
    inputs["slm_graphs"] = {g: n for g, n in SLM_GRAPHS.items() if g == "tree"}  # the ladder's: tree-only
    negative = read_io_spec(out / "io_spec.json")["tree.qdq.onnx"].meta["mask_negative"]
    seen = []
    real = evaluate.layer_taps
    monkeypatch.setattr(evaluate, "layer_taps", lambda s, t, f, r: seen.append((f, r)) or real(s, t, f, r))
    config = CalibrateConfig(eval_prompts=1, max_new_tokens=8, sqnr_passes=2, max_kl=None, min_sqnr_db=None)
    result = evaluate.run_slm(run / "convert", out, inputs, config, negative, tmp_path, Phases("test"))
    graphs = inputs["slm_graphs"]
    assert len(seen) == 2 * len(graphs)  # float then QDQ, per graph, on the same feeds
    for i, (g, name) in enumerate(graphs.items()):
        feeds, rows = seen[i]
        q_feeds, q_rows = seen[len(graphs) + i]
        assert len(feeds) == 2 and q_rows == rows and all(a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
                                                          for a, b in zip(feeds, q_feeds, strict=True))
        fresh = evaluate.sqnr(onnx.load(str(run / "convert" / name), load_external_data=False),
                              onnx.load(str(out / PARITY_NAMES[g]), load_external_data=False), feeds, tmp_path,
                              f"fresh_{g}", rows, weights=(run / "convert", out))
        assert fresh and result["graphs"][g]["sqnr_db"] == fresh, g


@pytest.mark.slow
def test_simulator_agrees_with_cpu_within_the_bound_distilled(tiny_export_distilled):
    """The stage's HTP check ran inside calibrate on the distilled family (peaked rows, as a trained
    drafter's): every graph whole on QNN, simulator within the bound, no HTP encoding trap, the
    stage's proofs passed, end to end within the bound and op by op within the per-op tolerance."""
    from hyco.calibrate import htp

    if reason := htp.qnn_available():
        pytest.skip(reason)
    run, _ = tiny_export_distilled
    report = json.loads((run / "calibrate" / "report.json").read_text())
    assert report["proof_failed"] is None
    for name, r in report["graphs"].items():
        s = r["htp"]["simulator_vs_cpu"]
        assert r["htp_accepted"] and r["cpu_nodes"] == 0 and r["htp_encoding_traps"] == [], (name, r["htp"])
        assert s["passes"] >= 1 and s["within_bound"] and s["id_mismatches"] == 0, (name, s)
        assert s["max_abs_logprob_diff"] <= s["bound"] == r["htp_logprob_bound"], (name, s)
        ops = r["htp"]["ops"]  # op by op: a wrong kernel (the Log trap: thousands of codes) is caught here
        assert ops["within_tolerance"] and ops["tensors"] > 100, (name, ops["beyond_tolerance"])
    assert "within the bound" in (run / "calibrate" / "summary.md").read_text()


# --- bad input ---------------------------------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hyco.pipeline.cli", "calibrate", *map(str, args), "--no-htp-check"],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["missing_answers", "keep_set_mismatch", "other_tokenizer"])
def test_bad_input_one_line_exit_2_nothing_written(tiny_calibrated, tmp_path, case):
    run = tiny_calibrated
    convert, qat, vocab, answers = run / "convert", run / "qat", run / "vocab", run / "answers"
    if case == "missing_answers":
        answers = Path(shutil.copytree(answers, tmp_path / "answers"))
        (answers / "answers.jsonl").unlink()
        expect = "answers.jsonl"
    elif case == "keep_set_mismatch":
        convert = tmp_path / "convert"
        shutil.copytree(run / "convert", convert)
        io = json.loads((convert / "io_spec.json").read_text())
        for g in io["graphs"]:
            g["meta"]["keep_size"] -= 1
        (convert / "io_spec.json").write_text(json.dumps(io))
        expect = "io_spec.json"
    else:  # the convert folder claims a tokenizer whose vocabulary differs from the keep set's
        tok = tmp_path / "tokenizer"
        shutil.copytree(json.loads((run / "vocab" / "manifest.json").read_text())["inputs"]["tokenizer"], tok)
        data = json.loads((tok / "tokenizer.json").read_text())
        vocab_map = data["model"]["vocab"]
        a, b = list(vocab_map)[300:302]
        vocab_map[a], vocab_map[b] = vocab_map[b], vocab_map[a]  # two ids swap tokens
        (tok / "tokenizer.json").write_text(json.dumps(data))
        convert = tmp_path / "convert"
        shutil.copytree(run / "convert", convert)
        manifest = json.loads((convert / "manifest.json").read_text())
        manifest["inputs"]["tokenizer"] = str(tok)
        (convert / "manifest.json").write_text(json.dumps(manifest))
        expect = "manifest.json"
    out = tmp_path / "out"
    proc = _cli("--convert", convert, "--qat", qat, "--vocab", vocab, "--answers", answers, "--out", out)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("hyco-convert")]
    assert len(lines) == 1 and expect in lines[0], proc.stderr[-2000:]
    assert not out.exists()


def test_calibrate_sessions_run_without_the_cpu_memory_arena(tiny_calibrated, monkeypatch):
    """Issue 13: onnxruntime's CPU arena keeps each pass's high-water mark (the dequantized fp32
    weights) and grows pass after pass; calibrate's sessions turn it off and compute the same."""
    from hyco.calibrate.drive import Recorder, cpu_session, slm_driver

    from hyco.data.keepset import load_keep_set

    convert = Path(tiny_calibrated) / "convert"
    sess, default = cpu_session(convert / "tree.onnx"), ort_session(convert / "tree.onnx")
    assert sess.get_session_options().enable_cpu_mem_arena is False
    assert default.get_session_options().enable_cpu_mem_arena is True  # onnxruntime's default
    spec = read_io_spec(convert / "io_spec.json")["tree.onnx"]
    feeds = {t.name: t.zeros() for t in spec.inputs}
    for a, b in zip(sess.run(None, feeds), default.run(None, feeds), strict=True):
        assert np.array_equal(a, b)
    keep = load_keep_set(Path(tiny_calibrated) / "vocab" / "keep_set.json").token_ids
    slm = slm_driver(convert, np.asarray(keep))
    assert slm.sessions["tree"].session.get_session_options().enable_cpu_mem_arena is False
    # a driver handed its sessions opens none of its own (it used to open and drop both graphs)
    import hyco.calibrate.drive as drive

    import hyco.runtime.slm_onnx as slm_onnx

    opened = []
    for module, name in ((drive, "cpu_session"), (slm_onnx, "ort_session")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, **k: opened.append(a) or _real(*a, **k))
    given = slm_driver(convert, np.asarray(keep), {"tree": sess, "prefill": sess})
    assert opened == [] and given.sessions["tree"].session is sess and given.sessions["prefill"].session is sess
    slm_driver(convert, np.asarray(keep))
    assert len(opened) == 2  # the counting above does count
    # the calibration recording keeps only the outputs it reads (no logits)
    rec = Recorder(sess, "tree", output_prefixes=("new_k_",))
    names = [o.name for o in sess.get_outputs()]
    rec.run(names, feeds)
    (_, kept), = rec.passes
    assert kept and set(kept) == {n for n in names if n.startswith("new_k_")}


def test_spilled_recording_reads_back_what_the_in_memory_one_holds(tiny_calibrated, tmp_path):
    """Issue 13: calibrate and its evaluation keep the recorded passes on disk (SpilledPasses):
    two drivers in lockstep over the same answer, one in memory and one spilled, record the same
    feeds and outputs, pass by pass, in the same order; indexing and iteration agree. And each
    recorded pass replays to its recorded outputs: the feeds are the ring as it was at that pass
    (KVRing.feeds() hands out live arrays that the next write changes in place; an in-memory
    recording that kept them replayed the final ring for every pass)."""
    from hyco.calibrate.drive import SpilledPasses, lockstep, slm_driver

    from hyco.data.keepset import load_keep_set

    convert = Path(tiny_calibrated) / "convert"
    keep = np.asarray(load_keep_set(Path(tiny_calibrated) / "vocab" / "keep_set.json").token_ids)
    memory, spilled = slm_driver(convert, keep), slm_driver(convert, keep, spill=tmp_path / "passes")
    assert isinstance(spilled.sessions["tree"].passes, SpilledPasses)
    lockstep([memory, spilled], [2, 40, 41, 42, 43], [50, 51, 52, 53, 54, 55], chain_depth=2, topk=4,
             rng=np.random.default_rng(0))
    for graph in ("tree", "prefill"):
        want, got = memory.sessions[graph].passes, spilled.sessions[graph].passes
        assert len(got) == len(want) > 0
        assert len(list(tmp_path.joinpath("passes", graph).iterdir())) == 2 * len(want)  # on disk
        for (wf, wo), (gf, go) in zip(want, got, strict=True):
            for a, b in ((wf, gf), (wo, go)):
                assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        assert all(np.array_equal(got[-1][1][k], want[-1][1][k]) for k in want[-1][1])
        session = memory.sessions[graph].session
        for feeds, outputs in got:
            replayed = session.run(list(outputs), feeds)
            assert all(np.array_equal(r, outputs[n]) for r, n in zip(replayed, outputs, strict=True))
    # the ring did change between the passes compared (else the replay proves nothing)
    first, last = spilled.sessions["prefill"].passes[0][0], spilled.sessions["tree"].passes[-1][0]
    assert any(not np.array_equal(first[k], last[k]) for k in first if k.startswith("k_ring_"))
    with pytest.raises(IndexError):
        spilled.sessions["tree"].passes[len(spilled.sessions["tree"].passes)]


def _augmented(model: onnx.ModelProto, folder: Path) -> Path:
    """onnxruntime's own MinMax calibrator graph (ReduceMin/ReduceMax taps) of `model`, on disk."""
    from onnxruntime.quantization.calibrate import CalibraterBase, MinMaxCalibrater

    prepare.save(model, folder / "model.onnx", check=False)
    ops = sorted({n.op_type for n in model.graph.node} - {"QuantizeLinear", "DequantizeLinear", "Cast"})
    original = CalibraterBase.create_inference_session
    CalibraterBase.create_inference_session = lambda self: None  # the graph only
    try:
        MinMaxCalibrater(str(folder / "model.onnx"), op_types_to_calibrate=ops, use_external_data_format=True,
                         augmented_model_path=str(folder / "augmented.onnx")).augment_graph()
    finally:
        CalibraterBase.create_inference_session = original
    return folder / "augmented.onnx"


def _taps_as_constants_agree(path: Path, feeds: list[dict]) -> int:
    from hyco.calibrate.ort_patches import constant_weight_taps

    from hyco.qnn.ort import session_for

    model = onnx.load(str(path), load_external_data=False)
    replaced = constant_weight_taps(model, path.parent)
    assert not any(t.HasField("raw_data") and len(t.raw_data) > 1024 for t in model.graph.initializer)  # weightless
    # ours as the calibrator's session is made (priority order too), theirs onnxruntime's graph as is
    # (INT4 weights through DequantizeLinear in both: the packed MatMulNBits sums in another order,
    # held to its fp32 bound in tests/test_int4_matmul.py)
    ours = session_for(model, path.parent, arena=False, priority_order=True, int4_matmul=False)
    theirs = ort_session(path, arena=False, int4_matmul=False)
    assert ours.get_session_options().execution_order != theirs.get_session_options().execution_order
    assert [o.name for o in ours.get_outputs()] == [o.name for o in theirs.get_outputs()]
    inputs = {i.name for i in theirs.get_inputs()}
    for f in feeds:
        f = {k: v for k, v in f.items() if k in inputs}
        for a, b in zip(ours.run(None, f), theirs.run(None, f), strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    return replaced


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_calibrator_weight_taps_as_constants_give_the_ranges_onnxruntime_measures(tiny_calibrated, tmp_path):
    """Issue 13: the calibrator's ReduceMin/ReduceMax taps on each weight's DequantizeLinear kept
    every fp32 weight alive until late in the pass (E2B size: 12.9 GB peak); `constant_weight_taps`
    writes the weight ranges as constants, and the calibrator's session runs in onnxruntime's
    priority order (its default order ran every tap at the end of the pass, keeping each tapped
    activation alive until then). Every output of the augmented graph, the ranges of
    all taps included, equals onnxruntime's own, bit for bit: on the tiny tree graph as calibrate
    prepares it, and on a synthetic one with what the fixtures lack (negative and mixed-sign
    per-channel scales, non-zero zero points, INT4 and INT8, per-tensor and per-channel)."""
    from onnx import TensorProto, helper, numpy_helper

    # the tiny tree graph, prepared as calibrate prepares it
    convert = Path(tiny_calibrated) / "convert"
    spec = read_io_spec(convert / "io_spec.json")["tree.onnx"]
    (tmp_path / "tree").mkdir()
    path = _augmented(prepare.prepare_slm(onnx.load(str(convert / "tree.onnx"))), tmp_path / "tree")
    graph = onnx.load(str(path), load_external_data=False).graph
    names = {t.name for t in graph.initializer}
    weight_dq = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in names}
    taps = sum(1 for n in graph.node if n.op_type in ("ReduceMin", "ReduceMax") and n.input[0] in weight_dq)
    assert len(weight_dq) >= 8 and taps == 2 * len(weight_dq)  # onnxruntime taps every weight, min and max
    assert _taps_as_constants_agree(path, [random_feeds(spec, seed=s) for s in range(2)]) == taps

    # synthetic: x [3, 64] -> MatMul DQ(int8, per-channel mixed-sign scale, zero point) -> MatMul DQ(int4, per-tensor < 0)
    rng = np.random.default_rng(7)
    q8 = rng.integers(-128, 128, (64, 48), dtype=np.int8)
    s8 = (rng.uniform(0.5, 2.0, 48) * np.where(np.arange(48) % 3 == 0, -1, 1) * 1e-2).astype(np.float32)
    z8 = rng.integers(-20, 20, 48, dtype=np.int8)
    q4 = rng.integers(-8, 8, (48, 40), dtype=np.int8)
    inits = [numpy_helper.from_array(q8, "w8"), numpy_helper.from_array(s8, "s8"), numpy_helper.from_array(z8, "z8"),
             prepare._int_tensor("w4", q4, TensorProto.INT4), numpy_helper.from_array(np.float32(-0.03), "s4"),
             helper.make_tensor("z4", TensorProto.INT4, [], [3])]
    nodes = [helper.make_node("DequantizeLinear", ["w8", "s8", "z8"], ["w8_dq"], axis=1, name="dq8"),
             helper.make_node("MatMul", ["x", "w8_dq"], ["h"], name="mm8"),
             helper.make_node("DequantizeLinear", ["w4", "s4", "z4"], ["w4_dq"], name="dq4"),
             helper.make_node("MatMul", ["h", "w4_dq"], ["y"], name="mm4")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 40])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model = onnx.shape_inference.infer_shapes(model)
    (tmp_path / "synthetic").mkdir()
    path = _augmented(model, tmp_path / "synthetic")
    feeds = [{"x": rng.standard_normal((3, 64)).astype(np.float32)} for _ in range(2)]
    assert _taps_as_constants_agree(path, feeds) == 4


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_packed_int4_calibration_writes_onnxruntimes_graph_on_the_tiny_family(tiny_calibrated, tmp_path, monkeypatch):
    """calibrate's own sessions multiply INT4 weights packed (MatMulNBits: the same fp32 products,
    summed in MLAS's packed order). On the tiny family's graphs (K <= 256: one block) that order
    is the plain kernel's: the QDQ graph `quantize_graph` writes through packed sessions equals
    onnxruntime's unpatched one, every node and initializer bit for bit. At E2B width the sums
    differ in their last bits; tests/test_int4_matmul.py holds them to the fp32 summation bound."""
    from hyco.calibrate.quantize import quantize_graph

    import hyco.qnn.ort as ort_module

    fused = []
    real = ort_module.fuse_int4_matmuls
    monkeypatch.setattr(ort_module, "fuse_int4_matmuls", lambda m, f: fused.append(real(m, f)) or fused[-1])
    convert = Path(tiny_calibrated) / "convert"
    spec = read_io_spec(convert / "io_spec.json")["tree.onnx"]
    prepared = tmp_path / "tree.prepared.onnx"
    prepare.save(prepare.prepare_slm(onnx.load(str(convert / "tree.onnx"))), prepared)
    feeds = [random_feeds(spec, seed=s) for s in range(3)]
    graphs = {}
    for packed in (True, False):
        out = tmp_path / f"packed-{packed}" / "tree.qdq.onnx"
        out.parent.mkdir()
        quantize_graph(prepared, out, feeds, overrides={}, method="minmax", percentile=99.99, activation_bits=16,
                       lean=packed, int4_matmul=packed)  # unpatched onnxruntime for the reference
        graphs[packed] = onnx.load(str(out))
    assert len(fused) == 1 and fused[0][0] >= 4  # the calibrator's session did multiply packed
    ours, theirs = graphs[True].graph, graphs[False].graph
    assert [n.SerializeToString() for n in ours.node] == [n.SerializeToString() for n in theirs.node]
    assert [t.name for t in ours.initializer] == [t.name for t in theirs.initializer]
    for a, b in zip(ours.initializer, theirs.initializer, strict=True):
        assert a.data_type == b.data_type and np.array_equal(onnx.numpy_helper.to_array(a),
                                                             onnx.numpy_helper.to_array(b)), a.name


def _augmented_graph(model_path: Path, augment) -> onnx.GraphProto:
    """The calibrator's augmented graph of `model_path` as `augment(calibrater)` builds it, its
    random reshape-shape name replaced by a fixed one."""
    from onnxruntime.quantization.calibrate import CalibraterBase, MinMaxCalibrater

    model = onnx.load(str(model_path), load_external_data=False)
    ops = sorted({n.op_type for n in model.graph.node} - {"QuantizeLinear", "DequantizeLinear", "Cast"})
    original = CalibraterBase.create_inference_session
    CalibraterBase.create_inference_session = lambda self: None  # the graph only
    try:
        out = model_path.with_name(f"augmented-{augment.__name__}.onnx")
        calibrater = MinMaxCalibrater(str(model_path), op_types_to_calibrate=ops, use_external_data_format=True,
                                      augmented_model_path=str(out))
        augment(calibrater)
    finally:
        CalibraterBase.create_inference_session = original
    graph = onnx.load(str(out), load_external_data=False).graph
    shapes = [t.name for t in graph.initializer if t.name not in {i.name for i in model.graph.initializer}]
    assert len(shapes) == 1  # the [-1] reshape shape, named by uuid4
    fixed = "0" * len(shapes[0])  # same length: protobuf's length prefixes stay valid
    text = graph.SerializeToString().replace(shapes[0].encode(), fixed.encode())
    result = onnx.GraphProto()
    result.ParseFromString(text)
    return result


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_linear_augment_builds_onnxruntimes_calibration_graph(tiny_calibrated, tmp_path):
    """Issue 13: onnxruntime's MinMax calibrator rescans the node list per tapped tensor (minutes
    per E2B graph); `augment_graph_linear` must build the very same graph: every node, in the same
    order, every output, on the tiny tree graph as calibrate prepares it (taps in front of each
    tensor's first reader) and on a graph with a tapped tensor no node reads (taps at the end)."""
    from hyco.calibrate.ort_patches import augment_graph_linear
    from onnx import TensorProto, helper
    from onnxruntime.quantization.calibrate import MinMaxCalibrater

    convert = Path(tiny_calibrated) / "convert"
    (tmp_path / "tree").mkdir()
    prepare.save(prepare.prepare_slm(onnx.load(str(convert / "tree.onnx"))), tmp_path / "tree" / "model.onnx")
    # y is both read (by Relu) and a graph output; z is read by nothing
    nodes = [helper.make_node("Mul", ["x", "x"], ["y"], name="mul"), helper.make_node("Relu", ["y"], ["z"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("y", "z")])
    (tmp_path / "small").mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "small" / "model.onnx")
    for folder in ("tree", "small"):
        path = tmp_path / folder / "model.onnx"
        theirs = _augmented_graph(path, MinMaxCalibrater.augment_graph)
        ours = _augmented_graph(path, augment_graph_linear)
        taps = [n for n in theirs.node if n.op_type in ("ReduceMin", "ReduceMax")]
        assert len(taps) >= (40 if folder == "tree" else 6)
        assert [n.SerializeToString() for n in ours.node] == [n.SerializeToString() for n in theirs.node]
        assert [o.SerializeToString() for o in ours.output] == [o.SerializeToString() for o in theirs.output]
        assert sorted(t.name for t in ours.initializer) == sorted(t.name for t in theirs.initializer)
    assert [n.name for n in theirs.node][-4:] == ["z_ReduceMax", "z_ReduceMax_Reshape", "z_ReduceMin", "z_ReduceMin_Reshape"]


def test_prepare_with_weights_on_disk_writes_the_in_memory_graph(tiny_calibrated, tmp_path):
    """Issue 13: calibrate prepares each graph with its integer weights on disk (`load_graph`,
    transposed weights streamed out as made, `save_streamed`), one weight in memory at a time
    (the in-memory passes peaked at 6 GB on E2B). The file it writes holds the graph the
    in-memory passes make: every node, input and output, every initializer's values and type."""
    from onnx.external_data_helper import uses_external_data

    convert = Path(tiny_calibrated) / "convert"
    for name in ("tree.onnx", "prefill.onnx"):
        (tmp_path / "memory").mkdir(exist_ok=True)
        (tmp_path / "disk").mkdir(exist_ok=True)
        prepare.save(prepare.prepare_slm(onnx.load(str(convert / name))), tmp_path / "memory" / name)
        path = tmp_path / "disk" / name
        with prepare.WeightFile(path) as weights:
            model = prepare.load_graph(convert / name)
            on_disk = [t.name for t in model.graph.initializer if uses_external_data(t)]
            assert len(on_disk) >= 8  # the tiny graphs' weights take the disk path too
            assert not any(t.data_type == onnx.TensorProto.FLOAT and uses_external_data(t) for t in model.graph.initializer)
            model = prepare.prepare_slm(model, convert, weights)
            prepare.save_streamed(model, convert, path, weights=weights)
        want, got = onnx.load(str(tmp_path / "memory" / name)), onnx.load(str(path))
        for field in ("node", "input", "output"):
            assert [x.SerializeToString() for x in getattr(got.graph, field)] == \
                   [x.SerializeToString() for x in getattr(want.graph, field)], (name, field)
        assert [t.name for t in got.graph.initializer] == [t.name for t in want.graph.initializer]
        for a, b in zip(got.graph.initializer, want.graph.initializer, strict=True):
            x, y = onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b)
            assert a.data_type == b.data_type and x.dtype == y.dtype and np.array_equal(x, y), a.name


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_a_replayed_script_drives_a_graph_as_lockstep_does(tiny_calibrated, tmp_path):
    """Issue 13: calibrate's evaluation walks the float driver first, recording each round's trees
    and commits (`lockstep(script=...)`), then the QDQ driver over the same rounds
    (`replay=...`), so only two graphs' sessions are open at a time. Each driver records the very
    passes it records walking in lockstep with the other. The replay gets an rng of another seed:
    a replay that drew its own commits or built its own trees would record other passes."""
    from hyco.calibrate.drive import cpu_session, lockstep, slm_driver

    from hyco.data.keepset import load_keep_set

    run = Path(tiny_calibrated)
    convert = run / "convert"
    keep = np.asarray(load_keep_set(run / "vocab" / "keep_set.json").token_ids)

    tree_only = ("tree",)  # the ladder's calibration: its tree graph prefills too

    def qdq():
        return slm_driver(convert, keep, {"tree": cpu_session(run / "calibrate" / "tree.parity.qdq.onnx")},
                          graphs=tree_only)

    prompt, answer = [2, 40, 41, 42, 43], [50, 51, 52, 53, 54, 55, 56, 57, 58]
    together = [slm_driver(convert, keep, graphs=tree_only), qdq()]
    lockstep(together, prompt, answer, chain_depth=2, topk=4, rng=np.random.default_rng(0))
    script: list = []
    first = slm_driver(convert, keep, graphs=tree_only)
    lockstep([first], prompt, answer, chain_depth=2, topk=4, rng=np.random.default_rng(0), script=script)
    second = qdq()
    rounds = lockstep([second], prompt, answer, chain_depth=2, topk=4, rng=np.random.default_rng(99), replay=script)
    assert rounds == len(script) >= 3
    for want, got in zip(together, (first, second), strict=True):
        assert set(want.sessions) == set(got.sessions) == {"tree"}
        for graph in tree_only:
            a, b = want.sessions[graph].passes, got.sessions[graph].passes
            assert len(a) == len(b) > 0
            for (fa, oa), (fb, ob) in zip(a, b, strict=True):
                assert fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)
                assert oa.keys() == ob.keys() and all(np.array_equal(oa[k], ob[k]) for k in oa)


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_lean_quantizer_writes_the_graph_onnxruntimes_own_quantize_writes(tiny_calibrated, tmp_path):
    """Issue 13: `quantize_graph` runs onnxruntime's calibrator and quantizer with their costly
    parts replaced (`ort_patches.lean_quantizer`: weightless calibrator model, linear augmentation, constant
    weight taps, priority order, no arena, indexed reader renames and initializer lookups). The
    QDQ graph it writes equals the one onnxruntime's unpatched code writes from the same feeds:
    every node and every initializer, bit for bit (tiny tree graph as calibrate prepares it,
    three random passes, the KV and mask overrides calibrate gives it)."""
    from hyco.calibrate.quantize import mask_qparams, quantize_graph
    from onnxruntime.quantization import QuantType

    convert = Path(tiny_calibrated) / "convert"
    spec = read_io_spec(convert / "io_spec.json")["tree.onnx"]
    prepared = tmp_path / "tree.prepared.onnx"
    prepare.save(prepare.prepare_slm(onnx.load(str(convert / "tree.onnx"))), prepared)
    feeds = [random_feeds(spec, seed=s) for s in range(3)]
    scale, zero = mask_qparams(-50.0)
    overrides = {t.name: [{"quant_type": QuantType.QUInt16, "scale": np.array(scale, np.float32),
                           "zero_point": np.array(zero, np.uint16)}] for t in spec.inputs if t.name.startswith("mask_")}
    ring = next(t.name for t in spec.inputs if t.name.startswith("k_ring_"))
    overrides[ring] = [{"quant_type": QuantType.QUInt8, "scale": np.array(0.02, np.float32),
                        "zero_point": np.array(128, np.uint8)}]
    graphs = {}
    for lean in (True, False):
        out = tmp_path / f"lean-{lean}" / "tree.qdq.onnx"
        out.parent.mkdir()
        quantize_graph(prepared, out, feeds, overrides={k: [dict(v[0])] for k, v in overrides.items()},
                       method="minmax", percentile=99.99, activation_bits=16, lean=lean, int4_matmul=False,
                       check_lookups=lean)  # each indexed lookup also against onnxruntime's scan
        graphs[lean] = onnx.load(str(out))
    ours, theirs = graphs[True].graph, graphs[False].graph
    assert len(theirs.node) > 3 * sum(1 for n in theirs.node if n.op_type == "MatMul")  # QDQ everywhere
    assert [n.SerializeToString() for n in ours.node] == [n.SerializeToString() for n in theirs.node]
    assert [t.name for t in ours.initializer] == [t.name for t in theirs.initializer]
    for a, b in zip(ours.initializer, theirs.initializer, strict=True):
        assert a.data_type == b.data_type and np.array_equal(onnx.numpy_helper.to_array(a),
                                                             onnx.numpy_helper.to_array(b)), a.name


@pytest.mark.parametrize("n, k", [(6, 8), (5, 8), (6, 7)])
def test_weights_bitexact_catches_one_changed_nibble_or_scale_bit(n, k):
    """The proof compares INT4 weights as packed bytes where both dims are even (the other one
    transposed nibble by nibble first), else unpacked (issue 13): either way one changed nibble,
    in either layout, or one changed scale bit fails it, naming the weight."""
    from hyco.formats.int4 import pack_int4

    rng = np.random.default_rng(0)
    ints = rng.integers(-8, 8, (n, k)).astype(np.int8)  # [out, in]
    scale = rng.random(n).astype(np.float32) + 0.1

    def model(values: np.ndarray, scales: np.ndarray, transposed: bool) -> onnx.ModelProto:
        stored = values.T if transposed else values  # [in, out] with axis 1, as calibrate deploys
        w = onnx.helper.make_tensor("w", onnx.TensorProto.INT4, stored.shape, pack_int4(stored), raw=True)
        s = onnx.numpy_helper.from_array(scales, "w_scale")
        dq = onnx.helper.make_node("DequantizeLinear", ["w", "w_scale"], ["w_f"], axis=1 if transposed else 0)
        g = onnx.helper.make_graph([dq], "g", [], [onnx.helper.make_tensor_value_info("w_f", onnx.TensorProto.FLOAT, None)],
                                   initializer=[w, s])
        return onnx.helper.make_model(g)

    from hyco.calibrate.quantize import _same_packed_int4

    source = model(ints, scale, False)
    packed = _same_packed_int4(source.graph.initializer[0], 0, model(ints, scale, True).graph.initializer[0], 1)
    assert packed is (None if n % 2 or k % 2 else True)  # which comparison ran
    for transposed in (False, True):
        assert weights_bitexact(source, model(ints, scale, transposed))["all_equal"]
        flipped = ints.copy()
        flipped[n - 1, k - 1] ^= 1
        result = weights_bitexact(source, model(flipped, scale, transposed))
        assert not result["all_equal"] and result["missing_or_different"] == ["w"]
        nudged = scale.copy()
        nudged.view(np.uint32)[0] ^= 1
        assert not weights_bitexact(source, model(ints, nudged, transposed))["all_equal"]


def test_the_quantizer_patches_refuse_an_onnxruntime_they_were_not_proven_on(tmp_path, monkeypatch):
    """The patches replace private onnxruntime functions: on a release outside PROVEN (pyproject's
    pin) or with one of the patched names gone, `lean_quantizer` refuses in one line naming the
    version or the function, and leaves onnxruntime unpatched."""
    import onnxruntime
    import onnxruntime.quantization.calibrate as ort_calibrate
    import onnxruntime.quantization.onnx_model as onnx_model
    from hyco.calibrate.ort_patches import PROVEN, lean_quantizer, require_proven_onnxruntime

    require_proven_onnxruntime()  # the installed release is inside the range
    require_proven_onnxruntime(".".join(map(str, PROVEN[0])) + ".9")
    for outside in ("1.22.0", ".".join(map(str, PROVEN[1])) + ".0", "2.0.0"):
        with pytest.raises(HycoError, match=rf"onnxruntime {outside}: .* proven on onnxruntime >=1\.32,<1\.33"):
            require_proven_onnxruntime(outside)
    augment = inspect.getattr_static(ort_calibrate.MinMaxCalibrater, "augment_graph")
    monkeypatch.setattr(onnxruntime, "__version__", "1.40.1")
    with pytest.raises(HycoError, match="onnxruntime 1.40.1"), lean_quantizer(tmp_path):
        pass
    monkeypatch.undo()
    monkeypatch.delattr(onnx_model.ONNXModel, "get_initializer")
    with pytest.raises(HycoError, match=r"no ONNXModel\.get_initializer"), lean_quantizer(tmp_path):
        pass
    assert inspect.getattr_static(ort_calibrate.MinMaxCalibrater, "augment_graph") is augment


@pytest.mark.slow  # two calibrate runs on the tiny family
def test_float_passes_beside_the_quantize_write_what_one_after_the_other_writes(tiny_calibrated, tmp_path):
    """The fidelity's float passes on a thread beside the quantize (`stage.side_by_side`: the memory
    allows) and the same passes after it (calibrate.memory_gb too small for both: the estimate
    refuses) write the same graphs, encodings and io_spec byte for byte and the same fidelity,
    spread and HTP-bound figures; each report says which ran and why."""
    from hyco.calibrate.stage import calibrate

    from hyco.config.recipe import CalibrateConfig

    run = tiny_calibrated
    reports = {}
    for how, memory_gb in (("beside", None), ("after", 0.001)):
        config = CalibrateConfig(prompts=2, eval_prompts=1, max_new_tokens=8, sqnr_passes=1, mtp_positions=1,
                                 mtp_steps=2, htp_check=False, fidelity_seeds=2, max_kl=None, min_sqnr_db=None,
                                 memory_gb=memory_gb)
        calibrate(convert=run / "convert", qat=run / "qat", vocab=run / "vocab", answers=run / "answers",
                  out=tmp_path / how, config=config)
        reports[how] = json.loads((tmp_path / how / "report.json").read_text())
    beside, after = reports["beside"], reports["after"]
    assert beside["slm"]["side_by_side"]["fits"] and not after["slm"]["side_by_side"]["fits"]
    assert after["slm"]["side_by_side"]["budget"] == "calibrate.memory_gb"
    assert after["slm"]["side_by_side"]["estimate_mb"] > after["slm"]["side_by_side"]["budget_mb"]
    names = {how: list(r["phases"]) for how, r in reports.items()}
    assert any("beside the fidelity's float SLM passes" in n for n in names["beside"])
    assert "fidelity: float SLM passes" in names["after"] and "fidelity: float SLM passes" not in names["beside"]
    files = sorted(p.relative_to(tmp_path / "after") for p in (tmp_path / "after").rglob("*") if p.is_file()
                   and p.name not in ("report.json", "summary.md", "manifest.json", "stage.log"))
    assert any(p.suffix == ".onnx" for p in files) and any(p.name == "encodings.json" for p in files)
    for rel in files:
        assert (tmp_path / "after" / rel).read_bytes() == (tmp_path / "beside" / rel).read_bytes(), rel
    for key in ("graphs", "fidelity_details", "htp_bounds"):
        assert json.dumps(beside[key], sort_keys=True) == json.dumps(after[key], sort_keys=True), key
