"""The keep set: which token ids the drafters may predict, and how to read it back.

The set is always-kept tokens topped up with the tokens most frequent in counted assistant
turns until it has exactly `size` ids. Ties break by token id so the set is a pure function of
(tokenizer, counts, size). Always kept, in disjoint categories (first match wins):
- `byte`: the 256 byte tokens, which can spell any string;
- `chat`: the special tokens the chat template emits (turn markers, BOS);
- `special`: the tokenizer's other special tokens (named ones such as EOS and PAD, and added
  tokens flagged special), except placeholders;
- `placeholder`: only with `keep_placeholders`: reserved slots such as Gemma's 6,242
  `<unusedN>`, which no chat text produces (the real Gemma tokenizer would otherwise spend
  6,000 keep-set places on them); left out, they still compete on their counts like any token;
- `script`: every token with a script the recipe protects (e.g. Hangul).
Added tokens that are not special (Gemma's newline, space and tab runs, HTML tags) are ordinary
text pieces: they are kept by frequency.

On disk (the contract in notes/design.md): `keep_set.json` holds the sorted ids, so a token's
keep index is its position there; `keep_to_vocab.npy` (int32, size) and `vocab_to_keep.npy`
(int32, vocab, -1 where not kept) map between the two index spaces.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hyco.base.errors import HycoError
from hyco.base.loading import read_json

KEEP_SET = "keep_set.json"
KEEP_TO_VOCAB = "keep_to_vocab.npy"
VOCAB_TO_KEEP = "vocab_to_keep.npy"
PROMPTS = "prompts.jsonl"
CATEGORIES = ("special", "chat", "placeholder", "byte", "script", "frequent")
# Reserved slots that a tokenizer registers but no text uses: Gemma's <unusedN>, Llama 3's
# <|reserved_special_token_N|>, <reserved_N>-style names.
PLACEHOLDER = re.compile(r"<unused\d+>|<\|reserved_special_token_\d+\|>|<reserved_?\d+>|\[unused\d+\]")
# Probe conversations rendered through the chat template to see which special tokens it emits.
_CHAT_PROBES = (
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], False),
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}], True),
)
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))

# Scripts a recipe can name in `vocab.always_scripts`: a token is kept when its text holds any
# character of these code point ranges. Token text is the vocabulary string (SentencePiece
# style, as Gemma stores it), where Hangul appears as itself.
SCRIPT_RANGES: dict[str, tuple[tuple[int, int], ...]] = {
    "hangul": (
        (0x1100, 0x11FF),  # Hangul Jamo
        (0x3130, 0x318F),  # Hangul Compatibility Jamo
        (0xA960, 0xA97F),  # Hangul Jamo Extended-A
        (0xAC00, 0xD7A3),  # Hangul Syllables
        (0xD7B0, 0xD7FF),  # Hangul Jamo Extended-B
    ),
}


def tokenizer_hash(tokenizer) -> str:
    """Identity of a vocabulary: the token string of every id, in order.

    Hashing the id -> token table (not the tokenizer files) survives re-saving the tokenizer
    and changes exactly when a keep index would point at another token.
    """
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return hashlib.sha256(json.dumps(tokens, ensure_ascii=False).encode()).hexdigest()


def folder_tokenizer_hash(path: str | Path) -> str:
    """`tokenizer_hash` of a tokenizer folder, loaded once per process while its files stay as
    they are (calibrate checks the keep set against convert's and qat's tokenizer, most often one
    folder: the Gemma tokenizer takes seconds to load)."""
    path = Path(path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    return _folder_hash(str(path), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=8)
def _folder_hash(path: str, files: tuple) -> str:
    return tokenizer_hash(load_tokenizer(path))


def load_tokenizer(path: str | Path):
    """A fast tokenizer from a local folder, or HycoError naming the folder."""
    from hyco.base.loading import load_tokenizer as load

    path = Path(path)
    tokenizer = load(path)
    if not getattr(tokenizer, "is_fast", False):
        raise HycoError(f"{path}: needs a fast tokenizer (tokenizer.json); batch counting relies on it")
    return tokenizer


def byte_token_ids(tokenizer, where: str) -> np.ndarray:
    vocab = tokenizer.get_vocab()
    missing = [t for t in BYTE_TOKENS if t not in vocab]
    if missing:
        raise HycoError(f"{where}: tokenizer has no byte tokens: {len(missing)} of 256 missing "
                        f"(e.g. {missing[0]}); the keep set needs <0x00>..<0xFF> so any string stays spellable")
    return np.array([vocab[t] for t in BYTE_TOKENS], dtype=np.int64)


def special_token_ids(tokenizer) -> np.ndarray:
    """The named special tokens (BOS, EOS, PAD, ...) and every added token flagged special."""
    ids = set(tokenizer.all_special_ids)
    ids |= {i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", True)}
    return np.array(sorted(ids), dtype=np.int64)


def placeholder_ids(tokenizer) -> np.ndarray:
    """Added tokens named like reserved slots (`PLACEHOLDER`) that no named special token is."""
    named = set(tokenizer.all_special_ids)
    ids = {i for i, t in tokenizer.added_tokens_decoder.items() if PLACEHOLDER.fullmatch(t.content) and i not in named}
    return np.array(sorted(ids), dtype=np.int64)


def chat_marker_ids(tokenizer) -> tuple[np.ndarray, str]:
    """Special tokens the chat template emits around a few probe conversations (turn markers,
    BOS), and how they were found; none when the tokenizer has no (working) template."""
    if not getattr(tokenizer, "chat_template", None):
        return np.zeros(0, dtype=np.int64), "none (tokenizer has no chat template)"
    special = set(special_token_ids(tokenizer).tolist())
    found, rendered = set(), 0
    for messages, generation in _CHAT_PROBES:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        except Exception:  # a template may refuse a probe (e.g. a system turn); the others still count
            continue
        rendered += 1
        found |= {i for i in tokenizer(text, add_special_tokens=False)["input_ids"] if i in special}
    if not rendered:
        return np.zeros(0, dtype=np.int64), "none (the chat template rendered no probe conversation)"
    return np.array(sorted(found), dtype=np.int64), f"special tokens in {rendered} probe renderings of the chat template"


def script_token_ids(tokenizer, scripts: tuple[str, ...]) -> np.ndarray:
    unknown = [s for s in scripts if s not in SCRIPT_RANGES]
    if unknown:
        raise HycoError(f"vocab.always_scripts: unknown script {unknown[0]!r} (known: {', '.join(SCRIPT_RANGES)})")
    ranges = [r for s in scripts for r in SCRIPT_RANGES[s]]
    if not ranges:
        return np.zeros(0, dtype=np.int64)
    # One character class for all ranges: one regex scan of the whole vocabulary stays fast.
    pattern = re.compile("[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in ranges) + "]")
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return np.array([i for i, tok in enumerate(tokens) if tok and pattern.search(tok)], dtype=np.int64)


def always_kept(tokenizer, scripts: tuple[str, ...], where: str, keep_placeholders: bool = False) -> dict[str, np.ndarray]:
    """The always-kept ids by category, disjoint (see the module doc): a byte token that is also
    registered as an added token counts as a byte token; a special token with Hangul text counts
    as special. Placeholders are an empty category unless `keep_placeholders`."""
    byte = np.unique(byte_token_ids(tokenizer, where))
    chat = np.setdiff1d(chat_marker_ids(tokenizer)[0], byte)
    placeholder = np.setdiff1d(placeholder_ids(tokenizer), np.union1d(byte, chat))
    special = np.setdiff1d(special_token_ids(tokenizer), np.concatenate([byte, chat, placeholder]))
    if not keep_placeholders:
        placeholder = placeholder[:0]
    taken = np.concatenate([byte, chat, special, placeholder])
    script = np.setdiff1d(script_token_ids(tokenizer, scripts), taken)
    return {"special": special, "chat": chat, "placeholder": placeholder, "byte": byte, "script": script}


def always_kept_report(tokenizer, always: dict[str, np.ndarray], keep_placeholders: bool) -> dict[str, Any]:
    """What the always-kept categories hold and what was left out, for report.json."""
    names = lambda ids: tokenizer.convert_ids_to_tokens([int(i) for i in ids])
    placeholders = placeholder_ids(tokenizer)
    added = set(tokenizer.added_tokens_decoder)
    forced = set(np.concatenate(list(always.values())).tolist())
    return {
        "special_tokens": names(always["special"]),
        "chat_markers": names(always["chat"]),
        "chat_markers_found_by": chat_marker_ids(tokenizer)[1],
        "placeholders_in_tokenizer": int(len(placeholders)),
        "placeholders_left_out": int(len(set(placeholders.tolist()) - forced)),
        "placeholder_examples": names(placeholders[:3]),
        "added_tokens": len(added),
        "added_tokens_kept_by_frequency_only": len(added - forced - set(placeholders.tolist())),
        "keep_placeholders": keep_placeholders,
    }


def frequency_order(counts: np.ndarray, last: np.ndarray | None = None) -> np.ndarray:
    """Token ids by count, most frequent first; equal counts in increasing id order. Ids in
    `last` (placeholders) that were never counted come after every other id."""
    ids = np.arange(len(counts))
    demoted = np.zeros(len(counts), dtype=bool)
    if last is not None and len(last):
        demoted[np.asarray(last)] = True
        demoted &= counts == 0
    return np.lexsort((ids, -counts.astype(np.int64), demoted))


def select_keep_set(counts: np.ndarray, always: dict[str, np.ndarray], size: int, where: str,
                    last: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Categories of the keep set of exactly `size` ids: `always` plus the most frequent others
    (`last`: see `frequency_order`)."""
    vocab = len(counts)
    kept = np.unique(np.concatenate(list(always.values())))
    if size > vocab:
        raise HycoError(f"{where}: keep-set size must be <= the vocabulary ({vocab}), but got {size}")
    if size < len(kept):
        parts = ", ".join(f"{len(v)} {k}" for k, v in always.items())
        raise HycoError(f"{where}: keep-set size must be >= the always-kept tokens ({len(kept)}: {parts}), but got {size}")
    order = frequency_order(counts, last)
    others = order[~np.isin(order, kept)]
    return {**always, "frequent": np.sort(others[: size - len(kept)])}


