"""The verifier's sampling distribution p~ (paper section 3.5): temperature, then top-k, then top-p.

p~ is what exact verification samples from and what the epsilon threshold is compared with, so it
is computed once per tree row and passed around as probabilities. Temperature 0 means greedy: p~
is one-hot on the argmax (the first maximal index, as `torch.argmax` and transformers' greedy
search pick it), so the epsilon rule can add nothing beyond exact verification.
"""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """p~ over the last dimension of `logits`, in float32. `top_k <= 0` and `top_p >= 1` switch a
    filter off. The order (temperature, top-k, top-p) is transformers' warper order."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays when the mass before it
        # is still below top_p (so the most likely token always stays).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [rows, V]. A one-hot row always yields its token, so greedy
    decoding consumes random numbers but never depends on them."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
