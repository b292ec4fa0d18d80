"""The vocab stage: exact keep set on a hand-made corpus, disjoint pools, determinism, both
schemas and file formats, the reader API, output-layer restriction, and every bad input."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hyco.vocab.corpus import assistant_view
from hyco.vocab.stage import build_vocab

from hyco.base.errors import HycoError
from hyco.config.recipe import DatasetConfig, VocabConfig
from hyco.data.chat import TruncatedWarning
from hyco.data.keepset import load_keep_set, load_tokenizer, tokenizer_hash
from hyco.npu.restrict import restrict_output_layer
from hyco.pipeline.cli import main
from hyco.pipeline.compare import differences

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"] + [f"<unused{i}>" for i in range(17)]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# Ordinary pieces after the 24 specials and 256 bytes: ids 280.. in this order.
PIECES = ["a", "b", "c", "d", "e", "f", "ab", "cd", "가", "한", "국", "한국"]
ID = {t: i for i, t in enumerate(SPECIALS + BYTES + PIECES)}
VOCAB_LEN = len(SPECIALS) + 256 + len(PIECES)
# Always kept: 5 special (pad, eos, bos, unk, mask) + 2 chat markers (<|turn>, <turn|>, which the
# template emits) + 256 bytes + the four Hangul pieces; the 17 <unusedN> placeholders are left out.
N_ALWAYS = 5 + 2 + 256 + 4
TEMPLATE = ("{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
            "{{ m['content'] | trim }}<turn|>\n{% endfor %}")


def write_hand_tokenizer(out: Path, with_bytes: bool = True) -> Path:
    """A Gemma-layout tokenizer whose tokenization of the test corpus is known by hand:
    whitespace-split words, merges a+b, c+d, 한+국, and byte fallback for anything else."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + (BYTES if with_bytes else []) + PIECES
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("c", "d"), ("한", "국")], unk_token="<unk>",
                               byte_fallback=with_bytes))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", chat_template=TEMPLATE)
    fast.save_pretrained(str(out))
    return out


def sharegpt(cid: str, user: str, answers: list[str]) -> dict:
    turns = []
    for a in answers:
        turns += [{"from": "human", "value": user}, {"from": "gpt", "value": a}]
    return {"id": cid, "conversations": turns}


def as_ultrachat(record: dict) -> dict:
    role = {"human": "user", "gpt": "assistant"}
    return {"prompt_id": record["id"], "messages": [{"role": role[t["from"]], "content": t["value"]}
                                                     for t in record["conversations"]]}


# User turns are full of "d" and "f": they must not count.
HAND_CORPUS = [
    sharegpt("c1", "d d d d d d", ["ab ab ab cd"]),
    sharegpt("c2", "f f f f f f", ["e e", "f 한국"]),
    sharegpt("c3", "d d d d d d", ["  cd cd z  "]),  # z falls back to its byte token
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def vocab_args(tokenizer: Path, dataset: Path, out: Path, size: int, *extra: str) -> list[str]:
    return ["vocab", "--tokenizer", str(tokenizer), "--dataset", str(dataset), "--size", str(size), "--out", str(out),
            "--reserved-train", "0", "--reserved-eval", "0", "--heldout-conversations", "0", *extra]


@pytest.fixture(scope="module")
def hand_tokenizer(tmp_path_factory) -> Path:
    return write_hand_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="module")
def hand_corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "hand.jsonl", HAND_CORPUS)


# --- the exact keep set ---------------------------------------------------------------------


def test_hand_tokenizer_tokenizes_as_designed(hand_tokenizer):
    tok = load_tokenizer(hand_tokenizer)
    assert tok("ab ab cd 한국 z", add_special_tokens=False)["input_ids"] == [ID["ab"], ID["ab"], ID["cd"], ID["한국"], ID["<0x7A>"]]
    assert len(tok) == VOCAB_LEN


