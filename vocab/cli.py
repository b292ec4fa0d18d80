"""`hyco-convert vocab`: the keep set from a tokenizer and a chat corpus (thin wrapper over
`hyco.vocab.stage.build_vocab`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hyco.chat import PACKAGED, SCHEMAS
from hyco.errors import HycoError
from hyco.recipe import DatasetConfig, VocabConfig, add_set_option, section_config, to_dict

_DEFAULT = VocabConfig()


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "vocab", help="build the keep set (restricted output vocabulary) and reserve prompt conversations",
        description="Keep every special token (placeholders such as <unusedN> only with --keep-placeholders), the "
        "chat template's markers, the byte tokens and every always-kept-script token, then the tokens most frequent in "
        "the assistant turns of the counted conversations, until the set has exactly --size tokens. Writes "
        "keep_set.json, keep_to_vocab.npy, vocab_to_keep.npy, prompts.jsonl (reserved prompt conversations, "
        "never counted), report.json and coverage.png (held-out share outside the keep set) into --out.")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder (fast tokenizer, tokenizer.json)")
    p.add_argument("--dataset", default=PACKAGED, metavar="SPEC",
                   help=f"chat corpus: {PACKAGED} (packaged ShareGPT, default), a .json/.jsonl/.parquet/.arrow "
                   "file, a dataset folder, or a dataset name already in the HF cache")
    p.add_argument("--schema", choices=SCHEMAS, default="auto", help="ultrachat (messages: role/content) or "
                   "sharegpt (conversations: from/value); auto detects it from the first record")
    p.add_argument("--split", default="train", help="split to count and reserve from (datasets sources)")
    p.add_argument("--heldout-split", help="split for the coverage report (default: held out of --split)")
    p.add_argument("--size", type=int, required=True, help="keep-set size N (86089 for Gemma 4 in the paper)")
    p.add_argument("--count-conversations", type=int, default=_DEFAULT.count_conversations,
                   help="conversations whose assistant turns are counted (20000 in the paper)")
    p.add_argument("--reserved-train", type=int, default=_DEFAULT.reserved_train,
                   help="prompt conversations reserved for calibration and QAT training, never counted (60)")
    p.add_argument("--reserved-eval", type=int, default=_DEFAULT.reserved_eval,
                   help="prompt conversations reserved for evaluation, disjoint from the others (60)")
    p.add_argument("--heldout-conversations", type=int, default=_DEFAULT.heldout_conversations,
                   help="held-out conversations for the coverage report")
    p.add_argument("--scripts", default=",".join(_DEFAULT.always_scripts),
                   help="comma-separated scripts always kept (default: hangul); empty for none")
    p.add_argument("--keep-placeholders", action="store_true",
                   help="also always keep reserved placeholder tokens such as <unusedN> (default: left out; "
                   "no chat text produces them)")
    p.add_argument("--seed", type=int, default=_DEFAULT.seed, help="seed of the conversation selection")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds a matching manifest")
    add_set_option(p, "vocab")
    p.set_defaults(func=_cmd_vocab)


def _cmd_vocab(args: argparse.Namespace) -> int:
    from hyco.vocab.stage import build_vocab

    from hyco.artifacts import run_stage, stage_state

    try:
        config = section_config(
            _DEFAULT, "vocab", args.set, size=args.size, count_conversations=args.count_conversations,
            reserved_train=args.reserved_train, reserved_eval=args.reserved_eval,
            heldout_conversations=args.heldout_conversations, seed=args.seed,
            keep_placeholders=args.keep_placeholders,
            always_scripts=tuple(s.strip() for s in args.scripts.split(",") if s.strip()))
        dataset = DatasetConfig(source=args.dataset, schema=args.schema, split=args.split, heldout_split=args.heldout_split)
    except ValueError as e:
        raise HycoError(str(e)) from None
    out, tokenizer = Path(args.out), Path(args.tokenizer)
    inputs = {"tokenizer": tokenizer}
    if Path(args.dataset).exists():
        inputs["dataset"] = Path(args.dataset)
    manifest = run_stage("vocab", out, {"vocab": to_dict(config), "dataset": to_dict(dataset)}, inputs,
                         lambda tmp: build_vocab(tokenizer=tokenizer, dataset=dataset, config=config, out=tmp),
                         force=args.force)
    s = manifest["summary"]
    state = stage_state(manifest)
    print(f"keep set {s['size']} tokens ({', '.join(f'{v} {k}' for k, v in s['categories'].items())}), "
          f"{100 * s['heldout_outside_share']:.2f}% of held-out assistant tokens outside: {state}")
    print(f"wrote {out}/keep_set.json, keep_to_vocab.npy, vocab_to_keep.npy, prompts.jsonl, report.json, coverage.png")
    short = {k: f"{v}/{s['requested'][k]}" for k, v in s["got"].items() if v < s["requested"][k]}
    if short:
        print(f"note: the corpus ran out before every pool was full (got/requested: {short})")
    print(f"next: convert/, qat/ and calibrate/ read {out} (hyco.keepset.load_keep_set, load_prompts)")
    return 0
