"""The cross-family recipes: the SLM side without qat, answers in the SLM's tokens, and check through
the token bridge (runtime_check/bridged.py) against a verifier of another family.

The fast tests read the ladder's artifacts (tests/ladder.py: random weights, so drafts are rarely
accepted; they prove the plumbing and exact losslessness) and the shipped cross-family verifier;
the slow test runs recipes/tiny-cross-family.yaml end to end on the distilled family, where drafts
are accepted and the lossless verdict means something.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hyco.base.errors import HycoError  # noqa: E402
from hyco.config.recipe import CheckConfig, TimingConfig, WorkloadConfig, load_recipe  # noqa: E402

RECIPES = Path(__file__).parents[1] / "recipes"
BRIDGED = ["bridge-slm", "bridge-slm-eps", "verifier-alone"]

# the ladder's shapes (tests/ladder.py: convert rings 128 / 64, the head's window 128)
PHONE = dict(ring_full=128, ring_sliding=64, max_prompt=128, mtp_window=128, capture_point="after_norm")


@pytest.fixture(scope="module")
def cross_verifier(tmp_path_factory):
    """The shipped cross-family verifier (a Llama decoder with its own byte-level BPE tokenizer)."""
    from hyco.fixtures.cache import cross_options
    from hyco.fixtures.shipped import copy_shipped

    out = tmp_path_factory.mktemp("cross") / "cross-verifier"
    assert copy_shipped(cross_options(0), out) is not None, "the package ships the cross-family verifier"
    return out


def test_the_cross_family_recipes_change_their_bases_alike():
    """tiny-cross-family.yaml is to tiny.yaml what hyco-cross-family.yaml is to hyco-gemma-4.yaml:
    no qat, the verifier's own tokenizer named, no head, the bridge's configurations."""
    real, real_base = load_recipe(RECIPES / "hyco-cross-family.yaml"), load_recipe(RECIPES / "hyco-gemma-4.yaml")
    tiny, tiny_base = load_recipe(RECIPES / "tiny-cross-family.yaml"), load_recipe(RECIPES / "tiny.yaml")
    assert [s for s in real_base.stages if s != "qat"] == list(real.stages)
    assert [s for s in tiny_base.stages if s != "qat"] == list(tiny.stages)
    assert real.check.configs == tiny.check.configs == tuple(BRIDGED)
    assert tiny.models.verifier_tokenizer and tiny.models.assistant is None and real.models.assistant is None
    assert "verifier_tokenizer" in (RECIPES / "hyco-cross-family.yaml").read_text()
    for recipe in (real, tiny):
        # a null drops the base's row: no MTP rows; Table 3's SLM row still applies
        assert set(recipe.export.footprint_targets) == {"slm"}
    assert tiny.fixtures.cross_family_verifier


def test_bridged_configurations_are_their_own_registry():
    from hyco.runtime.configs import decode_config

    check = CheckConfig()
    assert decode_config("bridge-slm", check, bridged=True).bridged
    assert decode_config("bridge-slm-eps", check, bridged=True).epsilon == check.epsilon
    assert decode_config("verifier-alone", check, bridged=True).verifier_alone
    assert decode_config("bridge-slm@float", check, bridged=True).drafters == "float"
    with pytest.raises(HycoError, match="'hyco'.*token bridge's"):
        decode_config("hyco", check, bridged=True)  # an MTP head of the SLM's family: not through the bridge
    with pytest.raises(HycoError, match="'bridge-slm'.*same-tokenizer"):
        decode_config("bridge-slm", check)


def test_a_verifiers_answer_becomes_the_slms_tokens(cross_verifier, tiny_family):
    """answers for a verifier of another family: its text in the SLM's ids, an unfinished character
    cut, the SLM's end of turn where the verifier ended its turn."""
    from hyco.answers.generate import translate_answer

    from hyco.base.loading import load_tokenizer
    from hyco.runtime.bridge import end_of_turn_ids

    bpe, slm_tok = load_tokenizer(cross_verifier), load_tokenizer(tiny_family["tokenizer"])
    text = "Sure: 12345 apples, naïve café!"
    answer = bpe(text, add_special_tokens=False)["input_ids"]
    end = slm_tok.convert_tokens_to_ids("<turn|>")
    assert end in end_of_turn_ids(slm_tok)
    ended = translate_answer(answer + [bpe.eos_token_id], {bpe.eos_token_id}, bpe, slm_tok, end)
    assert ended[-1] == end and slm_tok.decode(ended[:-1]) == text
    cut = bpe("café 東", add_special_tokens=False)["input_ids"]
    partial = translate_answer(cut[:-1], {bpe.eos_token_id}, bpe, slm_tok, end)  # the last character half there
    assert slm_tok.decode(partial) in ("café ", "café")


