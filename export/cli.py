"""`hyco-convert export` (QDQ graphs -> QNN context binaries + bundle, or qai-hub jobs with --hub)
and `hyco-convert smoke` (hybrid drafting through a bundle's binaries on the HTP backend):
thin wrappers over `hyco.export.stage.export`, `hyco.export.hub.hub_export` and
`hyco.export.smoke.smoke`."""

from __future__ import annotations

import argparse
from pathlib import Path

from hyco.config.recipe import CheckConfig, ExportConfig, to_dict
from hyco.pipeline.cli import at_least, stage_command

_DEFAULT = ExportConfig()
BUNDLE_ONLY = ("convert", "qat", "vocab", "tokenizer", "verifier", "verifier_tokenizer")  # --hub uploads calibrate's graphs only


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = stage_command(
        sub, "export", run=_cmd_export, sections={"export": _DEFAULT}, proof=True,
        inputs={"calibrate": "calibrate stage output (tree, mtp_step and, for --slm-graphs separate or shared, "
                              "prefill .qdq.onnx)"},
        optional={"convert": "convert stage output (luts/, rope.json, encodings.json); not with --hub",
                  "qat": "qat stage output (embed_lut.safetensors, encodings.json); not with --hub",
                  "vocab": "vocab stage output (keep set, reserved prompts); not with --hub",
                  "tokenizer": "tokenizer folder to ship in the bundle",
                  "verifier": "reference verifier checkpoint: the stage ends with a smoke run when given "
                  "(bundle.json records its name and config hash, not its path)",
                  "verifier_tokenizer": "the verifier's own tokenizer, for a verifier of another family: the smoke "
                  "run drafts for it through the token bridge"},
        help="QNN HTP context binaries for SM8850 (soc_model 87) and a self-describing bundle",
        description="Compile calibrate's QDQ graphs (the tree graph, which also prefills under the default "
        "--slm-graphs tree-only, a prefill graph for separate or shared, and mtp_step) offline (onnxruntime-qnn, prepare "
        "only) into QNN context binaries for --soc-model, and write OUT/bundle/ (binaries, EPContext wrappers, CPU "
        "LUTs, keep set, rope spec, io_spec, encodings, tokenizer, bundle.json with sha256 per file and the I/O read "
        "back from each binary), report.json and summary.md. With --hub: compile and profile on a qai-hub device.")
    p.add_argument("--hub", action="store_true", help="compile and profile through qai-hub (needs a token); the same "
                   "as --backend qai-hub")

    sampling = CheckConfig()  # what smoke's reference verifier samples with
    s = sub.add_parser(
        "smoke", help="hybrid drafting through a bundle's context binaries on the QNN HTP backend, vs onnxruntime CPU",
        description="Load only BUNDLE, run the SLM and MTP drafters through its context binaries on the QNN HTP "
        "backend (the x86 simulator on a workstation) for a few rounds of exact hybrid drafting (HyCo exact; "
        "SLM-only trees for a bundle without an MTP Drafter) against the reference verifier, which samples at "
        f"temperature {sampling.temperature:g}, top-k {sampling.top_k}, top-p {sampling.top_p:g} with each token's "
        "seed keyed by its position, so exact verification commits the same text whatever was drafted. The same "
        "rounds run with both drafters on onnxruntime CPU on the bundle's QDQ graphs; every pass is compared "
        "(top-k ids, log-probs within each graph's bound or --tolerance) and so are the committed tokens. Writes "
        "report.json and summary.md into --out.")
    s.add_argument("bundle", help="an export output's bundle/ folder (EXPORT_DIR/bundle)")
    s.add_argument("--verifier", required=True, help="reference verifier checkpoint (the server's; checked against "
                   "the name and config hash bundle.json records)")
    s.add_argument("--verifier-tokenizer", help="the verifier's own tokenizer, for a verifier of another family "
                   "(drafted for through the token bridge)")
    s.add_argument("--prompts", type=at_least(1), default=max(1, _DEFAULT.smoke_prompts), metavar="N",
                   help="prompts from the bundle's prompts.jsonl (default: %(default)s)")
    s.add_argument("--rounds", type=at_least(1), default=_DEFAULT.smoke_rounds, metavar="R",
                   help="drafting rounds per prompt (default: %(default)s)")
    s.add_argument("--tolerance", type=float, default=_DEFAULT.logprob_tolerance,
                   help="max |log-prob| difference HTP vs CPU, one number for every graph (default: each graph's "
                   "own bound from calibrate, htp_logprob_bound in the bundle's io_spec.json)")
    s.add_argument("--no-isolate", action="store_true",
                   help="run every context in this process (HTP results were seen to leak between sessions)")
    s.add_argument("--soc-model", type=int, default=_DEFAULT.soc_model,
                   help="the SoC the bundle must have been built for (default: %(default)s, SM8850); another is refused")
    s.add_argument("--out", help="report folder (default: BUNDLE/../smoke)")
    s.set_defaults(func=_cmd_smoke)


