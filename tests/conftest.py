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

# No hub is reachable from the tests, as from where the tool runs. hyco/data/chat.py sets these two
# before it imports `datasets`, but huggingface_hub reads them once, at its own import: in a test
# session transformers has imported it long before, and an unknown dataset then retried the
# network for 23 s (tests/test_preflight.py) before it was refused. Set before anything imports it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# The fast tier runs two pytest-xdist workers on this machine's cores: each gets its share of them
# for torch's intra-op pool, and so do the processes it starts (OMP_NUM_THREADS: the ladder, the
# CLI runs). Two workers with a pool of one thread per core each spin-wait against each other on
# the tiny models' many small ops: a bridged decode that takes 3 s alone took 16-100 s beside the
# other worker, qat on the tiny masked head 54 s instead of 6.
# A caller's own OMP_NUM_THREADS is left as it is; the slow tier (one process) keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    if "torch" in sys.modules:  # pyproject's filterwarnings (torch.jit.TracerWarning) imported it already
        sys.modules["torch"].set_num_threads(_share)


def pytest_configure(config):
    # xdist's --dist loadfile hands out the files in the order pytest_collection_modifyitems below
    # leaves them (its default is the files with the most tests first, whatever they read)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist: the files none of whose tests read the ladder first, then those that do,
    each group with the files with the most tests first (xdist's own order). The ladder is built in
    the background from the session's start (`_ladder_in_the_background`): by the time a worker
    reaches a file that reads it, it is there, where xdist's order sent both workers to one early."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    files: dict[str, list] = {}
    for i, item in enumerate(items):
        f = files.setdefault(item.nodeid.split("::")[0], [False, 0, i])  # reads the ladder, -tests, first index
        f[0] |= "ladder" in item.fixturenames
        f[1] -= 1
    items.sort(key=lambda item: files[item.nodeid.split("::")[0]])  # stable: a file's own order stays


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


def _ladder_paths(tmp_path_factory) -> tuple[Path, Path]:
    """(the session's folder, which holds ladder.lock; the ladder's run folder)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    return root, root / "ladder" / "tiny"


def _ladder_process(out: Path) -> subprocess.Popen:
    """The ladder's run, as a user runs it, in its own process: tests/test_console.py reads what it printed."""
    from ladder import run_args

    return subprocess.Popen([sys.executable, "-m", "hyco.pipeline.cli", *run_args(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _ladder_printed(root: Path, stdout: str, stderr: str) -> None:
    (root / "ladder").mkdir(parents=True, exist_ok=True)
    (root / "ladder" / "stdout.txt").write_text(stdout)
    (root / "ladder" / "stderr.txt").write_text(stderr)


@pytest.fixture(scope="session", autouse=True)
def _ladder_in_the_background(request, tmp_path_factory):
    """Under pytest-xdist, where a test of the session reads the ladder: the first worker to start
    starts its build in the background, under the ladder's lock, and both workers run other files
    meanwhile (each used to stand idle through the whole build at its first ladder test). The
    `ladder` fixture waits for the lock as before. Not in the slow tier (one process): its memory
    and time figures want the machine to themselves."""
    import fcntl
    import threading

    if not os.environ.get("PYTEST_XDIST_WORKER") or not any("ladder" in item.fixturenames
                                                            for item in request.session.items):
        yield
        return
    root, out = _ladder_paths(tmp_path_factory)
    lock = open(root / "ladder.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # the other worker builds it
        lock.close()
        yield
        return
    if (out / "run_report.json").is_file():  # built already
        lock.close()
        yield
        return
    process = _ladder_process(out)

    def finish():
        try:
            _ladder_printed(root, *process.communicate())
        finally:
            lock.close()  # the lock's release: the `ladder` fixture reads the run, or rebuilds a failed one

    thread = threading.Thread(target=finish, daemon=True)
    thread.start()
    yield
    if process.poll() is None:  # the session ended before a test needed it
        process.kill()
    thread.join()


@pytest.fixture(scope="session")
def ladder(tmp_path_factory):
    """The fast tier's one pipeline (tests/ladder.py): `hyco-convert run` of the CI-sized tiny
    recipe, every stage from fixtures to check, once per session (one build shared by pytest-xdist's
    workers: the first builds it under a lock, in the background from the session's start, see
    `_ladder_in_the_background`). The run folder; read-only."""
    import fcntl

    root, out = _ladder_paths(tmp_path_factory)
    with open(root / "ladder.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "run_report.json").is_file():
            process = _ladder_process(out)
            stdout, stderr = process.communicate()
            _ladder_printed(root, stdout, stderr)
            assert process.returncode == 0, stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def tiny_calibrated(ladder):
    """The ladder's run folder: vocab, convert (parity off), qat (2 steps) and calibrate (no HTP
    check) on the undistilled tiny family; the export and smoke tests build on it."""
    return ladder


def _calibrated_run(family: dict, run_dir: Path, calibrate: list[str]) -> Path:
    """The ladder's vocab..calibrate on `family`, with the `calibrate` overrides last."""
    from ladder import LADDER, RECIPE

    from hyco.config.recipe import load_recipe
    from hyco.pipeline.run import run_recipe

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
    simulator vs CPU on 1 pass per graph) and export (soc 87, no smoke, tree and prefill graphs
    separate; the main job ships and smokes the tree-only bundle) on the DISTILLED tiny
    family, CI-sized: (run folder, bundle folder). The smoke and simulator-agreement tests use it:
    its drafters are peaked like trained ones, where the undistilled family's near-flat rows make
    near-ties of most top-k entries."""
    from hyco.export.stage import ExportInputs, export

    from hyco.config.recipe import ExportConfig

    run_dir = _calibrated_run(tiny_family_distilled, tmp_path_factory.mktemp("distilled"),
                              ["calibrate.eval_prompts=2", "calibrate.htp_check=true", "calibrate.simulator_passes=1",
                               "export.slm_graphs=separate"])
    out = run_dir / "export"
    inputs = ExportInputs(calibrate=run_dir / "calibrate", convert=run_dir / "convert", qat=run_dir / "qat",
                          vocab=run_dir / "vocab", tokenizer=tiny_family_distilled["tokenizer"],
                          verifier=tiny_family_distilled["verifier"])
    export(inputs, out, ExportConfig(smoke_prompts=0, slm_graphs="separate"))  # the prefill graph's faults stay testable
    return run_dir, out / "bundle"
