"""The token bridge: the SLM Drafter drafting for a verifier with another tokenizer (paper, App. H).

The SLM drafts a tree in its own tokens. Each draft path becomes verifier tokens by
re-tokenizing the path's text, which follows the committed text, with the verifier's tokenizer;
paths that share a prefix share verifier nodes (`DraftTree.add` merges equal edges). The verifier
then verifies in its own tokens, exactly or by the epsilon rule, so exact verification stays
lossless: whatever the bridge sends, the committed text is the verifier's own sampled text.

Boundaries. A tokenization's last tokens can change once more text follows ("hel" + "lo" is one
token "hello"; "12" + "3" regroups digits; a run of spaces hands its last space to the next word).
The stable rule: the last word of a text, with the whitespace in front of it (`\\s*\\S*` at the
end), is unstable, and only the tokens that end before it stay tokens whatever follows. Text can
only continue that word or start after it, and none of the tokenizers we meet (byte-level BPE with
a regex pre-tokenizer, Gemma's SentencePiece-style BPE) merges across whitespace into a word it has
already closed: tests/test_bridge.py checks the rule on real text and three tokenizers.

Where it applies. The SLM's context follows the rule (below): a non-canonical tokenization would
stay in its ring. The verifier's tree drafts the last word of each leaf's path too (`draft_tail`,
the default; an inner node's last word is its children's, and drafting it there would only add
branches such as " 1" beside " 12"): a tail that tokenizes otherwise once text follows is a draft the exact check rejects,
which costs a verification row and never the text, and a tail that matches is accepted (on the
tiny pair it raised MAT under both rules: bench/bench_bridge.py against `--trim-tail`).
`draft_tail=False` trims every path at its last word instead and counts the SLM tokens that lost. Under the epsilon rule an accepted tail can
commit a non-canonical tokenization, which the verifier then carries in its context. A path that
ends in the SLM's end-of-turn is drafted whole, then the verifier's own EOS. A trailing byte token
that does not finish its character is cut, and so is a path at any other special or markup token
of the SLM (its markup means nothing to the verifier).

The SLM's side. The phone keeps its context as the committed text in SLM tokens: the prompt in
its own chat template, then the reply. The reply's unstable tail is re-tokenized each round with
the new text: the SLM's ring rolls back the rows of the tail's old tokens and runs the new ones in
front of the next tree pass (`SlmTorch.backlog`). What the phone must hold for this: the SLM's
tokenizer (vocabulary and merges, already there for the prompt), the reply text since its last
stable boundary (one word) and that word's token count; per round it runs one tokenization of
that word plus the new text, and rolls back that many ring rows. The verifier's tokenizer stays on
the server, which maps the phone's tree (the message is the same tree of token ids) and replies
with the committed text's bytes. A verifier commit that ends inside a UTF-8 character drafts
nothing for one round (the verifier's own next token finishes the character).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from hyco.base.errors import HycoError
from hyco.runtime.tree import DraftTree

LAST_WORD = re.compile(r"\s*\S*\Z")
REPLACEMENT = "\ufffd"  # what a decoder prints for bytes that do not finish a character
ROUND_TRIP_PROBE = "Hello,  world!\n\n\tx = 12345.678; naïve café 東京 🙂 — done"


def unstable_from(text: str) -> int:
    """Where the text's last word, with the whitespace in front of it, starts."""
    return LAST_WORD.search(text).start()


def encode(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Token ids of `text` (no special tokens added) and each token's end as a character offset.
    Text that spells a special token ("<|eot_id|>") stays text: a draft cannot end a turn by
    writing its marker."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
    return list(enc["input_ids"]), [end for _, end in enc["offset_mapping"]]


def stable_tokens(tokenizer, text: str, *, complete: bool = False) -> tuple[list[int], int, int]:
    """`text`'s tokens, how many lead tokens stay tokens whatever follows (all when `complete`),
    and the characters those cover."""
    ids, ends = encode(tokenizer, text)
    if complete:
        return ids, len(ids), len(text)
    cut = unstable_from(text)
    stable = 0
    while stable < len(ids) and ends[stable] <= cut:
        stable += 1
    return ids, stable, ends[stable - 1] if stable else 0


def check_round_trip(tokenizer, name: str) -> None:
    """The bridge moves text through both tokenizers; one that rewrites text (a dummy prefix space,
    lower-casing, NFKC) would shift every boundary."""
    ids, _ = encode(tokenizer, ROUND_TRIP_PROBE)
    back = tokenizer.decode(ids)
    if back != ROUND_TRIP_PROBE:
        raise HycoError(f"{name} tokenizer does not round-trip text ({ROUND_TRIP_PROBE!r} comes back as {back!r}): "
                        "the token bridge needs tokenizers that encode and decode text unchanged")


def complete_text(tokenizer, ids: list[int]) -> tuple[str, bool]:
    """The text of `ids` (special tokens as their text) and whether it ends inside a character."""
    text = tokenizer.decode(ids)
    trimmed = text.rstrip(REPLACEMENT)
    return trimmed, len(trimmed) < len(text)


def markup_ids(tokenizer) -> set[int]:
    """Special tokens and added tokens that are not whitespace (Gemma's <start_of_turn>, <unused0>;
    its added runs of newlines and spaces are text)."""
    added = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special or t.content.strip()}
    return added | set(tokenizer.all_special_ids)


