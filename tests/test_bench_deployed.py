"""bench/bench_deployed.py: the projection's arithmetic by hand, and the bench on the ladder's
calibrate folder (the figures at E2B shapes come from running it: README, "Check on what ships")."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_deployed import CAP, PROMPTS, project  # noqa: E402


def test_the_projection_is_rounds_times_passes_plus_prefill():
    ms = {"tree": 10.0, "prefill": 20.0, "mtp_step": 1.0}
    table = project(ms, prefill_rows=16, max_prompt=1024, prompt_tokens=300)
    rounds = 560 * 1024 / 4.71  # hyco: Table 2's MAT
    assert (PROMPTS, CAP) == (560, 1024) and table["hyco"]["rounds"] == round(rounds)
    assert table["hyco"]["per_round_ms"] == 10.0 + 4 * 1.0  # one tree pass, K = 4 MTP steps
    prefill = 560 * math.ceil(300 / 16) * 20.0
    assert table["hyco"]["hours"] == pytest.approx((rounds * 14.0 + prefill) / 3.6e6, abs=0.006)
    assert table["specedge-pd"]["per_round_ms"] == 60.0  # 4 passes + 2 proactive
    assert table["slm-alone"]["rounds"] == 560 * 1024 and table["cloud-mtp"]["hours"] == 0.0  # nothing on the phone
    tree_only = project({"tree": 10.0, "mtp_step": 1.0}, prefill_rows=33, max_prompt=1024, prompt_tokens=300)
    prefill = 560 * math.ceil(300 / 33) * 10.0  # the tree graph prefills, in passes of its 33 rows
    assert tree_only["hyco"]["hours"] == pytest.approx((rounds * 14.0 + prefill) / 3.6e6, abs=0.006)


def test_the_bench_times_the_graphs_check_runs(tiny_calibrated, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_deployed.py"), "--calibrate",
                           str(tiny_calibrated / "calibrate"), "--passes", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    executors = ("onnxruntime", "onnxruntime+opt", "torch:cpu")
    # the ladder calibrates tree-only (export.slm_graphs): no prefill graph to time; the tree's rows prefill
    assert set(report["timings"]) == {f"{g}@{e}" for g in ("tree", "mtp_step") for e in executors}
    assert report["prefill_rows"] == 33
    assert all(t["median_ms"] > 0 and t["passes"] == 2 for t in report["timings"].values())
    assert all(report["projection"][e]["hyco"]["hours"] > 0 for e in executors)
    ops = {g: report["timings"][f"{g}@torch:cpu"]["aten_ops"] for g in ("tree", "mtp_step")}
    assert ops["tree"] > ops["mtp_step"] > 100 and "ATen ops a pass" in done.stdout  # a GPU pass's kernel launches
    assert "drafter-pass hours on this machine" in done.stdout
