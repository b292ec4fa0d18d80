"""Named NPU rewrite steps: each takes transformers' module and returns a new static one.

- `integer_linear`: QuantizedLinear -> IntLinear (the checkpoint's packed ints and scales, SRQ kept)
- `decompose_rmsnorm`: Gemma4RMSNorm -> RMSNorm of x*x/ReduceMean/Sqrt/Reciprocal/Mul
- `restrict_to_keep_set`: the output layer's rows (and their scales) sliced to the keep set
- `static_layer`: one Gemma4TextDecoderLayer with host rotary and KV rings
- `build_static_model`: the whole text model, layer by layer, releasing each transformers
  layer once converted so two copies of the model never coexist
"""

from __future__ import annotations

import torch
from hyco.convert.static_model import IntLinear, PerLayerInputs, RingShape, SoftcapHead, StaticGemma
from torch import nn

from hyco.base.console import progress
from hyco.base.errors import HycoError
from hyco.config.recipe import ConvertConfig
from hyco.npu.ops import MLP, Attention, DecoderLayer, LayerShape, RMSNorm


def unpacked_ints(module) -> torch.Tensor:
    """The int values of a QuantizedLinear [out, in] as int8 (transformers' own unpacking)."""
    return integer_linear(module, "unpacked_ints").int_values()


def integer_linear(module, source: str, float_bits: int | None = None) -> IntLinear:
    """The QuantizedLinear's packed storage itself (no copy, no unpacking) and its scales. A
    linear the checkpoint left in float is quantized here at `float_bits` (None: refused)."""
    from transformers.integrations.gemma_quant import QuantizedLinear

    if getattr(module, "bias", None) is not None:
        raise HycoError(f"{source}: linears with a bias are not supported")
    float_linear = isinstance(module, nn.Linear) and not isinstance(module, QuantizedLinear)  # QuantizedLinear is an nn.Linear
    if float_linear and float_bits is not None:
        return quantized_here(module.weight.data, source, float_bits)
    if not isinstance(module, QuantizedLinear):
        raise HycoError(f"{source}: expected a quantized linear (QuantizedLinear), but got {type(module).__name__}; "
                        "the NPU graph takes integer weights only (convert.float_linear_bits quantizes float ones)")
    return IntLinear(module.weight.data, module.weight_scale.data.reshape(-1), module.num_bits, module.in_features,
                     source, float(module.input_activation_scale.detach()),
                     float(module.output_activation_scale.detach()))


