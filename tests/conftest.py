"""Shared pytest fixtures. Helpers may append their own fixtures at the end of this file."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_family():
    """The tiny fixture family (dict: "tokenizer", "slm", "verifier", "assistant" -> Path).

    Generated once per machine into .cache/test-fixtures/<hash of the generator's sources>/,
    then reused; treat the folders as read-only (copy before editing a file).
    """
    from hyco.fixtures.cache import cached_family

    return cached_family("tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_family_distilled():
    """The tiny family after the default short CPU distillation (hyco/fixtures/distill.py): the
    drafters agree with the verifier on real text (figures in <family>/distill_report.json).

    Several minutes on first use per machine (cached like `tiny_family`); use it only where a
    test needs drafters that agree with the verifier (acceptance, end-to-end runtime checks).
    """
    from hyco.fixtures.cache import cached_family

    return cached_family("tiny", seed=0, distill=True)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """One uninterrupted `hyco-convert run` of the shrunk tiny recipe (tests/reruns.py), in a fresh
    process: (reference folder, the path it ran at). Kept for the session, so the kill -9 and the
    determinism tests compare against the same run; each reruns at the same path (artifacts name
    their inputs by path) after the reference was moved aside."""
    from reruns import fresh_run

    base = tmp_path_factory.mktemp("reruns")
    fresh_run(base / "run")
    (base / "run").rename(base / "reference")
    return base / "reference", base / "run"


@pytest.fixture(scope="session")
def tiny_calibrated(tiny_family, tmp_path_factory):
    """vocab, convert (parity off), qat (2 steps) and calibrate (no HTP check) on the undistilled tiny
    family, CI-sized: the run folder (the export and smoke tests build on it)."""
    return _calibrated_run(tiny_family, tmp_path_factory.mktemp("calibrated"),
                           ["calibrate.eval_prompts=1", "calibrate.htp_check=false"])


def _calibrated_run(family: dict, run_dir: Path, calibrate: list[str]) -> Path:
    """The tiny recipe's vocab..calibrate on `family`, CI-sized (parity off, 2 QAT steps, 2
    calibration prompts), with the `calibrate` overrides last."""
    from hyco.pipeline import run_recipe
    from hyco.recipe import load_recipe

    models = [f"models.{k}={v}" for k, v in family.items()]
    small = ["stages=[vocab,convert,qat,calibrate]", "convert.parity=false",
             "vocab.count_conversations=300", "vocab.heldout_conversations=40", "vocab.reserved_train=4",
             "vocab.reserved_eval=4", "qat.steps=2", "qat.calibration_sequences=1", "qat.max_new_tokens_train=16",
             "qat.max_new_tokens_eval=12", "calibrate.prompts=2", "calibrate.max_new_tokens=16",
             "calibrate.sqnr_passes=2", *calibrate]
    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "tiny.yaml", [*models, *small])
    run_recipe(recipe, run_dir, log=lambda *a: None)
    return run_dir


@pytest.fixture(scope="session")
def tiny_export(tiny_calibrated, tiny_family, tmp_path_factory):
    """export (soc 87, no smoke) of `tiny_calibrated`: (bundle folder, the stage's summary)."""
    from hyco.export.stage import export

    from hyco.recipe import ExportConfig

    out = tmp_path_factory.mktemp("export") / "export"
    summary = export(calibrate=tiny_calibrated / "calibrate", convert=tiny_calibrated / "convert",
                     qat=tiny_calibrated / "qat", vocab=tiny_calibrated / "vocab", out=out,
                     tokenizer=tiny_family["tokenizer"], verifier=tiny_family["verifier"],
                     config=ExportConfig(smoke_prompts=0))
    return out / "bundle", summary


@pytest.fixture(scope="session")
def tiny_export_distilled(tiny_family_distilled, tmp_path_factory):
    """vocab, convert (parity off), qat (2 steps), calibrate (WITH the HTP check: acceptance and
    simulator vs CPU on 1 pass per graph) and export (soc 87, no smoke) on the DISTILLED tiny
    family, CI-sized: (run folder, bundle folder). The smoke and simulator-agreement tests use it:
    its drafters are peaked like trained ones, where the undistilled family's near-flat rows make
    near-ties of most top-k entries."""
    from hyco.export.stage import export

    from hyco.recipe import ExportConfig

    run_dir = _calibrated_run(tiny_family_distilled, tmp_path_factory.mktemp("distilled"),
                              ["calibrate.eval_prompts=2", "calibrate.htp_check=true", "calibrate.simulator_passes=1"])
    out = run_dir / "export"
    export(calibrate=run_dir / "calibrate", convert=run_dir / "convert", qat=run_dir / "qat", vocab=run_dir / "vocab",
           out=out, tokenizer=tiny_family_distilled["tokenizer"], verifier=tiny_family_distilled["verifier"],
           config=ExportConfig(smoke_prompts=0))
    return run_dir, out / "bundle"
