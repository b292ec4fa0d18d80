"""The draft tree: nodes with token, parent, depth, score and source; scoring and trim (paper 3.1).

Node 0 is the root: the last committed token, which the verifier sampled but has not run yet.
Every other node is a drafted token. Nodes are appended parents-first, so a node's index is
always larger than its parent's; verification and the attention mask rely on that order.

Scores (section 3.1) put the MTP chain's nodes, which carry no probability, on one scale with the
SLM's candidates: each depth along a path costs ln(rate) (rate = the chain's per-depth acceptance,
0.66), so a depth-d chain node scores d*ln(rate); a runner-up sibling pays that cost twice on its
own edge (just below the chain token it doubles); an SLM candidate adds its token's
log-probability to the edge cost. The trim keeps the best `budget` nodes, closed under ancestors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

ROOT, CHAIN, SIBLING, SLM = "root", "chain", "sibling", "slm"
SOURCES = (CHAIN, SIBLING, SLM)


@dataclass(frozen=True)
class Node:
    token: int
    parent: int  # -1 for the root
    depth: int
    score: float
    source: str  # root | chain | sibling | slm
    chain_depth: int = 0  # for chain nodes: their step in the MTP chain (1..K)


class DraftTree:
    def __init__(self, root_token: int):
        self.nodes: list[Node] = [Node(int(root_token), -1, 0, 0.0, ROOT)]
        self._child_by_token: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, parent: int, token: int, score: float, source: str, chain_depth: int = 0) -> int:
        """Append a child; a token already drafted under the same parent is not added twice (the
        verifier checks each (parent, token) edge once) and the existing node's index is returned.

        A repeat that scores higher takes the node over with its source: an SLM candidate at
        p = 0.9 repeating the depth-1 runner-up (2 ln r) scores ln r + ln 0.9, and the node must
        carry that score into the trim. The node's descendants move by the same amount, since
        their scores were built on top of it (ties keep the first: the chain wins at equal score)."""
        if score > self.nodes[parent].score:
            raise ValueError(f"a child's score ({score}) cannot exceed its parent's ({self.nodes[parent].score})")
        key = (parent, int(token))
        if key in self._child_by_token:
            index = self._child_by_token[key]
            if score > self.nodes[index].score:
                self._rescore(index, float(score), source, chain_depth)
            return index
        self.nodes.append(Node(int(token), parent, self.nodes[parent].depth + 1, float(score), source, chain_depth))
        self._child_by_token[key] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def _rescore(self, index: int, score: float, source: str, chain_depth: int) -> None:
        shift = {index: score - self.nodes[index].score}
        self.nodes[index] = replace(self.nodes[index], score=score, source=source, chain_depth=chain_depth)
        for i in range(index + 1, len(self.nodes)):  # parents come first: one pass reaches every descendant
            node = self.nodes[i]
            if node.parent in shift:
                shift[i] = shift[node.parent]
                self.nodes[i] = replace(node, score=node.score + shift[i])

    def child_with_token(self, parent: int, token: int) -> int | None:
        return self._child_by_token.get((parent, int(token)))

    def children(self, parent: int) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.parent == parent]

    def path_to(self, index: int) -> list[int]:
        path = []
        while index >= 0:
            path.append(index)
            index = self.nodes[index].parent
        return path[::-1]

    @property
    def tokens(self) -> list[int]:
        return [n.token for n in self.nodes]

    @property
    def parents(self) -> list[int]:
        return [n.parent for n in self.nodes]

    @property
    def depths(self) -> list[int]:
        return [n.depth for n in self.nodes]

    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: row i may attend to column j when j is i or one of its ancestors."""
        n = len(self.nodes)
        mask = np.zeros((n, n), dtype=bool)
        for i, node in enumerate(self.nodes):
            mask[i, i] = True
            if node.parent >= 0:
                mask[i] |= mask[node.parent]
        return mask

    def wire_bytes(self) -> int:
        """The tree message the phone sends: int32 token ids and int8 parent indices for every row
        (rows <= 127; 33 in the paper). The paper reports 2.2 KB per round for its own message
        layout, which it does not spell out; this is the compact layout's size."""
        return len(self.nodes) * (4 + 1)


# --- scores (section 3.1) --------------------------------------------------------------------


def chain_score(depth: int, rate: float) -> float:
    return depth * math.log(rate)


def sibling_score(parent_score: float, rate: float) -> float:
    return parent_score + 2 * math.log(rate)


def slm_score(parent_score: float, logprob: float, edge_cost: float) -> float:
    return parent_score + edge_cost + logprob


def plant_chain(tree: DraftTree, chain: list[int], runner_ups: dict[int, int], rate: float) -> list[int]:
    """Plant the MTP chain y_1..y_K under the root and, at each depth d in `runner_ups`, the
    runner-up token as a sibling of y_d. Returns the chain's node indices."""
    chain_nodes, parent = [], 0
    for depth, token in enumerate(chain, start=1):
        if depth in runner_ups:
            tree.add(parent, runner_ups[depth], sibling_score(tree.nodes[parent].score, rate), SIBLING)
        parent = tree.add(parent, token, chain_score(depth, rate), CHAIN, chain_depth=depth)
        chain_nodes.append(parent)
    return chain_nodes


def add_slm_children(tree: DraftTree, parent: int, tokens: list[int], logprobs: list[float], edge_cost: float) -> list[int]:
    parent_score = tree.nodes[parent].score
    return [tree.add(parent, t, slm_score(parent_score, lp, edge_cost), SLM) for t, lp in zip(tokens, logprobs, strict=True)]


def trim(tree: DraftTree, budget: int) -> DraftTree:
    """The best `budget` draft nodes by score, closed under ancestors, in their original order.

    Ties go to the shallower node, then to the earlier one, so the result is deterministic and a
    parent (whose score is never below its child's) always comes before its children.
    """
    return trim_with_map(tree, budget)[0]


def trim_with_map(tree: DraftTree, budget: int) -> tuple[DraftTree, dict[int, int]]:
    """`trim`, plus the map from kept node indices to their indices in the trimmed tree."""
    ranked = sorted(range(1, len(tree)), key=lambda i: (-tree.nodes[i].score, tree.nodes[i].depth, i))
    keep = {0}
    for i in ranked:
        if len(keep) > budget:
            break
        if tree.nodes[i].parent in keep:
            keep.add(i)
    new_index = {0: 0}
    out = DraftTree(tree.nodes[0].token)
    for i in sorted(keep)[1:]:
        n = tree.nodes[i]
        new_index[i] = out.add(new_index[n.parent], n.token, n.score, n.source, n.chain_depth)
    return out, new_index
