"""`hyco-convert check`: decode prompts under every configuration of Table 5 against the reference
verifier and write report.json, summary.md and check.png (thin wrapper over `run_check`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_cli(sub: argparse._SubParsersAction) -> None:
    from hyco.config.recipe import CheckConfig, WorkloadConfig
    from hyco.data.workloads import WORKLOADS
    from hyco.pipeline.cli import add_recipe_argument, at_least

    defaults = CheckConfig()
    workloads = "; ".join(f"{name}: {text}" for name, text in WORKLOADS.items())
    p = sub.add_parser(
        "check", help="hybrid drafting end to end: MAT, acceptance by source, hand-off bytes per configuration",
        description="Decode N prompts with the reference verifier (transformers) and the drafters of each "
        "configuration (--config), on the same prompts and seeds, and write report.json, summary.md and check.png "
        f"into RUN_DIR/check (or --out). Workloads (check.workload.schema, default {WorkloadConfig().schema}): "
        f"{workloads}. From a file, N below its question count takes questions evenly across its categories "
        "(round-robin in the file's order, which question of a category chosen by check.seed); the report says "
        "how.")
    add_recipe_argument(p, nargs="?")
    p.add_argument("--recipe", dest="recipe_option", metavar="RECIPE", help="the same as the RECIPE argument")
    p.add_argument("--config", action="append", metavar="NAME", help=f"only this configuration (repeatable; "
                   f"default: the recipe's check.configs, {', '.join(defaults.configs)} where it sets none). "
                   f"{configurations_text()}")
    p.add_argument("--prompts", type=at_least(1), metavar="N",
                   help=f"number of prompts (default: the recipe's check.prompts, {defaults.prompts} where it sets none)")
    p.add_argument("--run-dir", help="the run folder whose finished stages check reads (fixtures/, vocab/, convert/, "
                   "qat/, export/ as the recipe needs; default: the recipe's `out`)")
    p.add_argument("--out", help="output folder (default: RUN_DIR/check)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe value, e.g. check.temperature=0")
    p.add_argument("--force", action="store_true", help="rebuild even if the output holds a matching manifest")
    p.set_defaults(func=_cmd_check)

    q = sub.add_parser(
        "project", help="Table 2 / Table 11 / Figure 1 again from a check report, under other timings, network or server",
        description="Recompute check's server cost and delivery tables from CHECK_DIR/costs_inputs.json (the "
        "rounds check counted, the server sweep it measured) with the phone's per-pass times, the network or the "
        "server replaced; no model runs. Prints and writes the check's own figures beside the projected ones "
        "(OUT/projection.json, projection.md, figure1.png). Profile formats: the README's section \"Phone and "
        "server profiles\".")
    q.add_argument("check_dir", help="a check stage's folder, e.g. runs/tiny/check")
    q.add_argument("--out", help="output folder (default: CHECK_DIR/../projection)")
    q.add_argument("--network", choices=["lte-ca", "5g-nsa"], help="a network preset (default: the check's)")
    q.add_argument("--rtt-ms", type=float, help="round-trip time per round, ms (>= 0; 0: a LAN)")
    q.add_argument("--up-mbps", type=float, help="uplink, Mbit/s (> 0)")
    q.add_argument("--down-mbps", type=float, help="downlink, Mbit/s (> 0)")
    q.add_argument("--phone-profile", metavar="FILE|NAME",
                   help='a phone profile, JSON: {"device": "...", "graphs": {"tree": {"median_ms": 41.2}, '
                   '"mtp_step": {"median_ms": 2.9}, "prefill": {"median_ms": 95}}, "host_ms_per_round": 1.5} '
                   '(one graph or more; host optional), or paper-sm8850; docs/profiles.md')
    q.add_argument("--server-profile", metavar="FILE|NAME",
                   help='a server profile in place of the check\'s sweep, JSON: {"device": "...", "verify": [[rows, '
                   'context, ms], ...], "prefill": [[prompt tokens, ms], ...], "head_step": ms or null}, the form '
                   'of costs_inputs.json\'s "server"; or paper-26b-a4b (derived from the paper\'s figures); '
                   'docs/profiles.md')
    q.add_argument("--write-server-profile", metavar="FILE",
                   help="also write the check's measured server sweep to FILE as a server profile")
    q.add_argument("--slm-ms", type=float, help="the SLM's tree pass on the phone, ms (> 0)")
    q.add_argument("--mtp-ms", type=float, help="one MTP step on the phone, ms (> 0)")
    q.add_argument("--prefill-ms", type=float, help="one SLM prefill pass (a chunk) on the phone, ms (> 0)")
    q.add_argument("--host-ms", type=float, help="the phone's host work per drafting round, ms (>= 0)")
    q.set_defaults(func=_cmd_project)


def _cmd_project(args: argparse.Namespace) -> int:
    import os
    import sys

    from hyco.runtime_check.costs import WhatIf, console_lines, project

    check_dir = Path(args.check_dir)
    out = Path(args.out) if args.out else check_dir.parent / "projection"
    what_if = WhatIf(network_name=args.network, rtt_ms=args.rtt_ms, up_mbps=args.up_mbps, down_mbps=args.down_mbps,
                     phone_profile=args.phone_profile,
                     phone_ms={"tree": args.slm_ms, "mtp_step": args.mtp_ms, "prefill": args.prefill_ms},
                     host_ms=args.host_ms, server_profile=args.server_profile)
    result = project(check_dir, out, what_if, write_server_profile=args.write_server_profile)
    lines = [*console_lines(result), f"wrote {out}/projection.json, projection.md, figure1.png"]
    if args.write_server_profile:
        lines.append(f"wrote the check's server sweep as a server profile: {args.write_server_profile}")
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader has gone (`| head -1`): what it did not read is no error. stdout to devnull,
        # as Python's signal docs advise, so the interpreter's last flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def configurations_text() -> str:
    """check's configurations, from the runtime's registries (hyco/runtime/configs.py)."""
    from hyco.config.recipe import CheckConfig
    from hyco.runtime.configs import BRIDGE_CONFIGS, CONFIGS, NUMERICS

    def listed(registry: dict) -> str:
        return ", ".join(f"{name} ({make(CheckConfig()).label})" for name, make in registry.items())

    return (f"Configurations: {listed(CONFIGS)}; through the token bridge (a recipe with "
            f"models.verifier_tokenizer): {listed(BRIDGE_CONFIGS)}; each also as "
            f"{' or '.join(f'NAME@{n}' for n in NUMERICS)}, the phone's drafters on those numerics (backend "
            "onnxruntime).")


def _recipe_of(args: argparse.Namespace) -> str:
    from hyco.base.errors import HycoError

    given = [r for r in (args.recipe, args.recipe_option) if r is not None]
    if not given:
        raise HycoError("give a recipe: hyco-convert check RECIPE (see 'hyco-convert check --help')")
    if len(set(given)) > 1:
        raise HycoError(f"RECIPE {given[0]} and --recipe {given[1]} differ: give one recipe")
    return given[0]


def refuse_unbuilt(inputs: dict[str, Path], run_dir: Path, recipe: str, stages: tuple[str, ...]) -> None:
    """check reads earlier stages' folders from the run folder: when the recipe's own `stages` build
    some it lacks, one line naming them and the command that builds them, before any model loads
    (a folder no stage of the recipe builds is run_check's to explain)."""
    from hyco.base.errors import HycoError
    from hyco.pipeline.artifacts import MANIFEST
    from hyco.pipeline.preflight import unbuilt

    missing = [folder for folder in unbuilt(inputs.values(), run_dir) if folder in stages]
    if not missing:
        return
    inside = [p.resolve().relative_to(run_dir.resolve()) for p in inputs.values()
              if p.resolve().is_relative_to(run_dir.resolve())]
    read = ", ".join(f"{folder}/" for folder in dict.fromkeys(p.parts[0] for p in inside if p.parts))
    finished = run_dir.is_dir() and any((d / MANIFEST).is_file() for d in run_dir.iterdir())
    state = f"lacks {', '.join(f'{f}/' for f in missing)}" if finished else "holds no finished stages"
    raise HycoError(f"{run_dir} {state}: check reads {read} from the run folder, which `hyco-convert run {recipe}` "
                    "builds (or give --run-dir a finished run's folder)")


def _cmd_check(args: argparse.Namespace) -> int:
    from hyco.runtime_check import stage

    from hyco.base.launch import run_split
    from hyco.config.recipe import load_recipe
    from hyco.pipeline.artifacts import run_stage, stage_state

    recipe_name = _recipe_of(args)
    recipe = load_recipe(recipe_name, args.set or [])
    run_dir = Path(args.run_dir) if args.run_dir else recipe.path(recipe.out)
    out = Path(args.out) if args.out else run_dir / "check"
    refuse_unbuilt(stage.inputs(recipe, run_dir), run_dir, recipe_name, recipe.stages)
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
