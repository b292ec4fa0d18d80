"""A quantized embedding table with block scales, as Google's E2B QAT-mobile file stores its
per-layer table: `embedding_scale` [vocab, num_layers], one scale per layer's slice of the row.
transformers 5.24 allocates [vocab, 1] and refuses it; convert and the check stage's loader give
the table its block scales, and the rows then equal ints x scale per block (an independent numpy
unpack) and the forward equals transformers' own with the table stored dequantized in float."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hyco.formats.gemma_quant import bits_for_module, dequantize, pack, quantize_rows, unpack
from hyco.pipeline.cli import main

TABLE = "model.embed_tokens_per_layer"


def _table(folder):
    config = json.loads((folder / "config.json").read_text())
    quant = config["quantization_config"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][f"{TABLE}.embedding_quantized"]
    bits = bits_for_module(TABLE, quant.get("module_quant_configs"), quant.get("num_bits", 4))
    layers, width = config["num_hidden_layers"], config["hidden_size_per_layer_input"]
    return config, index, shard, bits, layers, width


def block_scaled_copy(src, dst):
    """The fixture SLM with its per-layer table requantized at the same bits with one scale per
    layer's block of each row ([V, layers]), as the published file stores it."""
    shutil.copytree(src, dst)
    _, _, shard, bits, layers, width = _table(dst)
    tensors = load_file(str(dst / shard))
    rows = dequantize(unpack(tensors[f"{TABLE}.embedding_quantized"], bits, layers * width),
                      tensors[f"{TABLE}.embedding_scale"])
    ints, scale = quantize_rows(rows.reshape(-1, width), bits)
    tensors[f"{TABLE}.embedding_quantized"] = pack(ints.reshape(rows.shape), bits)
    tensors[f"{TABLE}.embedding_scale"] = scale.reshape(rows.shape[0], layers).contiguous()
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    return dst


def float_table_twin(block, dst):
    """The same model with the per-layer table stored dequantized in float32 (ints x block scale)
    and left out of quantization, so transformers reads it as a plain float table."""
    shutil.copytree(block, dst)
    config, index, shard, bits, layers, width = _table(dst)
    tensors = load_file(str(dst / shard))
    ints = unpack(tensors.pop(f"{TABLE}.embedding_quantized"), bits, layers * width)
    scale = tensors.pop(f"{TABLE}.embedding_scale").repeat_interleave(width, dim=-1)
    tensors[f"{TABLE}.weight"] = ints.float() * scale
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    for k in (f"{TABLE}.embedding_quantized", f"{TABLE}.embedding_scale"):
        index["weight_map"].pop(k)
    index["weight_map"][f"{TABLE}.weight"] = shard
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config["quantization_config"]["modules_to_not_convert"] = ["embed_tokens_per_layer"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="module")
def block(tiny_text_family, tmp_path_factory):
    return block_scaled_copy(tiny_text_family["slm"], tmp_path_factory.mktemp("block") / "slm")


def _convert_model(folder):
    from hyco.convert.load import completeness, load_model, read_checkpoint

    ckpt = read_checkpoint(folder)
    completeness(ckpt)
    model, text, _ = load_model(ckpt)
    return model, text


def test_block_scaled_rows_equal_ints_times_the_block_scale(block):
    _, text = _convert_model(block)
    _, _, shard, bits, layers, width = _table(block)
    module = text.embed_tokens_per_layer
    assert tuple(module.embedding_scale.shape) == (module.num_embeddings, layers)
    tensors = load_file(str(block / shard))
    ids = np.array([0, 3, 17, 400, 4095])
    packed = tensors[f"{TABLE}.embedding_quantized"].numpy()[ids]
    scale = tensors[f"{TABLE}.embedding_scale"].numpy()[ids]
    from hyco.npu.host import unpack_ints  # the numpy reader, independent of transformers

    want = unpack_ints(packed, bits, layers * width).astype(np.float32) * np.repeat(scale, width, axis=-1)
    with torch.no_grad():
        got = module(torch.from_numpy(ids)).numpy() / module.scalar_embed_scale
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)  # one fp32 multiply by embed_scale undone


def test_block_scaled_model_computes_what_transformers_computes_on_the_float_table(block, tmp_path):
    """Reference: transformers' own classes on the twin whose table is stored as the float rows
    the block scales give. Same values; the only other arithmetic difference is where the fp32
    product with embed_scale happens, so the logits agree to a few fp32 ulps."""
    from transformers import AutoModelForCausalLM

    model, _ = _convert_model(block)
    twin = AutoModelForCausalLM.from_pretrained(str(float_table_twin(block, tmp_path / "twin")),
                                                dtype=torch.float32).eval()
    ids = torch.randint(3, 4096, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits, twin(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_check_loader_takes_the_block_scales(block):
    from hyco.runtime.inputs import load_model

    model, _ = _convert_model(block)
    checked = load_model(block, "SLM")
    ids = torch.randint(3, 4096, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(checked(ids).logits, model(ids).logits)


@pytest.mark.slow  # a conversion with the traced parity checks
def test_convert_keeps_the_block_scaled_lut_and_passes_parity(block, tmp_path):
    from hyco.npu.host import EmbeddingLut

    out = tmp_path / "out"
    assert main(["convert", "--checkpoint", str(block), "--out", str(out), "--rows", "5", "--prefill-chunk", "4",
                 "--ring-full", "32", "--ring-sliding", "16"]) == 0
    report = json.loads((out / "report.json").read_text())
    _, _, shard, bits, layers, _ = _table(block)
    assert report["luts"]["embed_tokens_per_layer"]["scale_blocks"] == layers
    assert report["luts"]["embed_tokens_per_layer"]["bits"] == bits
    lut = EmbeddingLut.open(out / "luts" / "embed_tokens_per_layer.safetensors")
    tensors = load_file(str(block / shard))
    assert np.array_equal(np.asarray(lut.scale), tensors[f"{TABLE}.embedding_scale"].numpy())
    assert np.array_equal(np.asarray(lut.packed), tensors[f"{TABLE}.embedding_quantized"].numpy())
    assert json.loads((out / "parity.json").read_text())["passed"] is True


def test_transformers_own_loader_gives_our_block_scaled_rows(block):
    """transformers 5.25's Gemma QAT quantizer loads a block-scaled `embedding_scale` itself; where
    the installed release does, its rows must equal our reader's bit for bit. 5.24 refuses such a
    checkpoint (it allocates [vocab, 1]), which is why convert and check read the table by hand."""
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    ours = _convert_model(block)[1].embed_tokens_per_layer
    try:
        theirs = AutoModelForCausalLM.from_pretrained(str(block), dtype=torch.float32).model.embed_tokens_per_layer
    except Exception as e:  # noqa: BLE001 - which error 5.24 raises is its own business
        assert Version(transformers.__version__) < Version("5.25"), f"transformers {transformers.__version__}: {e}"
        return
    assert tuple(theirs.embedding_scale.shape) == tuple(ours.embedding_scale.shape)  # not [vocab, 1] of ones
    ids = torch.arange(0, ours.num_embeddings, 7)
    with torch.no_grad():
        assert torch.equal(theirs.embedding_scale, ours.embedding_scale)
        assert torch.equal(theirs(ids), ours(ids))
