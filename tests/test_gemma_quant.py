"""The QAT-mobile packing against transformers' own unpacking and module-bit resolution."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.integrations import gemma_quant as hf

from hyco.base.errors import HycoError
from hyco.formats.gemma_quant import (
    QatCheckpoint,
    bits_for_module,
    dequantize,
    int_range,
    pack,
    quantize_rows,
    unpack,
)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("width", [1, 3, 8, 13, 64])
def test_pack_roundtrip_and_loader_agree(bits, width):
    torch.manual_seed(bits * 100 + width)
    lo, hi = int_range(bits)
    ints = torch.randint(lo, hi + 1, (5, width), dtype=torch.int8)
    stored = pack(ints, bits)
    assert torch.equal(unpack(stored, bits, width), ints)
    # What transformers' QuantizedLinear / QuantizedEmbedding unpack from the same bytes.
    theirs = {2: lambda: hf._unpack_int2(stored, width), 4: lambda: hf._unpack_int4(stored, width),
              8: lambda: stored}[bits]()
    assert torch.equal(theirs.to(torch.int8), ints)
    assert stored.dtype == (torch.int8 if bits == 8 else torch.uint8)


def test_pack_layout_is_low_bits_first():
    # int4: first value in the low nibble, stored +8; int2: first value in bits [1:0], stored +2.
    assert pack(torch.tensor([[-8, 7]]), 4).tolist() == [[0x00 | (15 << 4)]]
    assert pack(torch.tensor([[1, -2, 0, -1]]), 2).tolist() == [[3 | (0 << 2) | (2 << 4) | (1 << 6)]]


def test_pack_rejects_out_of_range_and_bad_bits():
    with pytest.raises(HycoError, match="outside the int4 range"):
        pack(torch.tensor([[8]]), 4)
    with pytest.raises(HycoError, match="unsupported bit width 3"):
        pack(torch.tensor([[0]]), 3)
    with pytest.raises(HycoError, match="unsupported bit width 16"):
        unpack(torch.zeros(1, 1, dtype=torch.uint8), 16, 1)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_rows_in_range_and_no_worse_than_absmax(bits):
    torch.manual_seed(bits)
    w = torch.randn(16, 48)
    ints, scale = quantize_rows(w, bits)
    lo, hi = int_range(bits)
    assert ints.dtype == torch.int8 and int(ints.min()) >= lo and int(ints.max()) <= hi
    assert scale.shape == (16, 1) and scale.dtype == torch.float32 and bool((scale > 0).all())
    plain_ints, plain_scale = quantize_rows(w, bits, ratios=torch.tensor([1.0]))
    err = ((dequantize(ints, scale) - w) ** 2).sum()
    plain_err = ((dequantize(plain_ints, plain_scale) - w) ** 2).sum()
    assert err <= plain_err
    if bits == 2:  # the clip search matters most at 2 bits
        assert err < 0.9 * plain_err


def _transformers_bits(names, configs, default_bits):
    """Bit widths transformers' own replace_with_quant_layers gives modules named `names`."""
    from transformers.utils.quantization_config import GemmaQuantizationConfig

    class Toy(torch.nn.Module):  # a module tree whose named_modules() are exactly `names`
        def __init__(self):
            super().__init__()
            for name in names:
                parent = self
                *path, leaf = name.split(".")
                for part in path:
                    if not hasattr(parent, part):
                        parent.add_module(part, torch.nn.Module())
                    parent = getattr(parent, part)
                is_embed = "embed" in leaf
                parent.add_module(leaf, torch.nn.Embedding(10, 8) if is_embed else torch.nn.Linear(8, 8))

    toy = Toy()
    hf.replace_with_quant_layers(toy, GemmaQuantizationConfig(num_bits=default_bits, quantize_embeddings=True,
                                                              module_quant_configs=configs))
    return {name: toy.get_submodule(name).num_bits for name in names}


@pytest.mark.parametrize("configs, name, expected", [
    # The case: the leftmost match in the name wins, not the first pattern listed.
    ({r"mlp\.down_proj": {"num_bits": 8}, r"layers\.1\.": {"num_bits": 2}}, "model.layers.1.mlp.down_proj", 2),
    ({r"layers\.1\.": {"num_bits": 2}, r"mlp\.down_proj": {"num_bits": 8}}, "model.layers.1.mlp.down_proj", 2),
    ({r"mlp\.down_proj": {"num_bits": 8}, r"layers\.1\.": {"num_bits": 2}}, "model.layers.0.mlp.down_proj", 8),
    # Same start: the first listed wins (so embed_tokens_per_layer must precede embed_tokens).
    ({"embed_tokens_per_layer": {"num_bits": 4}, "embed_tokens": {"num_bits": 8}}, "model.embed_tokens_per_layer", 4),
    ({"embed_tokens": {"num_bits": 8}, "embed_tokens_per_layer": {"num_bits": 4}}, "model.embed_tokens_per_layer", 8),
    ({"embed_tokens": {"num_bits": 8}}, "model.layers.0.mlp.up_proj", 4),  # no match: the default
    ({"up_proj": {}}, "model.layers.0.mlp.up_proj", 4),  # an override without num_bits keeps the default
])
def test_bits_for_module_is_transformers_rule(configs, name, expected):
    from hyco.convert.load import module_bits

    assert bits_for_module(name, configs, 4) == expected
    assert module_bits(name, {"num_bits": 4, "module_quant_configs": configs}) == expected  # one rule everywhere
    assert _transformers_bits([name], configs, 4)[name] == expected


