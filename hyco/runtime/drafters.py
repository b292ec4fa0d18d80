"""Drafters behind one small interface, and the tree builders of Table 5.

A drafter sees what the phone sees: the prompt (at most `max_prompt` tokens of it), the hand-off
replies, and the committed tokens. `start(prompt, reply)`, `draft(root) -> DraftTree`,
`proactive(tree)` (drafting while the reply is in flight; specedge-pd), `commit(tokens, reply)`,
and the counts `bets` / `wins` of proactive drafting: that is the whole interface the decode loop uses.

Backends: the MTP chain and the SLM pass each have a float torch backend here (the fixture
checkpoints through transformers; the chain through qat/mtp.py), and an onnxruntime backend on
the graphs the phone ships, with the same interface: the SLM on convert/'s integer graphs
(slm_onnx.py), the MTP chain on qat/'s mtp_step.onnx (mtp_onnx.py); and a QNN HTP backend on an
export bundle's context binaries (qnn_backend.py: the same drafters, other sessions).
"""

from __future__ import annotations

import torch

from hyco.base.errors import HycoError
from hyco.npu.handoff import StepInput, embed_tokens
from hyco.runtime.configs import DecodeConfig
from hyco.runtime.mtp import Draft, draft_chain
from hyco.runtime.tree import DraftTree, add_slm_children, plant_chain, trim_with_map
from hyco.runtime.tree_pass import CachedTreeModel
from hyco.runtime.verifier import Handoff, Reply
from hyco.runtime.wire import WireCount, send


class HandoffWindow:
    """What the MTP Drafter keeps from the hand-offs, whatever runs the head: the last `window`
    K/V rows they delivered (None: the whole prefix, as the server-side head of Cloud+MTP has),
    and the latest e(root), h and position."""

    def __init__(self, *, window: int | None, quantize_wire: bool):
        self.window = window
        self.quantize_wire = quantize_wire
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last: Handoff | None = None

    def receive(self, handoff: Handoff) -> WireCount:
        handoff, count = send(handoff, self.quantize_wire)
        for t, (k, v) in handoff.new_kv.items():
            if t in self.kv:
                k, v = torch.cat([self.kv[t][0], k], 1), torch.cat([self.kv[t][1], v], 1)
            if self.window is not None:
                k, v = k[:, -self.window:], v[:, -self.window:]
            self.kv[t] = (k, v)
        self.last = handoff
        return count

    def step_input(self) -> StepInput:
        """What the next drafting burst starts from."""
        return StepInput(self.last.embed, self.last.hidden, self.kv, self.last.position)


class MtpChainTorch(HandoffWindow):
    """The MTP Drafter: the gemma4_assistant head in float, driven by qat/mtp.py's chain.

    `embed_fn` embeds the drafted tokens (default: the verifier's exact scaled embedding; the
    phone's graph uses qat's 8-bit table of kept tokens instead).
    """

    def __init__(self, head, verifier, *, keep_ids: torch.Tensor | None, window: int | None, quantize_wire: bool,
                 embed_fn=None):
        super().__init__(window=window, quantize_wire=quantize_wire)
        self.head = head
        self.embed_fn = embed_fn or (lambda ids: embed_tokens(verifier, ids))
        self.keep_ids = keep_ids

    def propose(self, depth: int, topk: int) -> Draft:
        return draft_chain(self.head, self.embed_fn, self.step_input(), depth, topk=topk, keep_ids=self.keep_ids)


