"""The answers stage: the verifier's answers to vocab/'s reserved train and eval prompts, written
once (answers.jsonl, answers.json, report.json, summary.md) and read by qat (which trains the MTP head on them)
and calibrate (which calibrates the SLM graphs on them), so neither reruns the verifier for it and
a qat rerun leaves calibrate's answers as they were.

`make_answers(verifier=..., tokenizer=..., vocab=..., config=..., out=...)` is the whole stage as a
keyword-only function; the pipeline (`inputs` / `build` / `section`) and the CLI (`cli.py`) wrap it.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from hyco.base.errors import HycoError
from hyco.config.recipe import AnswersConfig, PlacementConfig, Recipe, to_dict
from hyco.pipeline import verdict
from hyco.pipeline.artifacts import StageEnd, finish_stage, markdown_table


def make_answers(*, verifier: Path, tokenizer: Path, vocab: Path, config: AnswersConfig, out: Path | None,
                 placement: PlacementConfig | None = None, verifier_tokenizer: Path | None = None,
                 slm: Path | None = None) -> dict[str, Any]:
    """Write OUT/answers.jsonl, answers.json, report.json and summary.md; return a short summary. For
    `source: corpus` only the verifier's generation config is read (its end-of-turn ids);
    `placement`: the verifier's dtype and devices (default: BF16 on a GPU, fp32 on the CPU).
    Under `accelerate launch` each process answers its share of the prompts (`hyco.base.launch`); a
    follower process passes `out=None` and writes nothing.

    `verifier_tokenizer`: a verifier of another family (the token bridge; `tokenizer` is then the
    SLM's, `slm` its checkpoint, whose generation config names its end-of-turn ids): the records
    hold the verifier's answers as text in the SLM's ids, which qat and calibrate read."""
    from hyco.answers.generate import generate_answers
    from transformers import GenerationConfig

    from hyco.base.launch import in_order, my_positions, start_followers
    from hyco.base.loading import load_tokenizer, load_verifier
    from hyco.data.answers import ANSWERS_REPORT, write_answers
    from hyco.data.keepset import load_prompts

    start_followers()
    start = time.perf_counter()
    tok = load_tokenizer(Path(tokenizer))
    prompts = load_prompts(vocab)
    if not any(p["split"] == "train" for p in prompts) or not any(p["split"] == "eval" for p in prompts):
        raise HycoError(f"{vocab}/prompts.jsonl: needs reserved prompts of both splits (train and eval)")
    if config.source == "corpus":
        if not (Path(verifier) / "generation_config.json").is_file():
            raise HycoError(f"{Path(verifier) / 'generation_config.json'}: not found (the verifier's end-of-turn ids)")
        model = SimpleNamespace(device=torch.device("cpu"), generation_config=GenerationConfig.from_pretrained(verifier))
    else:
        model = load_verifier(verifier, placement or PlacementConfig())
    bridge = {}
    if verifier_tokenizer is not None:
        from hyco.runtime.bridge import model_end_of_turn_ids

        if slm is None:
            raise HycoError("models.slm must name a folder: answers for a verifier of another family are written in "
                            "the SLM's tokens, ended at its end-of-turn ids")
        bridge = {"verifier_tokenizer": load_tokenizer(Path(verifier_tokenizer)),
                  "slm_eos": sorted(model_end_of_turn_ids(slm, tok))}
    lengths = {"train": config.max_new_tokens_train, "eval": config.max_new_tokens_eval}
    mine = my_positions(len(prompts))
    records = generate_answers(model, tok, prompts, config, positions=mine, **bridge)
    records = in_order(list(zip(mine, records, strict=True)), len(prompts), "answers")
    if out is None:
        return {}
    out = Path(out)
    written = write_answers(out, records, {**to_dict(config), "max_new_tokens": lengths}, tok)
    report = {"source": config.source, "answers": len(records), "max_new_tokens": lengths,
              "stats": written["stats"], "warnings": written["warnings"], "format_file": ANSWERS_REPORT,
              "wall_s": round(time.perf_counter() - start, 2)}
    summary = {"source": config.source, "answers": len(records),
               "degenerate": {split: s["degenerate"] for split, s in report["stats"].items()}}
    # no proof: degenerate text is warned about (summary.md, answers.json), the consumers decide
    return finish_stage("answers", out, StageEnd(report, _summary_markdown, summary,
                                                 nondeterministic=[("summary.md", "prints this run's wall time", None)],
                                                 verdict=verdict_lines(report)),
                        allow_parity_failure=False)


def verdict_lines(report: dict[str, Any]) -> list[verdict.Line]:
    """Whether the text qat and calibrate will measure on is natural: an answer set that is mostly
    one token makes their figures say nothing (a warning; the consumers decide)."""
    lines = []
    for split, s in report["stats"].items():
        if split == "all":
            continue
        lines.append(verdict.Line(f"{split} answers ({report['source']})", verdict.WARN if s["degenerate"] else verdict.INFO,
                                  f"{s['answers']} answers, {s['tokens']:,} tokens, {s['distinct_tokens']:,} distinct, "
                                  f"the most frequent {verdict.percent(s['top_share'])}", "most frequent token under 50%"))
    return lines


def _summary_markdown(report: dict[str, Any]) -> str:
    lengths = report["max_new_tokens"]
    rows = [{"split": split, **s} for split, s in report["stats"].items()]
    md = (f"# answers: {report['source']}\n\n{report['answers']} answers to vocab/'s reserved prompts (up to "
          f"{lengths['train']} / {lengths['eval']} new tokens for train / eval), read by qat and calibrate. "
          f"Wall {report['wall_s']:.1f} s.\n\n"
          + markdown_table(rows, ["split", "answers", "tokens", "distinct_tokens", "top_token", "top_share", "degenerate"]))
    return md + "".join(f"\n**Warning**: {w}\n" for w in report["warnings"])


# --- the pipeline's view ------------------------------------------------------------------


def section(recipe: Recipe) -> dict[str, Any]:
    return {"answers": to_dict(recipe.answers), "placement": to_dict(recipe.placement)}


def inputs(recipe: Recipe, run_dir: Path) -> dict[str, Path]:
    if "vocab" not in recipe.stages:
        raise HycoError(f"the answers stage needs the vocab stage's reserved prompts; add vocab to the recipe's "
                        f"stages, but got {list(recipe.stages)}")
    paths = {name: recipe.path(getattr(recipe.models, name), run_dir) for name in ("verifier", "tokenizer")}
    for name, p in paths.items():
        if p is None:
            raise HycoError(f"models.{name} must name a folder for the answers stage, but got null")
    paths["vocab"] = Path(run_dir) / "vocab"
    if recipe.models.verifier_tokenizer is not None:  # answers in the SLM's tokens (the token bridge)
        paths["verifier_tokenizer"] = recipe.path(recipe.models.verifier_tokenizer, run_dir)
        paths["slm"] = recipe.path(recipe.models.slm, run_dir)
        if paths["slm"] is None:
            raise HycoError("models.slm must name a folder for the answers stage of a cross-family recipe "
                            "(its end-of-turn ids), but got null")
    return paths


def build(recipe: Recipe, run_dir: Path, out: Path) -> dict[str, Any]:
    paths = inputs(recipe, run_dir)
    return make_answers(**paths, config=recipe.answers, out=out, placement=recipe.placement)
