"""smoke: hybrid drafting through the bundle's context binaries on the QNN HTP simulator vs
onnxruntime CPU on the same QDQ graphs; the comparison rule; the host's code I/O."""

from __future__ import annotations

import numpy as np
import pytest

from hyco.npu.io_spec import GraphSpec, TensorSpec

pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (QNN HTP backend absent)")


def test_pass_comparison_counts_ties_and_mismatches():
    from hyco.quant.pass_compare import PassLog

    log = PassLog(tolerance=0.1)
    names = ["topk_logprobs", "topk_ids"]
    cpu = [np.array([[-1.0, -1.05, -3.0]]), np.array([[5, 7, 9]])]
    log.record("mtp_step", names, [np.array([[-1.02, -1.04, -3.05]]), np.array([[7, 5, 9]])], cpu)  # a near tie
    log.record("mtp_step", names, [np.array([[-1.0, -1.05, -3.0]]), np.array([[9, 7, 5]])], cpu)  # 2 nats apart
    log.record("mtp_step", names, [np.array([[-1.0, -1.3, -3.0]]), np.array([[5, 7, 9]])], cpu)  # ids equal, lp off
    assert [(r["tie_swaps"], r["id_mismatches"]) for r in log.rows] == [(2, 0), (0, 2), (0, 0)]
    assert [log.ok(r) for r in log.rows] == [True, False, False]
    per_graph = PassLog(tolerance={"mtp_step": 0.01, "tree": 1.0})  # a bound per graph role
    per_graph.record("mtp_step", names, [np.array([[-1.02, -1.04, -3.05]]), np.array([[7, 5, 9]])], cpu)
    per_graph.record("tree", names, [np.array([[-1.02, -1.04, -3.05]]), np.array([[7, 5, 9]])], cpu)
    assert [(r["bound"], r["id_mismatches"], per_graph.ok(r)) for r in per_graph.rows] == [(0.01, 2, False),
                                                                                          (1.0, 0, True)]
    # every log-prob both rows hold is unchanged (d = 0), but a token came in from outside the
    # CPU's top-k: no honest swap, whatever the bound
    loose = PassLog(tolerance=5.0)
    loose.record("tree", names, [np.array([[-1.0, -2.0, -3.0]]), np.array([[5, 11, 9]])],
                 [np.array([[-1.0, -2.0, -3.0]]), np.array([[5, 7, 9]])])
    assert (loose.rows[0]["tie_swaps"], loose.rows[0]["id_mismatches"], loose.rows[0]["tie_margin"]) == (0, 1, 0.0)
    # a token moved by 1 nat: the difference is token by token, not only rank by rank
    moved = PassLog(tolerance=0.5)
    moved.record("tree", names, [np.array([[-1.0, -2.0, -3.0]]), np.array([[7, 5, 9]])],
                 [np.array([[-1.0, -2.0, -3.0]]), np.array([[5, 7, 9]])])
    assert moved.rows[0]["max_logprob_diff"] == 1.0 and not moved.ok(moved.rows[0])
    padded = PassLog(tolerance=0.1)  # row 1 is a padding row: never read, so never compared
    two = [np.array([[-1.0, -1.05, -3.0], [-1.0, -1.0, -1.0]]), np.array([[5, 7, 9], [1, 2, 3]])]
    padded.record("tree", names, [two[0] + [[0, 0, 0], [0, 0, -5]], np.array([[5, 7, 9], [3, 2, 1]])], two, active=1)
    padded.record("tree", names, [two[0] + [[0, 0, 0], [0, 0, -5]], np.array([[5, 7, 9], [3, 2, 1]])], two)
    assert [(r["rows"], r["tie_swaps"], padded.ok(r)) for r in padded.rows] == [(1, 0, True), (2, 2, False)]


