"""A gemma4_assistant head with `use_ordered_embeddings` (transformers' centroid-masked output
layer) is refused by qat/ with one line naming config.json and the key, never silently turned
into a plain-lm_head drafter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hyco.qat.mtp import TeacherForcedHead
from hyco.qat.step_graph import MtpStep, linear_names

from hyco.cli import main
from hyco.errors import HycoError

NUM_CENTROIDS, TOP_K = 64, 4


def ordered_assistant(src, dst):
    """Copy of the fixture head with use_ordered_embeddings on: a centroid layer and a token
    ordering (a seeded permutation) in an extra shard, listed in the index."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    text = config["text_config"]
    config.update(use_ordered_embeddings=True, num_centroids=NUM_CENTROIDS, centroid_intermediate_top_k=TOP_K)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)
    extra = {"masked_embedding.centroids.weight": torch.randn(NUM_CENTROIDS, text["hidden_size"], generator=g),
             "masked_embedding.token_ordering": torch.randperm(text["vocab_size"], generator=g)}
    save_file(extra, str(dst / "model-extra.safetensors"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-extra.safetensors" for k in extra})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="module")
def ordered(tiny_text_family, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = ordered_assistant(tiny_text_family["assistant"], tmp_path_factory.mktemp("ordered") / "assistant")
    head = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, head


def test_the_flag_changes_the_head(ordered):
    """Why it must be refused: transformers' masked head scores only the tokens of the top
    centroids, so its logits differ from lm_head(h) on most of the vocabulary."""
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


def test_qat_pieces_refuse_the_masked_head(ordered):
    folder, head = ordered
    with pytest.raises(HycoError, match=r"config\.json: use_ordered_embeddings is true"):
        TeacherForcedHead(head)
    params = head.state_dict()
    weights = {n: params[f"{n}.weight"] for n in linear_names(len(head.model.layers))}
    with pytest.raises(HycoError, match=r"config\.json: use_ordered_embeddings is true"):
        MtpStep(head, weights, topk=4)


def test_qat_cli_refuses_with_one_line_and_writes_nothing(ordered, tiny_text_family, tmp_path, capsys):
    from hyco.vocab.stage import build_vocab

    from hyco.recipe import VocabConfig, load_recipe

    folder, _ = ordered
    (tmp_path / "vocab").mkdir()
    build_vocab(tokenizer=tiny_text_family["tokenizer"], dataset=load_recipe("recipes/tiny.yaml").dataset,
                config=VocabConfig(size=1345, count_conversations=40, reserved_train=1, reserved_eval=1,
                                   heldout_conversations=5), out=tmp_path / "vocab")
    common = ["--verifier", str(tiny_text_family["verifier"]), "--tokenizer", str(tiny_text_family["tokenizer"]),
              "--vocab", str(tmp_path / "vocab")]
    assert main(["answers", *common, "--source", "corpus", "--out", str(tmp_path / "answers")]) == 0
    args = ["qat", *common, "--assistant", str(folder), "--answers", str(tmp_path / "answers"), "--out", str(tmp_path / "q")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{folder}/config.json: use_ordered_embeddings is true" in err[0]
    assert not (tmp_path / "q").exists()
    # The unmodified head passes the same check (the refusal is about the flag, not the folder).
    from hyco.qat.mtp import require_plain_output_layer
    from transformers import AutoConfig

    require_plain_output_layer(AutoConfig.from_pretrained(tiny_text_family["assistant"]), str(tiny_text_family["assistant"]))
