"""smoke: hybrid drafting through the bundle's context binaries on the QNN HTP simulator vs
onnxruntime CPU on the same QDQ graphs; the comparison rule; the host's code I/O."""

from __future__ import annotations

import numpy as np
import pytest

from hyco.io_spec import GraphSpec, TensorSpec

pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (QNN HTP backend absent)")


def test_pass_comparison_counts_ties_and_mismatches():
    from hyco.export.smoke import PassLog

    log = PassLog(tolerance=0.1)
    names = ["topk_logprobs", "topk_ids"]
    cpu = [np.array([[-1.0, -1.05, -3.0]]), np.array([[5, 7, 9]])]
    log.record("mtp_step", names, [np.array([[-1.02, -1.04, -3.05]]), np.array([[7, 5, 9]])], cpu)  # a near tie
    log.record("mtp_step", names, [np.array([[-1.0, -1.05, -3.0]]), np.array([[9, 7, 5]])], cpu)  # 2 nats apart
    log.record("mtp_step", names, [np.array([[-1.0, -1.3, -3.0]]), np.array([[5, 7, 9]])], cpu)  # ids equal, lp off
    assert [(r["tie_swaps"], r["id_mismatches"]) for r in log.rows] == [(2, 0), (0, 2), (0, 0)]
    assert [log.ok(r) for r in log.rows] == [True, False, False]


def test_codes_session_feeds_codes_and_returns_the_same_grid():
    from hyco.runtime_check.qnn_backend import CodesSession, float_view

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
def smoked(tiny_export, tmp_path_factory):
    from hyco.export.smoke import smoke

    bundle, _ = tiny_export
    return smoke(bundle=bundle, verifier=None, prompts=2, rounds=1, tolerance=0.15, isolate=True,
                 out=tmp_path_factory.mktemp("smoke"))


@pytest.mark.slow
def test_smoke_runs_every_graph_on_the_simulator_and_commits_what_cpu_commits(smoked):
    report = smoked
    assert {"tree", "prefill", "mtp_step"} <= set(report["by_graph"])
    htp = report["timings"]["htp (simulation, not phone speed)"]
    assert all(htp[g]["passes"] > 0 and htp[g]["load_s"] > 0 for g in ("tree", "prefill", "mtp_step"))
    assert report["isolate"] and "own worker process" in report["isolation_note"]
    assert len(report["rounds"]) == 2 and all(r["same_commit"] for r in report["rounds"])
    mtp = report["by_graph"]["mtp_step"]  # the MTP step graph agrees pass by pass
    assert mtp["id_mismatches"] == 0 and mtp["max_logprob_diff"] <= report["tolerance"]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="calibrate's prefill.qdq.onnx computes other numbers on the HTP simulator than "
                   "on CPU (measured: max |dlogprob| 2.6, top-1 equal on 8/32 rows; tree 0.18 > 0.15 on 1 row): issue 11")
def test_smoke_agrees_with_cpu_on_every_round_of_two_prompts(smoked):
    assert smoked["passed"], smoked["headline"]
    assert all(r["passes_agree"] and r["same_commit"] for r in smoked["rounds"])
