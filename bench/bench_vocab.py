"""Counting speed of the vocab stage on the embedded corpus (packaged ShareGPT).

    .venv/bin/python bench/bench_vocab.py [--tokenizer DIR] [--conversations N]

Counts the assistant turns of every complete conversation of the packaged file (17,671; it is
truncated) through the stage's own code path (`build_vocab` with nothing reserved or held out)
and prints tokens per second. Without --tokenizer it trains the tiny fixture tokenizer (4,096
tokens, Gemma layout) first, which is not timed. Goal: the whole corpus in under 60 s on the
2-core development machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hyco.vocab.stage import build_vocab

from hyco.config.recipe import DatasetConfig, VocabConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="tokenizer folder (default: train the tiny fixture tokenizer)")
    parser.add_argument("--conversations", type=int, default=10**9, help="count at most this many (default: all)")
    parser.add_argument("--size", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Path(args.tokenizer) if args.tokenizer else _fixture_tokenizer(Path(tmp) / "tokenizer")
        out = Path(tmp) / "vocab"
        out.mkdir()
        config = VocabConfig(size=args.size, count_conversations=args.conversations, reserved_train=0,
                             reserved_eval=0, heldout_conversations=0)
        start = time.perf_counter()
        summary = build_vocab(tokenizer=tokenizer, dataset=DatasetConfig(), config=config, out=out)
        wall = time.perf_counter() - start
        report = json.loads((out / "report.json").read_text())
    tokens = report["counted_assistant_tokens"]
    print(f"counted {summary['counted']} conversations, {tokens} assistant tokens "
          f"({report['counted_assistant_chars'] / 1e6:.1f} M chars) in {wall:.1f} s: "
          f"{tokens / wall / 1e6:.2f} M tokens/s end to end, {summary['count_tokens_per_s'] / 1e6:.2f} M tokens/s counting")
    print(f"goal: whole corpus under 60 s -> {'met' if wall < 60 else 'NOT met'}")


def _fixture_tokenizer(out: Path) -> Path:
    from hyco.fixtures.presets import PRESETS
    from hyco.fixtures.tokenizer import write_tokenizer

    print("training the tiny fixture tokenizer (not timed) ...")
    return write_tokenizer(out, PRESETS["tiny"].tokenizer)


if __name__ == "__main__":
    main()
