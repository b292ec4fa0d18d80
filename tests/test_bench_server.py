"""bench/bench_server.py's stand-in and summary, without running a sweep (the sweep is check's own
`measure`, tested in tests/test_server_timing.py and tests/test_costs.py; the figures come from
running the bench)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_server  # noqa: E402
import bench_verifier  # noqa: E402


@pytest.mark.parametrize("model", ["26b-a4b", "31b"])
def test_the_whole_depth_stand_in_is_the_models_shape(model):
    """On the meta device: the whole depth with every sixth layer full, and the parameters
    bench_verifier counts for it (the same configuration, the text model only)."""
    net, config = bench_server.stand_in(model, bench_verifier.MODELS[model][1], "meta", "bfloat16")
    types = config.layer_types
    assert len(types) == bench_verifier.MODELS[model][1] and types[5::6] == ["full_attention"] * (len(types) // 6)
    assert types.count("full_attention") == len(types) // 6
    counted = bench_verifier.weight_bytes(model, len(types), 6) / 2
    assert sum(p.numel() for p in net.parameters()) == pytest.approx(counted, rel=0.01)


def test_a_shallow_stand_in_has_both_layer_kinds():
    _, config = bench_server.stand_in("26b-a4b", 2, "meta", "bfloat16")
    assert config.layer_types == ["sliding_attention", "full_attention"]


def test_the_summary_shows_the_sweep_and_the_rounds():
    report = {"model": "26b-a4b", "layers": 30, "whole_depth": 30, "dtype": "bfloat16", "parameters": 25.2e9,
              "machine": {"device": "cuda:0 H200", "torch": "2.11"}, "source": "CUDA events, CUDA graphs replayed",
              "build_s": 3.0, "sweep_s": 60.0, "verify_ms": [[1, 64, 10.0], [1, 1024, 11.0], [33, 64, 12.0], [33, 1024, 14.5]],
              "prefill_ms": [[128, 20.0], [1024, 90.0]], "prefill_line": [10.0, 0.078], "round_ms_at_context": 1024,
              "rounds": {"hyco (33 rows)": {"this_machine_ms": 14.5, "paper_implied_ms": 22.6}}}
    text = bench_server.summary(report)
    assert "| 33 | 12.000 | 14.500 |" in text and "| hyco (33 rows) | 14.5 | 22.6 |" in text
    assert "CUDA events, CUDA graphs replayed" in text
