"""The tiny family in Google's published Gemma 4 layout (preset `tiny`), feature by feature, and
transformers' own classes reading it: the fixture cannot drift into a format only we read.

The layout as the published E2B QAT-mobile and 26B-A4B files have it (issue 24): a multimodal
wrapper with quantized towers, one model.safetensors, the published bit map with block-scaled
per-layer scales, a float per_layer_model_projection, lm_head stored under the tie flag, k/v on
KV-shared layers, cache scales on every layer, Gemma 4's special ids and chat template; the
verifier with MoE blocks and K = V on its full layers.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from hyco.formats.gemma_quant import bits_for_module, dequantize, unpack

TEXT = "model.language_model."


@pytest.fixture(scope="module")
def slm_files(tiny_family):
    folder = tiny_family["slm"]
    config = json.loads((folder / "config.json").read_text())
    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return folder, config, tensors


def test_slm_is_one_file_in_the_multimodal_wrapper(slm_files):
    folder, config, tensors = slm_files
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"] and config["model_type"] == "gemma4"
    assert not (folder / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]
    text = [k for k in tensors if k.startswith(TEXT)]
    towers = {k.split(".")[1] for k in tensors if not k.startswith(TEXT) and k != "lm_head.weight"
              and not k.startswith("lm_head.")}
    assert len(text) > 100 and towers == {"vision_tower", "audio_tower", "embed_vision", "embed_audio"}
    # quantized towers: the vision tower at 8 bits, the audio tower at 2 (Google's patterns)
    assert tensors["model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight"].dtype == torch.int8
    assert tensors["model.audio_tower.layers.0.self_attn.q_proj.linear.weight"].dtype == torch.uint8
    assert "model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight_scale" in tensors
    # the towers' projections listed in modules_to_not_convert stay float
    assert tensors["model.embed_vision.embedding_projection.weight"].dtype == torch.bfloat16


def test_slm_bit_map_is_the_published_one(slm_files):
    _, config, tensors = slm_files
    quant, text = config["quantization_config"], config["text_config"]
    layers, shared = text["num_hidden_layers"], text["num_kv_shared_layers"]

    def bits(module):
        return bits_for_module(module, quant["module_quant_configs"], quant["num_bits"])

    assert bits(TEXT + "embed_tokens") == 2 and bits(TEXT + "embed_tokens_per_layer") == 4 and bits("lm_head") == 2
    for i in range(layers):
        assert bits(f"{TEXT}layers.{i}.self_attn.q_proj") == 4 and bits(f"{TEXT}layers.{i}.self_attn.k_proj") == 4
        assert bits(f"{TEXT}layers.{i}.mlp.down_proj") == (4 if i < layers - shared else 2)
        assert bits(f"{TEXT}layers.{i}.per_layer_input_gate") == bits(f"{TEXT}layers.{i}.per_layer_projection") == 8
    assert list(quant["module_quant_configs"]) == sorted(quant["module_quant_configs"])  # as save_pretrained sorts
    # the per-layer table: one scale per layer's block of a row
    scale = tensors[TEXT + "embed_tokens_per_layer.embedding_scale"]
    assert tuple(scale.shape) == (text["vocab_size"], layers)
    # per_layer_model_projection left in float
    assert "per_layer_model_projection" in quant["modules_to_not_convert"]
    assert tensors[TEXT + "per_layer_model_projection.weight"].dtype == torch.bfloat16
    assert TEXT + "per_layer_model_projection.weight_scale" not in tensors


def test_lm_head_is_stored_with_the_token_tables_bytes_under_the_tie_flag(slm_files):
    _, config, tensors = slm_files
    assert config["tie_word_embeddings"] is True and config["text_config"]["tie_word_embeddings"] is True
    assert torch.equal(tensors["lm_head.weight"], tensors[TEXT + "embed_tokens.embedding_quantized"])
    assert torch.equal(tensors["lm_head.weight_scale"], tensors[TEXT + "embed_tokens.embedding_scale"])


def test_kv_shared_layers_carry_k_v_and_every_layer_cache_scales(slm_files):
    _, config, tensors = slm_files
    text = config["text_config"]
    layers, shared = text["num_hidden_layers"], text["num_kv_shared_layers"]
    for i in range(layers - shared, layers):
        assert f"{TEXT}layers.{i}.self_attn.k_proj.weight" in tensors
        assert f"{TEXT}layers.{i}.self_attn.v_proj.weight_scale" in tensors
    for i in range(layers):
        assert float(tensors[f"{TEXT}layers.{i}.self_attn.k_cache_scale"]) > 0
        assert float(tensors[f"{TEXT}layers.{i}.self_attn.v_cache_scale"]) > 0


def test_tokens_and_chat_template_are_gemma4s(tiny_family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_family["tokenizer"]))
    ids = tok.convert_tokens_to_ids(["<pad>", "<eos>", "<bos>", "<|tool>", '<|"|>', "<|think|>", "<|channel>",
                                     "<channel|>", "<|turn>", "<turn|>"])
    assert ids == [0, 1, 2, 46, 52, 98, 100, 101, 105, 106]
    prompt = tok.apply_chat_template([{"role": "user", "content": " Hi "}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    thinking = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False,
                                       enable_thinking=True)
    assert thinking == "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    # a past answer is rendered with its thoughts stripped, as Gemma 4's template does
    past = tok.apply_chat_template([{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "<|channel>thought\nhmm<channel|>Hello"}],
                                   tokenize=False)
    assert past.endswith("<|turn>model\nHello<turn|>\n")
    for name in ("slm", "verifier"):
        config = json.loads((tiny_family[name] / "config.json").read_text())
        generation = json.loads((tiny_family[name] / "generation_config.json").read_text())
        assert config["eos_token_id"] == [1, 106] and generation["eos_token_id"] == [1, 106, 50]
        assert tok.convert_ids_to_tokens(config["image_token_id"]) == "<|image|>"


def test_verifier_is_the_26b_a4b_layout(tiny_family):
    folder = tiny_family["verifier"]
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"] and config["audio_config"] is None
    assert text["enable_moe_block"] and text["num_experts"] > text["top_k_experts"] >= 2
    assert text["attention_k_eq_v"]
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
    full = [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    for i in range(text["num_hidden_layers"]):
        layer = f"{TEXT}layers.{i}."
        assert {layer + "router.proj.weight", layer + "experts.gate_up_proj", layer + "experts.down_proj",
                layer + "mlp.down_proj.weight"} <= names
        assert (layer + "self_attn.v_proj.weight" in names) == (i not in full)  # K = V on full layers
    assert any(n.startswith("model.vision_tower.") for n in names)


def test_transformers_reads_the_published_slm_with_its_towers(tiny_family):
    """Gemma4ForConditionalGeneration.from_pretrained on the whole file, towers included. Two steps
    only the published file needs, both as transformers documents them: the tie flag with a stored
    lm_head crashes its tie_weights (so the config is untied), and 5.24's QuantizedEmbedding allocates
    [V, 1] scales (so the [V, L] block scales come back as a size mismatch, then are set; 5.25 reads
    them itself). Either way the table must come out as ints x block scale."""
    from transformers import AutoConfig, Gemma4ForConditionalGeneration

    from hyco.base.loading import checkpoint_files, quiet_transformers, set_block_scales

    folder = tiny_family["slm"]
    with quiet_transformers(), pytest.raises(AttributeError, match="not an nn.Parameter"):
        Gemma4ForConditionalGeneration.from_pretrained(str(folder), ignore_mismatched_sizes=True)
    config = AutoConfig.from_pretrained(str(folder))
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
    with quiet_transformers():
        model, info = Gemma4ForConditionalGeneration.from_pretrained(
            str(folder), config=config, dtype=torch.float32, ignore_mismatched_sizes=True, output_loading_info=True)
    assert not info["missing_keys"]
    # 5.24 allocates [V, 1] and reports the block scales as a size mismatch; 5.25 loads them itself.
    mismatched = [k for k, *_ in info["mismatched_keys"]]
    assert mismatched in ([TEXT + "embed_tokens_per_layer.embedding_scale"], []), mismatched
    # the KV-shared layers' k/v and the cache scales are in the file (tested above), and transformers
    # drops them silently: nothing is reported unexpected
    assert not info["unexpected_keys"]
    assert model.model.vision_tower is not None and model.model.audio_tower is not None
    from transformers.integrations.gemma_quant import QuantizedLinear

    q = model.model.vision_tower.encoder.layers[0].self_attn.q_proj.linear
    assert isinstance(q, QuantizedLinear) and q.num_bits == 8
    if mismatched:
        set_block_scales(model, checkpoint_files(folder), mismatched)
    # the dequantized per-layer table is ints x scale per block, and the loaded forward reads it
    table = model.model.language_model.embed_tokens_per_layer
    with safe_open(folder / "model.safetensors", "pt") as f:
        ints = unpack(f.get_tensor(TEXT + "embed_tokens_per_layer.embedding_quantized"), 4, table.embedding_dim)
        scale = f.get_tensor(TEXT + "embed_tokens_per_layer.embedding_scale")
    torch.testing.assert_close(table.weight, dequantize(ints, scale), rtol=0, atol=0)
    ids = torch.tensor([[2, 105, 300, 301, 106, 105]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 6, config.text_config.vocab_size) and torch.isfinite(logits).all()


def test_text_only_load_leaves_the_towers_on_disk_and_computes_the_same(tiny_family):
    """hyco's loader builds the wrapper without towers (their tensors are never read) and gives
    the logits transformers' full model gives."""
    from transformers import AutoConfig, Gemma4ForConditionalGeneration

    from hyco.base.loading import checkpoint_files, load_pretrained, quiet_transformers, set_block_scales

    folder = tiny_family["slm"]
    text_only = load_pretrained(folder, "slm", float_checkpoint=False, dtype=torch.float32).eval()
    assert text_only.model.vision_tower is None and text_only.model.audio_tower is None
    assert not any(n.startswith(("model.vision_tower", "model.audio_tower")) for n, _ in text_only.named_parameters())
    config = AutoConfig.from_pretrained(str(folder))
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
    with quiet_transformers():
        full = Gemma4ForConditionalGeneration.from_pretrained(str(folder), config=config, dtype=torch.float32,
                                                              ignore_mismatched_sizes=True).eval()
    set_block_scales(full, checkpoint_files(folder), [TEXT + "embed_tokens_per_layer.embedding_scale"])
    ids = torch.tensor([[2, 105, 400, 401, 402, 106, 105, 500]])
    with torch.no_grad():
        torch.testing.assert_close(text_only(input_ids=ids).logits, full(input_ids=ids).logits, rtol=0, atol=0)
    verifier = load_pretrained(tiny_family["verifier"], "verifier", dtype=torch.float32)
    assert verifier.model.vision_tower is None