def index_maps(token_ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    keep_to_vocab = np.asarray(token_ids, dtype=np.int32)
    vocab_to_keep = np.full(vocab_size, -1, dtype=np.int32)
    vocab_to_keep[keep_to_vocab] = np.arange(len(keep_to_vocab), dtype=np.int32)
    return keep_to_vocab, vocab_to_keep


@dataclass(frozen=True)
class KeepSet:
    """A keep set read back from a vocab stage folder (see `load_keep_set`)."""

    token_ids: np.ndarray  # int32 [N], sorted; keep index = position
    vocab_to_keep: np.ndarray  # int32 [V], -1 where not kept
    tokenizer_hash: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.token_ids)

    @property
    def keep_to_vocab(self) -> np.ndarray:
        return self.token_ids

    def to_keep(self, vocab_ids) -> np.ndarray:
        """Keep indices of vocabulary ids (-1 for ids outside the keep set)."""
        return self.vocab_to_keep[np.asarray(vocab_ids)]


def load_keep_set(path: str | Path, tokenizer=None) -> KeepSet:
    """Read a keep set from a vocab output folder or its keep_set.json, checking it whole.

    `tokenizer` (a tokenizer object or a tokenizer folder) is checked against the hash the set
    was built for: keep indices from another vocabulary would silently point at other tokens.
    """
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    meta_path = folder / KEEP_SET if path.is_dir() else path
    meta = read_json(meta_path, "keep_set.json")
    try:
        token_ids = np.asarray(meta["token_ids"], dtype=np.int64)
        size, expected_hash = int(meta["size"]), str(meta["tokenizer"])
        vocab_size = int(meta["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise HycoError(f"{meta_path}: malformed keep set ({type(e).__name__}: {e})") from None
    if len(token_ids) != size or np.any(np.diff(token_ids) <= 0) or (size and (token_ids[0] < 0 or token_ids[-1] >= vocab_size)):
        raise HycoError(f"{meta_path}: 'token_ids' must be {size} sorted unique ids below {vocab_size}")
    keep_to_vocab = _load_index(folder / KEEP_TO_VOCAB, (size,))
    vocab_to_keep = _load_index(folder / VOCAB_TO_KEEP, (vocab_size,))
    if not np.array_equal(keep_to_vocab, token_ids) or not np.array_equal(index_maps(token_ids, vocab_size)[1], vocab_to_keep):
        raise HycoError(f"{folder}: {KEEP_TO_VOCAB} / {VOCAB_TO_KEEP} disagree with {KEEP_SET}")
    if tokenizer is not None:
        folder = isinstance(tokenizer, str | Path)
        actual = folder_tokenizer_hash(tokenizer) if folder else tokenizer_hash(tokenizer)
        if actual != expected_hash:
            where = tokenizer if folder else getattr(tokenizer, "name_or_path", "tokenizer")
            raise HycoError(f"{meta_path}: keep set was built for another tokenizer "
                            f"(hash {expected_hash[:12]}, but {where} has {actual[:12]})")
    return KeepSet(token_ids=keep_to_vocab, vocab_to_keep=vocab_to_keep, tokenizer_hash=expected_hash,
                   meta={k: v for k, v in meta.items() if k != "token_ids"})


def _load_index(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    from hyco.base.loading import load_npy

    return load_npy(path, np.int32, shape, "keep-set index")


def load_prompts(path: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """The reserved prompt conversations of a vocab output folder (or its prompts.jsonl):
    dicts {"id", "index", "split": "train" | "eval", "turns": [[role, text], ...]}, in the
    order they were drawn; `split` keeps one of the two."""
    path = Path(path)
    file = path / PROMPTS if path.is_dir() else path
    if not file.is_file():
        raise HycoError(f"prompts file not found: {file}")
    prompts = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            p = json.loads(line)
            ok = p["split"] in ("train", "eval") and all(len(t) == 2 for t in p["turns"]) and "id" in p
        except (json.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            raise HycoError(f"{file}: line {n} is not a prompt conversation {{id, split, turns}}")
        if split is None or p["split"] == split:
            prompts.append(p)
    return prompts
