"""Interruption and contention: SIGINT / SIGTERM inside convert, calibrate and export; two
processes on one output folder; an output folder on a read-only or full filesystem; a user's own
files in an output folder.

Each case must end with one line on stderr and an exit status (130 / 143 for the signals, 2 for
the folder's problems), nothing half-written (no temp folder, no scratch, no lock left behind),
the user's files untouched, and the next run completing as an uninterrupted one would.

The filesystem cases mount a small tmpfs in a mount namespace of their own (`unshare -m`), so
nothing is mounted outside the test's child processes; where namespaces or mounts are not
permitted the test skips and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ladder import LADDER, RECIPE, set_args
from reruns import run_command, run_env

from hyco.pipeline.compare import differences

PYTHON = sys.executable


def _one_line(stderr: str, prefix: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]


def _leftovers(folder: Path) -> list[str]:
    """Temp, scratch, old and lock entries anywhere under `folder`."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*")
                  if any(t in p.name for t in (".tmp-", ".scratch-", ".old-", ".lock")))


def _group_gone(pgid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _interrupt(out: Path, stage: str, delay: float, signum: int, env: dict) -> subprocess.CompletedProcess:
    """Start the run; once `stage` starts, wait `delay` s and send `signum` to the run's process
    alone (not its group: the run itself must stop the workers it started)."""
    proc = subprocess.Popen(run_command(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if f"[{stage}] -> " in line:
                time.sleep(delay)
                proc.send_signal(signum)
                break
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert _group_gone(proc.pid), f"processes of the interrupted run outlived it ({stage}, {signum})"
    assert f"[{stage}] -> " in seen[-1], f"the run never said it started {stage}; its output: {''.join(seen)[-2000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


RETRIES = 4  # signals to one stage that may land after it finished, before the test gives up


def _interrupt_inside(out: Path, stages: list[str], stage: str, delay: float, signum: int,
                      env: dict) -> subprocess.CompletedProcess:
    """`_interrupt`, again sooner while the signal lands after `stage` finished: a stage can run
    faster than in the reference run (a warm compiler cache, a quieter machine). What such a try
    built from `stage` on is taken away first."""
    for _ in range(RETRIES - 1):
        done = _interrupt(out, stage, delay, signum, env)
        manifest = out / stage / "manifest.json"
        if not manifest.is_file():
            return done
        ran = json.loads(manifest.read_text())["wall_s"]
        # the signal lands at the next Python bytecode, after a C call that may be seconds long
        assert ran < delay + 5.0, f"{stage} ran {ran} s, on past a signal sent {delay:.1f} s in: it was not acted on"
        for later in stages[stages.index(stage):]:
            shutil.rmtree(out / later, ignore_errors=True)
        delay /= 4
    return _interrupt(out, stage, delay, signum, env)  # the caller's checks fail if it got through again


@pytest.mark.slow
def test_sigint_and_sigterm_inside_convert_calibrate_export_then_rerun_equals_an_uninterrupted_run(reference_run):
    reference, out = reference_run
    shutil.rmtree(out, ignore_errors=True)
    env = run_env()
    wall = {s: json.loads((reference / s / "manifest.json").read_text())["wall_s"]
            for s in ("convert", "calibrate", "export")}
    stages = [row["stage"] for row in json.loads((reference / "run_report.json").read_text())["stages"]]
    seen = []
    try:
        for stage in ("convert", "calibrate", "export"):
            for signum in (signal.SIGINT, signal.SIGTERM):
                done = _interrupt_inside(out, stages, stage, 0.4 * wall[stage], signum, env)
                name = signal.Signals(signum).name
                assert done.returncode == 128 + signum, (stage, name, done.returncode, done.stderr[-2000:])
                line = _one_line(done.stderr, "hyco-convert run:")
                assert line == f"hyco-convert run: interrupted ({name}); no partial artifact was kept", line
                assert not (out / stage).exists(), f"{stage} moved into place although interrupted ({name})"
                assert not _leftovers(out), (stage, name, _leftovers(out))
                seen.append((stage, name))
        done = subprocess.run(run_command(out), env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert not _leftovers(out)
        diffs = differences(reference, out)
        assert not diffs, "\n".join(diffs)
        assert len(seen) == 6
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_children_of_the_tests_start_with_sigint_at_its_default():
    """tests/conftest.py: even where the test session itself inherited SIGINT ignored."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    assert subprocess.run([PYTHON, "-c", code], capture_output=True, text=True).stdout.strip() == "True"
    # What a background job of a non-interactive shell inherits (`cmd &` in a script): SIGINT ignored.
    done = subprocess.run(["bash", "-c", f"{PYTHON} -c '{code}' & wait"], capture_output=True, text=True)
    assert done.stdout.strip() == "False"


def test_a_run_that_inherited_sigint_ignored_keeps_it_and_stops_on_sigterm(tmp_path):
    """The cause of the SIGINT that a CI run finished through with exit 0: a run started as a
    background job of a non-interactive shell inherits SIGINT ignored, and Python then installs
    no KeyboardInterrupt handler. The CLI keeps that choice (the shell made it so that a Ctrl-C
    on the terminal reaches only the foreground job, as nohup does); SIGTERM stops such a run
    cleanly, with the usual line and nothing half-written."""
    out = tmp_path / "run"
    # vocab counts 20,000 conversations (the real recipe's; ~10x the tiny one's 4 s here), so the
    # stage is still running when the signals come: a run that ended first dies on SIGTERM's
    # default action after the CLI has put it back, which would say nothing about the CLI
    args = [PYTHON, "-m", "hyco.pipeline.cli", "run", str(RECIPE), "--out", str(out),
            *set_args(["fixtures.distill=false", "stages=[fixtures,vocab]", "vocab.count_conversations=20000"])]
    proc = subprocess.Popen(args, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        for line in proc.stdout:
            if "[vocab] -> " in line:
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.5)
        assert proc.poll() is None, "the run stopped on a SIGINT it had inherited as ignored"
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "[vocab] built" not in rest, f"vocab finished before the signals (make the stage longer): {rest[-1000:]}"
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert _one_line(err, "hyco-convert run:") == "hyco-convert run: interrupted (SIGTERM); no partial artifact was kept"
    assert not (out / "vocab").exists() and not _leftovers(out)


def test_a_second_process_on_a_locked_folder_refuses_with_the_lock_named(ladder, tmp_path):
    """A holder of the run folder's lock (a process of its own) makes `run` and a stage
    subcommand refuse at once; once the holder is killed with SIGKILL the kernel has released the
    lock and the folder is usable again."""
    out = tmp_path / "run"
    holder = subprocess.Popen([PYTHON, "-c", "import sys, time; from pathlib import Path; "
                               "from hyco.pipeline.artifacts import folder_lock\n"
                               "with folder_lock(Path(sys.argv[1])):\n print('locked', flush=True); time.sleep(120)",
                               str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        done = subprocess.run([PYTHON, "-m", "hyco.pipeline.cli", "run", str(RECIPE), "--out", str(out),
                               *set_args([*LADDER, "stages=[fixtures,vocab]"])],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        line = _one_line(done.stderr, "hyco-convert run:")
        assert f"{tmp_path / '.run.lock'}: {out} is being written by another hyco-convert (pid {holder.pid})" in line
        assert not out.exists()
        vocab = subprocess.run([PYTHON, "-m", "hyco.pipeline.cli", "vocab", "--tokenizer", str(ladder / "fixtures" / "tokenizer"),
                                "--size", "600", "--count-conversations", "50", "--out", str(out)],
                               capture_output=True, text=True, timeout=120)
        assert vocab.returncode == 2 and ".run.lock" in _one_line(vocab.stderr, "hyco-convert vocab:")
    finally:
        holder.kill()
        holder.wait()
    from hyco.pipeline.artifacts import folder_lock

    with folder_lock(out) as lock:  # released by the kernel when the holder died
        assert lock.read_text().strip() == str(os.getpid())
    assert not (tmp_path / ".run.lock").exists()


@pytest.mark.slow
def test_two_runs_on_one_folder_never_interleave(ladder, tmp_path):
    """Two `run`s started together on one folder: either the second refuses (one line naming the
    lock, exit 2) and the first finishes, or one runs after the other and finds every stage done;
    never two builds into the same folder."""
    out = tmp_path / "run"
    args = [PYTHON, "-m", "hyco.pipeline.cli", "run", str(RECIPE), "--out", str(out), *set_args([*LADDER, "stages=[fixtures,vocab]"])]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes in ([0, 0], [0, 2]), results
    for rc, _, err in results:
        if rc == 2:
            assert ".run.lock" in _one_line(err, "hyco-convert run:")
    built = sum("] built:" in o for _, o, _ in results for o in o.splitlines())
    assert built == 2, results  # fixtures and vocab built once, by one of them
    assert not _leftovers(out) and (out / "vocab" / "manifest.json").is_file()


def test_a_folder_holding_the_users_files_is_refused_untouched(ladder, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = subprocess.run([PYTHON, "-m", "hyco.pipeline.cli", "vocab", "--tokenizer", str(ladder / "fixtures" / "tokenizer"),
                           "--size", "600", "--count-conversations", "50", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "holds files hyco-convert did not write" in _one_line(done.stderr, "hyco-convert vocab:")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["mine", "notes.txt"]


def _in_small_filesystem(script: str, size: str = "2m") -> subprocess.CompletedProcess:
    """`script` (sh) in a mount namespace of its own with a `size` tmpfs at $FS."""
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` on this machine: cannot mount a small filesystem for the test")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"mount namespaces or tmpfs mounts are not permitted here ({probe.stderr.strip()[:200]})")
    full = f"set -u; FS=$(mktemp -d); mount -t tmpfs -o size={size} tmpfs \"$FS\" || exit 99; {script}"
    return subprocess.run(["unshare", "-m", "sh", "-c", full], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _vocab_command(ladder: Path) -> str:
    return (f"{PYTHON} -m hyco.pipeline.cli vocab --tokenizer {ladder / 'fixtures' / 'tokenizer'} --size 600 "
            "--count-conversations 50 --heldout-conversations 10")


def test_a_full_filesystem_mid_stage_one_line_exit_2_nothing_half_written(ladder):
    """The vocab stage writes ~300 KB; on a 160 KB filesystem it runs out mid-stage. The user's
    file there stays, nothing else does."""
    done = _in_small_filesystem(f"mkdir $FS/out && echo mine > $FS/notes.txt && "
                                f"{_vocab_command(ladder)} --out $FS/out/vocab; echo rc=$?; "
                                "cd $FS && find . | sort", size="160k")
    lines = done.stdout.splitlines()
    assert "rc=2" in lines, (done.stdout, done.stderr[-2000:])
    line = _one_line(done.stderr, "hyco-convert vocab:")
    assert "no space left on device" in line and "nothing was moved into place" in line, line
    assert lines[lines.index("rc=2") + 1:] == [".", "./notes.txt", "./out"], lines


def test_a_read_only_output_folder_one_line_exit_2(ladder):
    done = _in_small_filesystem(f"mkdir $FS/out && echo mine > $FS/out/notes.txt && mount -o remount,ro $FS && "
                                f"{_vocab_command(ladder)} --out $FS/out/vocab; echo rc=$?; cd $FS && find . | sort")
    lines = done.stdout.splitlines()
    assert "rc=2" in lines, (done.stdout, done.stderr[-2000:])
    line = _one_line(done.stderr, "hyco-convert vocab:")
    assert "read-only file system" in line, line
    assert lines[lines.index("rc=2") + 1:] == [".", "./out", "./out/notes.txt"], lines
