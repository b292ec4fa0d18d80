"""`hyco-convert check`: decode prompts under every configuration of Table 5 against the reference
verifier and write report.json, summary.md and check.png (thin wrapper over `run_check`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="hybrid drafting end to end: MAT, acceptance by source, hand-off bytes per configuration",
        description="Decode N prompts with the reference verifier (transformers) and the drafters of every "
        "configuration (HyCo, HyCo exact, HyCo-2P, SpecEdge-style, Cloud+MTP), on the same prompts and seeds, "
        "and write report.json, summary.md and check.png into RUN_DIR/check (or --out).")
    p.add_argument("--recipe", required=True, help="recipe YAML, e.g. recipes/tiny.yaml")
    p.add_argument("--config", action="append", metavar="NAME",
                   help="only this configuration (repeatable; default: the recipe's check.configs)")
    p.add_argument("--prompts", type=int, metavar="N", help="number of prompts (default: check.prompts)")
    p.add_argument("--run-dir", help="the run folder holding fixtures/ and vocab/ (default: the recipe's `out`)")
    p.add_argument("--out", help="output folder (default: RUN_DIR/check)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe value, e.g. check.temperature=0")
    p.add_argument("--force", action="store_true", help="rebuild even if the output holds a matching manifest")
    p.set_defaults(func=_cmd_check)


def _cmd_check(args: argparse.Namespace) -> int:
    from hyco.runtime_check import stage

    from hyco.artifacts import run_stage, stage_state
    from hyco.launch import run_split
    from hyco.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.set or [])
    run_dir = Path(args.run_dir) if args.run_dir else recipe.path(recipe.out)
    out = Path(args.out) if args.out else run_dir / "check"
    section = {**stage.section(recipe), "only": args.config, "prompts": args.prompts}

    def main() -> int:
        manifest = run_stage("check", out, section, stage.inputs(recipe, run_dir),
                             lambda tmp: stage.build(recipe, run_dir, tmp, configs=args.config, prompts=args.prompts),
                             force=args.force)
        mats = ", ".join(f"{name} {v['mat']:.2f}" for name, v in manifest["summary"]["configs"].items())
        print(f"MAT per configuration: {mats}: {stage_state(manifest)}")
        print(f"wrote {out}/report.json, summary.md, check.png")
        return 0

    return run_split(main, lambda word: stage.build(recipe, run_dir, None, configs=args.config, prompts=args.prompts))
