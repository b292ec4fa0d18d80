"""`hyco-convert qat`: 4-bit KL QAT of the MTP head and the static MTP Drafter (thin wrapper
over `hyco.qat.stage.build_qat`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hyco.errors import HycoError
from hyco.recipe import QatConfig, add_set_option, section_config, to_dict

_DEFAULT = QatConfig()


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "qat", help="4-bit KL QAT of the gemma4_assistant MTP head; W4/W8 PTQ baselines; mtp_step.onnx",
        description="Teacher-force the answers stage's text through the verifier, capture the hand-off "
        "(e(x_{t+1}), h_t, last full/sliding K/V) teacher-forced, train the head with 4-bit per-channel weights "
        "and 16-bit activations (aimet-torch QuantSim, KL to the float head), compare with W4/W8 PTQ, and write "
        "head_w4.safetensors, encodings.json, mtp_step.onnx, embed_lut.safetensors, io_spec.json, report.json, "
        "loss.png and agreement.png into --out.")
    p.add_argument("--verifier", required=True, help="verifier folder (Gemma 4 text model, transformers format)")
    p.add_argument("--assistant", required=True, help="gemma4_assistant head folder")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder")
    p.add_argument("--vocab", required=True, help="vocab stage output (keep_set.json)")
    p.add_argument("--answers", required=True, help="answers stage output (answers.jsonl: the text the head trains on)")
    p.add_argument("--steps", type=int, default=_DEFAULT.steps, help="optimizer steps (100 in the paper)")
    p.add_argument("--lr", type=float, default=_DEFAULT.lr, help="peak learning rate, AdamW (1e-5 in the paper)")
    p.add_argument("--warmup-steps", type=int, default=_DEFAULT.warmup_steps,
                   help="linear warm-up steps before the cosine decay (50 in the paper)")
    p.add_argument("--calibration-sequences", type=int, default=_DEFAULT.calibration_sequences,
                   help="train captures used for the 16-bit activation encodings")
    p.add_argument("--capture-point", choices=("after_norm", "before_norm"), default=_DEFAULT.capture_point,
                   help="h_t after the verifier's final norm (transformers' reference) or before it (the paper)")
    p.add_argument("--window", type=int, default=_DEFAULT.window, help="K/V ring positions of mtp_step.onnx")
    p.add_argument("--bf16-autocast", action="store_true", help="BF16 autocast in training (GPUs)")
    p.add_argument("--seed", type=int, default=_DEFAULT.seed, help="seed of training and sampling; same seed, same run")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--allow-parity-failure", action="store_true",
                   help="write the artifacts although the step graph's parity proof failed (manifest marked, warning)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds a matching manifest")
    add_set_option(p, "qat")
    p.set_defaults(func=_cmd_qat)


def _cmd_qat(args: argparse.Namespace) -> int:
    from hyco.qat.stage import build_qat, capture_share

    from hyco.artifacts import run_stage
    from hyco.launch import run_split

    try:
        config = section_config(
            _DEFAULT, "qat", args.set, steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
            calibration_sequences=args.calibration_sequences,
            capture_point=args.capture_point, window=args.window, bf16_autocast=args.bf16_autocast, seed=args.seed)
    except ValueError as e:
        raise HycoError(str(e)) from None
    paths = {"verifier": Path(args.verifier), "assistant": Path(args.assistant), "tokenizer": Path(args.tokenizer),
             "vocab": Path(args.vocab), "answers": Path(args.answers)}
    out = Path(args.out)

    def main() -> int:
        manifest = run_stage("qat", out, {"qat": to_dict(config)}, paths,
                             lambda tmp: build_qat(**paths, config=config, out=tmp,
                                                   allow_parity_failure=args.allow_parity_failure),
                             force=args.force, allow_parity_failure=args.allow_parity_failure)
        _print_done(out, manifest)
        return 0

    shared = {k: paths[k] for k in ("verifier", "tokenizer", "answers")}
    return run_split(main, lambda word: capture_share(**shared, config=config, captures=Path(word["captures"])))


def _print_done(out: Path, manifest: dict) -> None:
    from hyco.artifacts import stage_state

    s = manifest["summary"]
    state = stage_state(manifest)
    top1 = ", ".join(f"{k} {100 * v:.1f}%" for k, v in s["top1"].items() if not k.endswith("_train"))
    print(f"MTP head top-1 agreement with the float head: {top1}; {s['s_per_step']} s/step: {state}")
    print(f"wrote {out}/head_w4.safetensors, encodings.json, mtp_step.onnx, embed_lut.safetensors, io_spec.json, "
          "report.json, loss.png, agreement.png")
    if manifest.get("proof_failed"):
        import sys

        print(f"WARNING: proof failed, artifacts kept (--allow-parity-failure) and manifest marked: "
              f"{manifest['proof_failed']}", file=sys.stderr)
    print(f"next: the check stage's MTP Drafter runs {out}/mtp_step.onnx with check.backend onnxruntime "
          "(hyco-convert check --recipe RECIPE --set check.backend=onnxruntime)")
