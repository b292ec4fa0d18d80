"""Drafters behind one small interface, and the tree builders of Table 5.

A drafter sees what the phone sees: the prompt (at most `max_prompt` tokens of it), the hand-off
replies, and the committed tokens. `start(prompt, reply)`, `draft(root) -> DraftTree`,
`commit(tokens, reply)`; that is the whole interface the decode loop uses.

Backends: the MTP chain and the SLM pass each have a float torch backend here (the fixture
checkpoints through transformers; the chain through qat/mtp.py), and an onnxruntime backend on
the graphs the phone ships, with the same interface: the SLM on convert/'s integer graphs
(slm_onnx.py), the MTP chain on qat/'s mtp_step.onnx (mtp_onnx.py); and a QNN HTP backend on an
export bundle's context binaries (qnn_backend.py: the same drafters, other sessions).
"""

from __future__ import annotations

import torch

from hyco.errors import HycoError
from hyco.handoff import StepInput, embed_tokens
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
        start = StepInput(self.last.embed, self.last.hidden, self.kv, self.last.position)
        return draft_chain(self.head, self.embed_fn, start, depth, topk=topk, keep_ids=self.keep_ids)


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

    def draft(self, root: int) -> DraftTree:
        cfg = self.config
        tree = DraftTree(root)
        frontier = [0]
        if cfg.mtp_depth:
            # Runner-ups come from the chain's own top-2 at the sibling depths (section 3.1).
            draft = self.mtp.propose(cfg.mtp_depth, topk=2)
            runner_ups = {d: int(draft.topk_ids[d - 1, 1]) for d in cfg.sibling_depths if d <= cfg.mtp_depth}
            plant_chain(tree, draft.tokens.tolist(), runner_ups, cfg.rate)
            frontier = list(range(len(tree)))  # the root and every planted node
        for _ in range(cfg.slm_passes):
            proposals = self.slm.propose(tree, frontier, cfg.slm_topk)
            before = len(tree)
            for node, (tokens, logprobs) in proposals.items():
                add_slm_children(tree, node, tokens, logprobs, cfg.slm_edge_cost)
            added = range(before, len(tree))  # new nodes only (a repeat returns the old node, rescored if higher)
            # Nodes beyond the budget would be trimmed anyway (a child never outscores its
            # parent), so the next pass expands the best new nodes that survive the trim.
            tree, index = trim_with_map(tree, cfg.budget)
            survivors = sorted({index[i] for i in added if i in index}, key=lambda i: -tree.nodes[i].score)
            frontier = survivors[:cfg.slm_topk]
            if not frontier:
                break
        tree, _ = trim_with_map(tree, cfg.budget)
        return tree


BACKENDS = ("torch", "onnxruntime", "qnn")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise HycoError(f"check.backend must be one of {list(BACKENDS)}, but got {backend!r}")
