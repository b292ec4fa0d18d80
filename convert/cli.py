"""`hyco-convert convert`: the E2B QAT checkpoint to static integer NPU graphs (thin wrapper
over `hyco.convert.stage.convert`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hyco.recipe import ConvertConfig, add_set_option, section_config, to_dict

_DEFAULT = ConvertConfig()


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="graph surgery: E2B QAT checkpoint -> static integer ONNX graphs (tree, prefill) + CPU LUTs",
        description="Load the Gemma 4 E2B QAT checkpoint (quant_method 'gemma') through transformers and write "
        "tree.onnx and prefill.onnx (opset 21, INT4/INT8 weights, host rotary, KV rings, keep-set head with "
        "in-graph top-k), luts/ (embedding tables), rope.json, io_spec.json, encodings.json, bitexact.json, "
        "parity.json (vs transformers on onnxruntime CPU), report.json and summary.md into --out.")
    p.add_argument("--checkpoint", required=True, help="E2B QAT checkpoint folder (text-only or multimodal layout)")
    p.add_argument("--keep-set", help="keep_set.json or a vocab output folder (default: the whole vocabulary)")
    p.add_argument("--tokenizer", help="tokenizer the keep set must match (default: the checkpoint folder)")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--rows", type=int, default=_DEFAULT.rows, help="tree graph rows (32 draft nodes + root)")
    p.add_argument("--prefill-chunk", type=int, default=_DEFAULT.prefill_chunk, help="prefill graph rows")
    p.add_argument("--ring-full", type=int, default=_DEFAULT.ring_full, help="KV ring slots of full layers")
    p.add_argument("--ring-sliding", type=int, default=_DEFAULT.ring_sliding, help="KV ring slots of sliding layers")
    p.add_argument("--topk", type=int, default=_DEFAULT.topk, help="in-graph top-k")
    p.add_argument("--float-linear-bits", type=_bits_or_none, default=_DEFAULT.float_linear_bits,
                   help="width at which convert quantizes, per output channel, a linear the checkpoint leaves in "
                   "float (modules_to_not_convert); 'none' refuses such a checkpoint (default: %(default)s)")
    p.add_argument("--no-parity", action="store_true", help="skip the parity checks against transformers")
    p.add_argument("--allow-parity-failure", action="store_true",
                   help="write the artifacts although the bit-exact or parity proof failed (manifest marked, warning)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds a matching manifest")
    add_set_option(p, "convert")
    p.set_defaults(func=_cmd_convert)


def _bits_or_none(text: str) -> int | None:
    return None if text.lower() in ("none", "null") else int(text)


def _cmd_convert(args: argparse.Namespace) -> int:
    from hyco.convert.stage import convert

    from hyco.artifacts import run_stage, stage_state

    try:
        config = section_config(_DEFAULT, "convert", args.set, rows=args.rows, prefill_chunk=args.prefill_chunk,
                                     ring_full=args.ring_full, ring_sliding=args.ring_sliding, topk=args.topk,
                                     parity=not args.no_parity, float_linear_bits=args.float_linear_bits)
    except ValueError as e:
        from hyco.errors import HycoError

        raise HycoError(str(e)) from None
    keep_set = Path(args.keep_set) if args.keep_set else None
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    allow = args.allow_parity_failure
    inputs = {"checkpoint": Path(args.checkpoint)}
    if keep_set:
        inputs["keep_set"] = keep_set
    manifest = run_stage("convert", Path(args.out), {"convert": to_dict(config)}, inputs,
                         lambda tmp: convert(checkpoint=Path(args.checkpoint), out=tmp, config=config,
                                             keep_set=keep_set, tokenizer=tokenizer, allow_parity_failure=allow),
                         force=args.force, allow_parity_failure=allow)
    s = manifest["summary"]
    state = stage_state(manifest)
    print(f"wrote {args.out}: tree.onnx, prefill.onnx, luts/, io_spec.json ({state}); "
          f"bit-exact: {s.get('bitexact_all_equal')}, parity: {s.get('parity_passed')}")
    if manifest.get("proof_failed"):
        print(f"WARNING: proof failed, artifacts kept (--allow-parity-failure) and manifest marked: "
              f"{manifest['proof_failed']}", file=sys.stderr)
    elif s.get("parity_ties") is not None:
        print(f"parity: bit-exact up to {s['parity_ties']} rounding ties (parity.json lists each)")
    print(f"next: the check stage's SLM Drafter runs {args.out} with check.backend onnxruntime "
          "(hyco-convert check --recipe RECIPE --set check.backend=onnxruntime)")
    return 0
