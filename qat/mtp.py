"""The float MTP drafting chain: the gemma4_assistant head drafting K tokens from a hand-off.

`draft_chain` follows transformers' `SinglePositionMultiTokenCandidateGenerator` step for
step: input cat(e(last token), h), position held at t + 1 for the whole burst, the verifier's
shared K/V as the head's only context, the head's projected state fed back as the next h.
`TeacherForcedHead` runs the same head over many drafting positions at once (one query per
position, masks keep each query to the rows its hand-off would hold); it is the module that
QuantSim wraps for training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from hyco.base.errors import HycoError
from hyco.npu.handoff import attention_masks
from hyco.npu.ops import centroid_mask, centroid_masked


def check_output_layer(config, where: str | None = None) -> None:
    """A centroid-masked head's config, checked before any weight is read: transformers views
    `token_ordering` as [num_centroids, vocab / num_centroids] and takes the top
    `centroid_intermediate_top_k` of them, so both must fit."""
    if not centroid_masked(config):
        return
    folder = where or getattr(config, "_name_or_path", "") or "assistant"
    vocab = config.get_text_config().vocab_size
    centroids, top_k = config.num_centroids, config.centroid_intermediate_top_k
    if centroids <= 0 or vocab % centroids:
        raise HycoError(f"{folder}/config.json: num_centroids {centroids} does not divide the vocabulary "
                        f"({vocab} tokens), so token_ordering has no [num_centroids, tokens per centroid] view")
    if not 0 < top_k <= centroids:
        raise HycoError(f"{folder}/config.json: centroid_intermediate_top_k {top_k} is outside 1..{centroids} "
                        "(num_centroids)")


def clusters_of(head: nn.Module, keep_ids: torch.Tensor | None) -> torch.Tensor:
    """Each kept token's centroid (int64, keep order): `token_ordering` lists the vocabulary
    cluster by cluster, vocab / num_centroids tokens each (transformers' masked embedding).
    A missing ordering loads as zeros (transformers' init), so it must be a permutation."""
    masked = head.masked_embedding
    order = masked.token_ordering.detach().long().cpu()
    vocab = masked.vocab_size
    if order.shape != (vocab,) or not torch.equal(torch.sort(order).values, torch.arange(vocab)):
        folder = getattr(head.config, "_name_or_path", "") or "assistant"
        raise HycoError(f"{folder}: masked_embedding.token_ordering is not a permutation of the {vocab}-token "
                        "vocabulary (missing from the checkpoint's files, or cut)")
    cluster = torch.empty(vocab, dtype=torch.long)
    cluster[order] = torch.arange(vocab) // masked.vocab_size_per_centroid
    return cluster if keep_ids is None else cluster[keep_ids.cpu()]


def restricted_lm_head(head: nn.Module, keep_ids: torch.Tensor | None, rows: nn.Linear | None = None) -> nn.Linear:
    """An untied copy of the head's output layer, cut to the keep set (rows in keep order).
    `rows`: a layer already cut to it (the teacher's), copied instead."""
    weight = head.lm_head.weight.detach() if rows is None else rows.weight.detach()
    if keep_ids is not None and rows is None:
        weight = weight[keep_ids.to(weight.device)]
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


@contextlib.contextmanager
def output_table_on_disk(head: nn.Module, folder: Path) -> Iterator[None]:
    """The head's full-vocabulary tables (its output layer and the embedding tied to it) moved to
    `folder` for the block, then read back. Between the teacher's keep-set copy and graph parity's
    transformers reference nothing reads them (students copy the teacher's rows): at the 26B-A4B
    assistant's size, 262,144 x 1,024 fp32 off the QAT's peak. The Parameters stay
    (ties and module structure unchanged); only their storage goes."""
    layers = [m for m in (head.lm_head, getattr(head.model, "embed_tokens", None)) if m is not None]
    params = list({id(p): p for m in layers for p in m.parameters()}.values())
    saved = []
    try:
        for i, p in enumerate(params):
            path = Path(folder) / f"output_table_{i}.pt"
            torch.save(p.detach(), path)
            saved.append((p, path))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        yield
    finally:
        for p, path in saved:
            p.data = torch.load(path, map_location=p.device)
            path.unlink()


@contextlib.contextmanager
def dense_rows(*heads: nn.Module) -> Iterator[None]:
    """The heads (TeacherForcedHead, or a QuantSim of one) give their dense rows for the block."""
    saved = [h.dense for h in heads]
    try:
        for h in heads:
            h.dense = True
        yield
    finally:
        for h, d in zip(heads, saved, strict=True):
            h.dense = d


class TeacherForcedHead(nn.Module):
    """The head over T drafting positions at once, taking plain tensors (QuantSim wraps this).

    forward(inputs_embeds [1, T, 2Hb], position_ids [1, T], k_full, v_full, k_sliding,
    v_sliding [1, kv_heads, N, d], mask_full, mask_sliding [1, 1, T, N])
    -> (logits [1, T, V'] over the restricted output layer, next hidden [1, T, Hb]).
    Submodule names follow the HF head (`model.layers.0.self_attn.q_proj`, ...).

    A centroid-masked head keeps its centroid layer (`masked_embedding.centroids`, quantized like
    every Linear) and masks the row as the step graph does (hyco/npu/ops.py `centroid_mask`), unless
    `dense` is set: training takes the KL on the dense row (train.py says why).
    """

    def __init__(self, head: nn.Module, keep_ids: torch.Tensor | None = None, rows: nn.Linear | None = None):
        super().__init__()
        self.pre_projection = head.pre_projection
        self.model = head.model
        self.post_projection = head.post_projection
        self.lm_head = restricted_lm_head(head, keep_ids, rows)
        self.masked_embedding, self.centroid_top_k, self.dense = None, 0, False
        if centroid_masked(head.config):
            self.masked_embedding = nn.ModuleDict({"centroids": head.masked_embedding.centroids})
            self.register_buffer("cluster_of", clusters_of(head, keep_ids).to(head.lm_head.weight.device))
            self.centroid_top_k = head.config.centroid_intermediate_top_k
        # Optional fixed-range fake quantizers on the inputs, named like the step graph's inputs
        # (token_embed, hidden, k_full, ...): the student then sees the phone's input clipping.
        self.input_qdq: nn.ModuleDict | None = None

    def _qdq(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.input_qdq is None or name not in self.input_qdq:
            return x
        return self.input_qdq[name](x).as_subclass(torch.Tensor)

    def forward(self, inputs_embeds, position_ids, k_full, v_full, k_sliding, v_sliding, mask_full, mask_sliding):
        if self.input_qdq is not None:
            hb = inputs_embeds.shape[-1] // 2
            inputs_embeds = torch.cat([self._qdq("token_embed", inputs_embeds[..., :hb]),
                                       self._qdq("hidden", inputs_embeds[..., hb:])], dim=-1)
            k_full, v_full = self._qdq("k_full", k_full), self._qdq("v_full", v_full)
            k_sliding, v_sliding = self._qdq("k_sliding", k_sliding), self._qdq("v_sliding", v_sliding)
        x = self.pre_projection(inputs_embeds)
        out = self.model(
            inputs_embeds=x,
            attention_mask={"full_attention": mask_full, "sliding_attention": mask_sliding},
            position_ids=position_ids,
            shared_kv_states={"full_attention": (k_full, v_full), "sliding_attention": (k_sliding, v_sliding)},
            use_cache=False,
            logits_to_keep=None,  # an int makes the HF model slice multi-query inputs (and crash)
        )
        last = out.last_hidden_state
        logits = self.lm_head(last)
        if self.masked_embedding is not None and not self.dense:
            logits = centroid_mask(logits, self.masked_embedding["centroids"](last), self.cluster_of, self.centroid_top_k)
        return logits, self.post_projection(last)


def teacher_forced_inputs(embeds: torch.Tensor, hidden: torch.Tensor,
                          kv: dict[str, tuple[torch.Tensor, torch.Tensor]], sliding_window: int,
                          positions: torch.Tensor | None = None, negative: float = -1e9) -> tuple[torch.Tensor, ...]:
    """Inputs of `TeacherForcedHead` for drafting positions t (default: all, 0..N-2) of one
    sequence: query t is cat(e_{t+1}, h_t) at position t + 1 and sees K/V rows 0..t."""
    n = embeds.shape[0]
    t = torch.arange(n - 1) if positions is None else positions
    queries = torch.cat([embeds[t + 1], hidden[t]], dim=-1)[None]
    full, sliding = attention_masks(torch.arange(n).numpy(), (t + 1).numpy(), sliding_window, negative)
    (kf, vf), (ks, vs) = kv["full_attention"], kv["sliding_attention"]
    return (queries, (t + 1)[None], kf[None], vf[None], ks[None], vs[None],
            torch.from_numpy(full)[None, None], torch.from_numpy(sliding)[None, None])
