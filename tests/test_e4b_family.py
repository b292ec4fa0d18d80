"""A second family shape through the E4B recipe (recipes/hyco-gemma-4-e4b.yaml): the tiny-e4b
fixture family (another layer count and sliding:full period, two KV heads, 2 KV-shared layers,
head dims 24 / 48, no double-wide MLP) runs the whole system with convert's bit-exact and traced
parity proofs on, the HTP check and a smoke run on the simulator, as the E2B-shaped family does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RECIPE = Path(__file__).parents[1] / "recipes" / "hyco-gemma-4-e4b.yaml"


@pytest.mark.slow
def test_the_e4b_recipe_converts_a_family_of_another_shape(tmp_path):
    from ladder import REAL_RECIPE_SIZES, set_args

    from hyco.fixtures.cache import cached_family
    from hyco.pipeline.cli import main

    family = cached_family("tiny-e4b")
    config = json.loads((family["slm"] / "config.json").read_text())["text_config"]
    assert (config["num_hidden_layers"], config["num_kv_shared_layers"], config["num_key_value_heads"]) == (8, 2, 2)
    assert config["layer_types"][:3] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert config["use_double_wide_mlp"] is False and config["head_dim"] == 24
    out = tmp_path / "run"
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "And one more."]})
                         + "\n")
    sets = [*[f"models.{k}={v}" for k, v in family.items()], *REAL_RECIPE_SIZES, "convert.parity=true",
            f"check.workload.source={questions}"]
    assert main(["run", str(RECIPE), "--out", str(out), *set_args(sets)]) == 0
    report = json.loads((out / "run_report.json").read_text())
    assert all(s["status"] == "built" for s in report["stages"]), report["stages"]
    convert = json.loads((out / "convert" / "manifest.json").read_text())["summary"]
    assert convert["bitexact_all_equal"] is True and convert["parity_passed"] is True
    graphs = json.loads((out / "convert" / "io_spec.json").read_text())["graphs"]
    meta = next(g for g in graphs if g["graph"] == "tree.onnx")["meta"]
    assert meta["num_layers"] == 8 and meta["kv_owner"] == {**{str(i): i for i in range(6)}, "6": 4, "7": 5}
    assert {(r["layer_type"], r["kv_heads"], r["head_dim"]) for r in meta["rings"]} == {
        ("sliding_attention", 2, 24), ("full_attention", 2, 48)}
    assert json.loads((out / "export" / "manifest.json").read_text())["summary"]["smoke_passed"] is True
    calibrate = json.loads((out / "calibrate" / "report.json").read_text())
    assert calibrate["proof_failed"] is None
    assert json.loads((out / "check" / "report.json").read_text())["lossless"]["hyco-exact"]["equal"]
