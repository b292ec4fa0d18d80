"""Issue 37's sweep over checkpoint statistics: SLMs unlike any fixture (tests/variants.py) through
vocab, answers, convert, qat, calibrate (with the HTP checks) and export (with smoke), CI-sized.

A trained SLM at another shape (6 layers of width 96, 3 heads of 32, a full layer every third)
comes first; around it: weights at 0.3x (their SRQ scales scaled with them, and fitted again) and
3x with spread norms, an output layer 4x as confident.
`HYCO_SWEEP=all` adds a second trained SLM (width 128, 4 heads, a full layer every second, another
seed), weights at 5x and 0.5x, another seed of the spread, output layers 0.25x and 8x (logits to
about +-60 with the softcap off), the softcap off. Each run keeps its artifacts whatever its proofs say
(--allow-parity-failure), so the test sees what a user would have shipped, and holds:
- a trained variant reaches a faithful bundle: calibrate's proofs pass (the fidelity floor, every
  op within tolerance on the simulator), and smoke passes;
- every other variant either does the same, or calibrate refuses it (the floor's or the
  op-by-op proof's message): no variant leaves calibrate unfaithful by the floor unremarked;
- no bundle with a graph the HTP computes wrong (an op beyond tolerance) passes smoke;
- on a trained variant smoke keeps its power: each graph's log-prob and K/V bounds within
  `smoke.POWER_LIMIT` (5x) of the HTP's own difference, or at the output grid's resolution, and
  the K/V bound under 16 steps of the ring's 256.
Each variant's row (op-by-op worst codes, KL, worst layer, top-1, the fewest codes an SRQ spans,
bounds, smoke) is printed and
written beside the runs (sweep.json); the table of the last full run is in the closing note of
issue 37.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from variants import train_slm, vary

pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (QNN HTP backend absent)")

SHAPES = {  # both unlike the fixture (7 layers of 64, 4 heads of 16, a full layer every fourth)
    "a": {"hidden": 96, "intermediate": 192, "num_layers": 6, "full_period": 3, "num_kv_shared_layers": 2,
          "heads": 3, "head_dim": 32, "global_head_dim": 64, "per_layer_input": 24},
    "b": {"hidden": 128, "intermediate": 320, "num_layers": 6, "full_period": 2, "num_kv_shared_layers": 2,
          "heads": 4, "head_dim": 32, "global_head_dim": 64, "per_layer_input": 32},
}
TRAIN_STEPS = 150  # ~2 min here; loss 8.7 -> ~5.6
TRAINED = {"trained": ("a", 0, TRAIN_STEPS), "trained-b-seed1": ("b", 1, TRAIN_STEPS),  # name: (shape, seed, steps)
           "trained-long": ("a", 2, 4 * TRAIN_STEPS)}
# name: (the trained SLM it starts from, `vary`'s changes, vary's seed[, recipe settings]). CI runs
# the first five (about 1.5 min each here); HYCO_SWEEP=all runs every one (the closing note's table).
VARIANTS = {
    "trained": ("trained", {}, 0),
    "weights-0.3x": ("trained", {"weight_gain": 0.3}, 1),  # SRQ scaled with the weights: refused (its SRQ)
    "weights-0.3x-srq-fit": ("trained", {"weight_gain": 0.3, "srq": "refit"}, 1),  # the same, SRQ fitted again
    "weights-3x-spread": ("trained", {"weight_gain": 3.0, "norm_spread": 0.3}, 1),
    "confident-4x": ("trained", {"logit_scale": 4.0}, 1),
    "trained-b-seed1": ("trained-b-seed1", {}, 0),
    "trained-long": ("trained-long", {}, 0),  # 4x the steps: a peakier SLM, the bounds' hardest case so far
    "unconfident-0.25x": ("trained", {"logit_scale": 0.25}, 1),
    "softcap-off": ("trained", {"softcap": None}, 1),
    "logits-8x-softcap-off": ("trained", {"logit_scale": 8.0, "softcap": None}, 1),
    "weights-5x": ("trained", {"weight_gain": 5.0}, 1),
    "weights-3x-spread-seed2": ("trained", {"weight_gain": 3.0, "norm_spread": 0.3}, 2),
    "b-confident-4x": ("trained-b-seed1", {"logit_scale": 4.0}, 1),
    "b-weights-0.5x-spread": ("trained-b-seed1", {"weight_gain": 0.5, "norm_spread": 0.3}, 1),
}
# Issue 37's finding at weights 0.3x: the loss is down_proj's SRQ, scaled with the weights while its
# output shrank ~16x (14-16 of 255 codes), not a 16-bit grid. So that variant is refused naming the
# SRQ, and the same weights with their SRQ fitted again are faithful.
EXPECTED = {"weights-0.3x": "refused, its SRQ named", "weights-0.3x-srq-fit": "faithful"}
RUN = list(VARIANTS) if os.environ.get("HYCO_SWEEP") == "all" else list(VARIANTS)[:5]
SIZES = ["vocab.count_conversations=300", "vocab.heldout_conversations=40", "vocab.reserved_train=4",
         "vocab.reserved_eval=4", "convert.parity=false", "qat.steps=2", "qat.calibration_sequences=1",
         "answers.max_new_tokens_train=24", "answers.max_new_tokens_eval=24", "calibrate.prompts=4",
         "calibrate.eval_prompts=2", "calibrate.max_new_tokens=24", "calibrate.sqnr_passes=2",
         "calibrate.fidelity_seeds=1", "calibrate.htp_check=true", "calibrate.simulator_passes=1",
         "export.smoke_prompts=1", "export.smoke_rounds=2", "stages=[vocab,answers,convert,qat,calibrate,export]"]


@pytest.fixture(scope="module")
def trained_slms(tiny_family_distilled, tmp_path_factory):
    """name -> (folder, training figures), each trained on first use."""
    root, made = tmp_path_factory.mktemp("sweep"), {}

    def get(name: str) -> tuple[Path, dict]:
        if name not in made:
            shape, seed, steps = TRAINED[name]
            out = root / name
            made[name] = out, train_slm(tiny_family_distilled, out, shape=SHAPES[shape], steps=steps, seed=seed)
        return made[name]
    return get


SHARED = ("vocab", "answers", "qat")  # stages no SLM reads: run once, copied into every variant's run


@pytest.fixture(scope="module")
def shared_run(tiny_family_distilled, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep-shared")
    assert run(tiny_family_distilled, tiny_family_distilled["slm"], out, [f"stages=[{','.join(SHARED)}]"]) == 0
    return out


def run(family: dict[str, Path], slm: Path, out: Path, extra: list[str] = ()) -> int:
    from ladder import RECIPE, set_args

    from hyco.pipeline.cli import main

    models = [f"models.{k}={v}" for k, v in family.items() if k != "slm"] + [f"models.slm={slm}"]
    return main(["run", str(RECIPE), "--out", str(out), "--allow-parity-failure", *set_args([*SIZES, *models, *extra])])


def run_variant(family: dict[str, Path], slm: Path, out: Path, shared: Path, extra: list[str] = ()) -> dict:
    for stage in SHARED:  # copied with their times, so their manifests still match
        shutil.copytree(shared / stage, out / stage)
    code = run(family, slm, out, extra)
    calibrate = json.loads((out / "calibrate" / "report.json").read_text())
    smoke_path = out / "export" / "smoke" / "report.json"
    smoke = json.loads(smoke_path.read_text()) if smoke_path.is_file() else None
    graphs, logit_ranges = {}, head_output_ranges(out / "calibrate" / "encodings.json")
    for name, g in calibrate["graphs"].items():
        ops = g["htp"].get("ops") or {}
        worst = next(iter(ops.get("by_op", {}).items()), (None, {}))
        sim = g["htp"].get("simulator_vs_cpu") or {}
        graphs[name] = {"top1": round(g["top1_agreement"], 4), "kl": round(g["kl"], 5),
                        "worst_layer_db": round(g["worst_layers"][0]["sqnr_db"], 1) if g["worst_layers"] else None,
                        "floor_passed": g["fidelity_floor"]["passed"],
                        "srq_fewest_codes": min([s["codes"] for s in g["fidelity_floor"]["srq_fewest_codes"]], default=None), "ops_within": ops.get("within_tolerance"),
                        "worst_op": worst[0], "worst_codes": worst[1].get("max_codes"),
                        "beyond": [b["tensor"] for b in ops.get("beyond_tolerance", [])][:2],
                        "htp_vs_cpu": sim.get("max_abs_logprob_diff"), "bound": g["htp_logprob_bound"],
                        "logit_range": logit_ranges.get(name)}
    statuses = {r["stage"]: r["status"] for r in json.loads((out / "run_report.json").read_text())["stages"]}
    return {"exit": code, "statuses": statuses, "calibrate_proof_failed": calibrate["proof_failed"], "graphs": graphs,
            "smoke_passed": smoke and smoke["passed"],
            "smoke": smoke and {r: {k: v[k] for k in ("top1_share", "max_logprob_diff", "bound", "max_kv_steps",
                                                      "kv_step_bound", "bound_over_htp", "kv_bound_over_htp",
                                                      "power_note")} for r, v in smoke["by_graph"].items()}}


def head_output_ranges(encodings: Path) -> dict[str, list[float]]:
    """Per graph, the calibrated range of the output layer's logits before the softcap: the data
    statistic the variant's confidence is (logit_scale moves it)."""
    if not encodings.is_file():
        return {}
    ranges = {}
    for name, g in json.loads(encodings.read_text())["graphs"].items():
        found = {e["name"]: [round(e["min"], 1), round(e["max"], 1)] for e in g["activation_encodings"]}
        # with the softcap off the head's product is the logits themselves
        head = found.get("/output/head/MatMul_output_0") or found.get("logits_QuantizeLinear_Input")
        if head:
            ranges[name] = head
    return ranges


