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
  offset added, then over the candidates.
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
