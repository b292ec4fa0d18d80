"""hyco.data.chat: both schemas, every source kind, truncated files, bad records."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hyco.base.errors import HycoError
from hyco.data.chat import PACKAGED, Conversation, TruncatedWarning, iter_conversations

RECORDS = [
    {"id": "a", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "hello"}, {"from": "human", "value": "bye"},
                                  {"from": "bing", "value": "farewell"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "안녕"}, {"from": "chatgpt", "value": "안녕하세요"},
                                  {"from": "narrator", "value": "dropped: unknown role"}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "answer first"}]},
]
EXPECTED = [
    Conversation("a", (("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "bye"),
                       ("assistant", "farewell")), 0),
    Conversation("b", (("user", "안녕"), ("assistant", "안녕하세요")), 1),
    Conversation("c", (("assistant", "answer first"),), 2),
]


def ultrachat(record: dict) -> dict:
    role = {"system": "system", "human": "user", "gpt": "assistant", "bing": "assistant", "chatgpt": "assistant",
            "narrator": "narrator"}
    return {"prompt_id": record["id"], "messages": [{"role": role[t["from"]], "content": t["value"]}
                                                     for t in record["conversations"]]}


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def read_all(source, **kw) -> list[Conversation]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", TruncatedWarning)  # a complete file must not warn
        return list(iter_conversations(source, **kw))


def test_sharegpt_and_ultrachat_json_and_jsonl(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(RECORDS, ensure_ascii=False, indent=2))
    write_jsonl(tmp_path / "s.jsonl", RECORDS)
    write_jsonl(tmp_path / "u.jsonl", map(ultrachat, RECORDS))
    (tmp_path / "u_lines.json").write_text((tmp_path / "u.jsonl").read_text())  # JSON lines named .json
    for name in ("s.json", "s.jsonl", "u.jsonl", "u_lines.json"):
        assert read_all(tmp_path / name) == EXPECTED, name
    assert read_all(tmp_path / "u.jsonl", schema="ultrachat") == EXPECTED
    assert EXPECTED[0].assistant_texts() == ["hello", "farewell"] and EXPECTED[0].first_user_text() == "hi"
    assert EXPECTED[2].first_user_text() is None


def test_parquet_arrow_and_dataset_folder_through_datasets(tmp_path):
    import datasets

    table = datasets.Dataset.from_list([ultrachat(r) for r in RECORDS])
    table.to_parquet(str(tmp_path / "u.parquet"))
    (tmp_path / "folder" / "data").mkdir(parents=True)
    table.to_parquet(str(tmp_path / "folder" / "data" / "test_sft-00000-of-00001.parquet"))
    table.to_parquet(str(tmp_path / "folder" / "data" / "train_sft-00000-of-00001.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert read_all(tmp_path / "u.parquet") == EXPECTED
    assert read_all(arrow) == EXPECTED
    assert read_all(tmp_path / "folder", split="train_sft") == EXPECTED
    with pytest.raises(HycoError, match="cannot open as a dataset"):
        list(iter_conversations(tmp_path / "folder", split="no_such_split"))


def test_dataset_in_the_hf_cache_is_read_offline(tmp_path):
    """A dataset loaded once before (here: a prepared cache in the layout `load_dataset` leaves,
    namespace___name/default/0.0.0/hash) is found by name with no hub, through the CLI."""
    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    datasets.Dataset.from_list([ultrachat(r) for r in RECORDS]).to_parquet(str(tmp_path / "train_sft.parquet"))
    cache = tmp_path / "hf_datasets_cache"
    builder = Parquet(cache_dir=str(cache), dataset_name="tiny_chat", hash="0123abcd",
                      data_files=DataFilesDict.from_patterns({"train_sft": [str(tmp_path / "train_sft.parquet")]}))
    builder.download_and_prepare()
    (cache / "tiny_chat").rename(cache / "org___tiny_chat")
    prepared = next((cache / "org___tiny_chat").glob("default-*"))
    shutil.move(prepared, prepared.parent / "default")
    (tmp_path / "train_sft.parquet").unlink()  # only the cache is left
    code = ("import json; from hyco.data.chat import iter_conversations; "
            "print(json.dumps([[c.id, c.turns] for c in iter_conversations('org/tiny_chat', split='train_sft')]))")
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == [[c.id, [list(t) for t in c.turns]] for c in EXPECTED]


def test_truncated_files_read_up_to_the_last_complete_record(tmp_path):
    text = json.dumps(RECORDS, ensure_ascii=False)
    (tmp_path / "cut.json").write_text(text[: text.index('"id": "c"') + 3])
    with pytest.warns(TruncatedWarning, match="read 2 complete records"):
        assert list(iter_conversations(tmp_path / "cut.json")) == EXPECTED[:2]
    lines = (write_jsonl(tmp_path / "full.jsonl", RECORDS)).read_text()
    (tmp_path / "cut.jsonl").write_text(lines[: len(lines) - 20])
    with pytest.warns(TruncatedWarning, match="read 2 complete records"):
        assert list(iter_conversations(tmp_path / "cut.jsonl")) == EXPECTED[:2]
    # A corrupt record in the middle of an array stops there too, without reading on.
    (tmp_path / "corrupt.json").write_text(text.replace('{"id": "b"', '{"id": "b" oops', 1))
    with pytest.warns(TruncatedWarning, match="read 1 complete records"):
        assert list(iter_conversations(tmp_path / "corrupt.json")) == EXPECTED[:1]
    # A parquet file cut short: datasets cannot read its footer, which is one clear error.
    import datasets

    datasets.Dataset.from_list([ultrachat(r) for r in RECORDS]).to_parquet(str(tmp_path / "u.parquet"))
    data = (tmp_path / "u.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(HycoError, match="cut.parquet"):
        list(iter_conversations(tmp_path / "cut.parquet"))


def test_packaged_sharegpt_streams_and_is_truncated():
    first = list(itertools.islice(iter_conversations(PACKAGED), 50))
    assert len(first) == 50 and all(isinstance(c, Conversation) for c in first)
    assert sum(len(c.assistant_texts()) for c in first) > 50
    assert [c.index for c in first] == list(range(50))
    with pytest.warns(TruncatedWarning, match="read 17671 complete records"):
        count = sum(1 for _ in iter_conversations(PACKAGED, schema="sharegpt"))
    assert count == 17_671


def test_bad_sources_and_records(tmp_path):
    with pytest.raises(HycoError, match="dataset file not found"):
        list(iter_conversations(tmp_path / "missing.jsonl"))
    write_jsonl(tmp_path / "other.jsonl", [{"dialog": []}])
    with pytest.raises(HycoError, match="unknown chat schema"):
        list(iter_conversations(tmp_path / "other.jsonl"))
    with pytest.raises(HycoError, match="unknown chat schema 'alpaca'"):
        list(iter_conversations(tmp_path / "other.jsonl", schema="alpaca"))
    write_jsonl(tmp_path / "strings.jsonl", [{"conversations": ["hi", "hello"]}])
    with pytest.raises(HycoError, match="record 0.*holds a str"):
        list(iter_conversations(tmp_path / "strings.jsonl"))
    write_jsonl(tmp_path / "mixed.jsonl", [RECORDS[0], ultrachat(RECORDS[1])])
    with pytest.raises(HycoError, match="record 1 is not a conversation in the sharegpt schema"):
        list(iter_conversations(tmp_path / "mixed.jsonl"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(HycoError, match="unsupported dataset file type"):
        list(iter_conversations(tmp_path / "notes.txt"))
