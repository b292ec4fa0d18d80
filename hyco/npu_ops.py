"""The NPU building blocks both static graphs stack (convert's SLM graphs, qat's MTP step graph),
written once: each is the HTP-friendly form of a transformers op, and a second copy is how two
graphs drift apart (they did: two TopK slice widths).

- `rms_norm`: Gemma4RMSNorm as x*x (no Pow), ReduceMean, Add, Sqrt, Reciprocal, Mul
  (Reciprocal(Sqrt) is much closer to the CPU than Div at 16-bit activations);
- `gelu_tanh`: gelu_pytorch_tanh written out (much closer on the HTP than its Gelu op);
- `rotate`: rotary with host cos/sin tables (hyco.host.Rope); proportional RoPE's unrotated dims
  have cos 1, sin 0, so one full-width rotate_half serves every layer type;
- `sliced_topk`: the HTP returns TopK indices modulo 65,536 (platform notes), so a TopK wider
  than that runs over slices of at most TOPK_SLICE columns (indices 0..65,535), each slice's
  offset added, then over the candidates;
- `centroid_mask`: gemma4_assistant's centroid-masked output layer (`use_ordered_embeddings`) on
  a dense keep-set row: a TopK over the centroid logits, a Gather of the chosen flags per token, a
  Where (no gather of weight rows: the keep-set output layer is computed whole, as for the plain head).
"""

from __future__ import annotations

import math

import torch

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