def end_of_turn_ids(tokenizer) -> set[int]:
    """The tokenizer's EOS and the special token its chat template writes after an answer (Gemma
    4's <turn|>, Llama 3's <|eot_id|>): where a drafted path ends the turn."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                        tokenize=True, return_dict=False)
    markup = markup_ids(tokenizer)
    last = next((t for t in reversed(list(ids)) if t in markup), None)
    return {t for t in (tokenizer.eos_token_id, last) if t is not None}


def model_end_of_turn_ids(folder: Path, tokenizer) -> set[int]:
    """A model's end-of-turn ids: its generation_config.json's eos_token_id, else its tokenizer's
    (`end_of_turn_ids`). The SLM's, where the answers stage writes a verifier's answers in the
    SLM's tokens and where check drafts through the bridge."""
    from transformers import GenerationConfig

    if (Path(folder) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {eos}
    return end_of_turn_ids(tokenizer)


@dataclass
class BridgeRound:
    slm_nodes: int  # draft nodes of the SLM's tree
    verifier_nodes: int  # draft nodes of the verifier's tree
    lost: int  # SLM draft nodes whose text no verifier node covers (cut at a boundary)
    map_s: float  # the server's mapping of the tree
    sync_s: float = 0.0  # the phone's re-tokenization of the reply (before the tree was drafted)
    rollback: int = 0  # SLM ring rows rolled back before this round's tree
    unfinished: bool = False  # the committed text ended inside a character: nothing drafted


@dataclass
class SlmContext:
    """The SLM's context as the phone keeps it: prompt ids, then the reply text in SLM tokens."""

    tokenizer: object
    prompt: list[int]
    reply: list[int] = field(default_factory=list)
    stable: int = 0  # reply tokens that no later text can change
    stable_chars: int = 0  # the reply text they cover
    text: str = ""  # the reply text

    def sync(self, text: str) -> tuple[int, list[int]]:
        """The reply is now `text` (the old text plus what was committed since): re-tokenize from
        the last stable boundary. Returns how many old reply tokens were dropped and the ids that
        replace them."""
        if not text.startswith(self.text[:self.stable_chars]):
            raise ValueError("the committed text changed behind its stable boundary")
        ids, stable, chars = stable_tokens(self.tokenizer, text[self.stable_chars:])
        dropped = len(self.reply) - self.stable
        self.reply = self.reply[:self.stable] + ids
        self.stable += stable
        self.stable_chars += chars
        self.text = text
        return dropped, ids

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.reply


class TokenBridge:
    """Maps SLM draft trees to verifier trees and keeps the SLM's context in step with the text."""

    def __init__(self, slm_tokenizer, verifier_tokenizer, *, slm_eos: set[int], verifier_eos: int,
                 draft_tail: bool = True):
        check_round_trip(slm_tokenizer, "the SLM's")
        check_round_trip(verifier_tokenizer, "the verifier's")
        self.slm_tokenizer, self.verifier_tokenizer = slm_tokenizer, verifier_tokenizer
        self.slm_eos, self.verifier_eos = set(slm_eos), int(verifier_eos)
        self.draft_tail = draft_tail
        self.slm_markup = markup_ids(slm_tokenizer) | self.slm_eos

    def path_text(self, anchor: list[int], path: list[int]) -> tuple[str, bool]:
        """The text the SLM tokens `path` add after `anchor` (the SLM's last context tokens),
        cut at a special token and at a character left unfinished; and whether it ended in EOS."""
        cut = next((i for i, t in enumerate(path) if t in self.slm_markup), len(path))
        ended = cut < len(path) and path[cut] in self.slm_eos
        head = self.slm_tokenizer.decode(anchor)
        full, _ = complete_text(self.slm_tokenizer, anchor + path[:cut])
        if not full.startswith(head):  # the anchor itself re-decodes differently: draft nothing
            return "", False
        text = full[len(head):]
        if REPLACEMENT in text:  # invalid bytes drafted mid-path: keep what precedes them
            text, ended = text[:text.index(REPLACEMENT)], False
        return text, ended

    def verifier_tree(self, tree: DraftTree, anchor: list[int], verifier_root: int) -> tuple[DraftTree, BridgeRound]:
        """The verifier's tree for the SLM's `tree` (rooted at the SLM's last context token, whose
        text is already committed), under `verifier_root` (the verifier's last committed token)."""
        start = time.perf_counter()
        out = DraftTree(verifier_root)
        texts: dict[int, str] = {0: ""}
        covered: dict[int, int] = {0: 0}  # characters of each node's path text that reached the verifier
        inner = {n.parent for n in tree.nodes}  # nodes whose text their children's paths carry on
        for i in range(1, len(tree)):
            node = tree.nodes[i]
            path = [tree.nodes[j].token for j in tree.path_to(i)[1:]]
            text, ended = self.path_text(anchor, path)
            whole = ended or (self.draft_tail and i not in inner)
            ids, stable, chars = stable_tokens(self.verifier_tokenizer, text, complete=whole)
            parent = 0
            for token in ids[:stable] + ([self.verifier_eos] if ended else []):
                parent = out.add(parent, token, min(node.score, out.nodes[parent].score), node.source)
            texts[i], covered[i] = text, chars
        # an SLM node is lost when no path through it reaches the verifier with all of its text
        reach = dict(covered)
        for i in range(len(tree) - 1, 0, -1):
            parent = tree.nodes[i].parent
            reach[parent] = max(reach.get(parent, 0), reach[i])
        lost = sum(reach[i] < len(texts[i]) for i in range(1, len(tree)))
        return out, BridgeRound(len(tree) - 1, len(out) - 1, lost, time.perf_counter() - start)
