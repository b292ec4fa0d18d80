"""Shared by test_kill9.py and test_determinism.py: the tiny recipe shrunk to a CI-sized run on the
undistilled family, run as a fresh `hyco-convert` process. Two run folders are compared by
`hyco.pipeline.compare.differences` (what may differ between two runs, and nothing else)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ladder import LADDER, run_args

# The fast tier's ladder (tests/ladder.py) with parity, more calibration and the HTP check on: a
# kill can land in each of them.
SMALL = [*LADDER, "convert.parity=true", "calibrate.eval_prompts=2", "calibrate.max_new_tokens=12",
         "calibrate.max_passes=8", "calibrate.htp_check=true", "calibrate.simulator_passes=1"]


def run_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "hyco.pipeline.cli", *run_args(out, SMALL)]


def run_env() -> dict[str, str]:
    # One thread: the figures do not depend on a contended pool, and the machine is shared.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def fresh_run(out: Path, timeout: int = 900) -> None:
    done = subprocess.run(run_command(out), env=run_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
