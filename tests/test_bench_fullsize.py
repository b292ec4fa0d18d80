"""bench/bench_fullsize.py's stage plumbing on the tiny family (undistilled): every stage in its own
process, measured from a small parent, and the report and summary carry each stage's figures
and the Table 3 / per-pass sizes. The full-size figures themselves come from running the bench
(README, full-size section); this only proves the machinery that produces them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_fullsize.py"
STAGES = ["vocab", "answers", "convert", "qat", "calibrate", "export"]
# CI-sized on top of the bench's own plumbing overrides (as tests/conftest.py's tiny_calibrated)
SMALL = ["vocab.count_conversations=300", "vocab.heldout_conversations=40", "vocab.reserved_train=4",
         "vocab.reserved_eval=4", "qat.steps=2", "qat.calibration_sequences=1", "calibrate.prompts=2",
         "calibrate.eval_prompts=1", "calibrate.max_new_tokens=16"]


def bench(out: Path, family: Path, *extra: str) -> subprocess.CompletedProcess:
    sets = [x for s in SMALL for x in ("--set", s)]
    return subprocess.run([sys.executable, str(BENCH), "--out", str(out), "--family", str(family),
                           "--recipe", str(ROOT / "recipes" / "tiny.yaml"), *sets, *extra],
                          cwd=ROOT, capture_output=True, text=True)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_bench_runs_every_stage_and_reports_its_figures(tiny_family, tmp_path):
    family = tiny_family["slm"].parent
    done = bench(tmp_path, family)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == STAGES
    run = tmp_path / "run"
    for s in report["stages"]:
        assert s["status"] == "ok" and s["rc"] == 0, s
        # figures measured, not copied: the bytes are the stage folder's, the peak is at least what
        # the stage's own process recorded (wait4's figure also covers its worker processes)
        assert s["bytes"] == folder_bytes(run / s["stage"]) > 0, s
        manifest = json.loads((run / s["stage"] / "manifest.json").read_text())
        # the larger of wait4's figure (largest single process) and the stage's own (workers added)
        assert s["peak_rss_mb"] == max(s["peak_rss_mb_wait4"], manifest["peak_rss_mb"]), (s, manifest["peak_rss_mb"])
        # (only stages with worker processes count more than their largest single process: export's
        # compiles, calibrate's side-by-side graph preparation, the workers' peaks summed)
        assert s["peak_rss_mb_wait4"] >= manifest["peak_rss_mb"] - 1 or s["stage"] in ("export", "calibrate"), s
        assert 100 < s["peak_rss_mb"] < 8192 and 0 < s["wall_s"] >= manifest["wall_s"], (s, manifest["wall_s"])
        assert s["cpu_s"] > 0  # the stage process's CPU seconds, its waited-for workers included
        assert (tmp_path / "logs" / f"{s['stage']}.log").is_file()
        if s["stage"] in ("qat", "calibrate"):  # the stage's own phase log, from its report, in the child's log
            phases = s["phases"]
            assert len(phases) >= 6 and phases == json.loads((run / s["stage"] / "report.json").read_text())["phases"]
            assert sum(v["wall_s"] for v in phases.values()) <= s["wall_s"]
            peaks = [v["peak_rss_mb"] for v in phases.values()]
            assert peaks == sorted(peaks) and peaks[-1] <= manifest["peak_rss_mb"] + 1, peaks
            log = (tmp_path / "logs" / f"{s['stage']}.log").read_text()
            assert all(f"{s['stage']}: {name} " in log for name in phases), log[-2000:]
        if s["phases"]:  # where the wall went: before the first phase, in them, after the last, between
            a = s["phase_accounting"]
            assert 0 < a["start_up_s"] < s["wall_s"] and 0 <= a["wind_up_s"] < s["wall_s"], a
            assert a["phases_s"] == pytest.approx(sum(v["wall_s"] for v in s["phases"].values()), abs=0.01)
            # the phases lie inside the process's life, in order; what no phase names is what is left,
            # and every stage names all but 5% of its wall (issue 54: a table that says where time goes)
            assert a["between_phases_s"] >= -0.2 and 0 < a["named_share"] <= 1, a
            assert abs(a["between_phases_s"]) <= 0.05 * s["wall_s"], (s["stage"], a, s["phases"])
    # the VM's speed beside the figures: four positive timings before the first stage and after the last
    probes = [report["machine"]["speed_start"], report["machine"]["speed_end"]]
    assert all(set(p) == {"python_s", "sha256_s", "copy_s", "gather_s"} and min(p.values()) > 0 for p in probes), probes
    assert set(report["machine"]["cpu"]) == {"model", "caches", "boot_id"}, report["machine"]
    # a stage's wait4 peak includes the bench process's own (vfork + exec keep the larger): the
    # bench stays far below every stage's figure, so none of them is the bench's (the memory probe
    # runs in a child of its own: in the bench process it read vocab's peak as 2,275 MiB)
    parent = report["machine"]["bench_process_peak_rss_mb"]
    assert 0 < parent < min(s["peak_rss_mb_wait4"] for s in report["stages"]) / 2, (parent, report["stages"])
    t = report["totals"]
    assert t["all_passed"] and t["wall_s"] == pytest.approx(sum(s["wall_s"] for s in report["stages"]), abs=0.2)
    assert t["peak_rss_mb"] == max(s["peak_rss_mb"] for s in report["stages"])
    # the recipe the stages ran: the family's folders and the bench's plumbing overrides
    sets = report["overrides"]
    assert f"models.slm={family / 'slm'}" in sets and "convert.parity=false" in sets and "qat.steps=2" in sets

    sizes = report["sizes"]
    assert all(r["bytes"] and r["bytes"] > 0 for r in sizes["table3"]), sizes["table3"]
    binaries = {b["graph"]: b for b in sizes["context_binaries"]}
    assert set(binaries) == {"tree", "mtp_step"}  # export.slm_graphs tree-only: one copy of the SLM's weights
    for b in binaries.values():
        assert b["binary_bytes"] == (run / "export" / "bundle" / b["binary"]).stat().st_size > 0
    passes = {r["graph"]: r for r in sizes["weight_bytes_per_pass"]}
    assert set(passes) == {"tree", "prefill", "mtp_step"}
    for r in passes.values():
        assert r["floor_ms_at_60GBps"] == round(r["weight_bytes"] / 60e9 * 1e3, 2) and r["weight_bytes"] > 0
    assert {g["goal"] for g in report["goals"]} >= {"whole dry run <= 10 min wall", "convert <= 3 GiB peak RSS"}
    assert all(g["met"] in (True, False) for g in report["goals"])

    md = (tmp_path / "bench_summary.md").read_text()
    for s in report["stages"]:
        if s["phases"]:  # the phase table's rows, start-up to the unnamed rest, add up to the stage's wall
            table = md.split(f"{s['stage']} by phase")[1].split("\n\n")[1].splitlines()[2:]
            assert len(table) == len(s["phases"]) + 3, table
            walls = [float(line.split(" | ")[1]) for line in table]
            assert sum(walls) == pytest.approx(s["wall_s"], abs=0.1), (walls, s["wall_s"])
    for s in report["stages"]:
        row = next(line for line in md.splitlines() if line.startswith(f"| {s['stage']} | "))
        # markdown_table writes floats as .4g
        assert row.split(" | ")[1:5] == ["ok", f"{s['wall_s']:.4g}", f"{s['cpu_s']:.4g}", str(round(s["peak_rss_mb"]))], row
    assert "## Sizes vs the paper's Table 3" in md and "Context binaries:" in md and "Weight bytes per pass" in md
    assert md.splitlines()[2].startswith(f"**{report['totals']['wall_s']} s, peak ") and "whole dry run <= 10 min" in md.splitlines()[2]


def test_bench_stops_at_a_failing_stage_and_says_where(tiny_family, tmp_path):
    """A stage that fails ends the run with exit 1; the report names the stage and its log's tail."""
    family = tiny_family["slm"].parent
    done = bench(tmp_path, family, "--stages", "convert,qat", "--set", f"models.slm={tmp_path / 'no-such-slm'}")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "bench_report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["convert"]  # qat never started
    assert report["stages"][0]["status"] == "FAILED" and not report["totals"]["all_passed"]
    assert report["failure"]["stage"] == "convert" and "no-such-slm" in report["failure"]["log_tail"]
    assert "**Stopped at convert**" in (tmp_path / "bench_summary.md").read_text()
    assert "stopped at convert, no goal measured" in (tmp_path / "bench_summary.md").read_text().splitlines()[2]
    # a run that stopped holds no goal: "not measured", never "NOT met"
    assert report["goals"] and all(g["met"] is None for g in report["goals"]), report["goals"]
    assert "NOT met" not in done.stdout and "not measured (the run did not finish)" in done.stdout
