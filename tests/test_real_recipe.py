"""The one recipe for the real models (`recipes/hyco-gemma-4.yaml`), unchanged but for `--set` of
folders and sizes, runs the whole system end to end on the tiny family in Google's published
layout: keep set, answers, convert, qat, calibrate (with the HTP check), export (with smoke) and
check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RECIPE = Path(__file__).parents[1] / "recipes" / "hyco-gemma-4.yaml"


@pytest.mark.slow
def test_the_real_recipe_runs_the_whole_system_on_the_published_tiny_family(tiny_family, tmp_path):
    from ladder import REAL_RECIPE_SIZES, set_args

    from hyco.pipeline.cli import main

    out = tmp_path / "run"
    models = [f"models.{k}={v}" for k, v in tiny_family.items()]
    questions = tmp_path / "question.jsonl"  # the recipe's SB-480 workload, two questions in its format
    questions.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]})
                         + "\n" + json.dumps({"question_id": 95, "category": "qa", "turns": ["Why is the sky blue?"]}) + "\n")
    assert main(["run", str(RECIPE), "--out", str(out),
                 *set_args([*models, *REAL_RECIPE_SIZES, f"check.workload.source={questions}"])]) == 0
    report = json.loads((out / "run_report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["vocab", "answers", "convert", "qat", "calibrate", "export", "check"]
    assert all(s["status"] == "built" for s in report["stages"])
    assert json.loads((out / "export" / "manifest.json").read_text())["summary"]["smoke_passed"] is True
    check = json.loads((out / "check" / "report.json").read_text())
    assert check["lossless"]["hyco-exact"]["equal"]
    assert check["settings"]["workload"]["schema"] == "spec-bench" and check["settings"]["workload"]["prompts"] == 3
    calibrate = json.loads((out / "calibrate" / "report.json").read_text())
    assert calibrate["proof_failed"] is None and calibrate["answers"] == str(out / "answers")
