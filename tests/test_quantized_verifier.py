"""A quantized verifier checkpoint (compressed-tensors pack-quantized, W4 in groups of 32: the
format vLLM users download) through check's loader (`loading.load_verifier`, transformers'
quantizer): it computes exactly what its packed ints and scales say, and the check's verifier
pass runs on it. The reference unpacks the ints and scales from model.safetensors by hand (eight
4-bit values to an int32 word, low nibble first, stored as v + 8) into the float model."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

GROUP = 32


def write_compressed(src: Path, out: Path) -> Path:
    """The tiny verifier quantized by compressed-tensors itself: symmetric INT4 per group of 32,
    scales max|w| / 7 (the routers too; lm_head stays float), packed and saved with its config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    from hyco.base.loading import load_pretrained

    model = load_pretrained(src, "verifier").eval()
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"],
        format="pack-quantized"), show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                groups = module.weight.reshape(module.weight.shape[0], -1, GROUP).float()
                module.weight_scale.copy_((groups.abs().amax(-1) / 7).clamp(min=1e-8))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out


def unpacked(handle, prefix: str) -> torch.Tensor:
    packed = handle.get_tensor(f"{prefix}.weight_packed")
    scale = handle.get_tensor(f"{prefix}.weight_scale").float()
    rows, cols = handle.get_tensor(f"{prefix}.weight_shape").tolist()
    nibbles = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], -1).reshape(rows, -1)[:, :cols]
    return (nibbles - 8).float() * scale.repeat_interleave(GROUP, dim=1)


def test_a_compressed_tensors_verifier_computes_what_its_ints_and_scales_say(tiny_family, tmp_path):
    from safetensors import safe_open

    from hyco.base.loading import SERVER_QUANT, load_verifier, quant_method
    from hyco.config.recipe import PlacementConfig
    from hyco.pipeline.preflight import check_model
    from hyco.runtime.tree import DraftTree
    from hyco.runtime.verifier import ReferenceVerifier, Sampling

    folder = write_compressed(tiny_family["verifier"], tmp_path / "verifier-ct")
    assert quant_method(folder) == "compressed-tensors" and "compressed-tensors" in SERVER_QUANT
    check_model("verifier", folder)  # preflight lets it through
    quantized = load_verifier(folder, PlacementConfig())
    reference = load_verifier(tiny_family["verifier"], PlacementConfig())
    handle = safe_open(str(folder / "model.safetensors"), "pt")
    prefixes = sorted({k.rsplit(".", 1)[0] for k in handle.keys() if k.endswith(".weight_packed")})
    assert len(prefixes) >= 20  # attention, MLP and router projections of every layer
    modules = dict(reference.named_modules())
    with torch.no_grad():
        for prefix in prefixes:
            modules[prefix].weight.copy_(unpacked(handle, prefix))
        ids = torch.randint(3, quantized.config.get_text_config().vocab_size, (1, 48),
                            generator=torch.Generator().manual_seed(0))
        got, want = quantized(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same float32 weights, the same kernels
    float_model = load_verifier(tiny_family["verifier"], PlacementConfig())
    with torch.no_grad():
        assert not torch.equal(float_model(ids).logits, got)  # 4-bit weights: not the float verifier
    # check's verifier pass on it: prefill, then a tree verified against its p~
    verifier = ReferenceVerifier(quantized, Sampling(), keyed_seed=0)
    reply = verifier.prefill(ids[0].tolist(), None)
    tree = DraftTree(reply.root)
    tree.add(0, 5, -0.4, "chain", 1)
    verdict = verifier.verify_tree(tree, 1.0, None).verdict
    assert verdict.accepted in (0, 1) and reply.handoff.hidden.shape[-1] == quantized.config.get_text_config().hidden_size