@pytest.mark.slow
@pytest.mark.parametrize("variant", RUN)
def test_every_variant_is_faithful_or_refused_and_no_broken_graph_passes_smoke(variant, trained_slms, shared_run,
                                                                              tiny_family_distilled, tmp_path):
    start, changes, seed, *settings = VARIANTS[variant]
    base, figures = trained_slms(start)
    slm = vary(base, tmp_path / "slm", seed=seed, **changes) if changes else base
    row = {"variant": variant, "training": figures,
           **run_variant(tiny_family_distilled, slm, tmp_path / "run", shared_run, *settings)}
    statuses = row.pop("statuses")
    assert all(statuses[stage].startswith("skipped") for stage in SHARED), statuses
    print(json.dumps(row))
    with (base.parent / "sweep.json").open("a") as f:
        f.write(json.dumps(row) + "\n")
    failed = row["calibrate_proof_failed"]
    unfaithful = [n for n, g in row["graphs"].items() if not g["floor_passed"]]
    broken = [n for n, g in row["graphs"].items() if g["ops_within"] is False]
    assert not unfaithful or "below the fidelity floor" in failed, row  # refused with the floor's message
    assert not broken or "op by op" in failed, row
    if broken:  # what a user shipping it anyway would meet: smoke must not pass it
        assert row["smoke_passed"] is False, row
    if variant in TRAINED or EXPECTED.get(variant) == "faithful":
        assert failed is None and row["exit"] == 0 and row["smoke_passed"], row
    if variant in TRAINED:  # smoke keeps its power: a fault over POWER_LIMIT x the HTP's difference fails
        for graph, v in row["smoke"].items():
            assert v["power_note"] is None or "resolution" in v["power_note"], (graph, v)
            assert v["kv_step_bound"] is None or v["kv_step_bound"] < 16, (graph, v)
    if EXPECTED.get(variant) == "refused, its SRQ named":
        assert failed and "int8 output quantizer (SRQ)" in failed, row
