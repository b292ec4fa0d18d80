"""The full-size fixture writer (hyco/fixtures/fullsize.py, preset e2b-shapes), tested at reduced
depth: 4 SLM layers (S, F, S, F, the last two KV-shared, so both layer types share) and a 2-layer
verifier, at the real widths and the real 262,144-token vocabulary. The full 35-layer family is
written by `hyco-convert fixtures --preset e2b-shapes` (about 4.5 GB; see the issue 13 benchmark).

One family is written per module, in a subprocess that reports its own peak RSS.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hyco.base.errors import HycoError
from hyco.fixtures import fullsize, models, slm
from hyco.fixtures.presets import get_preset
from hyco.fixtures.tokenizer import token_layout
from hyco.formats.gemma_quant import QatCheckpoint, bits_for_module

pytestmark = pytest.mark.slow

E2B = get_preset("e2b-shapes")
SMALL = fullsize.reduced(E2B, slm_layers=4, full_period=2, kv_shared=2, verifier_layers=2)
VOCAB = 262_144

WRITE = textwrap.dedent("""
    import json, sys, time
    import torch, transformers  # imported before the baseline is taken: the writer needs both
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM  # noqa: F401
    from hyco.base.memory import peak_rss_mb
    from hyco.fixtures import fullsize
    from hyco.fixtures.presets import get_preset

    def peak_kib():
        return peak_rss_mb() * 1024  # this process's own peak, not the vfork'ing pytest's

    spec = fullsize.reduced(get_preset("e2b-shapes"), slm_layers=4, full_period=2, kv_shared=2, verifier_layers=2)
    baseline = peak_kib()
    start = time.time()
    fullsize.write_family(sys.argv[1], spec, seed=0)
    print(json.dumps({"baseline_kib": baseline, "peak_kib": peak_kib(), "wall_s": time.time() - start}))
