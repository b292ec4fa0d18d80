"""`hyco-convert calibrate`: convert's and qat's graphs -> QDQ graphs for the QNN HTP (thin
wrapper over `hyco.calibrate.stage.calibrate`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hyco.recipe import CalibrateConfig, add_set_option, section_config, to_dict

_DEFAULT = CalibrateConfig()


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="16-bit activations, 8-bit KV: convert's and qat's graphs -> QDQ ONNX the HTP runs whole",
        description="Drive convert's tree/prefill graphs and qat's MTP step graph as the phone does on the reserved "
        "train prompts' answers, choose the mask value from the visible scores' spread, and write tree.qdq.onnx, "
        "prefill.qdq.onnx, mtp_step.qdq.onnx (uint16 activations, uint8 KV, weights bit-exact; parity twins with "
        "float I/O beside them), io_spec.json (with each boundary tensor's scale/zero point), encodings.json "
        "(AIMET 1.0.0 layout), report.json (fidelity on the eval prompts, HTP acceptance, simulator vs CPU), "
        "summary.md and sqnr.png into --out.")
    p.add_argument("--convert", required=True, help="convert stage output folder")
    p.add_argument("--qat", required=True, help="qat stage output folder (mtp_step.onnx, captures/)")
    p.add_argument("--vocab", required=True, help="vocab stage output folder (keep_set.json)")
    p.add_argument("--answers", required=True, help="answers stage output folder (answers.jsonl)")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--prompts", type=int, default=_DEFAULT.prompts, help="train answers to calibrate on")
    p.add_argument("--eval-prompts", type=int, default=_DEFAULT.eval_prompts, help="eval answers for the figures")
    p.add_argument("--calibration", choices=["minmax", "percentile"], default=_DEFAULT.activation_calibration,
                   help="16-bit activation ranges: min/max or a percentile (--percentile)")
    p.add_argument("--percentile", type=float, default=_DEFAULT.activation_percentile,
                   help="percentile for --calibration percentile (default %(default)s)")
    p.add_argument("--no-htp-check", action="store_true", help="skip the HTP acceptance and simulator runs")
    p.add_argument("--allow-parity-failure", action="store_true",
                   help="keep the graphs although a proof failed (fidelity, HTP vs CPU; manifest marked, warning)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds a matching manifest")
    add_set_option(p, "calibrate")
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from hyco.calibrate.stage import calibrate

    from hyco.artifacts import run_stage, stage_state
    from hyco.errors import HycoError

    try:
        config = section_config(_DEFAULT, "calibrate", args.set, prompts=args.prompts, eval_prompts=args.eval_prompts,
                                     activation_calibration=args.calibration, activation_percentile=args.percentile,
                                     htp_check=not args.no_htp_check)
    except ValueError as e:
        raise HycoError(str(e)) from None
    paths = {"convert": Path(args.convert), "qat": Path(args.qat), "vocab": Path(args.vocab),
             "answers": Path(args.answers)}
    allow = args.allow_parity_failure
    manifest = run_stage("calibrate", Path(args.out), {"calibrate": to_dict(config)}, paths,
                         lambda tmp: calibrate(**paths, out=tmp, config=config, allow_parity_failure=allow),
                         force=args.force, allow_parity_failure=allow)
    s = manifest["summary"]
    if manifest.get("proof_failed"):
        print(f"WARNING: proof failed, artifacts kept (--allow-parity-failure) and manifest marked: "
              f"{manifest['proof_failed']}", file=sys.stderr)
    figures = ", ".join(f"{g}: top-1 {v['top1']}, cpu_nodes {v['cpu_nodes']}" for g, v in s.items() if isinstance(v, dict))
    print(f"wrote {args.out}: tree.qdq.onnx, prefill.qdq.onnx, mtp_step.qdq.onnx, io_spec.json, encodings.json "
          f"({stage_state(manifest)}); {figures}")
    print(f"next: hyco-convert export --calibrate {args.out} --convert {args.convert} --qat {args.qat} --out DIR")
    return 0