@pytest.mark.parametrize(("size", "expected_frequent"), [
    # Assistant counts: ab 3, cd 3, e 2, f 1 (한국 and <0x7A> are always kept anyway).
    (N_ALWAYS + 1, ["ab"]),  # ab and cd tie at 3: the lower id wins
    (N_ALWAYS + 3, ["ab", "cd", "e"]),
    (N_ALWAYS + 4, ["ab", "cd", "e", "f"]),
    (N_ALWAYS + 6, ["a", "b", "ab", "cd", "e", "f"]),  # then zero counts, by id
    (VOCAB_LEN - 15, PIECES[:8] + ["<unused0>", "<unused1>"]),  # uncounted placeholders come last
])
def test_exact_keep_set_on_hand_corpus(hand_tokenizer, hand_corpus, tmp_path, size, expected_frequent):
    out = tmp_path / "vocab"
    assert main(vocab_args(hand_tokenizer, hand_corpus, out, size, "--count-conversations", "3")) == 0
    keep = json.loads((out / "keep_set.json").read_text())
    always = list(range(7)) + list(range(24, 24 + 256)) + [ID[t] for t in ("가", "한", "국", "한국")]
    assert keep["token_ids"] == sorted(always + [ID[t] for t in expected_frequent])
    assert keep["size"] == size and len(keep["token_ids"]) == size
    assert keep["categories"] == {"special": 5, "chat": 2, "placeholder": 0, "byte": 256, "script": 4,
                                  "frequent": len(expected_frequent)}
    assert keep["counted"] == 3 and keep["reserved"] == []
    counts = np.load(out / "token_counts.npy")
    assert {t: int(counts[ID[t]]) for t in ("ab", "cd", "e", "f", "d", "<0x7A>")} == {
        "ab": 3, "cd": 3, "e": 2, "f": 1, "d": 0, "<0x7A>": 1}
    k2v, v2k = np.load(out / "keep_to_vocab.npy"), np.load(out / "vocab_to_keep.npy")
    assert k2v.dtype == np.int32 and v2k.dtype == np.int32 and len(v2k) == VOCAB_LEN
    assert k2v.tolist() == keep["token_ids"]
    assert [int(v2k[i]) for i in k2v] == list(range(size)) and int((v2k == -1).sum()) == len(v2k) - size
    for name in ("report.json", "coverage.png", "summary.md", "prompts.jsonl", "manifest.json"):
        assert (out / name).is_file(), name


def test_assistant_view_follows_the_chat_template(hand_tokenizer):
    tok = load_tokenizer(hand_tokenizer)
    view, label = assistant_view(tok)
    assert view("  ab\n ") == "ab" and "trimmed" in label
    tok.chat_template = None
    view, label = assistant_view(tok)
    assert view("  ab\n ") == "  ab\n " and label.startswith("raw")


# --- pools: counted, reserved and held-out are disjoint ------------------------------------


