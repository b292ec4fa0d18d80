"""The NPU building blocks both static graphs stack (convert's SLM graphs, qat's MTP step graph),
written once: each is the HTP-friendly form of a transformers op, and a second copy is how two
graphs drift apart (they did: two TopK slice widths).

- `rms_norm`: Gemma4RMSNorm as x*x (no Pow), ReduceMean, Add, Sqrt, Reciprocal, Mul
  (Reciprocal(Sqrt) is much closer to the CPU than Div at 16-bit activations);
- `gelu_tanh`: gelu_pytorch_tanh written out (much closer on the HTP than its Gelu op);
- `rotate`: rotary with host cos/sin tables (hyco.npu.host.Rope); proportional RoPE's unrotated dims
  have cos 1, sin 0, so one full-width rotate_half serves every layer type;
- `sliced_topk`: the HTP returns TopK indices modulo 65,536 (platform notes), so a TopK wider
  than that runs over slices of at most TOPK_SLICE columns (indices 0..65,535), each slice's
  offset added, then over the candidates;
- `RMSNorm`, `Attention`, `MLP`, `DecoderLayer`: one static Gemma 4 decoder layer, stacked by
  convert's SLM graphs (IntLinear weights, KV rings they extend) and by qat's MTP step graph
  (float weights INT4-swapped later, attending over the verifier's rings like a KV-shared layer);
- `centroid_mask`: gemma4_assistant's centroid-masked output layer (`use_ordered_embeddings`) on
  a dense keep-set row: a TopK over the centroid logits, a Gather of the chosen flags per token, a
  Where (no gather of weight rows: the keep-set output layer is computed whole, as for the plain head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

TOPK_SLICE = 65_536  # a slice this wide has indices 0..65,535: the widest the HTP returns intact


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.reciprocal(torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps))
    return x if weight is None else x * weight


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def sliced_topk(x: torch.Tensor, k: int, slice_width: int = TOPK_SLICE) -> tuple[torch.Tensor, torch.Tensor]:
    """TopK over the last axis that never emits an index above slice_width - 1 from one TopK."""
    width = x.shape[-1]
    k = min(k, width)
    if width <= slice_width:
        return torch.topk(x, k, dim=-1)
    values, indices = [], []
    for start in range(0, width, slice_width):
        part = x[..., start:start + slice_width]
        v, i = torch.topk(part, min(k, part.shape[-1]), dim=-1)
        values.append(v)
        indices.append(i + start)
    top, pick = torch.topk(torch.cat(values, dim=-1), k, dim=-1)
    return top, torch.gather(torch.cat(indices, dim=-1), -1, pick)


# Tokens a centroid-masked head did not score sit this far below the row's best logit: e^-50 per
# token, times a 262,144-token vocabulary, is ~5e-17 of the row's mass, below float32's resolution
# of a sum near 1, so the log-softmax equals the one over the scored tokens alone; and the masked
# row spans no more than a logit row does (no constant that saturates a 16-bit encoding).
CENTROID_GAP = 50.0


def centroid_masked(config) -> bool:
    """Whether a gemma4_assistant head's output layer is the centroid-masked one
    (`use_ordered_embeddings`, E2B/E4B's assistants) instead of the plain lm_head."""
    return bool(getattr(config, "use_ordered_embeddings", False))


def centroid_mask(logits: torch.Tensor, centroid_logits: torch.Tensor, cluster_of: torch.Tensor, top_k: int,
                  gap: float = CENTROID_GAP) -> torch.Tensor:
    """Tokens (the last axis of `logits`) whose cluster (`cluster_of`, int64 per token) is among
    the `top_k` best of `centroid_logits` keep their logit; the rest sit `gap` below the best of those.
    transformers fills them with the scored minimum - 1, a placeholder rather than a score, which
    the host's reference drops (hyco/runtime/mtp.py `scored_logits`). An exact tie with the k-th
    centroid admits both clusters (transformers' TopK picks one); float logits do not tie."""
    kth = torch.topk(centroid_logits, top_k, dim=-1).values[..., -1:]
    chosen = torch.index_select(centroid_logits >= kth, -1, cluster_of)
    # below the best *scored* logit: the dense row's best may be a token no chosen cluster holds
    best = torch.where(chosen, logits, logits.amin(dim=-1, keepdim=True)).amax(dim=-1, keepdim=True)
    return torch.where(chosen, logits, best.detach() - gap)  # detached: the fill is not a score to train


# --- the static decoder layer ------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Gemma4RMSNorm decomposed for the HTP with 16-bit activations: x*x (no Pow), ReduceMean,
    Add, Sqrt, Reciprocal, Mul (Reciprocal(Sqrt) is much closer to the CPU than Div)."""

    def __init__(self, weight: torch.Tensor | None, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = None if weight is None else nn.Parameter(weight.detach().float().clone(), requires_grad=False)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class LayerShape:
    index: int
    layer_type: str
    heads: int
    kv_heads: int
    head_dim: int
    kv_owner: int | str  # the layer whose K/V this layer attends over (itself if it stores them; the MTP
    # step: the verifier's layer type, whose ring it reads)


class Attention(nn.Module):
    def __init__(self, shape: LayerShape, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, v_norm):
        super().__init__()
        self.shape = shape
        self.q_proj, self.o_proj, self.q_norm = q_proj, o_proj, q_norm
        self.owns_kv = shape.kv_owner == shape.index
        if self.owns_kv:
            self.k_proj, self.v_proj, self.k_norm, self.v_norm = k_proj, v_proj, k_norm, v_norm

    def forward(self, h, cos, sin, mask, kv):
        """kv: dict layer -> (keys, values) [kv, slots + rows, D]; owners add theirs."""
        s = self.shape
        rows = h.shape[0]
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = rotate(self.q_norm(self.q_proj(h).view(rows, s.heads, s.head_dim)), cos, sin)
        new_kv = None
        if self.owns_kv:
            k = self.k_proj(h).view(rows, s.kv_heads, s.head_dim)
            # attention_k_eq_v: full layers without v_proj reuse the projected keys as values
            v = self.v_proj(h).view(rows, s.kv_heads, s.head_dim) if self.v_proj is not None else k
            new_k = rotate(self.k_norm(k), cos, sin).transpose(0, 1)
            new_v = self.v_norm(v).transpose(0, 1)
            k_ring, v_ring = kv[s.index]
            kv[s.index] = (torch.cat([k_ring, new_k], dim=1), torch.cat([v_ring, new_v], dim=1))
            new_kv = (new_k, new_v)
        keys, values = kv[s.kv_owner]
        # Grouped-query attention without repeat_kv: the query heads that share a KV head
        # are stacked along rows (transformers' head order: kv head j serves heads j*g..j*g+g-1).
        group = s.heads // s.kv_heads
        q = q.transpose(0, 1).reshape(s.kv_heads, group * rows, s.head_dim)
        scores = torch.matmul(q, keys.transpose(1, 2))  # Gemma 4 attention scaling is 1.0
        scores = scores.view(s.kv_heads, group, rows, -1) + mask
        weights = torch.softmax(scores, dim=-1).view(s.kv_heads, group * rows, -1)
        out = torch.matmul(weights, values).view(s.heads, rows, s.head_dim).transpose(0, 1)
        return self.o_proj(out.reshape(rows, s.heads * s.head_dim)), new_kv


class MLP(nn.Module):
    def __init__(self, gate_proj, up_proj, down_proj):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x):
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, attn, mlp, norms: dict[str, RMSNorm], layer_scalar: torch.Tensor,
                 per_layer_gate=None, per_layer_projection=None):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.input_norm = norms["input_layernorm"]
        self.post_attn_norm = norms["post_attention_layernorm"]
        self.pre_ffn_norm = norms["pre_feedforward_layernorm"]
        self.post_ffn_norm = norms["post_feedforward_layernorm"]
        self.per_layer_gate, self.per_layer_projection = per_layer_gate, per_layer_projection
        self.post_per_layer_norm = norms.get("post_per_layer_input_norm")
        self.register_buffer("layer_scalar", layer_scalar.detach().float().reshape(1).clone())

    def forward(self, h, per_layer_input, cos, sin, mask, kv):
        attn_out, new_kv = self.attn(self.input_norm(h), cos, sin, mask, kv)
        h = h + self.post_attn_norm(attn_out)
        h = h + self.post_ffn_norm(self.mlp(self.pre_ffn_norm(h)))
        if self.per_layer_gate is not None:
            gated = gelu_tanh(self.per_layer_gate(h)) * per_layer_input
            h = h + self.post_per_layer_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar, new_kv
