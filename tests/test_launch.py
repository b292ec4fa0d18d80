"""The verifier's per-prompt work split over the processes of `accelerate launch` (hyco/base/launch.py):
answers, qat's captures and the check give the same bytes and figures as one process, and a killed
worker fails the stage cleanly.

Launched as a user would, `accelerate launch --multi_gpu --num_processes 2 hyco-convert ...`: on this
GPU-less machine its processes talk over gloo on the CPU (accelerate's `--cpu` launcher starts
several processes only through mpirun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ladder import LADDER, RECIPE, set_args

from hyco.pipeline.cli import main
from hyco.pipeline.compare import differences

pytestmark = pytest.mark.slow  # two launches of two processes each, every one loading torch and the models

BIN = Path(sys.executable).parent
ANSWERS_ARGS = ["--source", "sampled", "--max-new-tokens-train", "24", "--max-new-tokens-eval", "16"]


def launch(args: list[str], **kwargs) -> subprocess.Popen:
    command = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
               str(BIN / "hyco-convert"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_args(ladder: Path, out: Path) -> list[str]:
    fixtures = ladder / "fixtures"
    return ["answers", "--verifier", str(fixtures / "verifier"), "--tokenizer", str(fixtures / "tokenizer"),
            "--vocab", str(ladder / "vocab"), "--out", str(out), *ANSWERS_ARGS]


def test_answers_split_over_two_processes_are_one_process_bytes(ladder, tmp_path):
    assert main(answers_args(ladder, tmp_path / "one")) == 0
    proc = launch(answers_args(ladder, tmp_path / "two"))
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert output.count("sampled answers (built") == 1, output[-3000:]  # the main process alone reports
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["processes"] == 2
    for name in ("answers.jsonl", "answers.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    records = [json.loads(line) for line in (tmp_path / "one" / "answers.jsonl").read_text().splitlines()]
    assert len(records) >= 4 and len({tuple(r["answer_ids"]) for r in records}) == len(records)  # not one text
    assert differences(tmp_path / "one", tmp_path / "two") == []


SPEC_BENCH = Path(__file__).resolve().parent / "data" / "spec-bench" / "question.jsonl"


@pytest.mark.parametrize("workload", [[], ["check.workload.schema=spec-bench", f"check.workload.source={SPEC_BENCH}"]],
                         ids=["chat", "spec-bench"])
def test_check_split_over_two_processes_has_one_process_figures(ladder, tmp_path, workload):
    """Chat prompts, and a file workload whose questions (both turns of one together) are answered
    by the process whose share they are."""
    overrides = [*LADDER, "check.prompts=3", "check.max_new_tokens=10", "check.configs=[hyco,hyco-exact]", *workload]
    args = ["check", "--recipe", str(RECIPE), "--run-dir", str(ladder), *set_args(overrides)]  # reads it only
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    proc = launch([*args, "--out", str(tmp_path / "two")])
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert output.count("MAT per configuration") == 1, output[-3000:]
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["processes"] == 2
    one, two = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
    assert one["settings"]["prompts"] == (3 if not workload else 6) and one["lossless"]["hyco-exact"]["equal"]
    assert differences(tmp_path / "one", tmp_path / "two") == []


def test_qat_captures_split_over_two_processes_are_one_process_bytes(ladder, tmp_path):
    """Each process captures its share into the main process's folder; the main process trains. The
    one-process run is a fresh process with one thread, as each process of the launch has."""
    fixtures = ladder / "fixtures"
    args = ["qat", "--verifier", str(fixtures / "verifier"), "--assistant", str(fixtures / "assistant"),
            "--tokenizer", str(fixtures / "tokenizer"), "--vocab", str(ladder / "vocab"),
            "--answers", str(ladder / "answers"), "--steps", "2", "--calibration-sequences", "1", "--window", "128"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    one = subprocess.run([sys.executable, "-m", "hyco.pipeline.cli", *args, "--out", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    proc = launch([*args, "--out", str(tmp_path / "two")])
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert output.count("MTP head top-1 agreement") == 1, output[-3000:]
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["processes"] == 2
    shards = sorted((tmp_path / "one" / "captures").glob("capture_*.safetensors"))
    assert len(shards) >= 4
    assert differences(tmp_path / "one", tmp_path / "two") == []


def _rank_one(launcher: subprocess.Popen) -> int | None:
    """The pid of the launch's process of rank 1, once it runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK=1" in environ and _descends_from(parent, launcher.pid):
            return int(entry.name)
    return None


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def test_a_killed_worker_fails_the_stage_with_one_line_and_nothing_in_place(ladder, tmp_path):
    out = tmp_path / "out" / "answers"
    args = answers_args(ladder, out)
    args[args.index("--max-new-tokens-train") + 1] = "2000"  # long enough to be killed mid-answer
    proc = launch(args)
    deadline, worker = time.monotonic() + 120, None
    while worker is None and time.monotonic() < deadline and proc.poll() is None:
        worker = _rank_one(proc)
        time.sleep(0.2)
    assert worker is not None, "the launch never started its second process"
    time.sleep(12)  # past the model's load, into the answers
    assert proc.poll() is None, "the launch ended before the worker was killed"
    os.kill(worker, signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    ours = [line for line in output.splitlines() if line.startswith("hyco-convert answers:")]
    assert len(ours) == 1, output[-3000:]
    assert not (tmp_path / "out").exists(), list((tmp_path / "out").iterdir())  # not even the folder made for it