def test_bits_for_module_agrees_with_transformers_on_a_module_tree():
    configs = {"embed_tokens_per_layer": {"num_bits": 4}, "embed_tokens": {"num_bits": 8},
               r"mlp\.down_proj": {"num_bits": 8}, r"(^|\.)layers\.1\.": {"num_bits": 2},
               r"\.self_attn\.(k_proj|v_proj)$": {"num_bits": 8}, r"^lm_head$": {"num_bits": 8}}
    names = ["model.embed_tokens", "model.embed_tokens_per_layer", "lm_head"] + [
        f"model.layers.{i}.{m}" for i in range(3)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj")]
    theirs = _transformers_bits(names, configs, 4)
    ours = {n: bits_for_module(n, configs, 4) for n in names}
    assert ours == theirs
    assert ours["model.layers.1.mlp.down_proj"] == 2 and ours["model.layers.0.mlp.down_proj"] == 8


def _write_checkpoint(folder, tensors, quant_method="gemma", num_bits=4):
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": quant_method, "num_bits": num_bits, "module_quant_configs": {"lin8": {"num_bits": 8}}}}))
    save_file(tensors, str(folder / "model.safetensors"))


def test_qat_checkpoint_reads_and_rejects(tmp_path):
    torch.manual_seed(0)
    ints, scale = quantize_rows(torch.randn(6, 10), 4)
    good = {"lin.weight": pack(ints, 4), "lin.weight_scale": scale, "lin.input_activation_scale": torch.tensor(0.5)}
    ckpt = QatCheckpoint(_write_checkpoint(tmp_path / "good", good) or tmp_path / "good")
    got_ints, got_scale, bits = ckpt.linear("lin", 10)
    assert bits == 4 and torch.equal(got_ints, ints) and torch.equal(got_scale, scale)
    assert ckpt.activation_scales("lin") == (0.5, 0.0)
    with pytest.raises(HycoError, match="'missing.weight' not in the checkpoint"):
        ckpt.linear("missing", 10)
    with pytest.raises(HycoError, match=r"tensor lin.weight is torch.uint8 \(6, 5\), but int4 storage of width 12"):
        ckpt.linear("lin", 12)
    bad = {"lin8.weight": pack(ints, 4), "lin8.weight_scale": scale}
    ckpt8 = QatCheckpoint(_write_checkpoint(tmp_path / "bad", bad) or tmp_path / "bad")
    with pytest.raises(HycoError, match="int8 storage"):
        ckpt8.linear("lin8", 10)
    _write_checkpoint(tmp_path / "awq", good, quant_method="awq")
    with pytest.raises(HycoError, match="quant_method must be 'gemma', but got 'awq'"):
        QatCheckpoint(tmp_path / "awq")
    _write_checkpoint(tmp_path / "bits3", good, num_bits=3)
    with pytest.raises(HycoError, match="unsupported bit width 3"):
        QatCheckpoint(tmp_path / "bits3")


def test_qat_checkpoint_truncated_file(tmp_path):
    torch.manual_seed(0)
    ints, scale = quantize_rows(torch.randn(6, 10), 4)
    _write_checkpoint(tmp_path / "t", {"lin.weight": pack(ints, 4), "lin.weight_scale": scale})
    path = tmp_path / "t" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(HycoError, match="model.safetensors"):
        QatCheckpoint(tmp_path / "t").linear("lin", 10)


def test_convert_refuses_a_pattern_that_is_not_a_regex(tiny_family, tmp_path):
    import shutil

    from hyco.convert.load import read_checkpoint

    ck = shutil.copytree(tiny_family["slm"], tmp_path / "slm")
    config = json.loads((ck / "config.json").read_text())
    config["quantization_config"]["module_quant_configs"]["(lm_head"] = {"num_bits": 8}
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(HycoError, match=r"config\.json: quantization_config\.module_quant_configs key '\(lm_head' is not"):
        read_checkpoint(ck)
