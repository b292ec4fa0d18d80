"""A tied output layer (tie_word_embeddings, no lm_head.* in the files), as Gemma releases ship:
convert takes the output layer's ints and scales from embed_tokens, restricted to the keep set,
bit-exact, and its graphs match transformers on the tied model, which itself computes exactly
what an untied twin holding copies of embed_tokens' tensors computes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import load_file, save_file
from test_convert import write_keep_set

from hyco.base.errors import HycoError
from hyco.config.recipe import ConvertConfig

EMBED = "model.embed_tokens"


def _edit_shards(folder, edit):
    """Rewrite every shard through `edit(tensors) -> tensors` and the index to match."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = edit(load_file(str(folder / shard)))
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2))


def _set_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def write_tied(src, dst):
    """The fixture SLM with its output layer tied: lm_head.* dropped, tie_word_embeddings set."""
    shutil.copytree(src, dst)
    _edit_shards(dst, lambda t: {k: v for k, v in t.items() if not k.startswith("lm_head.")})
    _set_config(dst, tie_word_embeddings=True)
    return dst


def write_untied_twin(src, dst):
    """The same model untied: lm_head holds copies of embed_tokens' ints and row scales, no SRQ."""
    shutil.copytree(src, dst)
    table = {k: v for k, v in load_file(str(next(src.glob("model-00001-*.safetensors")))).items() if k.startswith(EMBED + ".")}

    def edit(tensors):
        tensors = {k: v for k, v in tensors.items() if not k.startswith("lm_head.")}
        if f"{EMBED}.embedding_quantized" in tensors:
            tensors["lm_head.weight"] = table[f"{EMBED}.embedding_quantized"].clone()
            tensors["lm_head.weight_scale"] = table[f"{EMBED}.embedding_scale"].clone()
        return tensors

    _edit_shards(dst, edit)
    return dst


