"""`hyco-convert qat`: 4-bit KL QAT of the MTP head and the static MTP Drafter (thin wrapper
over `hyco.qat.stage.build_qat`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from hyco.errors import HycoError
from hyco.recipe import AnswersConfig, QatConfig, to_dict

_DEFAULT = QatConfig()


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "qat", help="4-bit KL QAT of the gemma4_assistant MTP head; W4/W8 PTQ baselines; mtp_step.onnx",
        description="Answer vocab/'s reserved prompts (--answers-source), capture the hand-off "
        "(e(x_{t+1}), h_t, last full/sliding K/V) teacher-forced, train the head with 4-bit per-channel weights "
        "and 16-bit activations (aimet-torch QuantSim, KL to the float head), compare with W4/W8 PTQ, and write "
        "head_w4.safetensors, encodings.json, mtp_step.onnx, embed_lut.safetensors, io_spec.json, report.json, "
        "loss.png and agreement.png into --out.")
    p.add_argument("--verifier", required=True, help="verifier folder (Gemma 4 text model, transformers format)")
    p.add_argument("--assistant", required=True, help="gemma4_assistant head folder")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder")
    p.add_argument("--vocab", required=True, help="vocab stage output (keep_set.json, prompts.jsonl)")
    p.add_argument("--steps", type=int, default=_DEFAULT.steps, help="optimizer steps (100 in the paper)")
    p.add_argument("--lr", type=float, default=_DEFAULT.lr, help="peak learning rate, AdamW (1e-5 in the paper)")
    p.add_argument("--warmup-steps", type=int, default=_DEFAULT.warmup_steps,
                   help="linear warm-up steps before the cosine decay (50 in the paper)")
    p.add_argument("--max-new-tokens-train", type=int, default=_DEFAULT.max_new_tokens_train,
                   help="length of the verifier's greedy answers to the training prompts (1024)")
    p.add_argument("--max-new-tokens-eval", type=int, default=_DEFAULT.max_new_tokens_eval,
                   help="length of the verifier's greedy answers to the evaluation prompts (512)")
    p.add_argument("--max-prompt-tokens", type=int, default=_DEFAULT.max_prompt_tokens,
                   help="prompts are cut to their last this-many tokens before answering")
    p.add_argument("--calibration-sequences", type=int, default=_DEFAULT.calibration_sequences,
                   help="train captures used for the 16-bit activation encodings")
    p.add_argument("--capture-point", choices=("after_norm", "before_norm"), default=_DEFAULT.capture_point,
                   help="h_t after the verifier's final norm (transformers' reference) or before it (the paper)")
    p.add_argument("--window", type=int, default=_DEFAULT.window, help="K/V ring positions of mtp_step.onnx")
    p.add_argument("--bf16-autocast", action="store_true", help="BF16 autocast in training (GPUs)")
    p.add_argument("--seed", type=int, default=_DEFAULT.seed, help="seed of training and sampling; same seed, same run")
    p.add_argument("--answers-source", choices=("greedy", "sampled", "corpus"), default=AnswersConfig.source,
                   help="what the head trains on: the verifier's greedy answers (the paper), its sampled answers "
                   "(--answers-temperature, top-k 64, top-p 0.95), or the corpus's own assistant turns teacher-forced")
    p.add_argument("--answers-temperature", type=float, default=AnswersConfig.temperature,
                   help="sampling temperature of --answers-source sampled")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--allow-parity-failure", action="store_true",
                   help="write the artifacts although the step graph's parity proof failed (manifest marked, warning)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds a matching manifest")
    p.set_defaults(func=_cmd_qat)


def _cmd_qat(args: argparse.Namespace) -> int:
    from hyco.qat.stage import build_qat

    from hyco.artifacts import run_stage, stage_state

    try:
        config = dataclasses.replace(
            _DEFAULT, steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
            max_new_tokens_train=args.max_new_tokens_train, max_new_tokens_eval=args.max_new_tokens_eval,
            max_prompt_tokens=args.max_prompt_tokens, calibration_sequences=args.calibration_sequences,
            capture_point=args.capture_point, window=args.window, bf16_autocast=args.bf16_autocast, seed=args.seed)
        answers = AnswersConfig(source=args.answers_source, temperature=args.answers_temperature, seed=args.seed)
    except ValueError as e:
        raise HycoError(str(e)) from None
    paths = {"verifier": Path(args.verifier), "assistant": Path(args.assistant), "tokenizer": Path(args.tokenizer),
             "vocab": Path(args.vocab)}
    out = Path(args.out)
    manifest = run_stage("qat", out, {"qat": to_dict(config), "answers": to_dict(answers)}, paths,
                         lambda tmp: build_qat(**paths, config=config, out=tmp, answers=answers,
                                               allow_parity_failure=args.allow_parity_failure),
                         force=args.force, allow_parity_failure=args.allow_parity_failure)
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
    return 0