def test_new_kv_rows_are_held_to_their_step_bound_in_codes_and_in_float():
    from hyco.quant.pass_compare import PassLog

    names = ["topk_logprobs", "topk_ids", "new_k_0", "new_v_0"]
    lp, ids = np.array([[-1.0, -2.0]]), np.array([[5, 7]])
    codes = np.full((1, 4), 128, np.uint8)
    log = PassLog(tolerance=0.1, kv_steps={"tree": {"new_k_0": 0.5, "new_v_0": 0.5}}, kv_bound={"tree": 4.0})
    log.record("tree", names, [lp, ids, codes + 3, codes], [lp, ids, codes, codes])  # 3 codes apart: within
    log.record("tree", names, [lp, ids, codes, codes + 42], [lp, ids, codes, codes])  # 42: a V grid twice off
    as_float = [lp, ids, np.full((1, 4), 1.0), np.full((1, 4), 1.0)]
    log.record("tree", names, [lp, ids, np.full((1, 4), 3.5), as_float[3]], as_float)  # 2.5 / 0.5 = 5 steps
    assert [(r["max_kv_steps"], log.ok(r)) for r in log.rows] == [(3.0, True), (42.0, False), (5.0, False)]
    unheld = PassLog(tolerance=0.1, kv_steps={"tree": {"new_k_0": 0.5, "new_v_0": 0.5}})  # --tolerance: not held
    unheld.record("tree", names, [lp, ids, codes, codes + 42], [lp, ids, codes, codes])
    assert unheld.rows[0]["kv_step_bound"] is None and unheld.ok(unheld.rows[0])


def test_top1_share_is_reported_per_graph_and_flags_a_graph_under_the_floor():
    from hyco.export.smoke import TOP1_FLOOR, below_top1_floor, pass_totals

    from hyco.quant.pass_compare import PassLog

    names = ["topk_logprobs", "topk_ids"]
    cpu = [np.array([[-1.0, -1.05, -3.0]] * 10), np.array([[5, 7, 9]] * 10)]
    swapped = [np.array([[-1.0, -1.05, -3.0]] * 10), np.array([[7, 5, 9]] * 2 + [[5, 7, 9]] * 8)]
    log = PassLog(tolerance=1.0)
    log.record("prefill", names, swapped, cpu)  # 2 of 10 rows swap their top-1, each a tie (2d = 0.1)
    log.record("tree", names, cpu, cpu)
    assert log.rows[0]["id_mismatches"] == 0 and log.ok(log.rows[0])
    totals = pass_totals(log, {"prefill": 1.0, "tree": 1.0})
    assert totals["prefill"]["top1_share"] == 0.8 < TOP1_FLOOR and totals["tree"]["top1_share"] == 1.0
    assert below_top1_floor(totals) == ["prefill"]


def test_a_bound_far_over_the_htps_difference_is_named_with_its_reason():
    from hyco.export.smoke import POWER_LIMIT, bound_power

    by_role = {"tree": {"bound": 0.3, "max_logprob_diff": 0.1, "kv_step_bound": 12.0, "max_kv_steps": 3.0},
               "prefill": {"bound": 0.3, "max_logprob_diff": 0.01, "kv_step_bound": 40.0, "max_kv_steps": 4.0},
               "mtp_step": {"bound": 0.05, "max_logprob_diff": 0.0, "kv_step_bound": None, "max_kv_steps": 0.0}}
    bound_power(by_role, {"tree": 0.002, "prefill": 0.002, "mtp_step": 0.004})
    assert by_role["tree"]["bound_over_htp"] == 3.0 and by_role["tree"]["kv_bound_over_htp"] == 4.0
    assert by_role["tree"]["power_note"] is None  # both within POWER_LIMIT
    prefill = by_role["prefill"]
    assert prefill["bound_over_htp"] == 30.0 > POWER_LIMIT and prefill["kv_bound_over_htp"] == 10.0
    assert prefill["power_note"] == ("log-prob bound 30x the HTP's difference: the perturbation at the HTP's measured "
                                     "codes moves this graph further than the HTP did here; K/V bound 10x the HTP's "
                                     "difference: the perturbation at the HTP's measured codes moves this graph "
                                     "further than the HTP did here")
    mtp = by_role["mtp_step"]  # the HTP equal to the CPU: measured against one step of the output grid
    assert mtp["bound_over_htp"] == 12.5 and "to the output grid's resolution" in mtp["power_note"]
    assert mtp["kv_bound_over_htp"] is None


