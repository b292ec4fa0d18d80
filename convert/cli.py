"""`hyco-convert convert`: the E2B QAT checkpoint to static integer NPU graphs (thin wrapper
over `hyco.convert.stage.convert`)."""

from __future__ import annotations

import argparse

from hyco.config.recipe import ConvertConfig, to_dict
from hyco.pipeline.cli import stage_command


def add_cli(sub: argparse._SubParsersAction) -> None:
    stage_command(
        sub, "convert", run=_cmd_convert, sections={"convert": ConvertConfig()}, proof=True,
        inputs={"checkpoint": "E2B QAT checkpoint folder (text-only or multimodal layout)"},
        optional={"keep_set": "keep_set.json or a vocab output folder (default: the whole vocabulary)",
                  "tokenizer": "tokenizer the keep set must match (default: the checkpoint folder)"},
        help="graph surgery: E2B QAT checkpoint -> static integer ONNX graphs (tree, prefill) + CPU LUTs",
        description="Load the Gemma 4 E2B QAT checkpoint (quant_method 'gemma') through transformers and write "
        "tree.onnx and prefill.onnx (opset 21, INT4/INT8 weights, host rotary, KV rings, keep-set head with "
        "in-graph top-k), luts/ (embedding tables), rope.json, io_spec.json, encodings.json, bitexact.json, "
        "parity.json (vs transformers on onnxruntime CPU), report.json and summary.md into --out.")


def _cmd_convert(args: argparse.Namespace, paths: dict, convert: ConvertConfig) -> int:
    from hyco.convert.stage import convert as build

    from hyco.pipeline.artifacts import run_stage, stage_state, warn_if_proof_failed

    allow = args.allow_parity_failure
    inputs = {k: paths[k] for k in ("checkpoint", "keep_set") if k in paths}
    manifest = run_stage("convert", paths["out"], {"convert": to_dict(convert)}, inputs,
                         lambda tmp: build(checkpoint=paths["checkpoint"], out=tmp, config=convert,
                                           keep_set=paths.get("keep_set"), tokenizer=paths.get("tokenizer"),
                                           allow_parity_failure=allow),
                         force=args.force, allow_parity_failure=allow)
    s = manifest["summary"]
    print(f"wrote {args.out}: tree.onnx, prefill.onnx, luts/, io_spec.json ({stage_state(manifest)}); "
          f"bit-exact: {s.get('bitexact_all_equal')}, parity: {s.get('parity_passed')}")
    warn_if_proof_failed(manifest)
    if not manifest.get("proof_failed") and s.get("parity_ties") is not None:
        print(f"parity: bit-exact up to {s['parity_ties']} rounding ties (parity.json lists each)")
    print(f"next: the check stage's SLM Drafter runs {args.out} with check.backend onnxruntime "
          "(hyco-convert check RECIPE --set check.backend=onnxruntime)")
    return 0