""")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    if not all((fullsize.TOKENIZER_DIR / f).is_file() for f in fullsize.TOKENIZER_FILES):
        pytest.skip(f"the real Gemma tokenizer is not in {fullsize.TOKENIZER_DIR}")
    out = tmp_path_factory.mktemp("fullsize") / "family"
    done = subprocess.run([sys.executable, "-c", WRITE, str(out)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    return {"root": out, "stats": stats, **{m: out / m for m in ("tokenizer", *fullsize.MODELS)}}


def header(folder: Path) -> dict[str, tuple[str, tuple[int, ...], Path]]:
    from hyco.base.loading import checkpoint_files

    return checkpoint_files(folder)


def sha256s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


# --- the full-size preset itself (meta device: free) ------------------------------------------


def test_e2b_config_carries_the_real_structure():
    from hyco.fixtures.writer import family_configs

    configs = family_configs(E2B)
    c = configs["slm"]
    assert (c.hidden_size, c.num_hidden_layers, c.num_kv_shared_layers, c.sliding_window) == (1536, 35, 20, 512)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == list(range(4, 35, 5))
    assert (c.num_attention_heads, c.num_key_value_heads) == (8, 1)
    assert {c.per_layer_config[i].head_dim for i in (0, 3, 15, 33)} == {256}
    assert {c.per_layer_config[i].head_dim for i in (4, 19, 34)} == {512}
    assert (c.hidden_size_per_layer_input, c.vocab_size, c.final_logit_softcapping) == (256, VOCAB, 30.0)
    assert c.rope_parameters["full_attention"]["rope_type"] == "proportional"
    names = models.stored_names(models.meta_model(c))
    assert names["model.layers.14.mlp.up_proj.weight"] == (6144, 1536)
    assert names["model.layers.15.mlp.up_proj.weight"] == (12288, 1536)  # double-wide on KV-shared layers
    assert "model.layers.15.self_attn.k_proj.weight" not in names
    a, v = configs["assistant"], configs["verifier"]
    assert (a.text_config.hidden_size, a.backbone_hidden_size, a.text_config.vocab_size) == (1024, 2816, VOCAB)
    assert a.text_config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert not a.use_ordered_embeddings  # the dense output layer
    assert v.hidden_size == 2816 and v.num_hidden_layers < 30  # a shallow stand-in, and the preset says so
    assert any("shallow stand-in" in n for n in E2B.notes)


def test_full_e2b_bit_map_by_parameter_count():
    """The whole 35-layer SLM's plan (no bytes written): parameters per bit width, counted from
    Google's published bit map and E2B's shapes by hand."""
    config = models.slm_config(E2B.slm, VOCAB, token_layout("packed"))
    qc = slm.quant_config(E2B.slm)
    by_bits: dict[int, int] = {}
    for t in fullsize.slm_tensors(config, qc, seed=0, per_layer_blocks=True):
        if t.name.endswith((".weight", ".embedding_quantized")) and t.dtype in ("U8", "I8"):
            module = t.name.rsplit(".", 1)[0]
            bits = bits_for_module(module, qc["module_quant_configs"], qc["num_bits"])
            by_bits[bits] = by_bits.get(bits, 0) + t.shape[0] * t.shape[1] * (8 // bits)
    h, layers, shared, v = 1536, 35, 20, VOCAB
    per_layer_table = v * layers * 256
    shared_mlps = shared * 3 * h * 2 * 6144
    assert by_bits[2] == 2 * v * h + shared_mlps  # token table, lm_head (its bytes), MLPs of layers 15-34
    assert by_bits[8] == layers * 2 * h * 256  # per_layer_input_gate + per_layer_projection
    assert by_bits[4] > per_layer_table  # the per-layer table, attention, MLPs of layers 0-14
    assert per_layer_table == 2_348_810_240  # the "2.35 G per-layer-embedding parameters" of the issue
    names = {t.name: t for t in fullsize.slm_tensors(config, qc, seed=0, per_layer_blocks=True)}
    assert names["model.embed_tokens_per_layer.embedding_scale"].shape == (v, layers)
    assert names["model.per_layer_model_projection.weight"].dtype == "BF16"  # left in float


# --- the reduced-depth family on disk ---------------------------------------------------------


def test_writer_peak_rss_is_a_small_fraction_of_the_largest_shard(family):
    """The writer streams: its peak RSS above the imports stays under a tenth of the largest
    shard (the verifier's 262,144 x 2,816 BF16 table, 1.48 GB). Holding any one table whole would
    break this bound."""
    shards = [p for m in fullsize.MODELS for p in family[m].glob("*.safetensors")]
    largest = max(p.stat().st_size for p in shards)
    assert largest >= VOCAB * 2816 * 2
    stats = family["stats"]
    extra = (stats["peak_kib"] - stats["baseline_kib"]) * 1024
    assert extra < largest / 10, f"writer used {extra / 2**20:.0f} MiB above its imports ({stats})"
    assert stats["peak_kib"] * 1024 < 2 * 2**30


def test_slm_format_follows_the_bit_map(family):
    tensors = header(family["slm"])
    config = json.loads((family["slm"] / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "gemma" and config["num_kv_shared_layers"] == 2
    expect_bits = {"model.embed_tokens": 2, "model.embed_tokens_per_layer": 4, "lm_head": 2,
                   "model.layers.0.self_attn.k_proj": 4, "model.layers.1.self_attn.v_proj": 4,
                   "model.layers.1.mlp.down_proj": 4, "model.layers.2.mlp.down_proj": 2,
                   "model.layers.3.mlp.gate_proj": 2, "model.layers.3.self_attn.q_proj": 4,
                   "model.layers.0.per_layer_input_gate": 8, "model.layers.3.per_layer_projection": 8}
    for module, bits in expect_bits.items():
        assert bits_for_module(module, qc["module_quant_configs"], qc["num_bits"]) == bits, module
    assert qc["modules_to_not_convert"] == ["per_layer_model_projection"] and config["tie_word_embeddings"]
    assert tensors["model.per_layer_model_projection.weight"][0] == "BF16"
    assert "model.per_layer_model_projection.weight_scale" not in tensors
    meta = models.meta_model(models.slm_config(SMALL.slm, VOCAB, token_layout("packed")))
    kinds = {n: k for n, k in slm.module_kinds(meta).items() if n != "model.per_layer_model_projection"}
    widths = {n: m.in_features if kinds[n] == "linear" else m.embedding_dim
              for n, m in meta.named_modules() if n in kinds}
    for module, width in widths.items():
        bits = bits_for_module(module, qc["module_quant_configs"], qc["num_bits"])
        storage = f"{module}.weight" if kinds[module] == "linear" else f"{module}.embedding_quantized"
        scale = f"{module}.weight_scale" if kinds[module] == "linear" else f"{module}.embedding_scale"
        dtype, shape, _ = tensors[storage]
        assert dtype == ("I8" if bits == 8 else "U8") and shape[1] == width * bits // 8, storage
        blocks = 4 if module == "model.embed_tokens_per_layer" else 1  # one scale per layer's block
        assert tensors[scale][:2] == ("F32", (shape[0], blocks)), scale
    assert tensors["model.embed_tokens_per_layer.embedding_quantized"][1] == (VOCAB, 4 * 256 // 2)
    assert tensors["model.layers.3.mlp.up_proj.weight"][1] == (2 * 6144, 1536 // 4)
    assert not any(".layers.2.self_attn.k_proj" in n or ".layers.3.self_attn.v_proj" in n for n in tensors)
    assert sorted(n for n in tensors if n.endswith("_cache_scale")) == [
        f"model.layers.{i}.self_attn.{w}_cache_scale" for i in (0, 1) for w in ("k", "v")]
    # index.json: every tensor mapped to the shard that holds it, total_size = the data bytes
    index = json.loads((family["slm"] / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    data = sum(np.dtype(fullsize.NUMPY[d]).itemsize * int(np.prod(s)) for d, s, _ in tensors.values())
    assert index["metadata"]["total_size"] == data
    # the stage's report reads it without loading the model
    from hyco.config.recipe import FixturesConfig
    from hyco.fixtures.stage import family_report

    report = family_report(family, FixturesConfig(preset="e2b-shapes"))
    assert set(report["slm"]["params_by_bits"]) == {"2", "4", "8"}
    assert report["slm"]["srq_scales_on"] == 3 * 4 and report["slm"]["kv_cache_scales"] == 4


def test_slm_ints_are_zero_mean_and_lm_head_holds_the_token_table(family):
    ckpt = QatCheckpoint(family["slm"])
    for module, width in (("model.layers.0.mlp.gate_proj", 1536), ("model.layers.3.mlp.down_proj", 12288),
                          ("model.layers.0.self_attn.k_proj", 1536)):
        ints, scale, bits = ckpt.linear(module, width)
        values = ints.float()
        # the codes' law: mean 0 (a shared mean offset grows through the layers), std as designed
        assert abs(float(values.mean())) < 0.02 * fullsize.code_std(bits), module
        assert abs(float(values.std()) / fullsize.code_std(bits) - 1) < 0.02, module
        assert int(ints.min()) >= -(1 << (bits - 1)) and int(ints.max()) <= (1 << (bits - 1)) - 1
        # dequantized rows have std ~ 1/sqrt(fan_in)
        assert abs(float((values * scale).std()) * width**0.5 - 1) < 0.1, module
    head = ckpt.tensor("lm_head.weight")
    assert torch.equal(head, ckpt.tensor("model.embed_tokens.embedding_quantized"))
    assert torch.equal(ckpt.tensor("lm_head.weight_scale"), ckpt.tensor("model.embed_tokens.embedding_scale"))


def test_slm_loads_in_transformers_with_plausible_srq_and_kv_scales(family):
    """from_pretrained on the folder (transformers' GemmaQuantizer path, through hyco's loader: the
    stored lm_head under the tie flag and the block scales, as the published file needs; it refuses
    any missing or misshapen tensor), bit-exact ints, and a forward on real text: the constant SRQ
    scales clip almost nothing, the KV scales cover K/V."""
    from transformers import AutoTokenizer, DynamicCache

    from hyco.base.loading import load_pretrained

    model = load_pretrained(family["slm"], "slm", float_checkpoint=False, dtype=torch.float32)
    ckpt = QatCheckpoint(family["slm"])
    layer3 = model.model.layers[3].mlp.down_proj
    assert layer3.num_bits == 2 and torch.equal(layer3.weight, ckpt.tensor("model.layers.3.mlp.down_proj.weight"))
    assert model.model.embed_tokens_per_layer.num_bits == 4 and model.lm_head.num_bits == 2
    assert tuple(model.model.embed_tokens_per_layer.embedding_scale.shape) == (VOCAB, 4)
    tok = AutoTokenizer.from_pretrained(str(family["slm"]))
    text = ("The committee reviewed the proposal on Tuesday and asked for a revised budget. "
            "안녕하세요, 오늘 날씨가 좋네요. def f(x): return x * 2  # doubles")
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 30 and int(ids.max()) < VOCAB
    clipped: dict[str, float] = {}

    def watch(name):
        def hook(mod, args, out):
            x = args[0]
            for which, s in (("in", mod.input_activation_scale), ("out", mod.output_activation_scale)):
                if float(s) > 0 and which == "in":
                    clipped[f"{name}.in"] = float((x.abs() > 127.5 * float(s)).float().mean())
            if float(mod.output_activation_scale) > 0:
                # the output is already rounded: measure the un-rounded product instead
                raw = torch.nn.functional.linear(x, mod._dequantize_weights(x.dtype))
                clipped[f"{name}.out"] = float((raw.abs() > 127.5 * float(mod.output_activation_scale)).float().mean())
        return hook

    for name, m in model.model.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            m.register_forward_hook(watch(name))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
    assert bool(torch.isfinite(hidden).all())
    assert len(clipped) == 3 * 4 and max(clipped.values()) < 1e-3, clipped
    ckpt_kv = {n: float(ckpt.tensor(n)) for n in ckpt.weight_map if n.endswith("_cache_scale")}
    for i in (0, 1):
        for which, stored in (("k", cache.layers[i].keys), ("v", cache.layers[i].values)):
            scale = ckpt_kv[f"model.layers.{i}.self_attn.{which}_cache_scale"]
            assert float(stored.abs().max()) < 127 * scale, (i, which)


def test_slm_loads_through_the_project_loader(family):
    from hyco.convert.load import completeness, load_model, read_checkpoint

    ckpt = read_checkpoint(family["slm"])
    report = completeness(ckpt)
    assert not report["missing"] and not report["misshapen"] and not report["extra"]
    model, text, head = load_model(ckpt)
    assert not ckpt.tied_head and head.num_bits == 2  # stored (tie flag set), the token table's bytes
    assert torch.equal(head.weight, text.embed_tokens.embedding_quantized)


def test_float_models_are_bf16_in_transformers_layout(family):
    """Verifier and assistant: exactly the tensors transformers expects (names, shapes), all BF16.
    The assistant is loaded for real; the verifier's 1.5 GB table is checked by header only."""
    from transformers import Gemma4AssistantForCausalLM

    from hyco.base.loading import check_float_checkpoint
    from hyco.fixtures.writer import family_configs

    configs = family_configs(SMALL)
    for name in ("verifier", "assistant"):
        tensors = header(family[name])
        check_float_checkpoint(tensors, name)
        expected = models.stored_names(models.meta_model(configs[name]))
        assert {n: s for n, (_, s, _) in tensors.items()} == {n: tuple(s) for n, s in expected.items()}, name
    verifier = header(family["verifier"])
    assert verifier["model.embed_tokens.weight"][1] == (VOCAB, 2816)
    head, info = Gemma4AssistantForCausalLM.from_pretrained(str(family["assistant"]), dtype=torch.bfloat16,
                                                            output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    weight = head.get_input_embeddings().weight
    assert weight.shape == (VOCAB, 1024) and 0.8 < float(weight[:4096].detach().float().std()) * 1024**0.5 < 1.2
    gen = json.loads((family["assistant"] / "generation_config.json").read_text())
    assert gen["num_assistant_tokens"] == 4


def test_tokenizer_is_the_real_gemma_one_within_the_model_rows(family):
    """The copy is the real tokenizer, piece for piece and id for id, minus the one added token
    with no row in a 262,144-row model (which the vocab stage would keep and convert refuse)."""
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained(str(fullsize.TOKENIZER_DIR))
    copy = AutoTokenizer.from_pretrained(str(family["tokenizer"]))
    assert len(real) == VOCAB + 1 and len(copy) == VOCAB and max(copy.all_special_ids) < VOCAB
    real_vocab = real.get_vocab()
    assert all(real_vocab[piece] == i for piece, i in copy.get_vocab().items())
    assert set(real_vocab) - set(copy.get_vocab()) == {"<image_soft_token>"}
    text = "<start_of_turn>user\n안녕하세요, what is 2+2? 🙂<end_of_turn>"
    assert copy(text)["input_ids"] == real(text)["input_ids"]
    fam = json.loads((family["root"] / "family.json").read_text())
    assert fam["tokenizer"]["left_out"] == ["<image_soft_token> (262144)"]
    for name in fullsize.MODELS:
        config = json.loads((family[name] / "config.json").read_text())
        text = config.get("text_config", config)
        assert (text["pad_token_id"], text["bos_token_id"], text["eos_token_id"]) == (0, 2, [1, 106]), name
        assert (family[name] / "tokenizer.json").is_file()
    fam = json.loads((family["root"] / "family.json").read_text())
    assert fam["full_size"] and fam["scales"]["how"].startswith("constants")


def test_same_seed_same_bytes(family, tmp_path):
    fullsize.write_family(tmp_path / "again", SMALL, seed=0, only=("slm", "assistant"))
    for name in ("slm", "assistant"):
        assert sha256s(tmp_path / "again" / name) == sha256s(family[name]), name
    fullsize.write_family(tmp_path / "other", SMALL, seed=1, only=("slm",))
    other, same = sha256s(tmp_path / "other" / "slm"), sha256s(family["slm"])
    differ = [n for n in same if n.endswith(".safetensors") and other[n] != same[n]]
    assert len(differ) == len([n for n in same if n.endswith(".safetensors")])


# --- bad input --------------------------------------------------------------------------------


def test_missing_tokenizer_is_an_error_naming_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(fullsize.TOKENIZER_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(HycoError, match=r"real Gemma tokenizer: tokenizer\.json, tokenizer_config\.json not found in .*nowhere"):
        fullsize.write_family(tmp_path / "fam", SMALL, seed=0)
    assert not (tmp_path / "fam").exists()


def test_full_size_presets_refuse_given_weights_and_distillation(tmp_path):
    from hyco.config.recipe import FixturesConfig
    from hyco.fixtures.stage import checked_preset
    from hyco.fixtures.writer import write_family

    with pytest.raises(HycoError, match="random ints"):
        write_family(tmp_path / "fam", preset="e2b-shapes", sources={"slm": lambda n, s: torch.zeros(s)})
    with pytest.raises(HycoError, match="distillation is for the tiny presets only"):
        checked_preset(FixturesConfig(preset="e2b-shapes", distill=True))