def _cmd_export(args: argparse.Namespace, paths: dict, export: ExportConfig) -> int:
    from hyco.export.stage import ExportInputs
    from hyco.export.stage import export as build

    from hyco.base.errors import HycoError
    from hyco.pipeline.artifacts import run_stage, stage_state, warn_if_proof_failed

    out = paths.pop("out")
    bundle_only = [f"--{k}" for k in BUNDLE_ONLY if k in paths]
    if export.htp_optimization_level:  # qai-hub compiles with its own settings
        bundle_only.append("--htp-optimization-level")
    if args.hub or export.backend == "qai-hub":
        from hyco.export.hub import hub_export

        if bundle_only:  # ignoring them would let the user think the hub jobs read them
            raise HycoError(f"export --hub reads only --calibrate (qai-hub compiles and profiles its QDQ graphs); "
                            f"{', '.join(bundle_only)} would not be used: drop them")
        result = hub_export(calibrate=paths["calibrate"], out=out, config=export)
        print(f"wrote {out}/hub.json: {len(result['jobs'])} qai-hub jobs on {export.device!r}")
        return 0
    allow = args.allow_parity_failure
    missing = [f"--{k}" for k in ("convert", "vocab") if k not in paths]
    if missing:
        raise HycoError(f"export needs {', '.join(missing)} (the bundle ships their LUTs, rope spec, encodings and "
                        "keep set); only `export --hub` runs on --calibrate alone")
    inputs = ExportInputs.of(paths)  # no --qat: no MTP Drafter
    manifest = run_stage("export", out, {"export": to_dict(export)}, paths,
                         lambda tmp: build(inputs, tmp, export, allow_parity_failure=allow, final=out),
                         force=args.force, allow_parity_failure=allow)
    s = manifest["summary"]
    sizes = ", ".join(f"{k} {v:,} B" for k, v in s["binaries"].items())
    smoke = {True: "smoke passed", False: "smoke FAILED", None: "no smoke run (it needs --verifier and --smoke-prompts "
             "> 0)"}[s["smoke_passed"]]
    print(f"wrote {out}/bundle ({stage_state(manifest)}): {sizes}; {smoke}")
    warn_if_proof_failed(manifest, "bundle")
    print(f"next: hyco-convert smoke {out}/bundle --verifier VERIFIER_DIR")
    return 0


def refuse_export_folder(bundle: Path) -> None:
    """The export stage's folder given for its bundle/ inside: say so, not that bundle.json is missing."""
    from hyco.base.errors import HycoError

    if not (bundle / "bundle.json").is_file() and (bundle / "bundle").is_dir():
        raise HycoError(f"{bundle} is an export folder, not a bundle: did you mean {bundle / 'bundle'}?")


def _cmd_smoke(args: argparse.Namespace) -> int:
    from hyco.export.smoke import smoke

    bundle = Path(args.bundle)
    refuse_export_folder(bundle)
    out = Path(args.out) if args.out else bundle.parent / "smoke"
    report = smoke(bundle=bundle, verifier=Path(args.verifier), prompts=args.prompts,
                   verifier_tokenizer=Path(args.verifier_tokenizer) if args.verifier_tokenizer else None,
                   rounds=args.rounds, tolerance=args.tolerance, isolate=not args.no_isolate, out=out,
                   soc_model=args.soc_model)
    print(report["headline"])
    print(f"wrote {out}/report.json, summary.md")
    return 0 if report["passed"] else 1