class SlmTorch:
    """The SLM Drafter in float through transformers (or the verifier itself: the oracle).

    Its own KV ring holds the last `ring_full` (full layers) / `ring_sliding` (sliding layers)
    committed tokens, and it never prefills more than `max_prompt` prompt tokens (section 3.4).
    Tokens committed since its last pass are run as extra rows in front of the next tree pass,
    then kept, as the phone folds them into its next graph call.
    """

    def __init__(self, model, *, keep_ids: torch.Tensor | None, ring_full: int, ring_sliding: int, max_prompt: int):
        self.runner = CachedTreeModel(model, ring_full=ring_full, ring_sliding=ring_sliding)
        self.keep_ids = keep_ids
        self.max_prompt = max_prompt
        self.backlog: list[int] = []

    def start(self, prompt: list[int]) -> None:
        kept = prompt[-self.max_prompt:]
        self.runner.prefill(kept, start_position=len(prompt) - len(kept))

    def commit(self, tokens: list[int]) -> None:
        self.backlog.extend(tokens)

    @property
    def cached(self) -> int:
        """Context tokens whose K/V rows are in the ring (the backlog's are not yet)."""
        return self.runner.committed

    def rewind(self, keep: int, backlog: list[int]) -> None:
        """Keep the first `keep` context rows, forget the rest, and run `backlog` in front of the
        next pass (the token bridge's re-tokenized tail)."""
        self.runner.rollback(self.runner.committed - keep)
        self.backlog = list(backlog)

    def propose(self, tree: DraftTree, nodes: list[int], topk: int) -> dict[int, tuple[list[int], list[float]]]:
        """One pass over the tree (plus the backlog); top-k children and log-probs at `nodes`,
        over the keep set (the restricted output layer's log-softmax)."""
        lead = len(self.backlog)
        tokens = self.backlog + tree.tokens
        parents = [i - 1 for i in range(lead)] + [p + lead if p >= 0 else lead - 1 for p in tree.parents]
        out = self.runner.forward_tree(tokens, parents)
        self.runner.commit(list(range(lead)))
        self.backlog = []
        logits = out.logits[[lead + i for i in nodes]]
        if self.keep_ids is not None:
            logits = logits[:, self.keep_ids]
        logprobs, index = torch.log_softmax(logits, -1).topk(min(topk, logits.shape[-1]), dim=-1)
        ids = self.keep_ids[index] if self.keep_ids is not None else index
        return {node: (ids[j].tolist(), logprobs[j].tolist()) for j, node in enumerate(nodes)}


