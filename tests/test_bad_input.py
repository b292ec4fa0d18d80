"""Fuzzing every stage's inputs: each bad input ends with one line on stderr naming the file (and
the tensor), exit status 2, and nothing written: no OUT folder, no temp folder beside it.

All reads go through hyco/base/loading.py, which turns the libraries' own errors (SafetensorError,
OSError, JSONDecodeError, transformers' warnings about missing or misshapen weights) into that
one line. Cases tried (stage: input: corruption -> what the line says):

| id | stage | input | corruption | message names |
|---|---|---|---|---|
| convert-truncated | convert | SLM shard | last 100 bytes cut | shard, last tensor ("truncated") |
| convert-empty | convert | SLM shard | 0 bytes | shard ("empty or truncated") |
| convert-header | convert | SLM shard | header bytes overwritten | shard ("corrupt safetensors header") |
| convert-header-length | convert | SLM shard | header length field 2^40 | shard |
| convert-dtype | convert | SLM q_proj.weight | stored I32 | tensor ("misshapen tensor") |
| convert-nan-scale | convert | SLM o_proj.weight_scale | NaN | shard, tensor ("NaN or Inf") |
| convert-zero-scale | convert | SLM o_proj.weight_scale | one row 0 | shard, tensor ("must be > 0") |
| convert-config | convert | SLM config.json | cut mid-file | config.json ("not valid JSON") |
| convert-keep-set | convert | keep_set.json | built for another tokenizer | keep_set.json |
| qat-truncated | qat | verifier shard | last 100 bytes cut | shard, tensor |
| qat-header | qat | assistant shard | header bytes overwritten | shard |
| qat-nan | qat | verifier weight | NaN in one row | folder, tensor ("NaN or Inf") |
| qat-dtype | qat | verifier weight | stored I32 | shard, tensor ("float checkpoint") |
| qat-shape | qat | verifier weight | one column short | folder, tensor ("wrong shape") |
| qat-missing | qat | assistant weight | tensor dropped | folder, tensor ("missing from") |
| qat-tokenizer | qat | tokenizer | another family (WordLevel) | keep_set.json ("another tokenizer") |
| qat-tokenizer-json | qat | tokenizer.json | cut mid-file | tokenizer.json |
| qat-prompts | qat | vocab/prompts.jsonl | cut mid-record | prompts.jsonl, line |
| qat-npy | qat | vocab/keep_to_vocab.npy | cut | keep_to_vocab.npy |
| check-truncated | check | verifier shard | last 100 bytes cut | shard, tensor |
| check-empty | check | assistant shard | 0 bytes | shard |
| check-slm-scale | check | SLM weight_scale | NaN | shard, tensor |
| vocab-no-record | vocab | dataset .json | cut inside the first record | dataset file ("no complete record") |
| vocab-empty | vocab | dataset .jsonl | 0 bytes | dataset file ("no complete record") |
| vocab-tokenizer | vocab | tokenizer.json | binary garbage | tokenizer.json |
| recipe-unknown-key | run | recipe | `qat: {stepz: 3}` | recipe, key |
| recipe-type | run | recipe | `qat.steps: five` | recipe, key |
| recipe-nan | run | recipe | `check.top_p: .nan` | recipe, key ("finite") |
| recipe-escape | run | recipe | `models.slm: "{out}/../elsewhere"` | recipe, key ("inside the run folder") |
| recipe-binary | run | recipe | invalid UTF-8 | recipe ("cannot read") |
| run-stage-input | run | SLM shard (convert only) | truncated | shard; OUT not created |
| run-preflight | run | verifier shard (qat, after vocab) | truncated | shard; vocab not run, no OUT |

A dataset cut after some complete records is not an error: the stage warns with the file and the
count read, and its report says how many conversations were read (test below).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyco.pipeline.cli import main

SHARD_VERIFIER = "model-00003-of-00005.safetensors"
O_PROJ = "model.layers.0.self_attn.o_proj"


def _edit_shard(folder: Path, shard: str, edit) -> None:
    """Rewrite one shard with `edit(tensors)` applied, keeping the index in step."""
    path = folder / shard
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if v != shard} | {k: shard for k in tensors}
    index.write_text(json.dumps(data))


def _shard_of(folder: Path, tensor: str) -> str:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _first_tensor(folder: Path, shard: str, suffix: str = "weight") -> str:
    names = sorted(k for k, v in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].items()
                   if v == shard and k.endswith(suffix))
    return names[0]


def _cut(path: Path, keep: int | None = None, drop: int = 100) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep is not None else data[:-drop])


def _corrupt_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"\x00garbage!{[not json" + b"\xff" * 13
    path.write_bytes(bytes(data))


def _header_length(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def _set_tensor(name: str, make):
    def edit(tensors):
        tensors[name] = make(tensors[name])
    return edit


def _nan_row(t):
    t = t.clone()
    t.view(t.shape[0], -1)[0, 0] = float("nan")
    return t


def _zero_row(t):
    t = t.clone()
    t[0] = 0
    return t


def _other_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    other = Tokenizer(models.WordLevel({f"w{i}": i for i in range(4095)} | {"[UNK]": 4095}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=other, unk_token="[UNK]").save_pretrained(path)
    return path


def _copy_family(family: dict[str, Path], dst: Path) -> dict[str, Path]:
    return {name: Path(shutil.copytree(src, dst / name)) for name, src in family.items()}


def _assert_refused(capsys, rc: int, out: Path, *names: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    for name in names:
        assert name in err[0], (name, err[0])
    assert not out.parent.exists() and not list(out.parent.parent.glob(f".{out.parent.name}*")), "something was written"
    return err[0]


@pytest.fixture(scope="module")
def vocab_dir(tiny_text_family, tmp_path_factory) -> Path:
    """A valid vocab stage folder on the tiny tokenizer (small counts: seconds)."""
    from hyco.vocab.stage import build_vocab

    from hyco.config.recipe import DatasetConfig, VocabConfig

    out = tmp_path_factory.mktemp("vocab")
    build_vocab(tokenizer=tiny_text_family["tokenizer"], dataset=DatasetConfig(schema="sharegpt"),
                config=VocabConfig(size=1345, count_conversations=100, reserved_train=2, reserved_eval=2,
                                   heldout_conversations=10), out=out)
    return out


@pytest.fixture(scope="module")
def answers_dir(tiny_text_family, vocab_dir, tmp_path_factory) -> Path:
    """A valid answers stage folder: the corpus's own answers to vocab_dir's prompts (no model run)."""
    from hyco.answers.stage import make_answers

    from hyco.config.recipe import AnswersConfig

    out = tmp_path_factory.mktemp("answers")
    make_answers(verifier=tiny_text_family["verifier"], tokenizer=tiny_text_family["tokenizer"], vocab=vocab_dir,
                 config=AnswersConfig(source="corpus", max_new_tokens_train=16, max_new_tokens_eval=12,
                                      max_prompt_tokens=48), out=out)
    return out


# --- convert ---------------------------------------------------------------------------------------


def _slm_case(case: str, slm: Path, tmp: Path) -> tuple[list[str], tuple[str, ...]]:
    """Corrupt the copied SLM for `case`; return (extra CLI args, names the message must hold)."""
    shard = _shard_of(slm, f"{O_PROJ}.weight_scale")
    path = slm / shard
    if case == "truncated":
        _cut(path)
        return [], (str(path), "truncated", "tensor")
    if case == "empty":
        path.write_bytes(b"")
        return [], (str(path), "empty or truncated")
    if case == "header":
        _corrupt_header(path)
        return [], (str(path), "corrupt safetensors header")
    if case == "header-length":
        _header_length(path)
        return [], (str(path), "header")
    if case == "dtype":
        name = "model.layers.0.self_attn.q_proj.weight"
        _edit_shard(slm, _shard_of(slm, name), _set_tensor(name, lambda t: t.to(torch.int32)))
        return [], (name, "I32")
    if case == "nan-scale":
        _edit_shard(slm, shard, _set_tensor(f"{O_PROJ}.weight_scale", _nan_row))
        return [], (str(path), f"{O_PROJ}.weight_scale", "NaN")
    if case == "zero-scale":
        _edit_shard(slm, shard, _set_tensor(f"{O_PROJ}.weight_scale", _zero_row))
        return [], (str(path), f"{O_PROJ}.weight_scale", "> 0")
    if case == "config":
        _cut(slm / "config.json", keep=200)
        return [], (str(slm / "config.json"), "not valid JSON")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["truncated", "empty", "header", "header-length", "dtype", "nan-scale",
                                  "zero-scale", "config"])
def test_convert_refuses_a_bad_checkpoint(case, tiny_text_family, tmp_path, capsys):
    slm = Path(shutil.copytree(tiny_text_family["slm"], tmp_path / "slm"))
    extra, names = _slm_case(case, slm, tmp_path)
    out = tmp_path / "out" / "convert"
    rc = main(["convert", "--checkpoint", str(slm), "--out", str(out), "--no-parity", "--rows", "4",
               "--prefill-chunk", "4", "--ring-full", "16", "--ring-sliding", "8", *extra])
    _assert_refused(capsys, rc, out, *names)


def test_convert_refuses_a_keep_set_of_another_family(tiny_text_family, vocab_dir, tmp_path, capsys):
    vocab = Path(shutil.copytree(vocab_dir, tmp_path / "vocab"))
    meta = json.loads((vocab / "keep_set.json").read_text())
    meta["tokenizer"] = "0" * 64  # what a keep set built on another tokenizer carries
    (vocab / "keep_set.json").write_text(json.dumps(meta))
    out = tmp_path / "out" / "convert"
    rc = main(["convert", "--checkpoint", str(tiny_text_family["slm"]), "--keep-set", str(vocab), "--out", str(out),
               "--no-parity", "--rows", "4", "--prefill-chunk", "4", "--ring-full", "16", "--ring-sliding", "8"])
    _assert_refused(capsys, rc, out, str(vocab / "keep_set.json"), "another tokenizer")


# --- qat ---------------------------------------------------------------------------------------------


def _qat_case(case: str, fam: dict[str, Path], vocab: Path, answers: Path, tmp: Path) -> tuple[str, ...]:
    ver, head = fam["verifier"], fam["assistant"]
    if case == "truncated":
        _cut(ver / SHARD_VERIFIER)
        return str(ver / SHARD_VERIFIER), "truncated", "tensor"
    if case == "header":
        shard = sorted(head.glob("model-*.safetensors"))[1]
        _corrupt_header(shard)
        return (str(shard), "corrupt safetensors header")
    name = _first_tensor(ver, SHARD_VERIFIER, "proj.weight")
    if case == "nan":
        _edit_shard(ver, SHARD_VERIFIER, _set_tensor(name, _nan_row))
        return str(ver), name, "NaN or Inf"
    if case == "dtype":
        _edit_shard(ver, SHARD_VERIFIER, _set_tensor(name, lambda t: t.to(torch.int32)))
        return str(ver / SHARD_VERIFIER), name, "float checkpoint"
    if case == "shape":
        _edit_shard(ver, SHARD_VERIFIER, _set_tensor(name, lambda t: t[:, :-1].contiguous()))
        return str(ver), name, "wrong shape"
    if case == "missing":
        shard = _shard_of(head, "model.layers.0.self_attn.q_proj.weight")
        _edit_shard(head, shard, lambda t: t.pop("model.layers.0.self_attn.q_proj.weight"))
        return str(head), "model.layers.0.self_attn.q_proj.weight", "missing from"
    if case == "tokenizer":
        shutil.rmtree(fam["tokenizer"])
        _other_tokenizer(fam["tokenizer"])
        return str(vocab / "keep_set.json"), "another tokenizer"
    if case == "tokenizer-json":
        _cut(fam["tokenizer"] / "tokenizer.json", keep=5000)
        return str(fam["tokenizer"] / "tokenizer.json"), "not valid JSON"
    if case == "answers":
        text = (answers / "answers.jsonl").read_text()
        (answers / "answers.jsonl").write_text(text[: text.index("\n") + 40])
        return str(answers / "answers.jsonl"), "line 2"
    if case == "npy":
        _cut(vocab / "keep_to_vocab.npy", drop=64)
        return str(vocab / "keep_to_vocab.npy"), "not a readable .npy"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["truncated", "header", "nan", "dtype", "shape", "missing", "tokenizer",
                                  "tokenizer-json", "answers", "npy"])
def test_qat_refuses_bad_input(case, tiny_text_family, vocab_dir, answers_dir, tmp_path, capsys):
    fam = _copy_family({k: tiny_text_family[k] for k in ("verifier", "assistant", "tokenizer")}, tmp_path)
    vocab = Path(shutil.copytree(vocab_dir, tmp_path / "vocab"))
    answers = Path(shutil.copytree(answers_dir, tmp_path / "answers"))
    names = _qat_case(case, fam, vocab, answers, tmp_path)
    out = tmp_path / "out" / "qat"
    rc = main(["qat", "--verifier", str(fam["verifier"]), "--assistant", str(fam["assistant"]),
               "--tokenizer", str(fam["tokenizer"]), "--vocab", str(vocab), "--answers", str(answers),
               "--out", str(out), "--steps", "1"])
    _assert_refused(capsys, rc, out, *names)


@pytest.mark.parametrize("case", ["prompts", "generation-config", "tokenizer-json"])
def test_answers_refuses_bad_input(case, tiny_text_family, vocab_dir, tmp_path, capsys):
    fam = _copy_family({k: tiny_text_family[k] for k in ("verifier", "tokenizer")}, tmp_path)
    vocab = Path(shutil.copytree(vocab_dir, tmp_path / "vocab"))
    if case == "prompts":
        text = (vocab / "prompts.jsonl").read_text()
        (vocab / "prompts.jsonl").write_text(text[: text.index("\n") + 40])
        names = (str(vocab / "prompts.jsonl"), "line 2")
    elif case == "generation-config":
        (fam["verifier"] / "generation_config.json").unlink()
        names = (str(fam["verifier"] / "generation_config.json"), "not found")
    else:
        _cut(fam["tokenizer"] / "tokenizer.json", keep=5000)
        names = (str(fam["tokenizer"] / "tokenizer.json"), "not valid JSON")
    out = tmp_path / "out" / "answers"
    rc = main(["answers", "--verifier", str(fam["verifier"]), "--tokenizer", str(fam["tokenizer"]), "--vocab", str(vocab),
               "--source", "corpus", "--out", str(out)])
    _assert_refused(capsys, rc, out, *names)


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_qat_truncated_shard_in_a_fresh_process(tiny_text_family, vocab_dir, answers_dir, tmp_path):
    """The reported bug, end to end: the real stderr of the console script, not a captured one."""
    fam = _copy_family({k: tiny_text_family[k] for k in ("verifier", "assistant", "tokenizer")}, tmp_path)
    _cut(fam["verifier"] / SHARD_VERIFIER)
    out = tmp_path / "out" / "qat"
    done = subprocess.run([sys.executable, "-m", "hyco.pipeline.cli", "qat", "--verifier", str(fam["verifier"]),
                           "--assistant", str(fam["assistant"]), "--tokenizer", str(fam["tokenizer"]),
                           "--vocab", str(vocab_dir), "--answers", str(answers_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and str(fam["verifier"] / SHARD_VERIFIER) in lines[0] and "tensor" in lines[0], lines
    assert not out.parent.exists()


# --- check -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["truncated", "empty", "slm-scale"])
def test_check_refuses_bad_input(case, tiny_text_family, tmp_path, capsys):
    fam = _copy_family(tiny_text_family, tmp_path)
    if case == "truncated":
        _cut(fam["verifier"] / SHARD_VERIFIER)
        names = (str(fam["verifier"] / SHARD_VERIFIER), "truncated")
    elif case == "empty":
        shard = sorted(fam["assistant"].glob("model-*.safetensors"))[2]
        shard.write_bytes(b"")
        names = (str(shard), "empty")
    else:
        slm = fam["slm"]
        shard = _shard_of(slm, f"{O_PROJ}.weight_scale")
        _edit_shard(slm, shard, _set_tensor(f"{O_PROJ}.weight_scale", _nan_row))
        names = (str(slm / shard), f"{O_PROJ}.weight_scale", "NaN")
    recipe = tmp_path / "r.yaml"
    models = "\n".join(f"  {k}: {v}" for k, v in fam.items())
    recipe.write_text(f"name: r\nout: {tmp_path / 'run'}\nstages: [check]\nmodels:\n{models}\n"
                      "check: {backend: torch, prompts: 1, max_new_tokens: 2, configs: [hyco]}\n")
    out = tmp_path / "out" / "check"
    rc = main(["check", "--recipe", str(recipe), "--out", str(out)])
    _assert_refused(capsys, rc, out, *names)


# --- vocab and the chat corpus ---------------------------------------------------------------------------


def _conversations(n: int) -> list[dict]:
    return [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}?"},
                                              {"from": "gpt", "value": f"answer number {i}, in words."}]}
            for i in range(n)]


@pytest.mark.parametrize("case", ["no-record", "empty", "tokenizer"])
def test_vocab_refuses_bad_input(case, tiny_text_family, tmp_path, capsys):
    tokenizer = Path(shutil.copytree(tiny_text_family["tokenizer"], tmp_path / "tok"))
    dataset = tmp_path / "data.json"
    text = json.dumps(_conversations(5))
    dataset.write_text(text)
    if case == "no-record":
        dataset.write_text(text[: text.index("answer number 0")])
        names = (str(dataset), "no complete record")
    elif case == "empty":
        dataset = tmp_path / "data.jsonl"
        dataset.write_text("")
        names = (str(dataset), "no complete record")
    else:
        (tokenizer / "tokenizer.json").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
        names = (str(tokenizer / "tokenizer.json"),)
    out = tmp_path / "out" / "vocab"
    rc = main(["vocab", "--tokenizer", str(tokenizer), "--dataset", str(dataset), "--size", "1345",
               "--out", str(out), "--reserved-train", "0", "--reserved-eval", "0", "--heldout-conversations", "0"])
    _assert_refused(capsys, rc, out, *names)


def test_dataset_cut_mid_record_warns_and_reads_up_to_it(tiny_text_family, tmp_path, capsys):
    dataset = tmp_path / "data.json"
    text = json.dumps(_conversations(30))
    dataset.write_text(text[: text.index('"id": "c20"') + 8])
    out = tmp_path / "out" / "vocab"
    rc = main(["vocab", "--tokenizer", str(tiny_text_family["tokenizer"]), "--dataset", str(dataset), "--size", "1345",
               "--out", str(out), "--reserved-train", "0", "--reserved-eval", "0", "--heldout-conversations", "0"])
    err = capsys.readouterr().err
    assert rc == 0, err
    warning = [line for line in err.splitlines() if "complete records" in line]
    assert len(warning) == 1 and str(dataset) in warning[0] and "read 20 complete records" in warning[0], err
    assert json.loads((out / "report.json").read_text())["conversations_read"] == 20


# --- recipes and `run` ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body,names", [
    ("qat: {stepz: 3}\n", ("unknown key 'stepz'",)),
    ("qat: {steps: five}\n", ("qat.steps must be an integer",)),
    ("check: {top_p: .nan}\n", ("check.top_p must be a finite number",)),
    ("models: {slm: '{out}/../elsewhere'}\n", ("models.slm must stay inside the run folder",)),
    (b"name: \xff\xfe\n", ("cannot read",)),
], ids=["unknown-key", "type", "nan", "escape", "binary"])
def test_bad_recipe_is_refused_before_any_work(body, names, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    head = f"name: r\nout: {tmp_path / 'out' / 'run'}\nstages: [vocab]\n"
    if isinstance(body, bytes):
        recipe.write_bytes(body)
    else:
        recipe.write_text(head + body)
    rc = main(["run", str(recipe)])
    _assert_refused(capsys, rc, tmp_path / "out" / "run", str(recipe), *names)


def test_run_leaves_no_out_folder_when_its_first_stage_refuses_input(tiny_text_family, tmp_path, capsys):
    slm = Path(shutil.copytree(tiny_text_family["slm"], tmp_path / "slm"))
    shard = slm / _shard_of(slm, f"{O_PROJ}.weight_scale")
    _cut(shard)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nout: {tmp_path / 'out' / 'run'}\nstages: [convert]\nmodels: {{slm: {slm}}}\n"
                      "convert: {parity: false, rows: 4, prefill_chunk: 4, ring_full: 16, ring_sliding: 8, "
                      "max_prompt: 16, use_keep_set: false}\n")
    rc = main(["run", str(recipe)])
    err = capsys.readouterr()
    lines = err.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and str(shard) in lines[0], err
    assert not (tmp_path / "out").exists()


def test_loading_scale_checks_name_the_tensor(tmp_path):
    """check_scales on its own: activation scales may be 0 (off), weight scales may not."""
    from hyco.base.errors import HycoError
    from hyco.base.loading import check_scales, checkpoint_files

    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    tensors = {"a.input_activation_scale": torch.zeros(()), "a.weight_scale": torch.ones(4, 1)}
    save_file(tensors, str(folder / "model.safetensors"))
    assert check_scales(checkpoint_files(folder)) == 2
    tensors["a.weight_scale"][2, 0] = math.inf
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(HycoError, match="a.weight_scale.*NaN or Inf"):
        check_scales(checkpoint_files(folder))
    tensors["a.weight_scale"][2, 0] = 1.0
    tensors["a.input_activation_scale"] = torch.tensor(-1.0)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(HycoError, match="a.input_activation_scale.*>= 0"):
        check_scales(checkpoint_files(folder))


def test_run_checks_a_later_stages_checkpoint_before_the_first_stage(tiny_text_family, tmp_path, capsys):
    fam = _copy_family({k: tiny_text_family[k] for k in ("verifier", "assistant", "tokenizer")}, tmp_path)
    _cut(fam["verifier"] / SHARD_VERIFIER)
    recipe = tmp_path / "r.yaml"
    models = "\n".join(f"  {k}: {v}" for k, v in fam.items())
    recipe.write_text(f"name: r\nout: {tmp_path / 'out' / 'run'}\nstages: [vocab, answers, qat]\nmodels:\n{models}\n"
                      "vocab: {size: 1345, count_conversations: 50}\n")
    rc = main(["run", str(recipe)])
    _assert_refused(capsys, rc, tmp_path / "out" / "run", str(fam["verifier"] / SHARD_VERIFIER), "truncated")
