"""`hyco-convert answers`: the verifier's answers to vocab/'s reserved prompts (thin wrapper over
`hyco.answers.stage.make_answers`)."""

from __future__ import annotations

import argparse

from hyco.config.recipe import AnswersConfig, to_dict
from hyco.pipeline.cli import stage_command


def add_cli(sub: argparse._SubParsersAction) -> None:
    stage_command(
        sub, "answers", run=_cmd_answers, sections={"answers": AnswersConfig()},
        inputs={"verifier": "verifier checkpoint folder (corpus: its generation_config only)",
                "tokenizer": "tokenizer folder", "vocab": "vocab stage output (prompts.jsonl)"},
        optional={"verifier_tokenizer": "a verifier of another family: its own tokenizer (the answers are then its "
                  "text in --tokenizer's ids, the SLM's; needs --slm)",
                  "slm": "the SLM checkpoint folder (its generation_config: the end-of-turn ids), with "
                  "--verifier-tokenizer"},
        help="the verifier's answers to the reserved prompts (read by qat and calibrate)",
        description="Answer vocab/'s reserved train and eval prompts once: the verifier's greedy text (the paper), "
        "its sampled text, or the conversations' own first assistant turns (corpus). Writes answers.jsonl, "
        "answers.json (how they were made, statistics per split, a warning when the text is one repeated token) "
        "and summary.md into --out.")


def _cmd_answers(args: argparse.Namespace, paths: dict, answers: AnswersConfig) -> int:
    from hyco.answers.stage import make_answers

    from hyco.base.launch import run_split
    from hyco.pipeline.artifacts import run_stage, stage_state

    out, inputs = paths.pop("out"), paths

    def main() -> int:
        manifest = run_stage("answers", out, {"answers": to_dict(answers)}, inputs,
                             lambda tmp: make_answers(**inputs, config=answers, out=tmp), force=args.force)
        s = manifest["summary"]
        print(f"{s['answers']} {s['source']} answers ({stage_state(manifest)}); degenerate: {s['degenerate']}")
        print(f"wrote {out}/answers.jsonl, answers.json, report.json, summary.md")
        print(f"next: hyco-convert qat ... --answers {out}; hyco-convert calibrate ... --answers {out}")
        return 0

    return run_split(main, lambda word: make_answers(**inputs, config=answers, out=None))
