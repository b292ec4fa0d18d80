"""The MTP Drafter on the host: a greedy chain with the torch head (the reference), and the feeds
of one step of its graph (ring, masks and rotary rows)."""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hyco.npu.handoff import StepInput, attention_masks
from hyco.npu.host import SHORT, Rope
from hyco.npu.io_spec import GraphSpec
from hyco.npu.ops import CENTROID_GAP, centroid_masked


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [K] greedy drafted token ids (vocab ids)
    topk_ids: torch.Tensor  # [K, topk] vocab ids, best first
    topk_logprobs: torch.Tensor  # [K, topk]


def shared_kv(kv: dict[str, tuple[torch.Tensor, torch.Tensor]], device, dtype) -> dict:
    return {name: (k[None].to(device, dtype), v[None].to(device, dtype)) for name, (k, v) in kv.items()}


@torch.no_grad()
def head_step(head: nn.Module, embed: torch.Tensor, hidden: torch.Tensor,
              kv: dict[str, tuple[torch.Tensor, torch.Tensor]], position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of the HF head, exactly as transformers' candidate generator makes it.
    Returns (logits [V], next hidden [Hb])."""
    device = head.pre_projection.weight.device
    dtype = head.pre_projection.weight.dtype
    inputs_embeds = torch.cat([embed.to(device), hidden.to(device)], dim=-1).reshape(1, 1, -1).to(dtype)
    kv_len = next(iter(kv.values()))[0].shape[1]
    out = head(
        inputs_embeds=inputs_embeds,
        attention_mask=torch.ones(1, kv_len, dtype=torch.long, device=device),
        position_ids=torch.tensor([[position]], device=device),
        shared_kv_states=shared_kv(kv, device, dtype),
        use_cache=False,
    )
    return scored_logits(head, out.logits[0, -1].float()), out.last_hidden_state[0, -1].float()


def scored_logits(head: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """A row of the head's own output, its unscored tokens given the step graph's fill.

    transformers' centroid-masked head (`use_ordered_embeddings`) scores the tokens of its top
    clusters and fills every other token with one value, the scored minimum - 1: a placeholder,
    not a score (and taken over the whole batch). The phone's step graph puts those tokens
    CENTROID_GAP below the row's best, which leaves them no mass in float32 (hyco/npu/ops.py
    `centroid_mask`); so does this, recognising the fill as the row's minimum, below every scored
    logit. In BF16 the fill can round onto the scored minimum, which then goes too: the least
    likely scored token, with no bearing on a top-k."""
    if not centroid_masked(head.config):
        return logits
    return logits.masked_fill(logits == logits.min(), float(logits.max()) - CENTROID_GAP)


def masked_logits(embedder, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """transformers' `Gemma4AssistantMaskedEmbedder.forward`, the same values, with its fill (the
    scored minimum - 1) kept on the device: transformers reads it to the host with `.item()`, which
    a CUDA graph cannot capture. The minimum - 1 rounds once to the logits' dtype either way."""
    batch, seq_len = hidden_states.shape[:2]
    _, top = torch.topk(embedder.centroids(hidden_states), k=embedder.centroid_intermediate_top_k, dim=-1)
    canonical = embedder.token_ordering.long().view(embedder.num_centroids, embedder.vocab_size_per_centroid)[top]
    width = embedder.centroid_intermediate_top_k * embedder.vocab_size_per_centroid
    rows = lm_head_weight[canonical.reshape(-1)].view(batch, seq_len, width, embedder.hidden_size)
    scored = (hidden_states.unsqueeze(-2) @ rows.transpose(-1, -2)).squeeze(-2)
    fill = (scored.min() - 1.0).to(hidden_states.dtype)
    output = fill.expand(batch, seq_len, embedder.vocab_size).clone()
    return output.scatter_(dim=-1, index=canonical.view(batch, seq_len, -1), src=scored)


@contextmanager
def fill_on_device(head):
    """A centroid-masked head's embedder runs `masked_logits` for the while (nothing else changes)."""
    embedder = getattr(head, "masked_embedding", None) if centroid_masked(head.config) else None
    if embedder is None:
        yield
        return
    embedder.forward = types.MethodType(masked_logits, embedder)
    try:
        yield
    finally:
        del embedder.forward


@torch.no_grad()
def draft_chain(head: nn.Module, embed_fn, start: StepInput, depth: int, topk: int = 8,
                keep_ids: torch.Tensor | None = None) -> Draft:
    """Draft `depth` tokens greedily; `embed_fn(ids)` is the verifier's scaled input embedding.

    With `keep_ids` (sorted vocab ids), logits are restricted to the keep set as on the phone:
    the argmax and top-k run in keep-index space and map back to vocab ids.
    """
    embed, hidden = start.embed, start.hidden
    tokens, ids, logprobs = [], [], []
    for _ in range(depth):
        logits, hidden = head_step(head, embed, hidden, start.kv, start.position)
        if keep_ids is not None:
            logits = logits[keep_ids.to(logits.device)]
        lp = torch.log_softmax(logits, dim=-1)
        top_lp, top_idx = torch.topk(lp, k=min(topk, lp.shape[-1]))
        top_vocab = keep_ids.to(top_idx.device)[top_idx] if keep_ids is not None else top_idx
        token = top_vocab[0]
        tokens.append(token)
        ids.append(top_vocab)
        logprobs.append(top_lp)
        embed = embed_fn(token.reshape(1).to(start.embed.device))[0].float()
    return Draft(torch.stack(tokens).cpu(), torch.stack(ids).cpu(), torch.stack(logprobs).cpu())


def rope_rows(table: dict, position: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin rows [1, head_dim] at `position`, as transformers' Gemma 4 rotary computes them."""
    rope = Rope({"layer": np.asarray(table["inv_freq"], dtype=np.float32)}, {"layer": float(table["scaling"])})
    return rope.tables("layer", [position])


def step_feeds(start: StepInput, embed: np.ndarray, hidden: np.ndarray, spec: GraphSpec, ropes: dict,
               negative: float) -> dict[str, np.ndarray]:
    """Host side: the ring (position p in slot p % window, the last `window` positions),
    masks and rotary rows for one step of a burst that started from `start`."""
    window = spec.meta["window"]
    n = next(iter(start.kv.values()))[0].shape[1]
    positions = np.arange(max(0, n - window), n)
    slots = positions % window
    kv_positions = np.full(window, -1, dtype=np.int64)
    kv_positions[slots] = positions
    full, sliding = attention_masks(kv_positions, np.array([start.position]), spec.meta["sliding_window"], negative)
    feeds = {"token_embed": np.asarray(embed, np.float32).reshape(1, -1),
             "hidden": np.asarray(hidden, np.float32).reshape(1, -1), "mask_full": full, "mask_sliding": sliding}
    for layer, (k_name, v_name) in {"full_attention": ("k_full", "v_full"),
                                    "sliding_attention": ("k_sliding", "v_sliding")}.items():
        for name, rows in zip((k_name, v_name), start.kv[layer], strict=True):
            ring = np.zeros(spec.input(name).shape, np.float32)
            ring[:, slots] = rows[:, positions].numpy()
            feeds[name] = ring
    for layer, short in SHORT.items():
        feeds[f"cos_{short}"], feeds[f"sin_{short}"] = rope_rows(ropes[layer], start.position)
    spec.check_feeds(feeds)
    return feeds
