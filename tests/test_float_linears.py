"""A linear the QAT checkpoint leaves in float, as Google's E2B QAT-mobile file leaves
`per_layer_model_projection` (listed in quantization_config.modules_to_not_convert, no
weight_scale): convert agrees with transformers on what stays float (transformers' own matcher:
suffix, prefix or regex), quantizes it per channel itself, marks it as its own in encodings.json
and bitexact.json with its error against float, and proves the graph against transformers with
those values (parity)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyco.formats.gemma_quant import dequantize, unpack
from hyco.pipeline.cli import main

PROJ = "model.per_layer_model_projection"


def float_projection_copy(src, dst, pattern: str = "per_layer_model_projection"):
    """The fixture SLM with per_layer_model_projection stored in float (BF16 of its dequantized
    ints, no scales) and `pattern` in modules_to_not_convert."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    quant = config["quantization_config"]
    quant["modules_to_not_convert"] = [pattern]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][f"{PROJ}.weight"]
    tensors = load_file(str(dst / shard))
    from hyco.formats.gemma_quant import bits_for_module

    bits = bits_for_module(PROJ, quant.get("module_quant_configs"), quant.get("num_bits", 4))
    width = int(config.get("text_config", config)["hidden_size"])
    ints = unpack(tensors[f"{PROJ}.weight"], bits, width)
    tensors[f"{PROJ}.weight"] = dequantize(ints, tensors[f"{PROJ}.weight_scale"]).to(torch.bfloat16)
    for suffix in ("weight_scale", "input_activation_scale", "output_activation_scale"):
        tensors.pop(f"{PROJ}.{suffix}", None)
        index["weight_map"].pop(f"{PROJ}.{suffix}", None)
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    return dst


@pytest.mark.parametrize("pattern", ["per_layer_model_projection", PROJ, r"model\.per_layer_model_proj\w*",
                                     "model.layers.1"])
def test_convert_leaves_in_float_what_transformers_leaves_in_float(tiny_text_family, tmp_path, pattern):
    """transformers' GemmaQuantizer on the same folder is the reference: the modules it loads as
    plain nn.Linear are the ones convert's name map expects float (a suffix, the full name, a regex,
    and "model.layers.1", a prefix up to a module boundary that catches every linear of layer 1)."""
    from hyco.convert.load import expected_tensors, read_checkpoint
    from torch import nn
    from transformers import AutoModelForCausalLM
    from transformers.integrations.gemma_quant import QuantizedLinear

    folder = float_projection_copy(tiny_text_family["slm"], tmp_path / "slm", pattern)
    if pattern == "model.layers.1":  # names modules the file still holds quantized: only their class is compared
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"]["modules_to_not_convert"] = ["per_layer_model_projection", pattern]
        (folder / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, ignore_mismatched_sizes=True)
    theirs = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, QuantizedLinear)}
    ckpt = read_checkpoint(folder)
    expected_tensors(ckpt)
    assert ckpt.float_linears == theirs
    assert PROJ in theirs
    assert bool({n for n in theirs if n.startswith("model.layers.1.")}) == (pattern == "model.layers.1")


def _convert(folder, out, *extra):
    return main(["convert", "--checkpoint", str(folder), "--out", str(out), "--rows", "5", "--prefill-chunk", "4",
                 "--ring-full", "32", "--ring-sliding", "16", *extra])


def _assert_quantized_here(out):
    enc = json.loads((out / "encodings.json").read_text())["weights"]
    assert enc[PROJ]["origin"] == "hyco-convert" and "not from the checkpoint" in enc[PROJ]["note"]
    assert enc[PROJ]["bits"] == 8 and enc[PROJ]["container"] == "INT8"
    assert {e["origin"] for k, e in enc.items() if k != PROJ} == {"checkpoint"}
    bitexact = json.loads((out / "bitexact.json").read_text())
    assert bitexact["all_equal"] is True
    for graph in ("tree.onnx", "prefill.onnx"):
        row = bitexact["graphs"][graph][PROJ]
        assert row["origin"] == "hyco-convert" and row["ints_equal"] and row["scales_equal"], (graph, row)
    # Symmetric 8-bit per channel: rounding error ~ s / sqrt(12) with s = absmax / 127; for weights
    # whose absmax is a few standard deviations that is ~1% of the rms, so 2% fails a broken scale.
    error = bitexact["graphs"]["tree.onnx"][PROJ]["error_vs_float"]
    assert 0 < error["relative_rms"] < 0.02 and error["max_abs"] > 0


def test_float_linear_bits_null_refuses_the_float_linear(tiny_text_family, tmp_path, capsys):
    folder = float_projection_copy(tiny_text_family["slm"], tmp_path / "slm")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nname: t\nout: {tmp_path / 'run'}\nstages: [convert]\nmodels:\n  slm: {folder}\n"
                      "convert:\n  parity: false\n  use_keep_set: false\n  float_linear_bits: null\n")
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and PROJ in err[0] and "float_linear_bits" in err[0], err
    assert not (tmp_path / "run" / "convert").exists()


@pytest.mark.slow  # a conversion with the traced parity checks
def test_parity_holds_with_the_float_linear_quantized_here(tiny_text_family, tmp_path):
    folder = float_projection_copy(tiny_text_family["slm"], tmp_path / "slm")
    assert _convert(folder, tmp_path / "out") == 0
    _assert_quantized_here(tmp_path / "out")
    parity = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert parity["passed"] is True
