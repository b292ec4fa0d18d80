"""gemma4_assistant's centroid-masked output layer (`use_ordered_embeddings`, E2B/E4B's assistants)
through qat, the step graph and check.

How the step graph handles the centroid selection over the keep set (hyco/npu/ops.py
`centroid_mask`): the keep-set output layer is computed whole, as for the plain head; the centroid
layer (INT4 like every linear) scores the clusters, a TopK takes transformers' top k, a Gather
gives each kept token its cluster's flag (`cluster_of`, a constant of the graph), and a Where puts
the unscored tokens 50 below the best scored logit, so the LogSoftmax is the one over the scored
kept tokens to float32. transformers fills them with the scored minimum - 1, a placeholder; the
host's reference gives them the graph's fill instead (hyco/runtime/mtp.py `scored_logits`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hyco.qat.mtp import TeacherForcedHead, check_output_layer, clusters_of, dense_rows, teacher_forced_inputs
from hyco.qat.step_graph import MtpStep, io_spec, linear_names
from hyco.qat.tiny_models import SLIDING_WINDOW, VOCAB, tiny_assistant, tiny_verifier

from hyco.base.errors import HycoError
from hyco.npu.handoff import handoff_states
from hyco.npu.ops import CENTROID_GAP, centroid_mask
from hyco.pipeline.cli import main
from hyco.runtime.mtp import scored_logits

sys.path.insert(0, str(Path(__file__).parent))
from ordered import ordered_assistant  # noqa: E402

NUM_CENTROIDS, TOP_K = 64, 4  # the fixture families' 4,096 tokens: 64 per centroid, 256 scored
TINY_CENTROIDS = (20, 4)  # qat/tiny_models.py's 300 tokens: 15 per centroid, 60 scored


@pytest.fixture(scope="module")
def ordered(tiny_text_family, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = ordered_assistant(tiny_text_family["assistant"], tmp_path_factory.mktemp("ordered") / "assistant",
                               NUM_CENTROIDS, TOP_K, fitted=False)
    head = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, head


@pytest.fixture(scope="module")
def tiny():
    verifier, head = tiny_verifier(), tiny_assistant(centroids=TINY_CENTROIDS)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
    return head, handoff_states(verifier, ids)


def test_the_flag_changes_the_head(ordered):
    """Why the masked layer needs its own path: transformers' masked head scores only the tokens of
    the top centroids, so its logits differ from lm_head(h) on most of the vocabulary."""
    folder, head = ordered
    assert head.config.use_ordered_embeddings and head.masked_embedding is not None
    torch.manual_seed(0)
    h = torch.randn(1, 3, head.config.get_text_config().hidden_size)
    with torch.no_grad():
        masked = head.masked_embedding(h, head.lm_head.weight)
        plain = head.lm_head(h)
    vocab = plain.shape[-1]
    scored = torch.isclose(masked, plain, rtol=0, atol=1e-5)  # gathered rows: same dot products up to rounding
    assert scored.sum(-1).tolist() == [[TOP_K * vocab // NUM_CENTROIDS] * 3]  # only the top clusters' tokens
    fill = masked[~scored]
    assert bool((fill == fill[0]).all()) and float(fill[0]) < float(masked[scored].min())
    shift = (torch.log_softmax(masked, -1) - torch.log_softmax(plain, -1)).abs()[scored].max()
    assert float(shift) > 0.1  # the kept tokens' probabilities change too


@pytest.mark.parametrize("keep_step", [1, 3])
@pytest.mark.parametrize("peak", [1.0, 12.0])
def test_centroid_mask_equals_transformers_masked_head(tiny, keep_step, peak):
    """centroid_mask on the dense keep-set row vs transformers' Gemma4AssistantMaskedEmbedder, cut
    to the keep set after: the same tokens scored, their logits equal to rounding (1e-5: the same
    dot products, gathered vs whole), and the log-softmax over the scored kept tokens the same
    (1e-5). Over the whole vocabulary and a keep set of every third token, on flat rows and on
    rows 12x peakier. scored_logits (the host's reference) gives the same row."""
    head, _ = tiny
    keep = torch.arange(0, VOCAB, keep_step)
    h = peak * torch.randn(6, 1, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = head.masked_embedding(h, head.lm_head.weight)[:, 0]
        dense = (h @ head.lm_head.weight.T)[:, 0, keep]
        ours = centroid_mask(dense, (h @ head.masked_embedding.centroids.weight.T)[:, 0], clusters_of(head, keep),
                             TINY_CENTROIDS[1])
    for row in range(6):
        scored = ref[row, keep] != ref.min()  # transformers' fill: the batch's scored minimum - 1
        assert 0 < int(scored.sum()) < len(keep)
        assert bool((ours[row][~scored] == ours[row][scored].max() - CENTROID_GAP).all())  # the fill
        assert torch.allclose(ours[row][scored], ref[row, keep][scored], atol=1e-5)
        expect = torch.log_softmax(ref[row, keep][scored], -1)
        assert torch.allclose(torch.log_softmax(ours[row], -1)[scored], expect, atol=1e-5)
        host = scored_logits(head, ref[row])[keep]
        assert torch.allclose(torch.log_softmax(host, -1)[scored], expect, atol=1e-5)


def test_the_masked_step_needs_its_clusters(tiny):
    """The centroid layer sits just before the output layer among the step's linears, the io spec
    records the centroids, and a step without each row's cluster is refused (the graph against
    transformers: tests/test_qat.py test_float_step_graph_matches_transformers[centroid-masked])."""
    head, states = tiny
    keep = torch.arange(0, VOCAB, 3)
    params = dict(head.named_parameters())
    names = linear_names(2, centroids=True)
    assert names[-2:] == ["masked_embedding.centroids", "lm_head"]
    weights = {n: params[f"{n}.weight"] for n in names[:-1]} | {"lm_head": head.lm_head.weight[keep]}
    kv_shapes = {k: (v[0].shape[0], v[0].shape[2]) for k, v in states.kv.items()}
    assert io_spec(head, kv_shapes, window=24, vocab=len(keep), topk=8, meta={}).meta["centroids"] == {
        "num_centroids": 20, "top_k": 4}
    with pytest.raises(ValueError, match="cluster_of"):
        MtpStep(head, weights, topk=8)
    with pytest.raises(ValueError, match="cluster_of"):
        MtpStep(head, weights, topk=8, cluster_of=clusters_of(head, keep)[:-1])


def test_teacher_forced_head_masks_and_trains_on_the_dense_row(tiny):
    """TeacherForcedHead (what QuantSim wraps) masks like the step graph; inside dense_rows (the
    training loop) it gives the dense keep-set row, and leaves the flag as it found it."""
    head, states = tiny
    keep = torch.arange(0, VOCAB, 3)
    teacher = TeacherForcedHead(head, keep).eval()
    assert dict(teacher.named_modules())["masked_embedding.centroids"] is head.masked_embedding.centroids
    inputs = teacher_forced_inputs(states.embeds, states.hidden, states.kv, SLIDING_WINDOW)
    with torch.no_grad():
        masked, nxt = teacher(*inputs)
        with dense_rows(teacher):
            dense, _ = teacher(*inputs)
            assert teacher.dense
        assert not teacher.dense
    kept = masked == dense  # scored tokens keep their logit; the fill sits CENTROID_GAP below the best of them
    assert bool((masked[~kept] == (masked.amax(-1, keepdim=True) - CENTROID_GAP).expand_as(masked)[~kept]).all())
    scored_per_row = kept.sum(-1)
    assert bool((scored_per_row > 0).all()) and bool((scored_per_row < len(keep)).all())


def test_bad_centroid_configs_are_refused_by_name(tiny):
    head, _ = tiny
    cfg = head.config
    for key, value, match in (("num_centroids", 7, "num_centroids 7 does not divide the vocabulary"),
                              ("centroid_intermediate_top_k", 21, "centroid_intermediate_top_k 21 is outside 1..20")):
        saved = getattr(cfg, key)
        setattr(cfg, key, value)
        try:
            with pytest.raises(HycoError, match=rf"head/config\.json: {match}"):
                check_output_layer(cfg, "head")
        finally:
            setattr(cfg, key, saved)
    check_output_layer(cfg, "head")
    saved = head.masked_embedding.token_ordering.clone()
    head.masked_embedding.token_ordering[5] = head.masked_embedding.token_ordering[6]
    try:
        with pytest.raises(HycoError, match="masked_embedding.token_ordering is not a permutation"):
            clusters_of(head, None)
    finally:
        head.masked_embedding.token_ordering.copy_(saved)


# --- the qat stage on a centroid-masked fixture head ------------------------------------------


@pytest.fixture(scope="module")
def masked_qat(ordered, tiny_text_family, tmp_path_factory):
    from hyco.vocab.stage import build_vocab

    from hyco.config.recipe import VocabConfig, load_recipe

    folder, _ = ordered
    root = tmp_path_factory.mktemp("masked-qat")
    (root / "vocab").mkdir()
    build_vocab(tokenizer=tiny_text_family["tokenizer"], dataset=load_recipe("recipes/tiny.yaml").dataset,
                config=VocabConfig(size=1345, count_conversations=40, reserved_train=2, reserved_eval=1,
                                   heldout_conversations=5), out=root / "vocab")
    common = ["--verifier", str(tiny_text_family["verifier"]), "--tokenizer", str(tiny_text_family["tokenizer"]),
              "--vocab", str(root / "vocab")]
    assert main(["answers", *common, "--source", "corpus", "--out", str(root / "answers"),
                 "--max-new-tokens-train", "24", "--max-new-tokens-eval", "16"]) == 0
    args = [*common, "--answers", str(root / "answers"), "--steps", "8", "--lr", "3e-4", "--warmup-steps", "2",
            "--window", "48",
            "--calibration-sequences", "2"]
    return root, folder, args


def test_qat_converts_the_masked_head(masked_qat, tmp_path):
    """qat on a centroid-masked head: the stage's own proofs pass (float graph vs transformers'
    head, the quantized graph vs its QuantSim weights on its own rounded inputs), the centroid layer
    is one of the INT4 linears, the graph holds each kept token's cluster as head_w4 records it, and
    the graph keeps the HTP rules."""
    from htp_rules import htp_violations
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hyco.base.loading import load_tokenizer
    from hyco.data.keepset import load_keep_set

    root, folder, args = masked_qat
    out = tmp_path / "qat"
    assert main(["qat", *args, "--assistant", str(folder), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    parity = report["parity"]
    assert parity["passed"], parity["failure"]
    assert parity["float_vs_transformers_max_abs_logprob"] < 1e-4 and parity["float_top1_match"] == 1.0
    assert parity["step_graph_proof"]["topk_ids_equal"] == 1.0
    # Training lowers the dense KL (its objective, qat/train.py); the masked rows that ship are
    # measured beside it, with the share of positions where the student scores the teacher's tokens.
    agreement = report["agreement"]
    assert agreement["w4_qat_train"]["kl_dense"] < agreement["w4_ptq_train"]["kl_dense"]
    assert all(0.0 <= a["same_scored_tokens"] <= 1.0 for a in agreement.values())
    assert agreement["w8_ptq"]["same_scored_tokens"] >= agreement["w4_ptq"]["same_scored_tokens"]
    assert "same_scored_tokens" in (out / "summary.md").read_text()
    tensors = load_file(str(out / "head_w4.safetensors"))
    centroids = tensors["masked_embedding.centroids.weight"]
    assert centroids.shape == (NUM_CENTROIDS, 64) and int(centroids.min()) >= -8 and int(centroids.max()) <= 7
    head = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    keep = load_keep_set(root / "vocab", load_tokenizer(Path(args[args.index("--tokenizer") + 1])))
    expect = clusters_of(head, torch.as_tensor(keep.keep_to_vocab, dtype=torch.long))
    assert torch.equal(tensors["cluster_of"].long(), expect)
    spec = json.loads((out / "io_spec.json").read_text())
    assert "centroids" in json.dumps(spec)
    import onnx

    ops = [n.op_type for n in onnx.load(str(out / "mtp_step.onnx"), load_external_data=False).graph.node]
    assert "Where" in ops and ops.count("TopK") >= 2  # the centroid TopK beside the drafting one
    assert htp_violations(out / "mtp_step.onnx") == []


def test_qat_refuses_a_cut_token_ordering_in_one_line(masked_qat, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    root, folder, args = masked_qat
    bad = shutil.copytree(folder, tmp_path / "bad")
    extra = load_file(str(bad / "model-extra.safetensors"))
    extra["masked_embedding.token_ordering"][3] = extra["masked_embedding.token_ordering"][4]
    save_file(extra, str(bad / "model-extra.safetensors"), metadata={"format": "pt"})
    assert main(["qat", *args, "--assistant", str(bad), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "masked_embedding.token_ordering is not a permutation" in err[0], err
    assert not (tmp_path / "q").exists()


# --- check on a centroid-masked head ---------------------------------------------------------


@pytest.fixture(scope="module")
def fitted_masked(tiny_family_distilled, tmp_path_factory):
    """The distilled family with its assistant centroid-masked, clusters fitted to its output rows
    (tests/ordered.py): a head whose top centroids hold the tokens it ranks high, as a real one's."""
    folder = ordered_assistant(tiny_family_distilled["assistant"], tmp_path_factory.mktemp("fitted") / "assistant",
                               NUM_CENTROIDS, TOP_K, fitted=True)
    return {**tiny_family_distilled, "assistant": folder}


def test_check_drafts_with_the_masked_head(fitted_masked, tiny_family_distilled, tmp_path):
    """check with the torch drafters on a centroid-masked head: the server head (Cloud+MTP) and
    the hybrid tree draft from the scored tokens, exact verification stays lossless against the
    verifier's own text, and drafts are accepted (MAT well above 1: the fitted clusters hold what
    the head ranks high). The selection is live: the same head with random clusters drafts
    tokens the verifier rarely takes (12 prompts x 48 tokens: Cloud+MTP 2.44 plain, 2.31 fitted,
    1.04 random)."""
    from test_runtime_check_stage import write_recipe

    def check(family, folder, configs):
        recipe = write_recipe(folder / "recipe.yaml", family, configs=configs, prompts=2)
        assert main(["check", "--recipe", str(recipe)]) == 0
        return json.loads((folder / "run" / "check" / "report.json").read_text())

    (tmp_path / "fitted").mkdir()
    report = check(fitted_masked, tmp_path / "fitted", ["hyco-exact", "cloud-mtp"])
    for name in ("hyco-exact", "cloud-mtp"):
        v = report["lossless"][name]
        assert v["equal"] is True and v["tokens_compared"] >= 8 and v["accepted_draft_tokens"] > 0, (name, v)
        assert report["configs"][name]["mat"] > 1.5, report["configs"][name]
    (tmp_path / "random").mkdir()
    scrambled = ordered_assistant(tiny_family_distilled["assistant"], tmp_path / "random" / "assistant",
                                  NUM_CENTROIDS, TOP_K, fitted=False)
    # only the configuration read below: Cloud+MTP's figures are the same with hyco-exact beside it or not
    random = check({**fitted_masked, "assistant": scrambled}, tmp_path / "random", ["cloud-mtp"])
    assert random["lossless"]["cloud-mtp"]["equal"] is True
    assert random["configs"]["cloud-mtp"]["mat"] < report["configs"]["cloud-mtp"]["mat"] - 0.3


@pytest.mark.slow
def test_the_tiny_recipe_with_a_masked_head_end_to_end(fitted_masked, tmp_path):
    """The tiny recipe (CI-sized like the ladder) from vocab to check with the fitted
    centroid-masked head: qat's proofs pass, export bundles the masked step graph, and check on the
    deployed QDQ graphs (the bundle's INT4 head, uint16 inputs) stays lossless with drafts accepted."""
    from ladder import LADDER, RECIPE

    from hyco.config.recipe import load_recipe
    from hyco.pipeline.run import run_recipe

    models = [f"models.{k}={v}" for k, v in fitted_masked.items()]
    recipe = load_recipe(RECIPE, [*models, *LADDER, "stages=[vocab,answers,convert,qat,calibrate,export,check]",
                                  "qat.steps=8", "calibrate.htp_check=true", "calibrate.simulator_passes=1",
                                  "check.configs=[hyco-exact,cloud-mtp]", "check.max_new_tokens=16"])
    run_recipe(recipe, tmp_path / "run", log=lambda *a: None)
    qat = json.loads((tmp_path / "run" / "qat" / "report.json").read_text())
    assert qat["parity"]["passed"] and "same_scored_tokens" in qat["agreement"]["w4_qat"]
    # the masked step graph (16-bit activations) whole on the HTP and within its bound on the simulator
    mtp = json.loads((tmp_path / "run" / "calibrate" / "report.json").read_text())["graphs"]["mtp_step.qdq.onnx"]
    assert mtp["htp_accepted"] is True and mtp["cpu_nodes"] == 0
    assert mtp["htp"]["simulator_vs_cpu"]["within_bound"] is True
    bundle = tmp_path / "run" / "export" / "bundle"
    spec = json.loads((bundle / "io_spec.json").read_text())
    assert "centroids" in json.dumps(spec)
    report = json.loads((tmp_path / "run" / "check" / "report.json").read_text())
    assert "mtp_step QDQ graph (deployed numerics)" in report["settings"]["backends"]["mtp"]
    for name in ("hyco-exact", "cloud-mtp"):
        v = report["lossless"][name]
        assert v["equal"] is True and v["accepted_draft_tokens"] > 0, (name, v)
    assert report["configs"]["hyco-exact"]["mat"] > 1.5
