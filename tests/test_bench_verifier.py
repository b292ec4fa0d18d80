"""bench/bench_verifier.py's machinery on the tiny verifier: its phases (load, answers, capture) as the
bench runs them in a child, the fit to the whole model's depth, the 26B-A4B and 31B shapes.
The full-size figures come from running the bench (README, full-size section)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_verifier  # noqa: E402


@pytest.mark.slow  # two fresh interpreters loading torch and the verifier
def test_phases_run_in_a_child_on_a_verifier(tiny_family, tmp_path):
    def phase(name: str) -> dict:
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_verifier.py"), "--out", str(tmp_path),
                               "--phase", name, "--verifier", str(tiny_family["verifier"]), "--work", str(tmp_path),
                               "--prompts", "2", "--new-tokens", "6"], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    answers = phase("answers")
    assert answers["dtype"] == "torch.bfloat16" and 2 <= answers["new_tokens"] <= 12 and answers["s_per_token"] > 0
    capture = phase("capture")
    records = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert capture["tokens"] == sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records)
    assert len(list((tmp_path / "captures").glob("capture_*.safetensors"))) == 2 and capture["capture_bytes"] > 0


def test_the_fit_is_a_line_through_the_depths():
    f = bench_verifier.fit([2, 4, 6], [10.0, 14.0, 18.0], 30)
    assert (f["per_layer"], f["fixed"], f["max_residual"], f["at_whole_depth"]) == (2.0, 6.0, 0.0, 66.0)
    assert bench_verifier.fit([2, 4, 6], [10.0, 14.0, 18.0], 60)["at_whole_depth"] == 126.0
    bent = bench_verifier.fit([2, 4, 6], [10.0, 15.0, 18.0], 30)
    assert bent["max_residual"] > 0.3


def test_the_stand_in_has_26b_a4b_layer_shapes():
    shape = bench_verifier.a4b_shape(4)
    assert (shape.hidden, shape.experts, shape.top_k_experts, shape.moe_intermediate) == (2816, 128, 8, 704)
    assert (shape.num_layers, shape.full_period) == (4, 2)
    # the whole model's BF16 bytes, counted on the meta device: ~50 GB
    assert 49e9 < bench_verifier.weight_bytes("26b-a4b", 30, 6) < 53e9
    assert bench_verifier.weight_bytes("26b-a4b", 4) - bench_verifier.weight_bytes("26b-a4b", 2) == pytest.approx(
        (bench_verifier.weight_bytes("26b-a4b", 30) - bench_verifier.weight_bytes("26b-a4b", 2)) / 14, rel=0.02)


def test_the_31b_stand_in_counts_the_published_parameters():
    """The dense 31B's shapes (public accounts, hidden inferred): 60 layers of 32 heads, FFN 21,504,
    no experts; counted on the meta device its text model holds the published 30.7 B parameters
    (within 2%: the vision tower is not in it, the inferred full-layer K/V are)."""
    shape = bench_verifier.dense_31b_shape(60, 6)
    assert (shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.experts) == (5376, 21504, 32, 16, 0)
    assert bench_verifier.weight_bytes("31b", 60, 6) / 2 == pytest.approx(30.7e9, rel=0.02)
