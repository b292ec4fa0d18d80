"""`hyco-convert answers`: the verifier's answers to vocab/'s reserved prompts (thin wrapper over
`hyco.answers.stage.make_answers`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hyco.answers import SOURCES
from hyco.errors import HycoError
from hyco.recipe import AnswersConfig, add_set_option, section_config, to_dict

_DEFAULT = AnswersConfig()


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "answers", help="the verifier's answers to the reserved prompts (read by qat and calibrate)",
        description="Answer vocab/'s reserved train and eval prompts once: the verifier's greedy text (the paper), "
        "its sampled text, or the conversations' own first assistant turns (corpus). Writes answers.jsonl, "
        "answers.json (how they were made, statistics per split, a warning when the text is one repeated token) "
        "and summary.md into --out.")
    p.add_argument("--verifier", required=True, help="verifier checkpoint folder (corpus: its generation_config only)")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder")
    p.add_argument("--vocab", required=True, help="vocab stage output (prompts.jsonl)")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--source", choices=SOURCES, default=_DEFAULT.source, help="where the answers come from")
    p.add_argument("--max-new-tokens-train", type=int, default=_DEFAULT.max_new_tokens_train,
                   help="longest answer to a train prompt (the MTP head's QAT text)")
    p.add_argument("--max-new-tokens-eval", type=int, default=_DEFAULT.max_new_tokens_eval,
                   help="longest answer to an eval prompt (calibration and held-out text)")
    p.add_argument("--max-prompt-tokens", type=int, default=_DEFAULT.max_prompt_tokens,
                   help="prompts are cut to their last tokens (the phone's prefill limit)")
    p.add_argument("--temperature", type=float, default=_DEFAULT.temperature, help="sampled source")
    p.add_argument("--top-k", type=int, default=_DEFAULT.top_k, help="sampled source (0: off)")
    p.add_argument("--top-p", type=float, default=_DEFAULT.top_p, help="sampled source")
    p.add_argument("--seed", type=int, default=_DEFAULT.seed, help="sampled source: prompt i uses seed + i")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds a matching manifest")
    add_set_option(p, "answers")
    p.set_defaults(func=_cmd_answers)


def _cmd_answers(args: argparse.Namespace) -> int:
    from hyco.answers.stage import make_answers
    from hyco.artifacts import run_stage
    from hyco.launch import run_split

    try:
        config = section_config(_DEFAULT, "answers", args.set, source=args.source, max_new_tokens_train=args.max_new_tokens_train,
                                     max_new_tokens_eval=args.max_new_tokens_eval,
                                     max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature,
                                     top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise HycoError(str(e)) from None
    paths = {k: Path(getattr(args, k)) for k in ("verifier", "tokenizer", "vocab")}

    def main() -> int:
        manifest = run_stage("answers", Path(args.out), {"answers": to_dict(config)}, paths,
                             lambda tmp: make_answers(**paths, config=config, out=tmp), force=args.force)
        _print_done(args, manifest)
        return 0

    return run_split(main, lambda word: make_answers(**paths, config=config, out=None))


def _print_done(args: argparse.Namespace, manifest: dict) -> None:
    from hyco.artifacts import stage_state

    s = manifest["summary"]
    print(f"{s['answers']} {s['source']} answers ({stage_state(manifest)}); degenerate: {s['degenerate']}")
    print(f"wrote {args.out}/answers.jsonl, answers.json, report.json, summary.md")
    print(f"next: hyco-convert qat ... --answers {args.out}; hyco-convert calibrate ... --answers {args.out}")
