"""kill -9 anywhere: `hyco-convert run` (the shrunk tiny recipe on the undistilled family, see
tests/reruns.py) is killed with SIGKILL at seeded random moments inside every stage, several
times, and restarted each time; the run that is finally let through must finish, and its folder
must equal an uninterrupted run's byte for byte (manifests aside from their timing fields).

A killed stage leaves its temp folder `.STAGE.tmp-PID` behind (or, killed between the manifest
and the rename, a finished one); the restart removes the first and adopts the second
(hyco/pipeline/artifacts.py), and skips the stages that finished before the kill.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time

import pytest
from reruns import run_command, run_env

from hyco.pipeline.compare import differences

SEED = 20261130
EXTRA_KILLS = 2  # besides one kill per stage: two more, in stages drawn at random
RETRIES = 4  # kills of one stage that may land after it finished, before the test gives up


def _run_until_killed(out, stages: list[str], stage: str, delay: float, env: dict) -> tuple[str, float]:
    """Start the run; once `stage` starts, wait `delay` seconds and SIGKILL its process group (the
    run and any helper process it started). Returns the stage it was in when killed ("finished"
    if the whole run ended first) and how long it ran."""
    proc = subprocess.Popen(run_command(out), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    current, started = None, time.monotonic()
    try:
        for line in proc.stdout:
            if line.startswith("[") and "] -> " in line:
                current = line[1:line.index("]")]
                if current == stage:
                    time.sleep(delay)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode == -signal.SIGKILL:
        # the stage that was running when the signal landed: the last one without a manifest
        current = next((s for s in stages if not (out / s / "manifest.json").is_file()), current)
        return current, time.monotonic() - started
    assert proc.returncode == 0, f"run exited {proc.returncode} before the kill"
    return "finished", time.monotonic() - started


@pytest.mark.slow
def test_kill9_inside_every_stage_then_rerun_equals_an_uninterrupted_run(reference_run, tmp_path):
    reference, out = reference_run
    shutil.rmtree(out, ignore_errors=True)
    # The killed runs' TMPDIR: a killed stage's scratch (spilled passes, quantizer temps) must sit
    # beside its stage folder, where the rerun removes it, not here (nothing removes it here).
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    # torch inductor's compile cache is a cache, kept in the real temp folder on purpose
    # (artifacts.scratch_tempdir; convert's torch makes it): given a folder of its own here
    env = {**run_env(), "TMPDIR": str(system_tmp), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    rng = random.Random(SEED)
    stages = [row["stage"] for row in json.loads((reference / "run_report.json").read_text())["stages"]]
    assert stages[-2:] == ["export", "check"], stages  # the QNN compile is killed too
    wall = {s: json.loads((reference / s / "manifest.json").read_text())["wall_s"] for s in stages}
    plan = stages + rng.sample(stages, EXTRA_KILLS)
    plan.sort(key=stages.index)  # stages finish in order: a stage's kills come before the next one
    kills = []
    try:
        for stage in plan:
            if (out / stage / "manifest.json").is_file():
                continue  # (an extra kill drawn for a stage that got through meanwhile)
            delay = rng.uniform(0.0, 0.6 * wall[stage])  # inside the stage even on a faster rerun
            for _ in range(RETRIES):
                where, ran = _run_until_killed(out, stages, stage, delay, env)
                kills.append({"stage": stage, "delay_s": round(delay, 2), "killed_in": where, "ran_s": round(ran, 1),
                              "leftovers": sorted(p.name for p in out.iterdir() if p.name.startswith("."))
                              if out.exists() else []})
                if where == stage:
                    break
                # The stage ran faster than in the reference (a warm cache, a quieter machine) and
                # finished before the kill: take it and what followed away, and kill sooner.
                for later in stages[stages.index(stage):]:
                    shutil.rmtree(out / later, ignore_errors=True)
                delay /= 4
        killed_in = {k["killed_in"] for k in kills}
        print("kills:", json.dumps(kills))
        # every stage was killed at least once while it was running
        assert killed_in >= set(stages), kills
        done = subprocess.run(run_command(out), env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "stale temps left after the rerun"
        assert not list(system_tmp.iterdir()), f"killed stages left files in TMPDIR: {sorted(system_tmp.iterdir())}"
        diffs = differences(reference, out)
        assert not diffs, "\n".join(diffs + [json.dumps(kills)])
    finally:
        shutil.rmtree(out, ignore_errors=True)