def test_commits_compare_as_streams_and_a_different_length_needs_a_tie():
    from hyco.export.smoke import compare_commits

    htp, cpu = [[5, 6], [7, 7, 9], [7, 7]], [[5, 6], [7, 7, 9, 7], [7, 4]]
    rows = compare_commits(htp, cpu, tie_swaps=[0, 3, 0])  # round 1: one draft fewer accepted, after a tie
    assert [r["same_commit"] for r in rows] == [True, False, False]
    assert [r["stream_agrees"] for r in rows] == [True, True, True]  # 5 6 7 7 9 7 7 vs 5 6 7 7 9 7 7 4
    assert [r["ok"] for r in rows] == [True, True, False]  # round 2 differs with no tie in its passes
    assert not compare_commits(htp[:2], cpu[:2], tie_swaps=[0, 0])[1]["ok"]  # no tie: unexplained
    other = compare_commits([[5, 6], [7, 8]], [[5, 6], [7, 9]], tie_swaps=[0, 5])
    assert other[1]["explained"] and not other[1]["stream_agrees"] and not other[1]["ok"]  # other text: lossy


def test_codes_session_feeds_codes_and_returns_the_same_grid():
    from hyco.runtime.qnn_backend import CodesSession, float_view

    q = {"dtype": "uint8", "scale": 0.02, "zero_point": 128}
    spec = GraphSpec("g", (TensorSpec("k_ring_0", (4,), "uint8", "ring", q),),
                     (TensorSpec("new_k_0", (4,), "uint8", "new rows", q),))

    class Echo:
        def run(self, names, feeds):
            assert feeds["k_ring_0"].dtype == np.uint8
            return [feeds["k_ring_0"]]

    values = np.array([-2.56, -0.02, 0.0, 2.54], np.float32)  # on the grid: codes 0, 127, 128, 255
    out = CodesSession(Echo(), spec).run(["new_k_0"], {"k_ring_0": values})[0]
    assert np.array_equal(out, values) and out.dtype == np.float32
    assert float_view(spec).inputs[0].dtype == "float32"


@pytest.fixture(scope="module")
def smoked(tiny_export_distilled, tiny_family_distilled, tmp_path_factory):
    """smoke on the DISTILLED family's bundle (the main job's family): its drafters' rows are
    peaked like trained ones. On the undistilled family (2 QAT steps from random weights) most
    rows are near-flat, most top-k entries near-ties, and its quantization error vs float (the
    bound) reaches 2 nats: a comparison there tests little."""
    from hyco.export.smoke import smoke

    _, bundle = tiny_export_distilled
    return smoke(bundle=bundle, verifier=tiny_family_distilled["verifier"], prompts=2, rounds=2, tolerance=None, isolate=True,
                 out=tmp_path_factory.mktemp("smoke"))


@pytest.mark.slow
def test_smoke_runs_every_graph_on_the_simulator_and_commits_what_cpu_commits(smoked):
    report = smoked
    assert {"tree", "prefill", "mtp_step"} <= set(report["by_graph"])
    htp = report["timings"]["htp (simulation, not phone speed)"]
    assert all(htp[g]["passes"] > 0 and htp[g]["load_s"] > 0 for g in ("tree", "prefill", "mtp_step"))
    assert report["isolate"] and "own worker process" in report["isolation_note"]
    assert len(report["rounds"]) == 4 and all(r["ok"] and r["stream_agrees"] for r in report["rounds"])
    for role, v in report["by_graph"].items():  # every bound's power stated, a weak one with its reason
        assert v["bound_over_htp"] > 0 and (v["power_note"] is None) == (
            v["bound_over_htp"] <= 5 and (v["kv_bound_over_htp"] or 0) <= 5), (role, v)
    assert "Power: each bound over the HTP's own difference" in report["summary_md"]


