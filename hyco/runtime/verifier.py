"""The reference verifier: transformers' Gemma 4 on the server side of a HyCo round.

Per round it runs one forward pass over the draft tree on top of the committed prefix (tree
attention mask, per-node positions: hyco/runtime/tree_pass.py), turns each row's logits into p~
(temperature, top-k, top-p; section 3.5), verifies the tree (exact or epsilon-threshold), keeps
the K/V of the root and the accepted path in its cache, and returns the hand-off for the next
round (section 3.1): e(bonus) as the assistant consumes it, h at the path's endpoint (the row the
bonus was sampled from) at the recipe's capture point, and the K/V rows of the last full and last
sliding layer for the newly committed tokens. The first reply (after the prompt's prefill) carries
the K/V rows of the prompt's last `window` positions (section 3.4), or of the whole prompt
(`window=None`) for a head that runs on the server (Cloud+MTP).

Later rounds hand off the K/V rows of the committed tokens only (the root and the accepted path,
at their own positions), and the head applies its sliding window by position. That is the
intended behaviour, the phone's: it is what `hyco.npu.handoff.handoff_states` computes over the
committed text, and what qat/ trains on. transformers' `SinglePositionMultiTokenCandidateGenerator`
agrees with it only while the sequence is shorter than the verifier's sliding window: it slices
the verifier's cache to the new length, so a rejected candidate's row stays at t + 1, and once
the sliding layer's cache has dropped old rows that slice no longer lines up with positions and
also passes the rows of rejected candidates (tests/test_handoff.py shows both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyco.npu.handoff import LAYER_TYPES, embed_tokens
from hyco.runtime.acceptance import Verdict, keyed_samples, verify
from hyco.runtime.sampling import sample_rows, sampling_probs
from hyco.runtime.tree import DraftTree
from hyco.runtime.tree_pass import CachedTreeModel, PassOutput


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 64
    top_p: float = 0.95

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class Handoff:
    """What the server returns for the MTP Drafter (float; `wire.py` quantizes it for the link)."""

    embed: torch.Tensor  # [H] e(x_{t+1}): the new root (bonus) token's scaled input embedding
    hidden: torch.Tensor  # [H] h_t at the capture point
    new_kv: dict[str, tuple[torch.Tensor, torch.Tensor]]  # type -> (K, V) [kv_heads, n_new, head_dim]
    position: int  # t + 1: the root's position, where the head drafts


@dataclass(frozen=True)
class Reply:
    root: int  # the token the verifier sampled last: the next tree's root
    handoff: Handoff | None  # None: a verifier that hands nothing off (the token bridge's)
    verdict: Verdict | None = None  # None for the prefill reply
    probs: torch.Tensor | None = None  # p~ per tree row (kept for metrics and tests)


class ReferenceVerifier:
    def __init__(self, model, sampling: Sampling, *, capture_point: str = "after_norm", window: int | None = 1024,
                 keyed_seed: int | None = None, hand_off: bool = True):
        """`keyed_seed`: draw each token from a generator keyed by its position (`keyed_samples`),
        so the committed text does not depend on the drafts; None: from the caller's generator.
        `hand_off=False`: replies carry no hand-off (a verifier of another family behind the
        token bridge, whose phone runs no MTP head)."""
        self.hand_off = hand_off
        self.model = model
        self.keyed_seed = keyed_seed
        self.runner = CachedTreeModel(model)
        self.sampling = sampling
        self.capture_point = capture_point
        self.window = window  # K/V rows of the prompt the first reply carries (None: all of them)

    def _handoff(self, out: PassOutput, rows: list[int], endpoint: int, root: int) -> Handoff:
        """Hand-off after a pass: K/V of `rows` (the newly committed ones), h at row `endpoint`."""
        hidden = out.hidden_before_norm if self.capture_point == "before_norm" else out.hidden_after_norm
        missing = [t for t in LAYER_TYPES if t not in out.shared_kv]
        if missing:
            raise ValueError(f"verifier returned no shared K/V for {missing}")
        index = torch.tensor(rows, dtype=torch.long)
        new_kv = {t: (k.index_select(1, index).float(), v.index_select(1, index).float())
                  for t, (k, v) in out.shared_kv.items() if t in LAYER_TYPES}
        embed = embed_tokens(self.model, torch.tensor([root]))[0].float().cpu()
        return Handoff(embed, hidden[endpoint].float(), new_kv, self.runner.committed)

    def prefill(self, prompt: list[int], generator: torch.Generator | None) -> Reply:
        out = self.runner.prefill(prompt)  # the verifier prefills the whole prompt
        probs = self.sampling.probs(out.logits)
        if self.keyed_seed is None:
            root = int(sample_rows(probs, generator)[0])
        else:
            root = int(keyed_samples(probs[-1:], [len(prompt)], self.keyed_seed)[0])
        first = 0 if self.window is None else max(0, len(prompt) - self.window)
        rows = list(range(first, len(prompt)))
        return Reply(root, self._handoff(out, rows, 0, root) if self.hand_off else None)

    def verify_tree(self, tree: DraftTree, epsilon: float, generator: torch.Generator | None) -> Reply:
        start = self.runner.committed  # the root's position
        out = self.runner.forward_tree(tree.tokens, tree.parents)
        probs = self.sampling.probs(out.logits)
        samples = None if self.keyed_seed is None else keyed_samples(
            probs, [start + node.depth + 1 for node in tree.nodes], self.keyed_seed).tolist()
        verdict = verify(tree, probs, epsilon, generator, samples)
        self.runner.commit(verdict.path)
        handoff = self._handoff(out, verdict.path, verdict.path[-1], verdict.bonus) if self.hand_off else None
        return Reply(verdict.bonus, handoff, verdict, probs)
