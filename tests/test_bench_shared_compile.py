"""bench/bench_shared_compile.py's machinery: the phases it reads from onnxruntime's verbose log, and
the whole bench on the tiny calibrated graphs (two separate compiles and one shared, each in a child).
The E2B-shaped figures come from running the bench on bench_fullsize's calibrate folder (README)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_shared_compile  # noqa: E402


def _line(second: float, text: str, colour: bool = False) -> str:
    stamp = f"2026-12-03 10:00:{second:09.6f}"
    return f"{chr(27) + '[0;93m' if colour else ''}{stamp} [V:onnxruntime:, x.cc:1 F] {text}\n"


def test_session_phases_follow_the_eps_markers_per_session(tmp_path):
    log = tmp_path / "shared.log"
    log.write_text("".join([
        _line(0.0, "Creating QNN EP"), " a tensor dump line without a stamp\n",
        _line(2.0, "ComposeGraph Graph name: G_1"), _line(2.5, "something between", colour=True),
        _line(5.0, "GetGraphInfoFromModel completed."), _line(5.1, "FinalizeGraphs started."),
        _line(15.1, "FinalizeGraphs completed."),  # the first shared session writes no binary
        _line(16.0, "Creating QNN EP"), _line(17.0, "ComposeGraph Graph name: G_2"),
        _line(18.0, "GetGraphInfoFromModel completed."), _line(28.0, "FinalizeGraphs completed."),
        _line(30.5, "prepare_only mode: context saved. Releasing QNN device resources."),
        _line(31.0, "prepare_only mode: context saved."),  # past the last marker: ignored
    ]))
    assert bench_shared_compile.session_phases(log) == [
        {"partition": 2.0, "compose": 3.0, "finalize": 10.1},
        {"partition": 1.0, "compose": 1.0, "finalize": 10.0, "binary": 2.5}]


@pytest.mark.slow  # three fresh interpreters, each compiling on the HTP prepare path
def test_the_bench_compiles_both_ways_and_reads_the_phases(tiny_export_distilled, tmp_path):
    run, _ = tiny_export_distilled  # calibrated for separate SLM graphs: tree and prefill
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_shared_compile.py"),
                           "--calibrate", str(run / "calibrate"), "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "bench_report.json").read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["tree", "prefill", "shared"]
    assert [len(rows[m]["sessions"]) for m in rows] == [1, 1, 2]
    for row in rows.values():
        for session in row["sessions"]:
            assert set(session) >= {"partition", "compose", "finalize"} and min(session.values()) >= 0
        assert row["peak_rss_mb"] > 0
    assert set(rows["tree"]["sessions"][0]) == {"partition", "compose", "finalize", "binary"}
    shared = {c["binary"] for c in rows["shared"]["compiled"]}
    assert len(shared) == 1 and [c["context"] for c in rows["shared"]["compiled"]] == ["tree_ctx.onnx", "prefill_ctx.onnx"]
    separate = sum(rows[m]["compiled"][0]["binary_bytes"] for m in ("tree", "prefill"))
    assert rows["shared"]["compiled"][0]["binary_bytes"] < separate
    assert report["rule"]["separate_s"] == round(rows["tree"]["wall_s"] + rows["prefill"]["wall_s"], 1)
    assert "| shared |" in (tmp_path / "bench_summary.md").read_text()
