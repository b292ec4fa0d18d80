"""The HyCo round loop (Algorithm 1): draft on the phone, verify on the server, hand off, repeat."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from hyco.runtime_check.drafters import TreeDrafter
from hyco.runtime_check.tree import CHAIN
from hyco.runtime_check.verifier import ReferenceVerifier


@dataclass
class RoundLog:
    accepted_sources: list[str]  # source of each accepted draft token, root to endpoint
    chain_depth_reached: int  # deepest chain node on the accepted path (0: none)
    chain_planted: int  # chain nodes in the tree
    bonus: int
    tree_nodes: int
    tree_bytes: int
    draft_s: float

    @property
    def committed(self) -> int:
        return len(self.accepted_sources) + 1


@dataclass
class DecodeLog:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)  # the output, cut at EOS / max_new_tokens
    rounds: list[RoundLog] = field(default_factory=list)
    wire_per_round: list[int] = field(default_factory=list)
    wire_kv: list[int] = field(default_factory=list)
    first_reply_bytes: int = 0


def decode(prompt: list[int], verifier: ReferenceVerifier, drafter: TreeDrafter, *, epsilon: float,
           max_new_tokens: int, eos_ids: set[int], generator: torch.Generator | None) -> DecodeLog:
    log = DecodeLog(len(prompt))
    reply = verifier.prefill(prompt, generator)
    drafter.start(prompt, reply)
    out = [reply.root]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        start = time.perf_counter()
        tree = drafter.draft(out[-1])
        draft_s = time.perf_counter() - start
        reply = verifier.verify_tree(tree, epsilon, generator)
        path = reply.verdict.path
        drafter.commit([tree.nodes[i].token for i in path], reply)
        out += reply.verdict.committed_tokens(tree)
        chain_on_path = [tree.nodes[i].chain_depth for i in path if tree.nodes[i].source == CHAIN]
        log.rounds.append(RoundLog(
            accepted_sources=[tree.nodes[i].source for i in path[1:]],
            chain_depth_reached=max(chain_on_path, default=0),
            chain_planted=sum(n.source == CHAIN for n in tree.nodes),
            bonus=reply.verdict.bonus, tree_nodes=len(tree) - 1, tree_bytes=tree.wire_bytes(), draft_s=draft_s,
        ))
    for i, token in enumerate(out):
        if token in eos_ids:
            out = out[:i + 1]
            break
    log.tokens = out[:max_new_tokens]
    wire = drafter.wire
    if wire:
        log.first_reply_bytes = wire[0].per_round + wire[0].kv
        log.wire_per_round = [w.per_round for w in wire[1:]]
        log.wire_kv = [w.kv for w in wire[1:]]
    return log