def test_answers_of_a_verifier_of_another_family_are_its_text_in_the_slms_ids(ladder, cross_verifier, tmp_path):
    """The answers stage of the real cross-family recipe (source greedy): the verifier answers its
    own chat template's prompt, and the record holds the SLM's prompt and the verifier's text in
    the SLM's ids (what calibrate reads); checked against the verifier's own `generate`."""
    import torch
    from hyco.answers.generate import translate_answer
    from hyco.answers.stage import make_answers
    from transformers import AutoModelForCausalLM

    from hyco.base.loading import load_tokenizer
    from hyco.config.recipe import AnswersConfig
    from hyco.data.answers import prompt_ids, read_answers
    from hyco.data.keepset import load_prompts

    config = AnswersConfig(source="greedy", max_new_tokens_train=12, max_new_tokens_eval=12, max_prompt_tokens=48)
    (tmp_path / "answers").mkdir()  # the stage's temp folder, as run_stage makes it
    make_answers(verifier=cross_verifier, tokenizer=ladder / "fixtures" / "tokenizer", vocab=ladder / "vocab",
                 config=config, out=tmp_path / "answers", verifier_tokenizer=cross_verifier,
                 slm=ladder / "fixtures" / "slm")
    records = read_answers(tmp_path / "answers" / "answers.jsonl")
    prompts = load_prompts(ladder / "vocab")
    slm_tok, bpe = load_tokenizer(ladder / "fixtures" / "tokenizer"), load_tokenizer(cross_verifier)
    verifier = AutoModelForCausalLM.from_pretrained(cross_verifier, dtype=torch.float32).eval()
    eos = set(verifier.generation_config.eos_token_id)
    end = slm_tok.convert_tokens_to_ids("<turn|>")
    for record, prompt in list(zip(records, prompts, strict=True))[:3]:
        assert record["prompt_ids"] == prompt_ids(slm_tok, prompt["turns"], 48)  # the SLM's template
        asked = prompt_ids(bpe, prompt["turns"], 48)  # the verifier's own
        own = verifier.generate(torch.tensor([asked]), max_new_tokens=12, do_sample=False,
                                pad_token_id=bpe.pad_token_id)[0, len(asked):].tolist()
        cut = next((k + 1 for k, t in enumerate(own) if t in eos), len(own))
        assert record["answer_ids"] == translate_answer(own[:cut], eos, bpe, slm_tok, end)
        assert record["answer_ids"] and max(record["answer_ids"]) < len(slm_tok)


def test_no_head_steps_cost_nothing_where_the_head_has_no_figure():
    """A check with no head on the server (the bridge's) has no head-step time (NaN): rounds that
    run no head must still have a server time."""
    from hyco.runtime.timing import Round, Times, phone_ms, server_ms

    t = Times(verify=lambda rows, context: 2.0, prefill=lambda n: 1.0, head_step=math.nan, slm_pass=3.0,
              mtp_step=math.nan, host=0.5)
    r = Round(rows=9, context=64, committed=2, slm_passes=4)
    assert server_ms(r, t) == 2.0 and phone_ms(r, t) == 12.5


def _bridged_check(ladder, cross_verifier, out, workload_file: Path | None = None, **overrides):
    from hyco.runtime_check.check import CheckInputs, PhoneShapes, run_check

    settings = dict(configs=tuple(BRIDGED), prompts=2, max_new_tokens=10, backend="onnxruntime", drafters="deployed",
                    deployed_executor="onnxruntime", threads=1, timing=TimingConfig(enabled=False),
                    bootstrap_resamples=100)
    config = CheckConfig(**{**settings, **overrides})
    inputs = CheckInputs(verifier=cross_verifier, verifier_tokenizer=cross_verifier, workload=workload_file,
                         slm=ladder / "fixtures" / "slm", tokenizer=ladder / "fixtures" / "tokenizer",
                         vocab_dir=ladder / "vocab", phone=PhoneShapes(**PHONE), bundle_dir=ladder / "export" / "bundle")
    return run_check(inputs, config, out)