@pytest.mark.slow
def test_smoke_agrees_with_cpu_on_every_round_of_two_prompts(smoked, tiny_export_distilled):
    """Every pass of every round: top-k ids equal up to tie swaps, top-k log-probs and new K/V rows
    within the graph's bounds, which are calibrate's (io_spec `htp_logprob_bound`,
    `htp_kv_step_bound`: the HTP's measured per-op codes carried through the graph). The committed text is
    the verifier's sampled text, not one repeated token, on prompts chosen for that."""
    from hyco.npu.io_spec import read_io_spec

    _, bundle = tiny_export_distilled
    specs = read_io_spec(bundle / "io_spec.json")
    assert smoked["passed"], smoked["headline"]
    assert all(r["passes_agree"] and r["ok"] for r in smoked["rounds"])
    # the bounds are tight: within a few times what the HTP moved (main job: 2-3x; looser bounds let
    # the mutations below through)
    for role, row in smoked["by_graph"].items():
        assert row["bound"] <= 6 * max(row["max_logprob_diff"], 0.01), (role, row)
        assert row["kv_step_bound"] is None or row["kv_step_bound"] <= 6 * max(row["max_kv_steps"], 1.0), (role, row)
    assert all(t["top_share"] <= 0.5 for t in smoked["committed_text"].values()), smoked["committed_text"]
    assert sum(r["chosen"] for r in smoked["prompt_selection"]) == 2
    text = smoked["committed_text"]  # the data behind the verdict, reported next to it
    assert sorted(text) == [0, 1] and all(t["tokens"] == sum(len(r["cpu_committed"]) for r in smoked["rounds"]
                                                             if r["prompt"] == p) for p, t in text.items())
    for key, spec in specs.items():
        g = smoked["by_graph"][key.split(".")[0]]
        assert g["bound"] == pytest.approx(spec.meta["htp_logprob_bound"], abs=1e-5) and g["bound"] > 0, key
        assert g["id_mismatches"] == 0 and g["max_logprob_diff"] <= g["bound"], (key, g)


def test_smoke_needs_the_bound_or_a_tolerance(tmp_path):
    """A bundle whose io_spec carries no bound (calibrated before it was recorded) is refused with
    the file named, unless a tolerance is given."""
    from hyco.export.smoke import graph_bounds

    from hyco.base.errors import HycoError

    specs = {"tree.qdq.onnx": GraphSpec("tree.qdq.onnx", (), (), {"htp_logprob_bound": 0.3}),
             "mtp_step.qdq.onnx": GraphSpec("mtp_step.qdq.onnx", (), (), {})}
    with pytest.raises(HycoError, match="io_spec.json: graph mtp_step.qdq.onnx has no htp_logprob_bound"):
        graph_bounds(tmp_path, specs)
    specs["mtp_step.qdq.onnx"].meta["htp_logprob_bound"] = 0.2
    assert graph_bounds(tmp_path, specs) == {"tree": 0.3, "mtp_step": 0.2}


@pytest.mark.slow
def test_check_runs_both_drafters_on_the_bundle_with_the_qnn_backend(tiny_export_distilled, tiny_family_distilled,
                                                                     tmp_path):
    """`hyco-convert check --set check.backend=qnn`: both drafters on the bundle's context binaries
    (simulator), exact decoding equal to the verifier's own text (keyed sampling), drafts accepted."""
    import json
    from pathlib import Path

    from hyco.pipeline.cli import main

    run_dir, bundle = tiny_export_distilled
    run = tmp_path / "run"
    run.mkdir()
    (run / "vocab").symlink_to(run_dir / "vocab")
    (run / "export").symlink_to(bundle.parent)
    recipe = Path(__file__).parents[1] / "recipes" / "tiny.yaml"
    sets = [f"out={run}", "stages=[vocab,export,check]", "check.backend=qnn", "check.max_new_tokens=8",
            *(f"models.{k}={v}" for k, v in tiny_family_distilled.items())]
    args = ["check", "--recipe", str(recipe), "--config", "hyco-exact", "--prompts", "1"]
    assert main([*args, *sum((["--set", s] for s in sets), [])]) == 0
    report = json.loads((run / "check" / "report.json").read_text())
    assert "QNN HTP" in report["settings"]["backends"]["slm"] and "QNN HTP" in report["settings"]["backends"]["mtp"]
    lossless = report["lossless"]["hyco-exact"]
    assert lossless["equal"] and lossless["tokens_compared"] == 8 and lossless["accepted_draft_tokens"] > 0
    assert report["configs"]["hyco-exact"]["mat"] > 1.0


