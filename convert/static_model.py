"""The static NPU graph: one small torch module with only fixed-shape inputs.

Inputs (all float32, `rows` = 33 for the tree pass or the prefill chunk):
  embeds [rows, H]                  token embedding rows, looked up on the host (luts/)
  per_layer_embeds [rows, L, P]     per-layer embedding rows, looked up on the host
  cos_<type>, sin_<type> [rows, D]  rotary tables per layer type, built on the host (rope.json)
  mask_<type> [rows, slots + rows]  additive mask over [ring slots, new rows], built on the host
  k_ring_<i>, v_ring_<i> [kv, slots, D]  the ring of each KV-owning layer i (keys already rotated)
Outputs:
  topk_logprobs, topk_indices [rows, k]   log-probabilities and keep-set indices of the top k
  logits [rows, K]                        softcapped keep-set logits (parity; may be ignored)
  new_k_<i>, new_v_<i> [kv, rows, D]      this pass's rotated keys and values per owning layer

Everything here mirrors transformers' Gemma 4 text forward (modeling_gemma4.py) with the NPU
rewrites of rewrites.py applied; the module holds integer weights only (IntLinear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyco.npu.host import SHORT
from hyco.npu.io_spec import GraphSpec, TensorSpec
from hyco.npu.ops import TOPK_SLICE, DecoderLayer, RMSNorm, sliced_topk

# --- ops with an explicit ONNX form ---------------------------------------------------------


class _IntMatMul(torch.autograd.Function):
    """x [rows, in] @ (ints [out, in] x scale [out])^T, exported as DequantizeLinear(axis=0) ->
    Transpose -> MatMul (what torch's exporter writes for F.linear on a dequantized weight), so
    the integer weight stays an integer initializer (never folded to float).

    Only used while the ONNX exporter traces: the op is recorded (its symbolic) and the numbers
    are never used, so the forward returns zeros of the output's shape and no float weight is
    ever made. (A traced F.linear on a zero-stride stand-in weight copied it to a contiguous
    float weight, linear by linear: the largest is the 86,089-row E2B output layer's.)"""

    @staticmethod
    def forward(ctx, x, ints, scale):
        return x.new_zeros((*x.shape[:-1], ints.shape[0]))

    @staticmethod
    def symbolic(g, x, ints, scale):
        weight = g.op("DequantizeLinear", ints, scale, axis_i=0)
        return g.op("MatMul", x, g.op("Transpose", weight, perm_i=[1, 0]))


class _StaticRangeQuantize(torch.autograd.Function):
    """transformers' SRQ rounding (`apply_srq`, 8 bits): clamp(round(x / s), -128, 127) * s.
    Exported as an int8 QuantizeLinear/DequantizeLinear pair, which is the same arithmetic
    (round half to even, saturate) and what the NPU calls activation quantization."""

    @staticmethod
    def forward(ctx, x, scale):
        return torch.clamp(torch.round(x / scale), -128.0, 127.0) * scale

    @staticmethod
    def symbolic(g, x, scale):
        zero = g.op("Constant", value_t=torch.tensor(0, dtype=torch.int8))
        return g.op("DequantizeLinear", g.op("QuantizeLinear", x, scale, zero), scale, zero)


# --- building blocks ------------------------------------------------------------------------------


class IntLinear(nn.Module):
    """A QuantizedLinear as an integer matmul: the checkpoint's ints and per-channel scales,
    SRQ on input and output where the checkpoint calibrated them (scale 0 = off).

    The ints stay PACKED as the checkpoint stores them (`packed`: int8 [out, in], or uint8
    [out, ceil(in * bits / 8)] for 2/4 bits, two or four values per byte) until export_onnx
    writes them: an int4 model is held at its int4 size, not twice it as int8. The buffer
    `ints` is a zero-stride int8 [out, in] stand-in that owns one byte: it gives the traced
    graph its integer weight input (named `<module>.ints`) with the right shape and type, and
    the exporter serializes no weight. `int_values()` unpacks (transformers' own code)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, bits: int, in_features: int, source: str,
                 input_scale: float = 0.0, output_scale: float = 0.0, origin: str = "checkpoint"):
        super().__init__()
        rows = packed.shape[0]
        per_byte = 8 // bits
        if packed.ndim != 2 or packed.shape[1] != -(-in_features // per_byte):
            raise ValueError(f"{source}: packed ints {tuple(packed.shape)} do not hold {in_features} int{bits} per row")
        self.packed = packed.detach()  # not a buffer: never traced, never in state_dict
        self.register_buffer("ints", torch.zeros((), dtype=torch.int8).expand(rows, in_features))
        self.register_buffer("scale", scale.to(torch.float32).reshape(-1).contiguous())  # [out]
        self.bits, self.source, self.in_features = bits, source, in_features
        self.origin = origin  # "checkpoint", or "hyco-convert": a float weight quantized here (rewrites.quantized_here)
        self.input_scale, self.output_scale = float(input_scale), float(output_scale)
        if self.input_scale:
            self.register_buffer("srq_in", torch.tensor(self.input_scale, dtype=torch.float32))
        if self.output_scale:
            self.register_buffer("srq_out", torch.tensor(self.output_scale, dtype=torch.float32))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ints.shape)

    def int_values(self) -> torch.Tensor:
        """The signed ints [out, in] as int8, unpacked by transformers' own code."""
        from hyco.base.compat_transformers import unpack_gemma_ints

        if self.bits in (2, 4):
            return unpack_gemma_ints(self.packed, self.bits, self.in_features)
        return self.packed.to(torch.int8)

    def forward(self, x):
        if self.input_scale:
            x = _StaticRangeQuantize.apply(x, self.srq_in)
        if torch.jit.is_tracing():
            y = _IntMatMul.apply(x, self.ints, self.scale)
        else:
            y = F.linear(x, self.int_values().to(torch.float32) * self.scale[:, None])
        if self.output_scale:
            y = _StaticRangeQuantize.apply(y, self.srq_out)
        return y


class SlicedTopK(nn.Module):
    """TopK that never emits an index above 65,535: the HTP returns TopK indices modulo
    65,536, so search slices of at most `slice_width`, add each slice's offset, and pick the
    final k among the candidates (whose TopK indices stay < slices * k)."""

    def __init__(self, k: int, slice_width: int = TOPK_SLICE):
        super().__init__()
        self.k, self.slice_width = k, slice_width

    def forward(self, x):
        return sliced_topk(x, self.k, self.slice_width)


class SoftcapHead(nn.Module):
    """Keep-set output layer + final logit softcap + log-softmax + top-k.

    The softcap's final multiply is by a vector, not a scalar constant: on the HTP a
    LogSoftmax directly after a Mul by a scalar constant computes garbage."""

    def __init__(self, norm: RMSNorm, head: IntLinear, softcap: float | None, topk: int, slice_width: int):
        super().__init__()
        self.norm, self.head, self.softcap = norm, head, softcap
        if softcap is not None:
            self.register_buffer("softcap_vector", torch.full((head.shape[0],), float(softcap)))
        self.topk = SlicedTopK(topk, slice_width)

    def forward(self, h):
        logits = self.head(self.norm(h))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap_vector
        logprobs, indices = self.topk(torch.log_softmax(logits, dim=-1))
        return logprobs, indices, logits


@dataclass(frozen=True)
class RingShape:
    ring_full: int
    ring_sliding: int
    windows: dict  # layer type -> effective window
    mask_negative: float


class StaticGemma(nn.Module):
    def __init__(self, embed_dim: int, layers: list[DecoderLayer], per_layer, output: SoftcapHead,
                 rings: RingShape, per_layer_width: int):
        super().__init__()
        self.embed_dim = embed_dim
        self.layers = nn.ModuleList(layers)
        self.per_layer = per_layer  # PerLayerInputs or None
        self.output = output
        self.rings = rings
        self.per_layer_width = per_layer_width
        self.shapes = [layer.attn.shape for layer in layers]
        self.owners = [s.index for s in self.shapes if s.kv_owner == s.index]
        self.layer_types = sorted({s.layer_type for s in self.shapes}, reverse=True)  # sliding first

    def slots(self, layer_type: str) -> int:
        return self.rings.ring_full if layer_type == "full_attention" else self.rings.ring_sliding

    def head_dim(self, layer_type: str) -> int:
        return next(s.head_dim for s in self.shapes if s.layer_type == layer_type)

    # -- one place for the graph's inputs and outputs -----------------------------------------

    def io_spec(self, rows: int, graph: str) -> GraphSpec:
        L, P, K, k = len(self.layers), self.per_layer_width, self.output.head.shape[0], self.output.topk.k
        inputs = [TensorSpec("embeds", (rows, self.embed_dim), "float32", "token embedding rows (luts/embed_tokens, scale included)")]
        if self.per_layer is not None:
            inputs.append(TensorSpec("per_layer_embeds", (rows, L, P), "float32",
                                     "per-layer embedding rows (luts/embed_tokens_per_layer), reshaped [rows, layers, width]"))
        for t in self.layer_types:
            d, n = self.head_dim(t), SHORT[t]
            inputs.append(TensorSpec(f"cos_{n}", (rows, d), "float32", f"rotary cos for {t} layers at each row's position (host.Rope)"))
            inputs.append(TensorSpec(f"sin_{n}", (rows, d), "float32", f"rotary sin for {t} layers at each row's position (host.Rope)"))
        for t in self.layer_types:
            inputs.append(TensorSpec(f"mask_{SHORT[t]}", (rows, self.slots(t) + rows), "float32",
                                     f"additive mask over [{t} ring slots, new rows]: 0 visible, {self.rings.mask_negative} hidden"))
        for s in (self.shapes[i] for i in self.owners):
            shape = (s.kv_heads, self.slots(s.layer_type), s.head_dim)
            inputs.append(TensorSpec(f"k_ring_{s.index}", shape, "float32", f"layer {s.index} key ring (rotated keys)"))
            inputs.append(TensorSpec(f"v_ring_{s.index}", shape, "float32", f"layer {s.index} value ring"))
        outputs = [TensorSpec("topk_logprobs", (rows, k), "float32", "log-probabilities of the top k keep-set tokens"),
                   TensorSpec("topk_indices", (rows, k), "int64", "keep-set indices of the top k (keep_to_vocab maps back)"),
                   TensorSpec("logits", (rows, K), "float32", "softcapped keep-set logits (for parity)")]
        for s in (self.shapes[i] for i in self.owners):
            shape = (s.kv_heads, rows, s.head_dim)
            outputs.append(TensorSpec(f"new_k_{s.index}", shape, "float32", f"layer {s.index} rotated keys of this pass's rows"))
            outputs.append(TensorSpec(f"new_v_{s.index}", shape, "float32", f"layer {s.index} values of this pass's rows"))
        rings = [{"layer": s.index, "layer_type": s.layer_type, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
                  "slots": self.slots(s.layer_type)} for s in (self.shapes[i] for i in self.owners)]
        meta = {"rows": rows, "num_layers": L, "keep_size": K, "topk": k, "rings": rings, "windows": dict(self.rings.windows),
                "mask_negative": self.rings.mask_negative,
                "kv_owner": {s.index: s.kv_owner for s in self.shapes}}
        return GraphSpec(graph, tuple(inputs), tuple(outputs), meta)

    def example_inputs(self, rows: int) -> tuple[torch.Tensor, ...]:
        spec = self.io_spec(rows, "example")
        return tuple(torch.zeros(t.shape, dtype=torch.float32) for t in spec.inputs)

    def input_names(self, rows: int) -> list[str]:
        return [t.name for t in self.io_spec(rows, "example").inputs]

    def output_names(self, rows: int) -> list[str]:
        return [t.name for t in self.io_spec(rows, "example").outputs]

    def forward(self, *inputs):
        named = dict(zip(self.input_names(inputs[0].shape[0]), inputs, strict=True))
        h = named["embeds"]
        per_layer = self.per_layer(h, named["per_layer_embeds"]) if self.per_layer is not None else None
        kv = {i: (named[f"k_ring_{i}"], named[f"v_ring_{i}"]) for i in self.owners}
        new_kv = []
        for i, layer in enumerate(self.layers):
            n = SHORT[layer.attn.shape.layer_type]
            h, new = layer(h, per_layer[:, i, :] if per_layer is not None else None,
                           named[f"cos_{n}"], named[f"sin_{n}"], named[f"mask_{n}"], kv)
            if new is not None:
                new_kv.extend(new)
        logprobs, indices, logits = self.output(h)
        return (logprobs, indices, logits, *new_kv)


class PerLayerInputs(nn.Module):
    """transformers' project_per_layer_inputs: (norm(proj(e) * H^-0.5) + ple) * 2^-0.5."""

    def __init__(self, projection: IntLinear, norm: RMSNorm, layers: int, width: int, hidden: int):
        super().__init__()
        self.projection, self.norm = projection, norm
        self.layers, self.width = layers, width
        self.projection_scale = hidden**-0.5
        self.input_scale = 2.0**-0.5

    def forward(self, embeds, per_layer_embeds):
        projected = self.projection(embeds) * self.projection_scale
        projected = self.norm(projected.view(embeds.shape[0], self.layers, self.width))
        return (projected + per_layer_embeds) * self.input_scale
