"""Tree verification (paper section 3.5): exact and epsilon-threshold acceptance.

Both rules start from the same draws: one sample s_v ~ p~(.|v) at every tree row v, taken in one
vectorised call. Exact verification descends from the root to the child whose token equals s_v;
the first sample matching no child is the bonus token. Since s_v is independent of everything
drafted under v, the committed text follows p~ (lossless).

Epsilon-threshold acceptance: a child c of v is accepted if c == s_v or p~(c|v) >= epsilon. The
verifier takes the deepest path of accepted children; among equally deep paths it prefers more
verifier-sampled edges (c == s_v), then the highest product of p~; a remaining tie goes to the
node drafted first (lowest index, our choice, so the result is deterministic). The bonus is the
sample at the path's endpoint. With epsilon = 1 only sampled edges (or p~ = 1, which the sample
then equals) pass, so the rule is exact verification; `verify` uses the descent for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyco.runtime.sampling import sample_rows
from hyco.runtime.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # node indices from the root (included) to the endpoint
    bonus: int  # the token sampled at the endpoint
    # per edge on the path: does its token equal the verifier's sample at its parent? (False:
    # accepted by the epsilon threshold only; exact verification accepts sampled edges alone)
    edge_sampled: tuple[bool, ...]

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    @property
    def sampled_edges(self) -> int:
        return sum(self.edge_sampled)

    def committed_tokens(self, tree: DraftTree) -> list[int]:
        """The round's new text after the root: accepted draft tokens, then the bonus."""
        return [tree.nodes[i].token for i in self.path[1:]] + [self.bonus]


def verify_exact(tree: DraftTree, samples: list[int]) -> Verdict:
    node = 0
    path = [0]
    while (child := tree.child_with_token(node, samples[node])) is not None:
        node = child
        path.append(node)
    return Verdict(path, int(samples[node]), (True,) * (len(path) - 1))


def verify_epsilon(tree: DraftTree, probs: torch.Tensor, samples: list[int], epsilon: float) -> Verdict:
    # Walk nodes parents-first; each node reachable through accepted edges carries its path key
    # (depth, sampled edges, log product of p~), compared lexicographically.
    p = probs.double()
    key: dict[int, tuple[int, int, float]] = {0: (0, 0, 0.0)}
    for i, node in enumerate(tree.nodes[1:], start=1):
        if node.parent not in key:
            continue
        prob = float(p[node.parent, node.token])
        sampled = node.token == samples[node.parent]
        if not (sampled or prob >= epsilon):
            continue
        depth, n_sampled, log_prod = key[node.parent]
        key[i] = (depth + 1, n_sampled + int(sampled), log_prod + (math.log(prob) if prob > 0 else -math.inf))
    best = max(key, key=lambda i: (*key[i], -i))
    path = tree.path_to(best)
    return Verdict(path, int(samples[best]), tuple(tree.nodes[i].token == samples[tree.nodes[i].parent] for i in path[1:]))


def verify(tree: DraftTree, probs: torch.Tensor, epsilon: float, generator: torch.Generator | None,
           samples: list[int] | None = None) -> Verdict:
    """`probs` [len(tree), V] holds p~ at every row (row i: the next token after node i);
    `samples`: each row's token drawn already (default: drawn here with `generator`)."""
    if probs.shape[0] != len(tree):
        raise ValueError(f"probs has {probs.shape[0]} rows for a tree of {len(tree)} nodes")
    if samples is None:
        samples = sample_rows(probs, generator).tolist()
    if epsilon >= 1.0:
        return verify_exact(tree, samples)
    return verify_epsilon(tree, probs, samples, epsilon)


def keyed_samples(probs: torch.Tensor, positions: list[int], seed: int) -> torch.Tensor:
    """One token per row of `probs`, row i drawn with a generator seeded by (`seed`, positions[i]),
    the absolute position of the token it samples. Text sampled this way depends on the
    verifier's distributions only, never on how many rows a round's tree had: exact verification
    then commits the same tokens whatever the drafts (as greedy decoding does), on sampled text."""
    out = []
    for row, position in zip(probs, positions, strict=True):
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(position))
        out.append(torch.multinomial(row, 1, generator=g))
    return torch.cat(out)