def mutated_copy(bundle, out, graph: str, tensor: str):
    """A copy of `bundle` whose CPU reference graph for `graph` reads `tensor` at twice its scale (its
    DequantizeLinear's scale doubled; the QuantizeLinear before it keeps the grid), bundle.json
    re-sealed. smoke compares the HTP on the context binary with the CPU on this reference, so a
    wrong scale on either side is the same disagreement; mutating the reference spares an export
    per case and tests smoke's rule, not QNN's converter."""
    import hashlib
    import json
    import shutil

    import onnx
    from onnx import numpy_helper

    shutil.copytree(bundle, out)
    path = out / "reference" / f"{graph}.qdq.onnx"
    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    quantized = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and quantized.get(n.input[0]) == tensor)
    doubled = numpy_helper.from_array(numpy_helper.to_array(inits[dq.input[1]]) * 2, dq.input[1] + "__x2")
    model.graph.initializer.append(doubled)
    dq.input[1] = doubled.name
    onnx.save(model, str(path))
    meta = json.loads((out / "bundle.json").read_text())
    meta["files"][f"reference/{graph}.qdq.onnx"] = {"bytes": path.stat().st_size,
                                                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (out / "bundle.json").write_text(json.dumps(meta, indent=2))
    return out


def softcap_fault_copy(bundle, out, graph: str = "prefill"):
    """A copy of `bundle` whose context binary for `graph` is compiled from its reference QDQ graph
    with the softcap written back as the HTP computes it wrong: Mul(Tanh(u), c) on Tanh's fixed
    uint16 grid (1/32768, zero point 32768) in place of calibrate's 2c sigmoid(2u) - c. The same
    function on the CPU, so the reference stays right and only the binary is faulty: at 16 rows
    (the tiny prefill chunk) the HTP's Tanh computes rows 2-15 thousands of codes wrong. On the
    main job's bundle smoke then measured 8.2 nats on prefill (bound 0.36), top-1 on 15% of rows."""
    import json
    import shutil

    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from hyco.qnn.bundle import file_table
    from hyco.qnn.contexts import compile_isolated

    shutil.copytree(bundle, out)
    meta = json.loads((out / "bundle.json").read_text())
    model = onnx.load(str(out / "reference" / f"{graph}.qdq.onnx"))
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    consumer = {i: n for n in nodes for i in n.input}

    def through_qdq(node):  # the op after `node`'s QuantizeLinear -> DequantizeLinear, and the two
        q = consumer[node.output[0]]
        dq = consumer[q.output[0]]
        return consumer[dq.output[0]], [q, dq]

    # the softcap's Sigmoid: the one whose Mul by 2c feeds a Sub (GELU's feed a Mul by the up projection)
    sigmoid, x2c, qdq1, sub, qdq2 = next((n, x2c, qdq1, *through_qdq(x2c)) for n in nodes if n.op_type == "Sigmoid"
                                         for x2c, qdq1 in [through_qdq(n)] if through_qdq(x2c)[0].op_type == "Sub")
    doubled = producer[producer[producer[sigmoid.input[0]].input[0]].input[0]]  # Mul(u, 2) -> Q -> DQ -> Sigmoid
    assert (doubled.op_type, x2c.op_type) == ("Mul", "Mul"), (doubled, x2c)
    before_sigmoid = [producer[sigmoid.input[0]], producer[producer[sigmoid.input[0]].input[0]]]
    gone = {id(n) for n in (doubled, *before_sigmoid, sigmoid, *qdq1, x2c, *qdq2, sub)}
    model.graph.initializer.extend([numpy_helper.from_array(np.array(1 / 32768, np.float32), "fault_tanh_scale"),
                                    numpy_helper.from_array(np.array(32768, np.uint16), "fault_tanh_zero")])
    fault = [helper.make_node("Tanh", [doubled.input[0]], ["fault_tanh"], name="fault_tanh"),
             helper.make_node("QuantizeLinear", ["fault_tanh", "fault_tanh_scale", "fault_tanh_zero"], ["fault_tanh_q"]),
             helper.make_node("DequantizeLinear", ["fault_tanh_q", "fault_tanh_scale", "fault_tanh_zero"], ["fault_tanh_dq"]),
             helper.make_node("Mul", ["fault_tanh_dq", sub.input[1]], [sub.output[0]], name="fault_times_c")]
    kept = [n for n in nodes if id(n) not in gone]
    at = kept.index(consumer[sub.output[0]])
    del model.graph.node[:]
    model.graph.node.extend(kept[:at] + fault + kept[at:])
    faulty = out.parent / f"{graph}.fault.qdq.onnx"
    onnx.save(model, str(faulty))
    onnx.checker.check_model(str(faulty))
    part = meta["graphs"][graph]["parts"][0]
    compiled = compile_isolated(faulty, out, graph, soc_model=meta["soc_model"])  # replaces both files
    assert (compiled.context.name, compiled.binary.name) == (part["context"], part["binary"])
    part["binary_bytes"] = compiled.binary.stat().st_size
    meta["files"] = file_table(out)
    (out / "bundle.json").write_text(json.dumps(meta, indent=2))
    return out


@pytest.mark.slow
def test_smoke_fails_on_a_bundle_compiled_with_the_softcap_fault(smoked, tiny_export_distilled, tiny_family_distilled,
                                                                  tmp_path):
    """The fault issue 37 met, in the binary itself: the prefill graph compiled with the softcap's
    Tanh (which calibrate no longer emits). smoke must refuse it on the prefill passes."""
    from hyco.export.smoke import smoke

    from hyco.quant.pass_compare import PassLog

    assert smoked["passed"], smoked["headline"]
    bundle = softcap_fault_copy(tiny_export_distilled[1], tmp_path / "bundle")
    report = smoke(bundle=bundle, verifier=tiny_family_distilled["verifier"], prompts=2, rounds=2, tolerance=None,
                   isolate=True, out=tmp_path / "smoke")
    assert not report["passed"], report["headline"]
    wrong = [p for p in report["passes"] if p["role"] == "prefill" and not PassLog.ok(p)]
    assert wrong, report["by_graph"]["prefill"]


# One activation at twice its scale, as a wrong encoding or kernel would leave it. Measured on the
# main job's bundle (graph bounds tree 0.35-0.40 / prefill 0.36 nats, K/V 7-8 steps; a pass's own
# bound up to twice its perturbation, 0.45-0.94; the HTP itself 0.10-0.13 nats and 2 steps): the
# softcap's Sigmoid output 3.1 nats off (its Tanh, before calibrate rewrote it, 2.5); prefill's layer-3
# value projection: log-probs within 0.31 nats but its K/V rows 42 steps off; layer 4's gate
# projection 0.53 nats; layer 2's output projection 0.99 nats and K/V 26 steps. (Layer 1's up
# projection sits at the edge: 0.29 nats, K/V 14 steps against pass bounds of 12-16.)
MUTATIONS = [("tree", "logits_sigmoid"), ("prefill", "/layers.3/attn/v_proj/MatMul_output_0"),
             ("tree", "/layers.4/mlp/gate_proj/MatMul_output_0"), ("tree", "/layers.2/attn/o_proj/MatMul_output_0")]


@pytest.mark.slow
@pytest.mark.parametrize("graph,tensor", MUTATIONS, ids=["softcap_sigmoid", "v_proj", "gate_proj", "o_proj"])
def test_smoke_fails_on_a_bundle_with_one_activation_scale_off_by_2x(smoked, tiny_export_distilled,
                                                                     tiny_family_distilled, tmp_path, graph, tensor):
    from hyco.export.smoke import smoke

    assert smoked["passed"], smoked["headline"]  # the same bundle unmutated
    bundle = mutated_copy(tiny_export_distilled[1], tmp_path / "bundle", graph, tensor)
    report = smoke(bundle=bundle, verifier=tiny_family_distilled["verifier"], prompts=2, rounds=2, tolerance=None,
                   isolate=True, out=tmp_path / "smoke")
    assert not report["passed"], report["headline"]
    from hyco.quant.pass_compare import PassLog

    wrong = [p for p in report["passes"] if p["role"] == graph and not PassLog.ok(p)]
    assert wrong, report["by_graph"][graph]  # the mutated graph's own passes disagree
