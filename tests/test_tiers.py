"""The two test tiers cover the suite exactly once, with the commands CI really runs.

The tier commands are read from .ci/run (its `tier ...pytest...` lines), so a tier dropped from
CI, a marker expression that selects a test into neither tier, or one that selects it into both,
fails here. Collecting the suite three times takes ~30 s, hence the slow tier.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ci_tiers() -> list[list[str]]:
    """The pytest arguments of each `tier .venv/bin/pytest ...` line of .ci/run."""
    tiers = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["tier", ".venv/bin/pytest"]:
            tiers.append([w for w in words[2:] if w not in ("||", "failed=1")])
    return tiers


def collected(args: list[str]) -> set[str]:
    # -n 0 after the tier's own arguments: xdist's workers would collect, not this process; the
    # caller's PYTEST_ADDOPTS (-v, say) would change what --collect-only -q prints
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args, "-n", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


@pytest.mark.slow
def test_every_test_is_in_exactly_one_tier_that_ci_runs():
    tiers = ci_tiers()
    assert len(tiers) == 2, f".ci/run should run the fast and the slow tier, but runs {tiers}"
    assert tiers[0] == [], "the fast tier is the README's plain `pytest`"
    fast, slow = (collected(args) for args in tiers)
    every = collected(["-m", ""])  # no marker expression: the whole suite
    assert len(every) > 400, f"collected only {len(every)} tests"
    assert not fast & slow, f"in both tiers: {sorted(fast & slow)[:10]}"
    assert fast | slow == every, f"in neither tier: {sorted(every - fast - slow)[:10]}"
    assert any(t.endswith("::test_every_test_is_in_exactly_one_tier_that_ci_runs") for t in slow)