def quantize_float_weight(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hyco-convert's own quantization of a weight the checkpoint left in float: symmetric, one
    scale per output channel, each scale's clip ratio chosen by least squared error (the same
    rule as the QAT format's writer, hyco/formats/gemma_quant.py). (ints int8 [out, in], scale [out])."""
    from hyco.formats.gemma_quant import quantize_rows

    ints, scale = quantize_rows(weight.float(), bits)
    return ints, scale.reshape(-1)


def quantized_here(weight: torch.Tensor, source: str, bits: int) -> IntLinear:
    """An IntLinear holding hyco-convert's quantization of a float weight, marked as such (no SRQ:
    the checkpoint calibrated none for it)."""
    from hyco.formats.gemma_quant import pack

    ints, scale = quantize_float_weight(weight, bits)
    return IntLinear(pack(ints, bits), scale, bits, weight.shape[1], source, origin="hyco-convert")


def restrict_to_keep_set(module, source: str, keep_ids) -> IntLinear:
    """Output layer restricted to the keep set (vocab/'s restrict_output_layer): row r is
    vocabulary row keep_ids[r] with its own per-channel scale; SRQ scales are per tensor."""
    from hyco.npu.restrict import restrict_output_layer

    if keep_ids is None:
        return integer_linear(module, source)
    return integer_linear(restrict_output_layer(module, keep_ids, where=source), source)


def decompose_rmsnorm(module) -> RMSNorm:
    weight = module.weight.data if getattr(module, "with_scale", True) else None
    from hyco.base.compat_transformers import rms_norm_eps

    return RMSNorm(weight, rms_norm_eps(module))


def layer_shape(config, index: int, attn) -> LayerShape:
    modes = config.kv_sharing_modes
    layer_type = config.layer_types[index]
    owner = index
    if modes[index] == "reuse":
        # transformers: a KV-shared layer reads the K/V stored by the last non-shared layer of its type
        first_shared = config.num_hidden_layers - config.num_kv_shared_layers
        owner = max(j for j in range(first_shared) if config.layer_types[j] == layer_type)
    kv_heads = config.num_attention_heads // attn.num_key_value_groups
    return LayerShape(index, layer_type, config.num_attention_heads, kv_heads, attn.head_dim, owner)


def static_layer(config, index: int, hf_layer, prefix: str, float_bits: int | None = None) -> DecoderLayer:
    a = hf_layer.self_attn
    shape = layer_shape(config, index, a)
    owns = shape.kv_owner == index
    lin = lambda m, name: integer_linear(m, f"{prefix}.{name}", float_bits)
    attn = Attention(
        shape,
        q_proj=lin(a.q_proj, "self_attn.q_proj"),
        k_proj=lin(a.k_proj, "self_attn.k_proj") if owns else None,
        v_proj=lin(a.v_proj, "self_attn.v_proj") if owns and a.v_proj is not None else None,
        o_proj=lin(a.o_proj, "self_attn.o_proj"),
        q_norm=decompose_rmsnorm(a.q_norm),
        k_norm=decompose_rmsnorm(a.k_norm) if owns else None,
        v_norm=decompose_rmsnorm(a.v_norm) if owns else None,
    )
    m = hf_layer.mlp
    mlp = MLP(lin(m.gate_proj, "mlp.gate_proj"), lin(m.up_proj, "mlp.up_proj"), lin(m.down_proj, "mlp.down_proj"))
    norm_names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    has_ple = bool(config.hidden_size_per_layer_input)
    if has_ple:
        norm_names.append("post_per_layer_input_norm")
    norms = {n: decompose_rmsnorm(getattr(hf_layer, n)) for n in norm_names}
    return DecoderLayer(
        attn, mlp, norms, hf_layer.layer_scalar,
        per_layer_gate=lin(hf_layer.per_layer_input_gate, "per_layer_input_gate") if has_ple else None,
        per_layer_projection=lin(hf_layer.per_layer_projection, "per_layer_projection") if has_ple else None,
    )


def effective_windows(config, ring_full: int, ring_sliding: int) -> dict[str, int]:
    """Keys a row may see, itself included: transformers' sliding window (capped by the ring)
    on sliding layers, the ring on full layers."""
    return {"sliding_attention": min(config.sliding_window, ring_sliding), "full_attention": ring_full}


def build_static_model(text_model, lm_head, settings: ConvertConfig, *, text_prefix: str, keep_ids,
                       release: bool = True) -> StaticGemma:
    """transformers' Gemma4TextModel + lm_head -> StaticGemma, one layer at a time, with the convert
    section's rings, mask value, top-k (and its slice) and float linears' bit width.

    With `release`, each transformers layer is replaced by an empty module as soon as it is
    converted, so the integer copy and the packed copy of a layer never both stay alive."""
    config, float_bits = text_model.config, settings.float_linear_bits
    ring_full, ring_sliding, mask_negative = settings.ring_full, settings.ring_sliding, settings.mask_negative
    if release:  # the embedding tables live on the CPU as LUTs (luts.py), never in the graph
        text_model.embed_tokens = nn.Module()
        if config.hidden_size_per_layer_input:
            text_model.embed_tokens_per_layer = nn.Module()
    layers = []
    for i in progress(range(config.num_hidden_layers), desc="convert layers", leave=False):
        layers.append(static_layer(config, i, text_model.layers[i], f"{text_prefix}layers.{i}", float_bits))
        if release:
            text_model.layers[i] = nn.Module()
    per_layer = None
    if config.hidden_size_per_layer_input:
        per_layer = PerLayerInputs(
            integer_linear(text_model.per_layer_model_projection, f"{text_prefix}per_layer_model_projection", float_bits),
            decompose_rmsnorm(text_model.per_layer_projection_norm),
            config.num_hidden_layers, config.hidden_size_per_layer_input, config.hidden_size)
    output = SoftcapHead(decompose_rmsnorm(text_model.norm), restrict_to_keep_set(lm_head, "lm_head", keep_ids),
                         config.final_logit_softcapping, settings.topk, settings.topk_slice)
    rings = RingShape(ring_full, ring_sliding, effective_windows(config, ring_full, ring_sliding), mask_negative)
    return StaticGemma(config.hidden_size, layers, per_layer, output, rings, config.hidden_size_per_layer_input or 0)