def test_transformers_reads_the_published_verifier_whole(tiny_family):
    from transformers import AutoModelForCausalLM

    from hyco.base.loading import quiet_transformers

    with quiet_transformers():
        model, info = AutoModelForCausalLM.from_pretrained(str(tiny_family["verifier"]), dtype=torch.float32,
                                                           output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert type(model).__name__ == "Gemma4ForConditionalGeneration" and model.model.vision_tower is not None
    layer = model.model.language_model.layers[0]
    routed = {}
    layer.router.register_forward_hook(lambda m, a, out: routed.update(index=out[2]))
    with torch.no_grad():
        model(input_ids=torch.tensor([[2, 105, 300, 301, 302, 303]]))
    top_k = model.config.text_config.top_k_experts
    assert routed["index"].shape == (6, top_k) and len(set(routed["index"].flatten().tolist())) > 1


def test_keep_set_keeps_the_thought_channel_markers(ladder):
    keep = json.loads((ladder / "vocab" / "keep_set.json").read_text())["token_ids"]
    assert {1, 2, 100, 101, 105, 106} <= set(keep)


@pytest.mark.slow
def test_whole_tiny_recipe_on_the_text_only_layout(tmp_path):
    """The fast tier's ladder runs the recipe on the published layout; this runs it again on the
    project's earlier text-only layout (Gemma4ForCausalLM, sharded, untied lm_head), which stays
    a supported input."""
    from ladder import LADDER, run_args

    from hyco.pipeline.cli import main

    out = tmp_path / "run"
    assert main(run_args(out, [*LADDER, "fixtures.preset=tiny-text"])) == 0
    report = json.loads((out / "run_report.json").read_text())
    assert [s["status"] for s in report["stages"]] == ["built"] * 8
    convert = json.loads((out / "convert" / "report.json").read_text())
    assert convert["layout"] == "text-only" and convert["bitexact_all_equal"] and not convert.get("quantized_here")
    family = json.loads((out / "fixtures" / "family.json").read_text())
    assert family["layout"]["name"] == "text-only"


def _published_copy(src, dst, drop=(), cut_bytes=0):
    """A copy of a published-layout folder with tensors dropped from its one file, or the file cut."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    if drop:
        tensors = {k: v for k, v in load_file(str(path)).items() if k not in drop}
        save_file(tensors, str(path), metadata={"format": "pt"})
    if cut_bytes:
        data = path.read_bytes()
        path.write_bytes(data[:-cut_bytes])
    return dst


@pytest.mark.parametrize("case, expect", [
    ("truncated", "model.safetensors: truncated: tensor"),
    ("missing", f"missing tensor {TEXT}layers.1.mlp.up_proj.weight_scale"),
])
def test_convert_refuses_a_bad_published_checkpoint(case, expect, tiny_family, tmp_path, capsys):
    """The one-file layout's bad input: one line naming the file and the tensor, exit 2, no output."""
    from hyco.pipeline.cli import main

    src = tiny_family["slm"]
    if case == "truncated":
        ck = _published_copy(src, tmp_path / "ck", cut_bytes=1000)
    else:
        ck = _published_copy(src, tmp_path / "ck", drop={f"{TEXT}layers.1.mlp.up_proj.weight_scale"})
    out = tmp_path / "out"
    rc = main(["convert", "--checkpoint", str(ck), "--out", str(out), "--no-parity", "--rows", "4",
               "--prefill-chunk", "4", "--ring-full", "16", "--ring-sliding", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and expect in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_tie_flag_without_a_stored_head_reads_the_token_table(tiny_family, tmp_path):
    """The published file with its lm_head left out (the tie flag then means what it says): the
    output layer is embed_tokens' 2-bit table, proven bit-exact against it, and the text-only
    loader gives the same logits as the file with the stored copy."""
    from hyco.convert.stage import convert

    from hyco.base.loading import load_pretrained
    from hyco.config.recipe import ConvertConfig

    head = {f"lm_head.{t}" for t in ("weight", "weight_scale", "input_activation_scale", "output_activation_scale")}
    ck = _published_copy(tiny_family["slm"], tmp_path / "ck", drop=head)
    config = ConvertConfig(rows=4, prefill_chunk=4, ring_full=16, ring_sliding=8, topk=4, parity=False,
                           use_keep_set=False)
    convert(checkpoint=ck, out=tmp_path / "out", config=config)
    bitexact = json.loads((tmp_path / "out" / "bitexact.json").read_text())
    row = bitexact["graphs"]["tree.onnx"]["lm_head"]
    assert bitexact["all_equal"] and row["bits"] == 2
    assert row["checkpoint_tensors"][0] == TEXT + "embed_tokens.embedding_quantized"
    ids = torch.tensor([[2, 105, 300, 301, 106]])
    with torch.no_grad():
        tied = load_pretrained(ck, "slm", float_checkpoint=False, dtype=torch.float32)(input_ids=ids).logits
        stored = load_pretrained(tiny_family["slm"], "slm", float_checkpoint=False, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(tied, stored, rtol=0, atol=0)


def test_check_refuses_a_truncated_published_verifier(tiny_family, tmp_path, capsys):
    """The verifier's one file cut: every loader's header check names it before any stage works."""
    from hyco.base.errors import HycoError
    from hyco.base.loading import load_pretrained

    verifier = _published_copy(tiny_family["verifier"], tmp_path / "verifier", cut_bytes=10)
    with pytest.raises(HycoError, match=r"verifier/model\.safetensors: truncated: tensor"):
        load_pretrained(verifier, "verifier", dtype=torch.float32)


def test_prompts_and_answers_start_after_the_empty_thought_channel(ladder, tiny_family):
    """The answers stage's answers (read by qat and calibrate) follow the template's generation prompt: the model's
    turn starts after `<|channel>thought\\n<channel|>`, as Gemma 4 -it writes it."""
    from transformers import AutoTokenizer

    from hyco.base.loading import read_jsonl
    from hyco.data.chat import EMPTY_THOUGHT

    tok = AutoTokenizer.from_pretrained(str(tiny_family["tokenizer"]))
    answers = read_jsonl(ladder / "answers" / "answers.jsonl")
    assert answers
    for record in answers:
        assert tok.decode(record["prompt_ids"]).endswith("<|turn>model\n" + EMPTY_THOUGHT)
        assert 101 not in record["answer_ids"][:1]  # the answer is the text after the channel


def test_text_only_load_reads_media_placeholders_as_tokens(tiny_family):
    """With the towers off, `<|image|>` / `<|audio|>` / `<|video|>` are ordinary ids (the NPU graph
    embeds them from its LUT); transformers' wrapper with towers swaps them for pad before the
    embedding. The text-only load must therefore differ from the full one exactly where one occurs."""
    from transformers import AutoConfig, Gemma4ForConditionalGeneration

    from hyco.base.loading import checkpoint_files, load_pretrained, quiet_transformers, set_block_scales

    folder = tiny_family["slm"]
    config = AutoConfig.from_pretrained(str(folder))
    text_only = load_pretrained(folder, "slm", float_checkpoint=False, dtype=torch.float32).eval()
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
    with quiet_transformers():
        full = Gemma4ForConditionalGeneration.from_pretrained(str(folder), config=config, dtype=torch.float32,
                                                              ignore_mismatched_sizes=True).eval()
    set_block_scales(full, checkpoint_files(folder), [TEXT + "embed_tokens_per_layer.embedding_scale"])
    image = config.image_token_id
    with torch.no_grad():
        plain = text_only(input_ids=torch.tensor([[2, 105, 300, 301]])).logits
        as_token = text_only(input_ids=torch.tensor([[2, 105, 300, image]])).logits
        padded = full(input_ids=torch.tensor([[2, 105, 300, image]])).logits
        as_pad = text_only(input_ids=torch.tensor([[2, 105, 300, config.text_config.pad_token_id]])).logits
    torch.testing.assert_close(padded, as_pad, rtol=0, atol=0)  # the wrapper reads it as <pad>
    assert not torch.equal(as_token[0, -1], as_pad[0, -1]) and not torch.equal(as_token[0, -1], plain[0, -1])
    torch.testing.assert_close(as_token[0, :-1], padded[0, :-1], rtol=0, atol=0)  # causal: earlier rows agree