def test_check_drafts_through_the_bridge_on_the_shipped_graphs(ladder, cross_verifier, tmp_path):
    """check through the token bridge on the ladder's export bundle (the QDQ graphs that ship,
    onnxruntime CPU): exact verification commits the verifier's own keyed text, the verifier alone
    too, and the report carries the bridge's figures in the verifier's tokens."""
    _bridged_check(ladder, cross_verifier, tmp_path / "check")
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    assert list(report["configs"]) == BRIDGED
    assert report["lossless"]["bridge-slm"]["equal"] and report["lossless"]["verifier-alone"]["equal"]
    assert report["lossless"]["bridge-slm"]["tokens_compared"] >= 2 * 5
    for name in ("bridge-slm", "bridge-slm-eps"):
        b = report["configs"][name]["bridge"]
        assert b["rounds"] > 0 and b["slm_nodes_per_round"] > 0 and b["verifier_tokens_per_slm_token"] > 0
        assert b["host_ms_per_round"] > 0 and b["lost_share"] <= 1
    alone = report["configs"]["verifier-alone"]
    assert alone["mat"] == 1.0 and alone["bridge"] is None and alone["verifier_passes_per_output_token"] == 1.0
    assert alone["tree_bytes_per_round"] == 0  # the server decodes alone: nothing goes up
    settings = report["settings"]
    assert settings["bridge"]["verifier_vocab_size"] == 1024 and settings["bridge"]["slm_vocab_size"] == 4096
    assert "export bundle" in settings["backends"]["slm"]
    summary = (tmp_path / "check" / "summary.md").read_text()
    assert "## Token bridge" in summary and "keep set 1345 of 4096" in summary  # the SLM's keep set


def test_check_through_the_bridge_on_a_spec_bench_file_over_two_runs(ladder, cross_verifier, tmp_path):
    """A Spec-Bench file through the bridge: every question, its second turn asked after the
    verifier's own first answer, each turn in each side's chat template; two sampling runs, each
    lossless against its own reference text."""
    questions = tmp_path / "question.jsonl"
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write a short poem about the sea.",
                                                                 "Now rewrite it for a child."]},
            {"question_id": "math_1", "category": "math", "turns": ["What is 12 times 7?"]}]
    questions.write_text("".join(json.dumps(q) + "\n" for q in rows))
    _bridged_check(ladder, cross_verifier, tmp_path / "check", workload_file=questions, runs=2, max_new_tokens=6,
                   configs=("bridge-slm", "verifier-alone"),
                   workload=WorkloadConfig(schema="spec-bench", source=str(questions)))
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    w = report["settings"]["workload"]
    assert (w["questions"], w["prompts"], w["second_turns"]) == (2, 3, 1)  # the workload, once
    assert w["categories"] == {"writing": 2, "math": 1}
    for name in ("bridge-slm", "verifier-alone"):
        v = report["lossless"][name]
        assert v["equal"] and v["runs"] == 2 and v["prompts"] == 6, name  # 3 prompts x 2 runs
    assert len(report["configs"]["bridge-slm"]["mat_runs"]) == 2


def test_cloud_head_runs_beside_the_bridge_where_the_verifier_has_one(ladder, tmp_path):
    """Cloud+head (cloud-mtp) in a bridged check: the verifier's own MTP head on the server, here
    the tiny Gemma verifier with its gemma4_assistant head, bridged to from the SLM's tokenizer
    (the same vocabulary: the bridge's identity case, text in and the same text out)."""
    from hyco.runtime_check.check import CheckInputs, PhoneShapes, run_check

    fixtures = ladder / "fixtures"
    config = CheckConfig(configs=("cloud-mtp", "bridge-slm"), prompts=2, max_new_tokens=8, threads=1,
                         timing=TimingConfig(enabled=False), bootstrap_resamples=100)
    inputs = CheckInputs(verifier=fixtures / "verifier", verifier_tokenizer=fixtures / "tokenizer",
                         assistant=fixtures / "assistant", slm=fixtures / "slm", tokenizer=fixtures / "tokenizer",
                         vocab_dir=ladder / "vocab", phone=PhoneShapes(**PHONE))
    run_check(inputs, config, tmp_path / "check")
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    assert report["configs"]["cloud-mtp"]["label"] == "Cloud+head" and report["configs"]["cloud-mtp"]["mtp_depth"] == 4
    assert report["lossless"]["cloud-mtp"]["equal"] and report["lossless"]["bridge-slm"]["equal"]
    assert report["configs"]["cloud-mtp"]["bridge"] is None and report["configs"]["bridge-slm"]["bridge"]["rounds"] > 0
    assert report["settings"]["paired_mat"]["baseline"] == "cloud-mtp"


