"""The HyCo round loop (Algorithm 1): draft on the phone, verify on the server, hand off, repeat.

The text ends at its first committed EOS, wherever the round put it: an EOS accepted in the
middle of a path ends the round there (the accepted tokens after it and the bonus are never
text), and no further round runs, so MAT and passes per token count only what was committed up
to and including that EOS. No hand-off follows the last round (the server has nothing left to
send). A round cut by `max_new_tokens` counts in full: the verifier accepted those tokens, the
cut is the harness's budget, not the end of the text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hyco.runtime.acceptance import keyed_samples
from hyco.runtime.bridge import BridgeRound, SlmContext, TokenBridge, complete_text, encode
from hyco.runtime.drafters import TreeDrafter
from hyco.runtime.tree import CHAIN, DraftTree, trim_with_map
from hyco.runtime.verifier import ReferenceVerifier, Sampling


@dataclass
class RoundLog:
    accepted_sources: list[str]  # source of each committed draft token, root to endpoint
    chain_depth_reached: int  # deepest chain node among them (0: none)
    chain_planted: int  # chain nodes in the tree
    bonus: int | None  # the token sampled at the endpoint; None when an accepted EOS ended the text first
    unsampled: int  # committed draft tokens the verifier did not sample (accepted by the epsilon threshold)
    rows_at_epsilon: int  # over every tree row (root included): tokens with p~ >= the probed epsilon
    top_probability_sum: float  # over every tree row: the largest p~
    tree_nodes: int
    tree_bytes: int
    draft_s: float
    pd_s: float = 0.0  # proactive drafting, done while the reply is in flight (specedge-pd)

    @property
    def committed(self) -> int:
        return len(self.accepted_sources) + (self.bonus is not None)


@dataclass
class DecodeLog:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)  # the output, cut at EOS / max_new_tokens
    rounds: list[RoundLog] = field(default_factory=list)
    wire_per_round: list[int] = field(default_factory=list)
    wire_kv: list[int] = field(default_factory=list)
    wire_kv_rows: list[int] = field(default_factory=list)  # committed tokens each wire_kv entry covers
    first_reply_bytes: int = 0
    verified: bool = True  # False: the SLM alone decoded it (no verifier pass)
    pd_bets: int = 0  # proactive drafting: bets made, and won (the next tree started from one)
    pd_wins: int = 0
    bridge: list[BridgeRound] = field(default_factory=list)  # per round, through the token bridge
    slm_tokens: int = 0  # through the token bridge: the output's text in SLM tokens


def round_log(tree: DraftTree, reply, kept: int, probe: float, draft_s: float, pd_s: float = 0.0,
              wire_tree: DraftTree | None = None) -> RoundLog:
    """One round's log: `tree` as verified, `kept` of its committed tokens added to the text;
    `wire_tree`: the tree the phone sent, when the server verified another (the token bridge's)."""
    verdict = reply.verdict
    drafted = verdict.path[1:1 + min(kept, verdict.accepted)]  # committed draft nodes
    return RoundLog(
        accepted_sources=[tree.nodes[i].source for i in drafted],
        chain_depth_reached=max((tree.nodes[i].chain_depth for i in drafted if tree.nodes[i].source == CHAIN),
                                default=0),
        chain_planted=sum(n.source == CHAIN for n in tree.nodes),
        bonus=verdict.bonus if kept > verdict.accepted else None,
        unsampled=sum(not s for s in verdict.edge_sampled[:len(drafted)]),
        rows_at_epsilon=int((reply.probs.double() >= probe).sum()),  # compared as verify_epsilon does
        top_probability_sum=float(reply.probs.max(-1).values.sum()),
        tree_nodes=len(tree) - 1, tree_bytes=(wire_tree or tree).wire_bytes(), draft_s=draft_s, pd_s=pd_s,
    )


def first_eos(tokens: list[int], eos_ids: set[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in eos_ids), None)


def decode(prompt: list[int], verifier: ReferenceVerifier, drafter: TreeDrafter, *, epsilon: float,
           max_new_tokens: int, eos_ids: set[int], generator: torch.Generator | None,
           probe_epsilon: float | None = None) -> DecodeLog:
    """`probe_epsilon` (default `epsilon`): the threshold whose support size per tree row the log
    records (`RoundLog.rows_at_epsilon`), so exact configurations report it too."""
    probe = epsilon if probe_epsilon is None else probe_epsilon
    log = DecodeLog(len(prompt))
    reply = verifier.prefill(prompt, generator)
    drafter.start(prompt, reply)
    out = [reply.root]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        start = time.perf_counter()
        tree = drafter.draft(out[-1])
        draft_s = time.perf_counter() - start
        start = time.perf_counter()
        drafted = drafter.proactive(tree)  # while the tree and the reply are on the link (False: no PD)
        pd_s = time.perf_counter() - start if drafted else 0.0
        reply = verifier.verify_tree(tree, epsilon, generator)
        verdict = reply.verdict
        new = verdict.committed_tokens(tree)
        eos = first_eos(new, eos_ids)
        kept = len(new) if eos is None else eos + 1  # tokens this round adds to the text
        out += new[:kept]
        log.rounds.append(round_log(tree, reply, kept, probe, draft_s, pd_s))
        if eos is not None:
            break
        drafter.commit([tree.nodes[i].token for i in verdict.path], reply)
    log.tokens = out[:max_new_tokens]
    log.pd_bets, log.pd_wins = drafter.bets, drafter.wins
    wire = drafter.wire
    if wire:
        log.first_reply_bytes = wire[0].per_round + wire[0].kv
        log.wire_per_round = [w.per_round for w in wire[1:]]
        log.wire_kv = [w.kv for w in wire[1:]]
        log.wire_kv_rows = [w.kv_rows for w in wire[1:]]
    return log


def decode_alone(prompt: list[int], slm, *, topk: int, sampling: Sampling, seed: int, max_new_tokens: int,
                 eos_ids: set[int]) -> DecodeLog:
    """The SLM Drafter alone on the phone (`slm-alone`, the paper's delivery reference): it prefills
    the prompt but its last token, then makes one pass a token over a one-node tree (the last
    token), and samples the next from what its graph returns, the top-`topk` log-probs over the
    keep set, through the check's temperature / top-k / top-p, keyed by the token's position as
    the verifier's samples are (`acceptance.keyed_samples`). At temperature 0 that is the SLM's
    greedy decoding. Each pass is a round of one committed token (MAT 1), with its draft time;
    nothing is verified and nothing crosses the link."""
    if len(prompt) < 2:
        raise ValueError("slm-alone needs a prompt of at least 2 tokens (the SLM prefills all but the last)")
    log = DecodeLog(len(prompt), verified=False)
    slm.start(prompt[:-1])
    out, last = [], prompt[-1]
    while len(out) < max_new_tokens and (not out or out[-1] not in eos_ids):
        start = time.perf_counter()
        ids, logprobs = slm.propose(DraftTree(last), [0], topk)[0]
        probs = sampling.probs(torch.tensor([logprobs]))  # log-probs as logits: p~ renormalized over the k
        token = ids[int(keyed_samples(probs, [len(prompt) + len(out)], seed)[0])]
        log.rounds.append(RoundLog(accepted_sources=[], chain_depth_reached=0, chain_planted=0, bonus=token,
                                   unsampled=0, rows_at_epsilon=0, top_probability_sum=0.0, tree_nodes=0,
                                   tree_bytes=0, draft_s=time.perf_counter() - start))
        slm.commit([last])
        out.append(token)
        last = token
    log.tokens = out
    return log


def verifier_alone(verifier: ReferenceVerifier, prompt: list[int], max_new_tokens: int,
                   eos_ids: set[int] = frozenset(), probe_epsilon: float = 1.0) -> DecodeLog:
    """The verifier decoding by itself, one-node trees through the same tree pass: the reference
    text a bridged run must commit, and the cost reference (`verifier-alone`: a round, a pass and
    a token each, MAT 1 by construction)."""
    log = DecodeLog(len(prompt))
    out = [verifier.prefill(prompt, None).root]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        tree = DraftTree(out[-1])
        reply = verifier.verify_tree(tree, 1.0, None)
        out.append(reply.root)
        log.rounds.append(round_log(tree, reply, 1, probe_epsilon, 0.0))
        log.rounds[-1].tree_bytes = 0  # nothing goes up: the server decodes alone
    log.tokens = out
    return log


def decode_bridged(prompt: tuple[list[int], list[int]], verifier: ReferenceVerifier, drafter: TreeDrafter,
                   bridge: TokenBridge, *, epsilon: float, max_new_tokens: int, eos_ids: set[int],
                   generator: torch.Generator | None, probe_epsilon: float | None = None,
                   on_round: Callable[[int], bool] | None = None) -> DecodeLog:
    """Hybrid decoding through the token bridge (`bridge-slm`; hyco/runtime/bridge.py): the SLM
    drafts its tree in its tokens on its own prompt (its chat template), the server maps the tree
    to the verifier's tokens and verifies it on the verifier's prompt, and the SLM's context
    follows the committed text. `prompt`: the turn in the verifier's ids and in the SLM's.
    `log.tokens` are verifier tokens; `log.bridge` holds the bridge's figures per round.
    `on_round`: called as each round starts with the rounds done so far; False ends the decoding
    there (export's smoke marks its passes per round and stops after a few)."""
    verifier_prompt, slm_prompt = prompt
    if drafter.mtp is not None or drafter.config.pd_passes:
        raise ValueError(f"{drafter.config.name}: the token bridge drafts SLM-only trees (no MTP head, no PD)")
    probe = epsilon if probe_epsilon is None else probe_epsilon
    log = DecodeLog(len(verifier_prompt))
    reply = verifier.prefill(verifier_prompt, generator)
    slm = drafter.slm
    slm.start(slm_prompt)
    context = SlmContext(bridge.slm_tokenizer, list(slm_prompt))
    out = [reply.root]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        if on_round is not None and not on_round(len(log.rounds)):
            break
        start = time.perf_counter()
        text, unfinished = complete_text(bridge.verifier_tokenizer, out)
        unchanged = len(context.prompt) + context.stable  # context tokens no new text can change
        context.sync(text)
        ids = context.ids
        keep = min(slm.cached, unchanged, len(ids) - 1)  # the root (last context token) runs in the tree pass
        rolled_back = slm.cached - keep
        slm.rewind(keep, ids[keep:-1])
        sync_s = time.perf_counter() - start
        start = time.perf_counter()
        # A commit ending inside a character drafts nothing: the verifier finishes it first.
        tree = DraftTree(ids[-1]) if unfinished else drafter.draft(ids[-1])
        draft_s = time.perf_counter() - start
        vtree, figures = bridge.verifier_tree(tree, ids[-4:], out[-1])
        vtree, _ = trim_with_map(vtree, drafter.config.budget)  # the server verifies at most the phone's budget
        figures.sync_s, figures.rollback, figures.unfinished = sync_s, rolled_back, unfinished
        log.bridge.append(figures)
        reply = verifier.verify_tree(vtree, epsilon, generator)
        new = reply.verdict.committed_tokens(vtree)
        eos = first_eos(new, eos_ids)
        kept = len(new) if eos is None else eos + 1
        out += new[:kept]
        log.rounds.append(round_log(vtree, reply, kept, probe, draft_s, wire_tree=tree))
        if eos is not None:
            break
    log.tokens = out[:max_new_tokens]
    text, _ = complete_text(bridge.verifier_tokenizer, [t for t in log.tokens if t not in eos_ids])
    log.slm_tokens = len(encode(bridge.slm_tokenizer, text)[0])
    return log
