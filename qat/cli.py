"""`hyco-convert qat`: 4-bit KL QAT of the MTP head and the static MTP Drafter (thin wrapper
over `hyco.qat.stage.build_qat`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hyco.config.recipe import QatConfig, to_dict
from hyco.pipeline.cli import stage_command


def add_cli(sub: argparse._SubParsersAction) -> None:
    stage_command(
        sub, "qat", run=_cmd_qat, sections={"qat": QatConfig()}, proof=True,
        inputs={"verifier": "verifier folder (Gemma 4 text model, transformers format)",
                "assistant": "gemma4_assistant head folder", "tokenizer": "tokenizer folder",
                "vocab": "vocab stage output (keep_set.json)",
                "answers": "answers stage output (answers.jsonl: the text the head trains on)"},
        help="4-bit KL QAT of the gemma4_assistant MTP head; W4/W8 PTQ baselines; mtp_step.onnx",
        description="Teacher-force the answers stage's text through the verifier, capture the hand-off "
        "(e(x_{t+1}), h_t, last full/sliding K/V) teacher-forced, train the head with 4-bit per-channel weights "
        "and 16-bit activations (aimet-torch QuantSim, KL to the float head), compare with W4/W8 PTQ, and write "
        "head_w4.safetensors, encodings.json, mtp_step.onnx, embed_lut.safetensors, io_spec.json, report.json, "
        "loss.png and agreement.png into --out.")


def _cmd_qat(args: argparse.Namespace, paths: dict, qat: QatConfig) -> int:
    from hyco.qat.stage import build_qat, capture_share

    from hyco.base.launch import run_split
    from hyco.pipeline.artifacts import run_stage, stage_state, warn_if_proof_failed

    out, inputs = paths.pop("out"), paths
    allow = args.allow_parity_failure

    def main() -> int:
        manifest = run_stage("qat", out, {"qat": to_dict(qat)}, inputs,
                             lambda tmp: build_qat(**inputs, config=qat, out=tmp, allow_parity_failure=allow),
                             force=args.force, allow_parity_failure=allow)
        s = manifest["summary"]
        top1 = ", ".join(f"{k} {100 * v:.1f}%" for k, v in s["top1"].items() if not k.endswith("_train"))
        print(f"MTP head top-1 agreement with the float head: {top1}; {s['s_per_step']} s/step: {stage_state(manifest)}")
        print(f"wrote {out}/head_w4.safetensors, encodings.json, mtp_step.onnx, embed_lut.safetensors, io_spec.json, "
              "report.json, loss.png, agreement.png")
        warn_if_proof_failed(manifest)
        print(f"next: the check stage's MTP Drafter runs {out}/mtp_step.onnx with check.backend onnxruntime "
              "(hyco-convert check RECIPE --set check.backend=onnxruntime)")
        return 0

    shared = {k: inputs[k] for k in ("verifier", "tokenizer", "answers")}
    return run_split(main, lambda word: capture_share(**shared, config=qat, captures=Path(word["captures"])))