def test_preflight_takes_a_verifier_of_another_family_only_for_a_bridged_recipe(cross_verifier):
    from hyco.pipeline.preflight import check_model

    assert check_model("verifier", cross_verifier, cross_family=True) > 0
    with pytest.raises(HycoError, match="model_type 'llama' is no registered family"):
        check_model("verifier", cross_verifier)


def test_a_mismatched_verifier_tokenizer_is_refused_by_name(ladder, cross_verifier, tmp_path):
    from hyco.runtime_check.check import CheckInputs, PhoneShapes, run_check

    slm, tokenizer = ladder / "fixtures" / "slm", ladder / "fixtures" / "tokenizer"
    config = CheckConfig(configs=("bridge-slm",), prompts=1, max_new_tokens=4)
    inputs = CheckInputs(verifier=cross_verifier, verifier_tokenizer=tokenizer, slm=slm, tokenizer=tokenizer,
                         vocab_dir=ladder / "vocab", phone=PhoneShapes(**PHONE))
    with pytest.raises(HycoError, match=r"tokenizer.*4096 tokens.*vocabulary of 1024"):
        run_check(inputs, config, tmp_path / "check")
    assert not (tmp_path / "check").exists()
    with pytest.raises(HycoError, match="cloud-mtp.*models.assistant"):
        run_check(dataclasses.replace(inputs, verifier_tokenizer=cross_verifier),
                  CheckConfig(configs=("cloud-mtp",), prompts=1, max_new_tokens=4), tmp_path / "check")


def test_the_pipeline_reads_the_verifiers_tokenizer_only_where_the_recipe_bridges():
    from hyco.runtime_check import stage

    run = Path("/tmp/none")
    tiny = load_recipe(RECIPES / "tiny-cross-family.yaml")
    paths = stage.inputs(tiny, run)
    assert paths["verifier_tokenizer"] == paths["verifier"] and "assistant" not in paths
    plain = stage.inputs(load_recipe(RECIPES / "tiny.yaml"), run)
    assert "verifier_tokenizer" not in plain and "assistant" in plain
    with_head = load_recipe(RECIPES / "tiny-cross-family.yaml", ["check.configs=[bridge-slm,cloud-mtp]"])
    with pytest.raises(HycoError, match="models.assistant"):
        stage.inputs(with_head, run)


@pytest.mark.slow
def test_the_tiny_cross_family_recipe_end_to_end(tmp_path):
    """`hyco-convert run recipes/tiny-cross-family.yaml`: the distilled tiny SLM through calibrate
    and export without qat (the tree graph alone, smoke through the bridge on the HTP simulator), then check
    through the bridge: exact verification lossless with drafts accepted, MAT, the bridge's costs,
    and Table 2 / 11 against the verifier alone."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "hyco.pipeline.cli", "run", str(RECIPES / "tiny-cross-family.yaml"),
                           "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    calibrate = json.loads((out / "calibrate" / "report.json").read_text())
    assert sorted(calibrate["graphs"]) == ["tree.qdq.onnx"] and calibrate["qat"] is None  # tree-only: it prefills
    bundle = json.loads((out / "export" / "bundle" / "bundle.json").read_text())
    assert sorted(bundle["graphs"]) == ["tree"] and "embed_lut.safetensors" not in bundle["files"]
    smoke = json.loads((out / "export" / "smoke" / "report.json").read_text())
    assert smoke["passed"] and smoke["drafting"] == "specedge through the token bridge"
    report = json.loads((out / "check" / "report.json").read_text())
    exact = report["lossless"]["bridge-slm"]
    assert exact["equal"] and exact["accepted_draft_tokens"] > 0 and exact["distinct_tokens"] >= 40
    assert report["configs"]["bridge-slm"]["mat"] > 1.0
    assert not report["settings"]["bridge"]["reference_text"]["degenerate"]
    rows = report["costs"]["rows"]
    assert report["costs"]["reference"] == "verifier-alone" and rows["verifier-alone"]["delta_g_percent"] == 0.0
    assert all(rows[n]["g_ms"] > 0 and rows[n]["tok_s"] > 0 for n in BRIDGED)
    answers = [json.loads(line) for line in (out / "answers" / "answers.jsonl").read_text().splitlines()]
    assert max(max(a["prompt_ids"] + a["answer_ids"]) for a in answers) < 4096  # the SLM's ids