def varied_corpus(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = np.array(PIECES + ["z", "xy"])
    records = []
    for i in range(n):
        answers = [" ".join(rng.choice(words, size=int(rng.integers(3, 12)))) for _ in range(int(rng.integers(1, 3)))]
        records.append(sharegpt(f"conv{i}", f"question {i}", answers))
    records.insert(5, {"id": "no-answer", "conversations": [{"from": "human", "value": "hello"}]})
    return records


def recount(tokenizer, records: list[dict], indices: list[int], vocab_size: int) -> np.ndarray:
    """Independent reference: Python Counter over each assistant text tokenized one by one."""
    counter = Counter()
    for i in indices:
        for t in records[i]["conversations"]:
            if t["from"] == "gpt":
                counter.update(tokenizer(t["value"].strip(), add_special_tokens=False)["input_ids"])
    counts = np.zeros(vocab_size, dtype=np.int64)
    for k, v in counter.items():
        counts[k] = v
    return counts


def test_pools_are_disjoint_and_reserved_prompts_are_recorded(hand_tokenizer, tmp_path):
    records = varied_corpus(300)
    corpus = write_jsonl(tmp_path / "varied.jsonl", records)
    out = tmp_path / "vocab"
    config = VocabConfig(size=N_ALWAYS + 5, count_conversations=150, reserved_train=12, reserved_eval=9,
                         heldout_conversations=40, seed=3)
    build_out = out
    build_out.mkdir()
    build_vocab(tokenizer=hand_tokenizer, dataset=DatasetConfig(source=str(corpus)), config=config, out=build_out)
    keep = json.loads((out / "keep_set.json").read_text())
    counted, held = set(keep["counted_indices"]), set(keep["heldout_indices"])
    train, evals = set(keep["reserved_indices"]["train"]), set(keep["reserved_indices"]["eval"])
    assert (len(counted), len(train), len(evals), len(held)) == (150, 12, 9, 40)
    assert keep["counted"] == 150
    pools = [counted, train, evals, held]
    assert sum(map(len, pools)) == len(set().union(*pools)), "a conversation sits in two pools"
    assert 5 not in set().union(*pools), "a conversation without an answer was used"
    # Pools interleave along the stream rather than one after another.
    assert min(train) < max(counted) and min(held) < max(counted)
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert [p["id"] for p in prompts] == keep["reserved"]
    assert {p["index"] for p in prompts if p["split"] == "train"} == train
    assert {p["index"] for p in prompts if p["split"] == "eval"} == evals
    for p in prompts:
        src = records[p["index"]]
        assert p["id"] == src["id"] and p["turns"][0] == ["user", src["conversations"][0]["value"]]
    # The counts are those of the counted conversations only: reserved and held-out ones never counted.
    tok = load_tokenizer(hand_tokenizer)
    expected = recount(tok, records, sorted(counted), len(tok))
    np.testing.assert_array_equal(np.load(out / "token_counts.npy"), expected)
    report = json.loads((out / "report.json").read_text())
    held_counts = recount(tok, records, sorted(held), len(tok))
    kept = np.array(keep["token_ids"])
    assert report["outside_share"] == pytest.approx(1 - held_counts[kept].sum() / held_counts.sum(), abs=1e-12)
    assert report["heldout_assistant_tokens"] == held_counts.sum()


def test_two_runs_write_the_same_bytes(hand_tokenizer, tmp_path):
    corpus = write_jsonl(tmp_path / "varied.jsonl", varied_corpus(120))
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert main(["vocab", "--tokenizer", str(hand_tokenizer), "--dataset", str(corpus), "--size", str(N_ALWAYS + 4),
                     "--count-conversations", "60", "--reserved-train", "5", "--reserved-eval", "5",
                     "--heldout-conversations", "20", "--seed", "7", "--out", str(out)]) == 0
    names = sorted(p.name for p in outs[0].iterdir() if p.name != "manifest.json")
    assert names == sorted(p.name for p in outs[1].iterdir() if p.name != "manifest.json")
    for name in names:
        if name not in ("report.json", "stage.log"):  # declared in the manifest as varying: compared below
            assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    assert differences(outs[0], outs[1]) == []
    # Another seed deals other conversations.
    other = tmp_path / "c"
    assert main(["vocab", "--tokenizer", str(hand_tokenizer), "--dataset", str(corpus), "--size", str(N_ALWAYS + 4),
                 "--count-conversations", "60", "--reserved-train", "5", "--reserved-eval", "5",
                 "--heldout-conversations", "20", "--seed", "8", "--out", str(other)]) == 0
    assert json.loads((other / "keep_set.json").read_text())["reserved"] != json.loads((outs[0] / "keep_set.json").read_text())["reserved"]


# --- schemas and file formats ----------------------------------------------------------------


def keep_of(out: Path) -> tuple[list[int], list[int]]:
    keep = json.loads((out / "keep_set.json").read_text())
    return keep["token_ids"], np.load(out / "token_counts.npy").tolist()


def test_both_schemas_and_all_file_formats_give_the_same_keep_set(hand_tokenizer, tmp_path):
    import datasets

    records = varied_corpus(80)
    files = {
        "sharegpt.jsonl": write_jsonl(tmp_path / "sharegpt.jsonl", records),
        "ultrachat.jsonl": write_jsonl(tmp_path / "ultrachat.jsonl", [as_ultrachat(r) for r in records]),
        "sharegpt.json": tmp_path / "sharegpt.json",
    }
    files["sharegpt.json"].write_text(json.dumps(records, ensure_ascii=False, indent=1))
    ultra = datasets.Dataset.from_list([as_ultrachat(r) for r in records])
    ultra.to_parquet(str(tmp_path / "ultrachat.parquet"))
    files["ultrachat.parquet"] = tmp_path / "ultrachat.parquet"
    folder = tmp_path / "ultrachat_folder" / "data"
    folder.mkdir(parents=True)
    ultra.to_parquet(str(folder / "train-00000-of-00001.parquet"))
    files["ultrachat folder"] = folder.parent
    ultra.save_to_disk(str(tmp_path / "saved"))
    files["ultrachat.arrow"] = next((tmp_path / "saved").glob("*.arrow"))
    results = {}
    for name, path in files.items():
        out = tmp_path / f"out-{name.replace(' ', '_')}"
        rc = main(vocab_args(hand_tokenizer, path, out, N_ALWAYS + 3, "--count-conversations", "80"))
        assert rc == 0, name
        results[name] = keep_of(out)
    reference = results["sharegpt.jsonl"]
    assert sum(reference[1]) > 0
    for name, result in results.items():
        assert result == reference, name


def test_truncated_json_is_read_up_to_its_last_complete_record(hand_tokenizer, tmp_path):
    records = varied_corpus(30)
    text = json.dumps(records, ensure_ascii=False)
    cut = text.index('"conv20"')  # somewhere inside record 21 (0-based 21 after the inserted one)
    (tmp_path / "cut.json").write_text(text[:cut])
    write_jsonl(tmp_path / "head.jsonl", records[:21])
    with pytest.warns(TruncatedWarning, match="read 21 complete records"):
        build_vocab(tokenizer=hand_tokenizer, dataset=DatasetConfig(source=str(tmp_path / "cut.json")),
                    config=VocabConfig(size=N_ALWAYS + 3, count_conversations=1000, reserved_train=0, reserved_eval=0,
                                       heldout_conversations=0), out=_mk(tmp_path / "cut"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TruncatedWarning)
        build_vocab(tokenizer=hand_tokenizer, dataset=DatasetConfig(source=str(tmp_path / "head.jsonl")),
                    config=VocabConfig(size=N_ALWAYS + 3, count_conversations=1000, reserved_train=0, reserved_eval=0,
                                       heldout_conversations=0), out=_mk(tmp_path / "head"))
    assert keep_of(tmp_path / "cut") == keep_of(tmp_path / "head")
    assert json.loads((tmp_path / "cut" / "keep_set.json").read_text())["counted"] == 20  # one has no answer


def _mk(path: Path) -> Path:
    path.mkdir()
    return path


# --- the reader API ---------------------------------------------------------------------------


def test_load_keep_set_checks_the_tokenizer(hand_tokenizer, hand_corpus, tmp_path):
    out = tmp_path / "vocab"
    assert main(vocab_args(hand_tokenizer, hand_corpus, out, N_ALWAYS + 2, "--count-conversations", "3")) == 0
    keep = load_keep_set(out, tokenizer=hand_tokenizer)
    assert keep.size == N_ALWAYS + 2 and keep.tokenizer_hash == tokenizer_hash(load_tokenizer(hand_tokenizer))
    assert keep.to_keep([ID["ab"], ID["a"]]).tolist() == [int(np.searchsorted(keep.token_ids, ID["ab"])), -1]
    assert load_keep_set(out / "keep_set.json").size == keep.size
    # A tokenizer with another vocabulary (here: one token renamed) is refused.
    from tokenizers import Tokenizer
    other = tmp_path / "other_tok"
    write_hand_tokenizer(other)
    data = json.loads((other / "tokenizer.json").read_text())
    data["model"]["vocab"]["g"] = data["model"]["vocab"].pop("f")
    (other / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    Tokenizer.from_file(str(other / "tokenizer.json"))  # still a valid tokenizer
    with pytest.raises(HycoError, match="another tokenizer"):
        load_keep_set(out, tokenizer=other)
    # A folder's hash is computed once per process while its files stay as they are
    from hyco.data import keepset

    loads = []
    real = keepset.load_tokenizer
    keepset.load_tokenizer = lambda path: loads.append(path) or real(path)
    try:
        with pytest.raises(HycoError, match="another tokenizer"):  # its hash from the refusal above
            load_keep_set(out, tokenizer=other)
        assert not loads
        data["model"]["vocab"]["f"] = data["model"]["vocab"].pop("g")  # renamed back: the set's tokenizer again
        (other / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
        assert load_keep_set(out, tokenizer=other).size == keep.size and len(loads) == 1
    finally:
        keepset.load_tokenizer = real
    # Index files that disagree with keep_set.json are refused.
    np.save(out / "keep_to_vocab.npy", np.load(out / "keep_to_vocab.npy")[::-1].copy())
    with pytest.raises(HycoError, match="disagree"):
        load_keep_set(out)


# --- restricting an output layer -------------------------------------------------------------


def test_restricted_linear_logits_equal_full_logits_at_kept_ids():
    torch.manual_seed(0)
    full = torch.nn.Linear(48, 500, bias=True)
    keep = torch.sort(torch.randperm(500)[:137]).values.numpy()
    x = torch.randn(7, 48)
    restricted = restrict_output_layer(full, keep)
    assert restricted.weight.shape == (137, 48)
    # Same rows, same dot products: a different row count may block the BLAS reduction
    # differently, so allow fp32 rounding (a few ulp of values ~3), nothing more.
    torch.testing.assert_close(restricted(x), full(x)[:, keep], rtol=0, atol=2e-6)
    tied = torch.nn.Embedding(500, 48)
    torch.testing.assert_close(restrict_output_layer(tied, keep)(x), (x @ tied.weight.T)[:, keep], rtol=0, atol=2e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_restricted_quantized_linear_keeps_integers_scales_and_logits(bits):
    from transformers.integrations.gemma_quant import QuantizedLinear

    torch.manual_seed(bits)
    full = QuantizedLinear(40, 300, num_bits=bits)
    with torch.no_grad():
        dtype = torch.int8 if bits == 8 else torch.uint8
        high = 127 if bits == 8 else 256
        full.weight.copy_(torch.randint(-128 if bits == 8 else 0, high, full.weight.shape).to(dtype))
        full.weight_scale.copy_(torch.rand(300, 1) * 0.02 + 0.001)
        full.input_activation_scale.fill_(0.05)
        full.output_activation_scale.fill_(0.01)
    keep = np.sort(np.random.default_rng(bits).choice(300, size=77, replace=False))
    restricted = restrict_output_layer(full, keep)
    assert isinstance(restricted, QuantizedLinear) and restricted.num_bits == bits
    assert torch.equal(restricted.weight, full.weight[keep]) and torch.equal(restricted.weight_scale, full.weight_scale[keep])
    assert torch.equal(restricted._dequantize_weights(), full._dequantize_weights()[keep])
    # float64 so the output SRQ rounding (x / 0.01 rounded) cannot flip on a last-bit difference.
    x = torch.randn(5, 40, dtype=torch.float64)
    assert torch.equal(restricted(x), full(x)[:, keep])
    with pytest.raises(HycoError, match="within the layer"):
        restrict_output_layer(full, [0, 300])


# --- bad input: one line, exit 2, nothing written ----------------------------------------------


def run_bad(capsys, args: list[str], out: Path, match: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert match in err, err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*")), "partial output left behind"


def test_bad_inputs_exit_2_with_one_line_and_write_nothing(hand_tokenizer, hand_corpus, tmp_path, capsys):
    out = tmp_path / "out" / "vocab"
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"dialog": [{"speaker": "a", "text": "b"}]}])
    run_bad(capsys, vocab_args(hand_tokenizer, unknown, out, N_ALWAYS + 1), out, "unknown chat schema")
    run_bad(capsys, vocab_args(hand_tokenizer, hand_corpus, out, N_ALWAYS + 1, "--schema", "ultrachat"), out,
            "not a conversation in the ultrachat schema")
    no_answers = write_jsonl(tmp_path / "questions.jsonl", [sharegpt(f"q{i}", "hi", []) | {
        "conversations": [{"from": "human", "value": f"question {i}"}]} for i in range(5)])
    run_bad(capsys, vocab_args(hand_tokenizer, no_answers, out, N_ALWAYS + 1), out, "no assistant turns")
    run_bad(capsys, vocab_args(hand_tokenizer, hand_corpus, out, N_ALWAYS - 1), out, f"must be >= the always-kept tokens ({N_ALWAYS}")
    run_bad(capsys, vocab_args(hand_tokenizer, hand_corpus, out, VOCAB_LEN + 1), out, f"must be <= the vocabulary ({VOCAB_LEN})")
    no_bytes = write_hand_tokenizer(tmp_path / "no_bytes", with_bytes=False)
    run_bad(capsys, vocab_args(no_bytes, hand_corpus, out, N_ALWAYS + 1), out, "no byte tokens")
    run_bad(capsys, vocab_args(tmp_path / "missing_tok", hand_corpus, out, N_ALWAYS + 1), out, "tokenizer folder not found")
    run_bad(capsys, vocab_args(hand_tokenizer, tmp_path / "missing.jsonl", out, N_ALWAYS + 1), out, "dataset file not found")
    run_bad(capsys, vocab_args(hand_tokenizer, hand_corpus, out, N_ALWAYS + 1, "--scripts", "klingon"), out, "unknown script")
    run_bad(capsys, vocab_args(hand_tokenizer, hand_corpus, out, 0), out, "vocab.size must be > 0")


# --- the pipeline and the fixture family ---------------------------------------------------------


def test_recipe_run_includes_the_vocab_stage(hand_tokenizer, tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "varied.jsonl", varied_corpus(60))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
version: 1
name: vocab-only
out: {tmp_path / 'run'}
stages: [vocab]
models:
  tokenizer: {hand_tokenizer}
dataset:
  source: {corpus}
  schema: sharegpt
vocab:
  size: {N_ALWAYS + 3}
  count_conversations: 30
  reserved_train: 4
  reserved_eval: 4
  heldout_conversations: 10
""")
    assert main(["run", str(recipe)]) == 0
    out = tmp_path / "run" / "vocab"
    keep = load_keep_set(out, tokenizer=hand_tokenizer)
    assert keep.size == N_ALWAYS + 3 and keep.meta["counted"] == 30 and len(keep.meta["reserved"]) == 8
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "vocab" and "keep_set.json" in manifest["outputs"]
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 0
    assert "[vocab] skipped" in capsys.readouterr().out
    assert main(["run", str(recipe), "--set", "vocab.seed=1"]) == 0  # the section changed: rebuilt
    assert json.loads((out / "keep_set.json").read_text())["seed"] == 1


def test_fixture_tokenizer_keeps_every_always_kept_category(tiny_family, tmp_path):
    from hyco.data.keepset import BYTE_TOKENS, SCRIPT_RANGES

    tokenizer = tiny_family["tokenizer"]
    tok = load_tokenizer(tokenizer)
    out = _mk(tmp_path / "vocab")
    build_vocab(tokenizer=tokenizer, dataset=DatasetConfig(), out=out,
                config=VocabConfig(size=1345, count_conversations=150, reserved_train=4, reserved_eval=4,
                                   heldout_conversations=20))
    keep = load_keep_set(out, tokenizer=tok)
    kept = set(keep.token_ids.tolist())
    cats = keep.meta["categories"]
    # Gemma 4's named specials at their real ids: <bos>, <|turn>, <turn|> and the empty thought
    # channel's <|channel>, <channel|> are the template's markers; the 89 <unusedN> between them
    # are placeholders, left out.
    assert cats["special"] == 20 and cats["chat"] == 5 and cats["placeholder"] == 0
    assert {100, 101, 105, 106} <= set(keep.token_ids.tolist())
    assert "Left out: 89 placeholder tokens" in (out / "summary.md").read_text()
    assert cats["byte"] == 256 and cats["script"] > 0 and cats["frequent"] > 0
    assert sum(cats.values()) == 1345
    assert set(tok.all_special_ids) <= kept
    assert set(tok.convert_tokens_to_ids(list(BYTE_TOKENS))) <= kept
    hangul = [i for i, t in enumerate(tok.convert_ids_to_tokens(list(range(len(tok)))))
              if any(lo <= ord(ch) <= hi for ch in t for lo, hi in SCRIPT_RANGES["hangul"])]
    assert len(hangul) == cats["script"] and set(hangul) <= kept
    assert keep.meta["assistant_text"] == "chat template (content trimmed)"
    report = json.loads((out / "report.json").read_text())
    sizes = [m["size"] for m in report["comparison"]]
    assert sizes == sorted(sizes) and sizes[-1] == len(tok) and report["comparison"][-1]["outside_share"] == 0.0
    shares = [m["outside_share"] for m in report["comparison"]]
    assert shares == sorted(shares, reverse=True) and 0 < report["outside_share"] < 1


def test_restricting_the_fixture_heads(tiny_family, tmp_path):
    """The SLM's quantized lm_head and the assistant's tied head, restricted to a keep set:
    same logits at the kept ids as the full heads on the same hidden states."""
    from transformers import AutoModelForCausalLM

    from hyco.base.loading import load_pretrained

    torch.manual_seed(0)
    slm = load_pretrained(tiny_family["slm"], "slm", float_checkpoint=False, dtype=torch.float32)
    vocab = slm.config.get_text_config().vocab_size
    keep = np.sort(np.random.default_rng(0).choice(vocab, size=vocab // 3, replace=False))
    assistant = AutoModelForCausalLM.from_pretrained(str(tiny_family["assistant"]), dtype=torch.float32)
    tied = assistant.get_output_embeddings()
    assert tied.weight.data_ptr() == assistant.get_input_embeddings().weight.data_ptr()  # the real head is tied
    for name, head in [("slm.lm_head", slm.get_output_embeddings()), ("assistant.lm_head", tied)]:
        hidden = torch.randn(3, head.in_features)
        restricted = restrict_output_layer(head, keep, name)
        assert restricted.out_features == len(keep) and type(restricted) is type(head)
        # fp32 rounding only (see test_restricted_linear_logits_equal_full_logits_at_kept_ids).
        torch.testing.assert_close(restricted(hidden), head(hidden)[:, keep], rtol=0, atol=2e-6)
    restricted = restrict_output_layer(tied, keep, "assistant.lm_head")
    assert restricted.weight.data_ptr() != tied.weight.data_ptr()  # untied: the embedding table stays whole
    assert torch.equal(assistant.get_input_embeddings().weight[keep], restricted.weight)


def test_heldout_split_and_prompt_reader(hand_tokenizer, tmp_path):
    import datasets

    from hyco.data.keepset import load_prompts

    folder = tmp_path / "chat" / "data"
    folder.mkdir(parents=True)
    train, test = varied_corpus(60, seed=1), varied_corpus(25, seed=2)
    datasets.Dataset.from_list([as_ultrachat(r) for r in train]).to_parquet(str(folder / "train_sft-00000-of-00001.parquet"))
    datasets.Dataset.from_list([as_ultrachat(r) for r in test]).to_parquet(str(folder / "test_sft-00000-of-00001.parquet"))
    out = tmp_path / "vocab"
    assert main(["vocab", "--tokenizer", str(hand_tokenizer), "--dataset", str(folder.parent), "--split", "train_sft",
                 "--heldout-split", "test_sft", "--size", str(N_ALWAYS + 2), "--count-conversations", "40",
                 "--reserved-train", "3", "--reserved-eval", "2", "--heldout-conversations", "100", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    keep = json.loads((out / "keep_set.json").read_text())
    assert report["got"] == {"count": 40, "train": 3, "eval": 2, "heldout": 25}  # test_sft ran out: 25 of its 26 have answers
    tok = load_tokenizer(hand_tokenizer)
    held = recount(tok, test, keep["heldout_indices"], len(tok))
    assert report["heldout_assistant_tokens"] == held.sum()
    assert [p["id"] for p in load_prompts(out, "train")] == [train[i]["id"] for i in keep["reserved_indices"]["train"]]
    assert len(load_prompts(out / "prompts.jsonl")) == 5
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "turns": []}\n')
    with pytest.raises(HycoError, match="line 1 is not a prompt conversation"):
        load_prompts(tmp_path / "bad.jsonl")


# --- special tokens, chat markers and placeholders ---------------------------------------------


def test_placeholders_left_out_unless_the_recipe_keeps_them(hand_tokenizer, hand_corpus, tmp_path):
    out = tmp_path / "default"
    assert main(vocab_args(hand_tokenizer, hand_corpus, out, N_ALWAYS + 2, "--count-conversations", "3")) == 0
    keep = json.loads((out / "keep_set.json").read_text())
    report = json.loads((out / "report.json").read_text())
    unused = [ID[f"<unused{i}>"] for i in range(17)]
    assert not set(unused) & set(keep["token_ids"])
    a = report["always_kept"]
    assert a["chat_markers"] == ["<|turn>", "<turn|>"] and a["special_tokens"] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    assert a["placeholders_in_tokenizer"] == 17 and a["placeholders_left_out"] == 17
    assert a["placeholder_occurrences_counted"] == 0
    summary = (out / "summary.md").read_text()
    assert "5 special + 2 chat-template markers + 0 placeholder + 256 byte + 4 script + 2 frequent" in summary
    assert "Left out: 17 placeholder tokens" in summary
    kept = tmp_path / "kept"
    assert main(vocab_args(hand_tokenizer, hand_corpus, kept, N_ALWAYS + 17 + 2, "--count-conversations", "3",
                           "--keep-placeholders")) == 0
    keep2 = json.loads((kept / "keep_set.json").read_text())
    assert keep2["categories"]["placeholder"] == 17 and set(unused) <= set(keep2["token_ids"])
    assert set(keep2["token_ids"]) == set(keep["token_ids"]) | set(unused)  # same top-up, plus the 17
    assert json.loads((kept / "report.json").read_text())["always_kept"]["placeholders_left_out"] == 0


def test_chat_markers_come_from_the_template(hand_tokenizer):
    from hyco.data.keepset import always_kept, chat_marker_ids

    tok = load_tokenizer(hand_tokenizer)
    ids, how = chat_marker_ids(tok)
    assert ids.tolist() == [ID["<|turn>"], ID["<turn|>"]] and "probe renderings" in how
    tok.chat_template = None  # no template: the markers are plain special tokens, still kept
    cats = always_kept(tok, ("hangul",), "hand")
    assert len(cats["chat"]) == 0 and cats["special"].tolist() == list(range(7))
    assert always_kept(tok, (), "hand", keep_placeholders=True)["placeholder"].tolist() == list(range(7, 24))


REAL_TOKENIZER = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gemma-tokenizer"


@pytest.mark.slow
@pytest.mark.skipif(not (REAL_TOKENIZER / "tokenizer.json").is_file(),
                    reason=f"the real Gemma tokenizer is not on this machine ({REAL_TOKENIZER} is absent)")
def test_real_gemma_tokenizer_categories(tmp_path, monkeypatch):
    """The real 262K Gemma (3) tokenizer: 10 special tokens (3 of them the chat template's markers)
    are kept, its 6,242 <unusedN> placeholders are not, its 4,678 Hangul pieces are. Counted on
    40 packaged ShareGPT conversations only, and the 33 MB tokenizer is loaded once, to stay fast."""
    from hyco.vocab import stage

    from hyco.data.keepset import always_kept

    tok = load_tokenizer(REAL_TOKENIZER)
    monkeypatch.setattr(stage, "load_tokenizer", lambda path: tok if Path(path) == REAL_TOKENIZER else None)
    out = _mk(tmp_path / "vocab")
    size = 5_000
    build_vocab(tokenizer=REAL_TOKENIZER, dataset=DatasetConfig(), out=out,
                config=VocabConfig(size=size, count_conversations=40, reserved_train=1, reserved_eval=1,
                                   heldout_conversations=5))
    keep = load_keep_set(out, tokenizer=tok)
    cats, a = keep.meta["categories"], json.loads((out / "report.json").read_text())["always_kept"]
    assert cats["chat"] == 3 and set(a["chat_markers"]) == {"<bos>", "<start_of_turn>", "<end_of_turn>"}
    assert cats["special"] == 7 and set(a["special_tokens"]) == {
        "<pad>", "<eos>", "<unk>", "<mask>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"}
    assert (cats["placeholder"], cats["byte"], cats["script"]) == (0, 256, 4_678)
    assert cats["frequent"] == size - 10 - 256 - 4_678
    assert a["placeholders_in_tokenizer"] == 6_242 and a["placeholders_left_out"] == 6_242
    assert a["added_tokens"] == 6_415 and a["added_tokens_kept_by_frequency_only"] == 6_415 - 6_242 - 10
    kept = set(keep.token_ids.tolist())
    assert not kept & set(tok.convert_tokens_to_ids([f"<unused{i}>" for i in range(6_242)]))
    assert {tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")} <= kept
    # The switch: the same tokenizer with keep_placeholders has them all as a category.
    assert len(always_kept(tok, ("hangul",), "real", keep_placeholders=True)["placeholder"]) == 6_242
