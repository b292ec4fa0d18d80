"""The README's "What to expect" table against a real run of the embedded default: `hyco-convert
run tiny`, started from outside the checkout as a new user would, in a fresh process. Every row
of the table has a reader here and every reader a row, so the table cannot drift from what a
user's run gives."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def expectations() -> dict[str, tuple[str, str]]:
    """figure -> (expected, tolerance), from the README's table under "## What to expect"."""
    section = README.read_text().split("## What to expect", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return {figure.strip(): (expected.strip(), tolerance.strip()) for figure, expected, tolerance in rows[1:]}


def _json(run: Path, path: str):
    return json.loads((run / path).read_text())


def _percent(x: float) -> float:
    return 100 * x


def _parity(run: Path) -> float:
    return max(c["max_abs_diff"] for c in _json(run, "convert/parity.json")["checks"].values())


def _bitexact(run: Path) -> str:
    rows = [r for g in _json(run, "convert/bitexact.json")["graphs"].values() for r in g.values()]
    return f"{sum(r['ints_equal'] and r['scales_equal'] for r in rows)}/{len(rows)}"


def _top1(graph: str) -> Callable[[Path], float]:
    return lambda run: _percent(_json(run, "calibrate/report.json")["graphs"][graph]["top1_agreement"])


def _lossless(run: Path) -> str:
    lossless = _json(run, "check/report.json")["lossless"]
    return f"{sum(v['equal'] for v in lossless.values())}/{len(lossless)}"


def _cost(name: str, key: str) -> Callable[[Path], float]:
    return lambda run: _json(run, "check/report.json")["costs"]["rows"][name][key]


def _slm_copies(run: Path) -> str:
    graphs = _json(run, "export/bundle/bundle.json")["graphs"]
    binaries = {role: {p["binary"] for p in graphs.get(role, {}).get("parts", [])} for role in ("tree", "prefill")}
    return str(1 + bool(binaries["prefill"] - binaries["tree"]))  # a prefill context of its own: a second copy


READERS: dict[str, Callable[[Path], object]] = {
    "run verdict": lambda run: (run / "run_summary.md").read_text().splitlines()[0].split(": ", 1)[1].split(" ")[0],
    "convert: integer weights bit-exact": _bitexact,
    "convert: parity, max logit difference": _parity,
    "qat: W4 head top-1 agreement with the BF16 head":
        lambda run: _percent(_json(run, "qat/report.json")["agreement"]["w4_qat"]["top1_agreement"]),
    "calibrate: tree top-1 agreement with its float graph": _top1("tree.qdq.onnx"),
    "calibrate: MTP step top-1 agreement with its float graph": _top1("mtp_step.qdq.onnx"),
    "export: copies of the SLM's weights on the phone": _slm_copies,
    "export: smoke": lambda run: "PASS" if _json(run, "export/report.json")["smoke"]["passed"] else "FAIL",
    "check: exact configurations lossless": _lossless,
    "check: HyCo MAT": lambda run: _json(run, "check/report.json")["configs"]["hyco"]["mat"],
    "check: Cloud+MTP MAT": lambda run: _json(run, "check/report.json")["configs"]["cloud-mtp"]["mat"],
    "check: HyCo Delta-g against Cloud+MTP": _cost("hyco", "delta_g_percent"),
    "check: HyCo delivery": _cost("hyco", "tok_s"),
}


def number(text: str) -> float:
    return float(re.match(r"-?[\d.]+", text.replace(",", "")).group())


def holds(value: object, expected: str, tolerance: str) -> bool:
    """`exact`: the same text; `at most X`: value <= X; `N ...`: within N of the expected figure."""
    if tolerance == "exact":
        return str(value) == expected
    if tolerance.startswith("at most "):
        return float(value) <= number(tolerance.removeprefix("at most "))
    return abs(float(value) - number(expected)) <= number(tolerance)


def test_every_row_of_the_table_has_a_reader_and_the_tolerance_rule_can_fail():
    assert set(expectations()) == set(READERS)
    assert holds(98.0, "98.8%", "1.5 points") and not holds(97.0, "98.8%", "1.5 points")
    assert holds(-73.0, "-78%", "8 points") and not holds(-69.0, "-78%", "8 points")
    assert holds(5e-6, "0.0000", "at most 0.0001") and not holds(2e-4, "0.0000", "at most 0.0001")
    assert not holds("117/118", "118/118", "exact")


@pytest.mark.slow
def test_the_embedded_default_gives_what_the_readme_says(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "hyco.pipeline.cli", "run", "tiny"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    misses = {}
    for figure, (expected, tolerance) in expectations().items():
        value = READERS[figure](run)
        if not holds(value, expected, tolerance):
            misses[figure] = (value, expected, tolerance)
    assert not misses, misses