class TreeDrafter:
    """Builds one configuration's tree: MTP chain (+ runner-up siblings), then SLM passes, then
    the trim to the budget (section 3.1; the SLM-only and chain-only trees are special cases)."""

    def __init__(self, config: DecodeConfig, mtp: HandoffWindow | None, slm: SlmTorch | None):
        if config.mtp_depth and mtp is None or config.slm_passes and slm is None:
            raise ValueError(f"{config.name}: needs {'an MTP head' if mtp is None else 'an SLM'}")
        self.config, self.mtp, self.slm = config, mtp, slm
        self.wire: list[WireCount] = []
        self.bet: tuple[list[int], DraftTree, int, list[int]] | None = None  # proactive drafting's, see `proactive`
        self.seed: tuple[DraftTree, list[int]] | None = None  # the next tree's start after a bet that won
        self.bets = self.wins = 0

    def _receive(self, reply: Reply) -> None:
        count = self.mtp.receive(reply.handoff)
        if not self.config.mtp_on_server:  # a server-side head's inputs never cross the link
            self.wire.append(count)

    def start(self, prompt: list[int], reply: Reply) -> None:
        if self.mtp is not None:
            self._receive(reply)
        if self.slm is not None:
            self.slm.start(prompt)

    def commit(self, tokens: list[int], reply: Reply) -> None:
        """`tokens`: the round's newly committed tokens before the new root (old root + accepted)."""
        if self.mtp is not None:
            self._receive(reply)
        if self.slm is not None:
            self.slm.commit(tokens)
        if self.bet is not None:
            path, bet, leaf, frontier = self.bet
            bonus = bet.child_with_token(leaf, reply.root)
            if tokens == path and bonus is not None:  # the whole bet accepted, its bonus drafted
                self.wins += 1
                seed, index = subtree(bet, bonus)
                self.seed = seed, [index[i] for i in frontier if i in index] or [0]
            self.bet = None

    def proactive(self, tree: DraftTree) -> bool:
        """Proactive drafting (SpecEdge's PD), run while the verifier's reply is in flight: bet
        that the verifier accepts the tree's best path (the highest-scoring child at each step)
        and draft `pd_passes` SLM passes beyond its leaf, in the SLM's own context plus that path
        (one tree of the path and what grows under its leaf, `budget` nodes). The bet's tokens
        are never sent: `commit` keeps what grew under the bonus when the bet wins, and
        `draft` goes on from there; a lost bet is dropped. Returns whether it drafted."""
        cfg = self.config
        if not cfg.pd_passes:
            return False
        path = best_path(tree)
        bet, leaf = DraftTree(tree.nodes[0].token), 0
        for i in path[1:]:
            node = tree.nodes[i]
            leaf = bet.add(leaf, node.token, node.score, node.source, node.chain_depth)
        bet, leaf, frontier = self._expand(bet, [leaf], cfg.pd_passes, keep=leaf)
        self.bet = [tree.nodes[i].token for i in path], bet, leaf, frontier
        self.bets += 1
        return True

    def _expand(self, tree: DraftTree, frontier: list[int], passes: int, keep: int = 0) -> tuple[DraftTree, int, list[int]]:
        """`passes` SLM passes, each over the best new nodes of the one before (from `frontier`),
        the tree trimmed to the budget after each; returns the tree, node `keep`'s index in it
        and the last pass's best new nodes."""
        cfg = self.config
        for _ in range(passes):
            proposals = self.slm.propose(tree, frontier, cfg.slm_topk)
            before = len(tree)
            for node, (tokens, logprobs) in proposals.items():
                add_slm_children(tree, node, tokens, logprobs, cfg.slm_edge_cost)
            added = range(before, len(tree))  # new nodes only (a repeat returns the old node, rescored if higher)
            # Nodes beyond the budget would be trimmed anyway (a child never outscores its
            # parent), so the next pass expands the best new nodes that survive the trim.
            tree, index = trim_with_map(tree, cfg.budget)
            keep = index[keep]
            frontier = sorted({index[i] for i in added if i in index}, key=lambda i: -tree.nodes[i].score)[:cfg.slm_topk]
            if not frontier:
                break
        return tree, keep, frontier

    def draft(self, root: int) -> DraftTree:
        cfg = self.config
        tree = DraftTree(root)
        frontier = [0]
        if self.seed is not None:  # a proactive bet won: start from what was drafted under this root
            (tree, frontier), self.seed = self.seed, None
            if tree.nodes[0].token != root:
                raise ValueError(f"proactive drafting's seed is rooted at {tree.nodes[0].token}, not at {root}")
        if cfg.mtp_depth:
            # Runner-ups come from the chain's own top-2 at the sibling depths (section 3.1).
            draft = self.mtp.propose(cfg.mtp_depth, topk=2)
            runner_ups = {d: int(draft.topk_ids[d - 1, 1]) for d in cfg.sibling_depths if d <= cfg.mtp_depth}
            plant_chain(tree, draft.tokens.tolist(), runner_ups, cfg.rate)
            frontier = list(range(len(tree)))  # the root and every planted node
        if cfg.slm_passes:
            tree, _, _ = self._expand(tree, frontier, cfg.slm_passes)
        tree, _ = trim_with_map(tree, cfg.budget)
        return tree


def best_path(tree: DraftTree) -> list[int]:
    """From the root, the highest-scoring child at each step (the earlier node on a tie): the
    path the drafter holds likeliest, which proactive drafting bets on."""
    path = [0]
    while children := tree.children(path[-1]):
        path.append(max(children, key=lambda i: (tree.nodes[i].score, -i)))
    return path


def subtree(tree: DraftTree, top: int) -> tuple[DraftTree, dict[int, int]]:
    """The nodes under `top`, rooted at it, their scores relative to its own; and the map from
    their indices in `tree` to the new ones."""
    out, index, base = DraftTree(tree.nodes[top].token), {top: 0}, tree.nodes[top].score
    for i in range(top + 1, len(tree)):
        node = tree.nodes[i]
        if node.parent in index:
            index[i] = out.add(index[node.parent], node.token, node.score - base, node.source, node.chain_depth)
    return out, index


BACKENDS = ("torch", "onnxruntime", "qnn")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise HycoError(f"check.backend must be one of {list(BACKENDS)}, but got {backend!r}")
