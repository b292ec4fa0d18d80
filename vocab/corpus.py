"""One streaming pass over the chat corpus: deal conversations to disjoint pools, count tokens.

Pools: `count` (the keep set's frequency counts), `train` / `eval` (reserved prompt
conversations for QAT and calibration, never counted), `heldout` (the coverage report). The
`eval` pool takes the first eligible conversations of the evaluation partition (hyco/data/splits.py),
which the `train` pool and the fixtures' distillation never read, so evaluation prompts are
unseen by construction (the rest of the partition may be counted or held out). Each
conversation read goes to exactly one pool, drawn with a seeded generator in proportion to the
places each pool still has, so the pools are disjoint by construction, interleave along the
stream, and the pass stops once every pool is full: memory holds token counts (one int64 per
vocabulary entry) and the reserved prompts, never the corpus.

Assistant text is tokenized as the chat template renders it, on its own (see `assistant_view`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from hyco.data.chat import Conversation
from hyco.data.splits import is_evaluation

POOLS = ("count", "train", "eval", "heldout")
_PROBE = "Probe answer, line one.\nLine two."


def assistant_view(tokenizer) -> tuple[Callable[[str], str], str]:
    """How the chat template renders an assistant message's content, as a text -> text function.

    The drafters see an answer as the template renders it (Gemma's template trims it), and at
    generation time the answer starts right after the generation prompt, on a token boundary.
    So each assistant message is tokenized alone, after the template's own transformation,
    rather than tokenizing the whole rendered conversation, where BPE could merge across the
    turn header. The transformation is read off one probe rendering; the end-of-turn marker is
    not counted (it is a special token, always kept).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return (lambda text: text), "raw (tokenizer has no chat template)"
    raw = f"  \n{_PROBE}\n  "
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": raw}], tokenize=False)
    except Exception as e:  # a template may reject a probe (e.g. it requires a system turn)
        return (lambda text: text), f"raw (chat template failed on a probe: {type(e).__name__})"
    if raw in rendered:
        return (lambda text: text), "chat template (content as is)"
    if _PROBE in rendered:
        return str.strip, "chat template (content trimmed)"
    return (lambda text: text), "raw (chat template transforms content in a way not reproduced)"


def eligible_pools(conv: Conversation) -> list[str]:
    answers = any(t.strip() for t in conv.assistant_texts())
    prompt = (conv.first_user_text() or "").strip() != ""
    pools = []
    if answers:
        pools += ["count", "heldout"]
    if answers and prompt:
        # The evaluation partition gives the eval prompts and no training prompt; the rest the reverse.
        pools += ["eval"] if is_evaluation(conv) else ["train"]
    return pools


@dataclass
class Deal:
    """What the pass kept: the ids of each pool's conversations and the reserved ones whole."""

    quotas: dict[str, int]
    ids: dict[str, list[str]] = field(default_factory=lambda: {p: [] for p in POOLS})
    indices: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in POOLS})
    reserved: list[tuple[str, Conversation]] = field(default_factory=list)
    read: int = 0
    skipped: int = 0  # conversations with no assistant text (or no prompt, for reserved pools)

    def full(self) -> bool:
        return all(len(self.ids[p]) >= q for p, q in self.quotas.items())


def deal(conversations: Iterable[Conversation], quotas: dict[str, int], seed: int, state: Deal) -> Iterator[tuple[str, Conversation]]:
    """Yield (pool, conversation) until every pool is full or the stream ends."""
    rng = np.random.default_rng(seed)
    for conv in conversations:
        if state.full():
            return
        state.read += 1
        open_pools = [p for p in eligible_pools(conv) if len(state.ids[p]) < quotas.get(p, 0)]
        if not open_pools:
            state.skipped += 1
            continue
        room = np.array([quotas[p] - len(state.ids[p]) for p in open_pools], dtype=np.float64)
        # One draw per conversation read, so the deal depends only on the stream and the seed.
        pool = open_pools[int(np.searchsorted(np.cumsum(room) / room.sum(), rng.random(), side="right"))]
        if "eval" in open_pools:  # the partition is 1 in 8: eval takes its first eligible conversations
            pool = "eval"
        state.ids[pool].append(conv.id)
        state.indices[pool].append(conv.index)
        if pool in ("train", "eval"):
            state.reserved.append((pool, conv))
        yield pool, conv


class TokenCounter:
    """Counts of token ids over batches of texts, tokenized by the fast tokenizer's backend."""

    def __init__(self, tokenizer, vocab_size: int, batch_texts: int = 512):
        self.backend = tokenizer.backend_tokenizer
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.pending: list[str] = []
        self.batch_texts = batch_texts
        self.tokens = 0
        self.chars = 0

    def add(self, text: str) -> None:
        self.pending.append(text)
        if len(self.pending) >= self.batch_texts:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        # encode_batch_fast skips offset tracking we do not need; it tokenizes on all cores.
        encodings = self.backend.encode_batch_fast(self.pending, add_special_tokens=False)
        ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64)
        self.counts += np.bincount(ids, minlength=len(self.counts))[: len(self.counts)]
        self.tokens += len(ids)
        self.chars += sum(map(len, self.pending))
        self.pending = []
