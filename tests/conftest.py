"""Shared pytest fixtures. Helpers may append their own fixtures at the end of this file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Every child process a test starts gets SIGINT at its default. A test session started as a
# background job of a non-interactive shell (`.ci/run &` in a script) inherits SIGINT ignored,
# every child would inherit that too, and Python installs no KeyboardInterrupt handler for an
# ignored SIGINT: a test's Ctrl-C would do nothing (tests/test_interrupts.py met exactly this in
# CI). A handler here resets to SIG_DFL in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# check's server sweep is cached under HYCO_CACHE (default ~/.cache/hyco-convert), keyed by the
# models' files: a sweep an earlier session measured would let a test skip the code that measures
# it. Each session (each xdist worker) measures into its own folder; children inherit it.
if "HYCO_CACHE" not in os.environ:
    os.environ["HYCO_CACHE"] = tempfile.mkdtemp(prefix="hyco-test-cache-")


@pytest.fixture(scope="session")
def tiny_family():
    """The tiny fixture family (dict: "tokenizer", "slm", "verifier", "assistant" -> Path).

    Generated once per machine into .cache/test-fixtures/<hash of the generator's sources>/,
    then reused; treat the folders as read-only (copy before editing a file).
    """
    from hyco.fixtures.cache import cached_family

    return cached_family("tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_text_family():
    """The tiny family in the project's earlier text-only layout (preset tiny-text: Gemma4ForCausalLM,
    sharded, untied 8-bit lm_head, [vocab, 1] scales, dense verifier), kept readable beside the
    published one."""
    from hyco.fixtures.cache import cached_family

    return cached_family("tiny-text", seed=0)


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
def ladder(tmp_path_factory):
    """The fast tier's one pipeline (tests/ladder.py): `hyco-convert run` of the CI-sized tiny
    recipe, every stage from fixtures to check, once per session (one build shared by pytest-xdist's
    workers: the first builds it under a lock). The run folder; read-only."""
    import fcntl
    import os

    from ladder import run_args

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    out = root / "ladder" / "tiny"
    with open(root / "ladder.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "run_report.json").is_file():
            # As a user runs it, in its own process: tests/test_console.py reads what it printed.
            done = subprocess.run([sys.executable, "-m", "hyco.cli", *run_args(out)], capture_output=True, text=True)
            (root / "ladder" / "stdout.txt").write_text(done.stdout)
            (root / "ladder" / "stderr.txt").write_text(done.stderr)
            assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def tiny_calibrated(ladder):
    """The ladder's run folder: vocab, convert (parity off), qat (2 steps) and calibrate (no HTP
    check) on the undistilled tiny family; the export and smoke tests build on it."""
    return ladder


def _calibrated_run(family: dict, run_dir: Path, calibrate: list[str]) -> Path:
    """The ladder's vocab..calibrate on `family`, with the `calibrate` overrides last."""
    from ladder import LADDER, RECIPE

    from hyco.pipeline import run_recipe
    from hyco.recipe import load_recipe

    models = [f"models.{k}={v}" for k, v in family.items()]
    recipe = load_recipe(RECIPE, [*models, *LADDER, "stages=[vocab,answers,convert,qat,calibrate]", *calibrate])
    run_recipe(recipe, run_dir, log=lambda *a: None)
    return run_dir


@pytest.fixture(scope="session")
def tiny_export(ladder):
    """The ladder's export (soc 87, no smoke): (bundle folder, the stage's summary)."""
    import json

    manifest = json.loads((ladder / "export" / "manifest.json").read_text())
    return ladder / "export" / "bundle", manifest["summary"]


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