@pytest.fixture(scope="module")
def pair(tiny_text_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    slm = tiny_text_family["slm"]
    assert f"{EMBED}.embedding_quantized" in load_file(str(next(slm.glob("model-00001-*.safetensors"))))
    return write_tied(slm, root / "tied"), write_untied_twin(slm, root / "twin")


def test_tied_checkpoint_loads_with_embed_tokens_tensors(pair):
    from hyco.convert.load import completeness, load_model, read_checkpoint
    from hyco.convert.rewrites import unpacked_ints

    tied, twin = pair
    ckpt = read_checkpoint(tied)
    assert ckpt.tied_head and not read_checkpoint(twin).tied_head
    report = completeness(ckpt)
    assert report["tied_head"] == {"ints": f"{EMBED}.embedding_quantized", "scales": f"{EMBED}.embedding_scale",
                                   "bits": 8}
    assert not report["missing"] and not report["extra"]
    model, text, head = load_model(ckpt)
    assert head.weight is text.embed_tokens.embedding_quantized  # shared, not copied
    assert head.weight_scale is text.embed_tokens.embedding_scale
    assert float(head.input_activation_scale.detach()) == 0.0 and float(head.output_activation_scale.detach()) == 0.0
    twin_model, _, twin_head = load_model(read_checkpoint(twin))
    assert head.num_bits == twin_head.num_bits == text.embed_tokens.num_bits
    assert torch.equal(unpacked_ints(head), unpacked_ints(twin_head))
    ids = torch.randint(3, 4096, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tied_logits, twin_logits = model(ids).logits, twin_model(ids).logits
    assert torch.equal(tied_logits, twin_logits)  # the same ints, scales and arithmetic: identical


def test_tied_head_unpacks_at_the_tables_width(pair, tmp_path):
    """A config whose lm_head override names another width (4) than embed_tokens' table (8):
    the tied layer still reads the table at 8 bits."""
    from hyco.convert.load import completeness, load_model, read_checkpoint

    tied, twin = pair
    odd = shutil.copytree(tied, tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    config["quantization_config"]["module_quant_configs"]["^lm_head$"] = {"num_bits": 4}
    (odd / "config.json").write_text(json.dumps(config))
    ckpt = read_checkpoint(odd)
    assert completeness(ckpt)["tied_head"]["bits"] == 8 and ckpt.bits["lm_head"] == 8
    model, _, head = load_model(ckpt)
    twin_model, _, _ = load_model(read_checkpoint(twin))
    assert head.num_bits == 8
    ids = torch.randint(3, 4096, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, twin_model(ids).logits)


@pytest.fixture(scope="module")
def converted_tied(pair, tiny_text_family, tmp_path_factory):
    from hyco.convert.stage import convert

    tied, _ = pair
    root = tmp_path_factory.mktemp("tied_convert")
    keep_ids = np.sort(np.random.default_rng(1).choice(4096, 1000, replace=False))
    keep = write_keep_set(root / "vocab", tiny_text_family["tokenizer"], keep_ids)
    config = ConvertConfig(rows=9, prefill_chunk=8, ring_full=32, ring_sliding=16, topk=4, parity_ring_full=16)
    summary = convert(checkpoint=tied, out=root / "out", config=config, keep_set=keep, tokenizer=tiny_text_family["tokenizer"])
    return root / "out", keep_ids, summary


def _graph_lm_head(out, graph):
    """The tree/prefill graph's output-layer ints [keep, hidden] and scales [keep], read back here."""
    from onnx.external_data_helper import load_external_data_for_tensor

    from hyco.formats.int4 import unpack_int4

    enc = json.loads((out / "encodings.json").read_text())["weights"]["lm_head"]
    model = onnx.load(str(out / graph), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    ints_t, scale_t = inits[enc["onnx_initializer"]], inits[enc["onnx_initializer"][: -len("ints")] + "scale"]
    for t in (ints_t, scale_t):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            load_external_data_for_tensor(t, str(out))
    shape = tuple(ints_t.dims)
    if ints_t.data_type == onnx.TensorProto.INT4:
        ints = unpack_int4(ints_t.raw_data, int(np.prod(shape))).reshape(shape)
    else:
        ints = numpy_helper.to_array(ints_t)
    return ints, numpy_helper.to_array(scale_t)


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_tied_convert_is_bit_exact_to_embed_tokens(converted_tied, pair):
    out, keep_ids, summary = converted_tied
    tied, _ = pair
    assert summary["bitexact_all_equal"] and summary["parity_passed"]
    table = load_file(str(next(tied.glob("model-00001-*.safetensors"))))
    ck_ints = table[f"{EMBED}.embedding_quantized"].numpy()[keep_ids]  # int8 storage: the values themselves
    ck_scale = table[f"{EMBED}.embedding_scale"].numpy().reshape(-1)[keep_ids]
    bitexact = json.loads((out / "bitexact.json").read_text())
    for graph in ("tree.onnx", "prefill.onnx"):
        row = bitexact["graphs"][graph]["lm_head"]
        assert row["checkpoint_tensors"] == [f"{EMBED}.embedding_quantized", f"{EMBED}.embedding_scale"]
        assert row["ints_equal"] and row["scales_equal"] and row["shape"] == [len(keep_ids), ck_ints.shape[1]]
        ints, scale = _graph_lm_head(out, graph)
        np.testing.assert_array_equal(ints, ck_ints)
        np.testing.assert_array_equal(scale.view(np.uint32), ck_scale.astype(np.float32).view(np.uint32))
    parity = json.loads((out / "parity.json").read_text())
    assert parity["passed"] and all(c["passed"] for c in parity["checks"].values())


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_bitexact_compares_against_the_embedding_table(converted_tied, pair, tmp_path):
    """The proof reads embed_tokens: one changed int in a kept row of the table fails it."""
    from hyco.convert.load import completeness, read_checkpoint
    from hyco.convert.stage import bitexact

    out, keep_ids, _ = converted_tied
    tied, _ = pair
    changed = shutil.copytree(tied, tmp_path / "changed")

    def edit(tensors):
        if f"{EMBED}.embedding_quantized" in tensors:
            table = tensors[f"{EMBED}.embedding_quantized"].clone()
            table[int(keep_ids[5]), 0] = -table[int(keep_ids[5]), 0] - 1  # always a different int8 value
            tensors[f"{EMBED}.embedding_quantized"] = table
        return tensors

    _edit_shards(changed, edit)
    ckpt = read_checkpoint(changed)
    completeness(ckpt)
    enc = json.loads((out / "encodings.json").read_text())
    rows = bitexact(out, "tree.onnx", enc, ckpt, keep_ids)
    assert not rows["lm_head"]["ints_equal"] and rows["lm_head"]["scales_equal"]
    assert all(r["ints_equal"] for name, r in rows.items() if name != "lm_head")


def test_tied_with_block_wise_embedding_scales_is_refused(pair, tmp_path):
    from hyco.convert.load import completeness, read_checkpoint

    tied, _ = pair
    blocks = shutil.copytree(tied, tmp_path / "blocks")

    def edit(tensors):
        if f"{EMBED}.embedding_scale" in tensors:
            tensors[f"{EMBED}.embedding_scale"] = tensors[f"{EMBED}.embedding_scale"].repeat(1, 2).contiguous()
        return tensors

    _edit_shards(blocks, edit)
    with pytest.raises(HycoError, match=rf"{EMBED}\.embedding_scale has 2 blocks per row, but a tied output layer"):
        completeness(read_checkpoint(blocks))


# --- the other loaders: the check stage's torch SLM ---------------------------------------------


def write_tie_flag_with_stored_head(src, dst):
    """The published E2B QAT-mobile file's way: tie_word_embeddings true, and lm_head stored anyway."""
    shutil.copytree(src, dst)
    _set_config(dst, tie_word_embeddings=True)
    return dst


def test_check_loads_a_tie_flag_with_a_stored_head_as_the_untied_model(tiny_text_family, tmp_path):
    """transformers' own tie would reach for embed_tokens.weight, which a quantized table lacks
    (an AttributeError in tie_weights); the stored head is the model's output layer."""
    from hyco.runtime.inputs import load_model

    stored = write_tie_flag_with_stored_head(tiny_text_family["slm"], tmp_path / "stored")
    model, plain = load_model(stored, "SLM"), load_model(tiny_text_family["slm"], "SLM")
    assert model.lm_head.weight is not model.model.embed_tokens.embedding_quantized
    ids = torch.randint(3, 4096, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_check_loads_a_tied_table_as_its_untied_twin(pair):
    from hyco.runtime.inputs import load_model

    tied, twin = pair
    model, twin_model = load_model(tied, "SLM"), load_model(twin, "SLM")
    assert model.lm_head.weight is model.model.embed_tokens.embedding_quantized
    assert model.lm_head.num_bits == model.model.embed_tokens.num_bits
    ids = torch.randint(3, 4096, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, twin_model(ids).logits)
