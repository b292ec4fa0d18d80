"""`hyco-convert calibrate`: convert's and qat's graphs -> QDQ graphs for the QNN HTP (thin
wrapper over `hyco.calibrate.stage.calibrate`)."""

from __future__ import annotations

import argparse

from hyco.config.recipe import (
    SLM_GRAPHS,
    TWO_BIT_WEIGHTS,
    CalibrateConfig,
    ExportConfig,
    field_help,
    ships_prefill,
    to_dict,
)
from hyco.pipeline.cli import NOT_GIVEN, stage_command

# the export keys the deployable graphs follow (how the 2-bit weights ship): flags here too
EXPORT_FLAGS = {"two_bit_weights": {"choices": TWO_BIT_WEIGHTS}, "int2_block_size": {"type": int},
                "slm_graphs": {"choices": SLM_GRAPHS}}


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = stage_command(
        sub, "calibrate", run=_cmd_calibrate, sections={"calibrate": CalibrateConfig()}, proof=True,
        inputs={"convert": "convert stage output folder", "vocab": "vocab stage output folder (keep_set.json)",
                "answers": "answers stage output folder (answers.jsonl)"},
        optional={"qat": "qat stage output folder (mtp_step.onnx, captures/); without it the SLM graphs only "
                         "(no MTP Drafter on the phone, e.g. the token bridge's recipes)"},
        aliases={"activation_calibration": "--calibration", "activation_percentile": "--percentile"},
        help="16-bit activations, 8-bit KV: convert's and qat's graphs -> QDQ ONNX the HTP runs whole",
        description="Drive convert's tree/prefill graphs and qat's MTP step graph as the phone does on the reserved "
        "train prompts' answers, choose the mask value from the visible scores' spread, and write tree.qdq.onnx, "
        "prefill.qdq.onnx, mtp_step.qdq.onnx (uint16 activations, uint8 KV, weights bit-exact; parity twins with "
        "float I/O beside them), io_spec.json (with each boundary tensor's scale/zero point), encodings.json "
        "(AIMET 1.0.0 layout), report.json (fidelity on the eval prompts, HTP acceptance, simulator vs CPU), "
        "summary.md and sqnr.png into --out.")
    helps, defaults = field_help(ExportConfig), ExportConfig()
    for key, kind in EXPORT_FLAGS.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, default=NOT_GIVEN, **kind,
                       help=f"{helps[key]} (recipe export.{key}; default: {getattr(defaults, key)})")


def _cmd_calibrate(args: argparse.Namespace, paths: dict, calibrate: CalibrateConfig) -> int:
    from hyco.calibrate.stage import calibrate as build

    from hyco.config.recipe import section_config
    from hyco.pipeline.artifacts import run_stage, stage_state, warn_if_proof_failed
    from hyco.qnn.int2_probe import export_keys

    out, inputs = paths.pop("out"), paths
    allow = args.allow_parity_failure
    export = section_config(ExportConfig(), "export", [], **{k: getattr(args, k) for k in EXPORT_FLAGS if hasattr(args, k)})
    two_bit = export_keys(export)
    manifest = run_stage("calibrate", out, {"calibrate": to_dict(calibrate), "two_bit_weights": two_bit,
                                            "slm_graphs": export.slm_graphs}, inputs,
                         lambda tmp: build(**{"qat": None, **inputs}, out=tmp, config=calibrate,
                                           two_bit_weights=two_bit, slm_graphs=export.slm_graphs,
                                           allow_parity_failure=allow),
                         force=args.force, allow_parity_failure=allow)
    s = manifest["summary"]
    warn_if_proof_failed(manifest)
    figures = ", ".join(f"{g}: top-1 {v['top1']}, cpu_nodes {v['cpu_nodes']}" for g, v in s.items() if isinstance(v, dict))
    graphs = "tree.qdq.onnx" + (", prefill.qdq.onnx" if ships_prefill(export.slm_graphs) else "") \
        + (", mtp_step.qdq.onnx" if "qat" in inputs else "")
    print(f"wrote {out}: {graphs}, io_spec.json, encodings.json ({stage_state(manifest)}); {figures}")
    qat = f" --qat {inputs['qat']}" if "qat" in inputs else ""
    print(f"next: hyco-convert export --calibrate {out} --convert {inputs['convert']}{qat} --out DIR")
    return 0
