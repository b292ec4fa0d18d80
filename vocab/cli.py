"""`hyco-convert vocab`: the keep set from a tokenizer and a chat corpus (thin wrapper over
`hyco.vocab.stage.build_vocab`)."""

from __future__ import annotations

import argparse

from hyco.config.recipe import DatasetConfig, VocabConfig, to_dict
from hyco.pipeline.cli import stage_command


def add_cli(sub: argparse._SubParsersAction) -> None:
    stage_command(
        sub, "vocab", run=_cmd_vocab, sections={"vocab": VocabConfig(), "dataset": DatasetConfig()},
        inputs={"tokenizer": "tokenizer folder (fast tokenizer, tokenizer.json)"},
        aliases={"always_scripts": "--scripts", "source": "--dataset"},
        help="build the keep set (restricted output vocabulary) and reserve prompt conversations",
        description="Keep every special token (placeholders such as <unusedN> only with --keep-placeholders), the "
        "chat template's markers, the byte tokens and every always-kept-script token, then the tokens most frequent in "
        "the assistant turns of the counted conversations, until the set has exactly --size tokens. Writes "
        "keep_set.json, keep_to_vocab.npy, vocab_to_keep.npy, prompts.jsonl (reserved prompt conversations, "
        "never counted), report.json and coverage.png (held-out share outside the keep set) into --out.")


def _cmd_vocab(args: argparse.Namespace, paths: dict, vocab: VocabConfig, dataset: DatasetConfig) -> int:
    from pathlib import Path

    from hyco.vocab.stage import build_vocab

    from hyco.pipeline.artifacts import run_stage, stage_state

    out, tokenizer = paths["out"], paths["tokenizer"]
    inputs = {"tokenizer": tokenizer}
    if Path(dataset.source).exists():
        inputs["dataset"] = Path(dataset.source)
    manifest = run_stage("vocab", out, {"vocab": to_dict(vocab), "dataset": to_dict(dataset)}, inputs,
                         lambda tmp: build_vocab(tokenizer=tokenizer, dataset=dataset, config=vocab, out=tmp),
                         force=args.force)
    s = manifest["summary"]
    print(f"keep set {s['size']} tokens ({', '.join(f'{v} {k}' for k, v in s['categories'].items())}), "
          f"{100 * s['heldout_outside_share']:.2f}% of held-out assistant tokens outside: {stage_state(manifest)}")
    print(f"wrote {out}/keep_set.json, keep_to_vocab.npy, vocab_to_keep.npy, prompts.jsonl, report.json, coverage.png")
    short = {k: f"{v}/{s['requested'][k]}" for k, v in s["got"].items() if v < s["requested"][k]}
    if short:
        print(f"note: the corpus ran out before every pool was full (got/requested: {short})")
    print(f"next: convert/, qat/ and calibrate/ read {out} (hyco.data.keepset.load_keep_set, load_prompts)")
    return 0
