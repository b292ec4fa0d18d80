"""The verdict that opens run_summary.md and every stage's summary.md: one line per proof with its
figure and its threshold, FAILED above everything else when a proof failed, on a passing run (the
fast tier's ladder) and on runs whose proof failed (stopped, or kept with --allow-parity-failure)."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from ladder import STAGES

from hyco.base.errors import ProofFailed
from hyco.pipeline import verdict
from hyco.pipeline.artifacts import StageEnd, finish_stage

LINE = re.compile(r"^- \*\*(PASS|FAIL|OFF|INFO|WARN)\*\* ")


def test_a_failed_line_makes_the_verdict_failed_whatever_else_passed():
    lines = [verdict.Line("a", verdict.PASS, "1/1"), verdict.Line("b", verdict.FAIL, "0.2", "<= 0.1"),
             verdict.Line("c", verdict.OFF, "off")]
    assert verdict.overall(lines).startswith("FAILED")
    assert verdict.overall(lines[:1] + lines[2:]) == "PASSED (1 proof held, 1 off)"
    assert verdict.overall([verdict.Line("x", verdict.INFO, "3")]).startswith("figures only")
    md = verdict.with_verdict("# Title\n\nbody\n", lines)
    head = md.splitlines()
    assert head[0] == "# Title" and head[2].startswith("**Verdict: FAILED")
    assert "- **FAIL** b: 0.2 (threshold: <= 0.1)" in md and md.rstrip().endswith("body")


def test_a_failed_proof_without_a_line_of_its_own_still_fails_the_summary(tmp_path):
    end = StageEnd({"x": 1}, lambda r: "# stage\n\ndetail\n", {}, proof_failed="parity: 3 logits off",
                   verdict=[verdict.Line("bit-exact", verdict.PASS, "4/4")])
    finish_stage("demo", tmp_path, end, allow_parity_failure=True)
    text = (tmp_path / "summary.md").read_text()
    assert text.splitlines()[2].startswith("**Verdict: FAILED")
    assert "- **FAIL** proof: parity: 3 logits off" in text
    assert json.loads((tmp_path / "report.json").read_text())["verdict"][-1]["status"] == "FAIL"
    (tmp_path / "again").mkdir()
    with pytest.raises(ProofFailed):
        finish_stage("demo", tmp_path / "again", end, allow_parity_failure=False)


def test_every_summary_of_the_ladder_opens_with_its_verdict(ladder):
    for stage in STAGES:
        text = (ladder / stage / "summary.md").read_text().splitlines()
        assert text[0].startswith("# ") and text[2].startswith("**Verdict: "), (stage, text[:4])
        lines = [x for x in text[3:12] if LINE.match(x)]
        assert lines, (stage, text[:12])
        report = json.loads((ladder / stage / "report.json").read_text())
        assert len(report["verdict"]) == len([x for x in text if LINE.match(x)]), stage


def test_the_run_summary_leads_with_every_proof_its_figure_and_threshold(ladder):
    text = (ladder / "run_summary.md").read_text()
    first = text.splitlines()
    assert first[0] == "# Run of recipe `tiny`: " + first[0].split(": ", 1)[1]
    # the ladder's 16 reference tokens are too few to measure a MAT on: check warns, and the word says so
    assert re.fullmatch(r"# Run of recipe `tiny`: PASSED \(\d+ proofs held, \d+ off\), with warnings", first[0]), first[0]
    body = "\n".join(first[:40])
    # the proofs the ladder runs (convert's parity, calibrate's floor and HTP check, smoke are off there)
    assert re.search(r"\*\*PASS\*\* convert: integer weights bit-exact: (\d+)/\1 weight tensors", body)
    assert "**OFF** convert: parity vs transformers: off (convert.parity: false)" in body
    assert re.search(r"\*\*PASS\*\* qat: W4 step graph vs its QuantSim weights: .*\(threshold: ", body)
    assert "**OFF** export: smoke through the binaries" in body
    assert re.search(r"\*\*PASS\*\* check: lossless: .*\(threshold: every token equal\)", body)
    assert re.search(r"^Pays off: (yes|no): Delta-g [-+]\d", body, re.M)
    for stage in STAGES:
        assert f" {stage}: " in body, stage


def _fake_stage(fail: bool):
    def build(recipe, run_dir, out):
        end = StageEnd({}, lambda r: "# convert\n", {}, proof_failed="parity tree: 2 logits beyond 1e-4" if fail else None,
                       verdict=[verdict.Line("integer weights bit-exact", verdict.PASS, "9/9 weight tensors", "all equal"),
                                verdict.proof("parity vs transformers", not fail, "max 3e-2", "1e-4")])
        return finish_stage("convert", out, end, recipe.allow_parity_failure)

    return SimpleNamespace(inputs=lambda r, d: {}, build=build, section=lambda r: {})


@pytest.mark.parametrize("allow", [False, True])
def test_a_run_whose_proof_failed_says_so_first(tmp_path, monkeypatch, allow):
    """Stopped at the failed proof: run_summary.md still written, FAILED at the stage with why;
    kept with --allow-parity-failure: FAILED, the failing line among the proofs."""
    from hyco.config.recipe import Recipe
    from hyco.pipeline import run as pipeline

    monkeypatch.setattr(pipeline, "load_stage", lambda name: _fake_stage(fail=True))
    recipe = Recipe(name="t", out=str(tmp_path), stages=("convert",))
    run = tmp_path / "run"
    if allow:
        pipeline.run_recipe(recipe, run, allow_parity_failure=True, log=lambda *_: None)
    else:
        with pytest.raises(ProofFailed):
            pipeline.run_recipe(recipe, run, log=lambda *_: None)
    text = (Path(run) / "run_summary.md").read_text()
    head = text.splitlines()[0]
    assert head.startswith("# Run of recipe `t`: FAILED"), head
    if allow:
        assert "- **FAIL** convert: parity vs transformers: max 3e-2 (threshold: 1e-4)" in text
    else:
        assert head.endswith("FAILED at convert") and "parity tree: 2 logits beyond 1e-4" in text
        assert json.loads((run / "run_report.json").read_text())["stopped"]["stage"] == "convert"
