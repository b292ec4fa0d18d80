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

    q = sub.add_parser(
        "project", help="Table 2 / Table 11 / Figure 1 again from a check report, under other timings or network",
        description="Recompute check's server cost and delivery tables from CHECK_DIR/costs_inputs.json (the "
        "rounds check counted, the server sweep it measured) with the phone's per-pass times or the network "
        "replaced; no model runs. Writes OUT/projection.json, projection.md and figure1.png.")
    q.add_argument("check_dir", help="a check stage's folder, e.g. runs/tiny/check")
    q.add_argument("--out", help="output folder (default: CHECK_DIR/../projection)")
    q.add_argument("--network", choices=["lte-ca", "5g-nsa"], help="a network preset (default: the check's)")
    q.add_argument("--rtt-ms", type=float, help="round-trip time per round, ms")
    q.add_argument("--up-mbps", type=float, help="uplink, Mbit/s")
    q.add_argument("--down-mbps", type=float, help="downlink, Mbit/s")
    q.add_argument("--phone-profile", help="a device profile JSON (hyco/runtime/phone_timing.py), or paper-sm8850")
    q.add_argument("--slm-ms", type=float, help="the SLM's tree pass on the phone, ms")
    q.add_argument("--mtp-ms", type=float, help="one MTP step on the phone, ms")
    q.add_argument("--prefill-ms", type=float, help="one SLM prefill pass (a chunk) on the phone, ms")
    q.add_argument("--host-ms", type=float, help="the phone's host work per drafting round, ms")
    q.set_defaults(func=_cmd_project)


def _cmd_project(args: argparse.Namespace) -> int:
    from hyco.runtime_check.costs import project

    check_dir = Path(args.check_dir)
    out = Path(args.out) if args.out else check_dir.parent / "projection"
    result = project(check_dir, out, network_name=args.network, rtt_ms=args.rtt_ms, up_mbps=args.up_mbps,
                     down_mbps=args.down_mbps, phone_profile=args.phone_profile,
                     phone_ms={"tree": args.slm_ms, "mtp_step": args.mtp_ms, "prefill": args.prefill_ms},
                     host_ms=args.host_ms)
    for name, row in result["rows"].items():
        g = "n/a" if row.get("g_ms") is None else f"{row['g_ms']:.2f} ms"
        dg = "" if row.get("delta_g_percent") is None else f" ({row['delta_g_percent']:+.1f}%)"
        tok = "n/a" if row.get("tok_s") is None else f"{row['tok_s']:.1f}"
        print(f"{name:18s} g {g}{dg}, {tok} tok/s")
    print(f"wrote {out}/projection.json, projection.md, figure1.png")
    return 0


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
