"""Full-size dry run of the verifier's side: a stand-in for a Gemma 4 verifier at its real layer
shapes, a few layers deep, through the answers stage's generation and qat's teacher-forced capture,
loaded in BF16 as `placement.dtype: bfloat16` loads it. `--model`:

- `26b-a4b` (default): hidden 2,816; MoE of 128 experts, top-8, expert width 704, beside a dense MLP
  of 2,112; 16 heads; sliding K/V 8 x 256, full K/V 2 x 512 with K = V; 30 layers, every sixth full.
- `31b` (the dense verifier of recipes/hyco-gemma-4-31b.yaml): public accounts of its config give
  60 layers, every sixth full, 32 heads, sliding K/V 16 x 256, FFN 21,504, sliding window 1,024,
  30.7 B parameters; hidden 5,376 is what that count implies with the 262,144-token table; the full
  layers' K/V (4 x 512, K = V) are assumed like 26B-A4B's, not read from a config.

Both with the real 262,144-token vocabulary.

    .venv/bin/python bench/bench_verifier.py --out DIR [--model 31b] [--layers 2 4] [--prompts 2] [--new-tokens 16]

For each depth it writes the stand-in (random BF16 weights, hyco/fixtures/fullsize.py; every
second layer full, so each depth has both kinds) and runs each phase in a fresh interpreter, its
peak RSS the child's `ru_maxrss` (os.wait4): `load` (the checkpoint into memory), `answers`
(greedy answers to the prompts, `hyco.data.answers.generate_answers`), `capture` (qat's capture over
prompt + answer, `hyco.npu.captures.capture_answers`). The load is inside every phase's figure and
also reported alone.

Each figure is fitted as a + b x layers over the depths run by least squares (a: embedding,
lm_head, the interpreter; b: one layer, the mean of a sliding and a full one) and extrapolated to
the whole model's depth; its BF16 weight bytes are counted exactly from its configuration on the
meta device. Random weights: the answers are not text, and
the MoE routing is random (every token still runs 8 experts), so times are the real work's.
Writes DIR/bench_report.json and DIR/bench_summary.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fullsize import measure, speed_probe_in_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("load", "answers", "capture")
PROMPTS = ("Explain how a heat pump can warm a house in winter while the air outside is cold.",
           "Write a short letter to a neighbour asking to borrow a ladder for the weekend.",
           "What are three things to check before buying a used bicycle?",
           "Summarize the plot of a detective story in which the detective is the culprit.")


def a4b_shape(layers: int, full_period: int = 2):
    """Gemma 4 26B-A4B's text model (its config.json) at `layers`, every `full_period`-th layer full
    (the model: 30 layers, every sixth full; the stand-ins: every second, so each depth has both)."""
    from hyco.fixtures.presets import VerifierShape

    return VerifierShape(hidden=2816, intermediate=2112, num_layers=layers, full_period=full_period, heads=16, kv_heads=8,
                         head_dim=256, global_kv_heads=2, global_head_dim=512, sliding_window=1024,
                         experts=128, top_k_experts=8, moe_intermediate=704)


def dense_31b_shape(layers: int, full_period: int = 2):
    """Gemma 4 31B's text model as public accounts give it (module doc: hidden and the full layers'
    K/V are inferred, not read), at `layers`, every `full_period`-th layer full."""
    from hyco.fixtures.presets import VerifierShape

    return VerifierShape(hidden=5376, intermediate=21504, num_layers=layers, full_period=full_period, heads=32,
                         kv_heads=16, head_dim=256, global_kv_heads=4, global_head_dim=512, sliding_window=1024)


# name -> (shape at a depth, the whole model's layers, its full-layer period, the summary's title)
MODELS = {"26b-a4b": (a4b_shape, 30, 6, "a 26B-A4B-shaped stand-in"),
          "31b": (dense_31b_shape, 60, 6, "a 31B-dense-shaped stand-in (hidden and full-layer K/V inferred)")}


def write_stand_in(folder: Path, model: str, layers: int) -> Path:
    from hyco.fixtures.fullsize import write_family
    from hyco.fixtures.presets import PRESETS

    spec = dataclasses.replace(PRESETS["e2b-shapes"], verifier=MODELS[model][0](layers))
    return write_family(folder, spec, only=("verifier",))["verifier"]


def prompt_records() -> list[dict]:
    return [{"id": f"bench-{i}", "index": i, "split": "train", "turns": [["user", text]]}
            for i, text in enumerate(PROMPTS)]


def run_phase(phase: str, verifier: Path, work: Path, prompts: int, new_tokens: int) -> dict:
    """One phase in this (child) process; its own figures, printed as JSON by the caller."""
    import torch
    from hyco.answers.generate import generate_answers

    from hyco.base.loading import load_tokenizer, load_verifier
    from hyco.config.recipe import AnswersConfig, PlacementConfig
    from hyco.npu.captures import capture_answers

    start = time.perf_counter()
    model = load_verifier(verifier, PlacementConfig(dtype="bfloat16"))
    figures = {"load_s": round(time.perf_counter() - start, 2), "dtype": str(next(model.parameters()).dtype)}
    if phase == "answers":
        tok = load_tokenizer(verifier)
        start = time.perf_counter()
        config = AnswersConfig(source="greedy", max_new_tokens_train=new_tokens, max_prompt_tokens=64)
        records = list(generate_answers(model, tok, prompt_records()[:prompts], config))
        seconds = time.perf_counter() - start
        tokens = sum(len(r["answer_ids"]) for r in records)
        (work / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        figures |= {"answers_s": round(seconds, 2), "new_tokens": tokens, "s_per_token": round(seconds / tokens, 3),
                    "prompt_tokens": sum(len(r["prompt_ids"]) for r in records)}
    elif phase == "capture":
        records = [json.loads(line) for line in (work / "answers.jsonl").read_text().splitlines()]
        start = time.perf_counter()
        with torch.no_grad():
            rows = capture_answers(model, records, work / "captures", "after_norm")
        seconds = time.perf_counter() - start
        tokens = sum(r["tokens"] for r in rows)
        figures |= {"capture_s": round(seconds, 2), "tokens": tokens, "s_per_token": round(seconds / tokens, 4),
                    "capture_bytes": sum(p.stat().st_size for p in (work / "captures").iterdir())}
    return figures


def weight_bytes(model: str, layers: int, full_period: int = 2) -> int:
    """BF16 bytes of the parameters at `layers`, counted on the meta device."""
    from hyco.fixtures import models
    from hyco.fixtures.presets import PRESETS
    from hyco.fixtures.writer import family_configs

    spec = dataclasses.replace(PRESETS["e2b-shapes"], verifier=MODELS[model][0](layers, full_period))
    config = family_configs(spec)["verifier"]
    return 2 * sum(int(n) for n in (_numel(s) for s in models.stored_names(models.meta_model(config)).values()))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def fit(depths: list[int], values: list[float], whole: int) -> dict:
    """a + b x layers by least squares over the depths run, its largest residual (how straight the
    line is), and its value at the whole model's depth `whole`."""
    import numpy as np

    b, a = np.polyfit(np.asarray(depths, float), np.asarray(values, float), 1)
    residual = max(abs(v - (a + b * n)) for n, v in zip(depths, values, strict=True))
    return {"per_layer": round(float(b), 4), "fixed": round(float(a), 4), "max_residual": round(float(residual), 4),
            "at_whole_depth": round(float(a + b * whole), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="26b-a4b", help="the verifier whose shapes to stand in for")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--keep", action="store_true", help="keep the written stand-ins (GBs each)")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--verifier", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.verifier, args.work, args.prompts, args.new_tokens)))
        return 0
    if len(args.layers) < 2 or sorted(set(args.layers)) != args.layers or any(n % 2 for n in args.layers):
        parser.error("--layers: at least two distinct even depths, ascending (each has sliding and full layers)")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    shape, full_layers, full_period, title = MODELS[args.model]
    report = {"machine": {"python": platform.python_version(), "speed_probe": speed_probe_in_child(out)},
              "model": args.model, "title": title, "shape": dataclasses.asdict(shape(full_layers, full_period)),
              "prompts": args.prompts, "new_tokens": args.new_tokens, "depths": {}}
    for layers in args.layers:
        folder, work = out / f"stand-in-{layers}", out / f"work-{layers}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        start = time.perf_counter()
        verifier = write_stand_in(folder, args.model, layers)
        row = {"write_s": round(time.perf_counter() - start, 1),
               "checkpoint_bytes": sum(p.stat().st_size for p in verifier.glob("*.safetensors")),
               "weight_bytes": weight_bytes(args.model, layers)}
        for phase in PHASES:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--phase", phase,
                   "--verifier", str(verifier), "--work", str(work), "--prompts", str(args.prompts),
                   "--new-tokens", str(args.new_tokens)]
            log = out / "logs" / f"{phase}-{layers}.log"
            figures = measure(cmd, log)
            if figures["rc"] != 0:
                raise SystemExit(f"bench_verifier: phase {phase} at {layers} layers failed (rc {figures['rc']}); see {log}")
            figures |= json.loads(log.read_text().strip().splitlines()[-1])
            row[phase] = figures
            print(f"{layers} layers, {phase}: {figures}", flush=True)
        report["depths"][layers] = row
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    depths = args.layers
    rows = [report["depths"][n] for n in depths]
    report["whole_model"] = {
        "layers": full_layers,
        "weight_bytes": weight_bytes(args.model, full_layers, full_period),
        "load_s": fit(depths, [r["load"]["load_s"] for r in rows], full_layers),
        "answers_s_per_token": fit(depths, [r["answers"]["s_per_token"] for r in rows], full_layers),
        "capture_s_per_token": fit(depths, [r["capture"]["s_per_token"] for r in rows], full_layers),
        **{f"{phase}_peak_rss_mb": fit(depths, [r[phase]["peak_rss_mb"] for r in rows], full_layers) for phase in PHASES},
    }
    (out / "bench_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench_summary.md").write_text(summary(report))
    print(summary(report))
    return 0


def summary(report: dict) -> str:
    whole = report["whole_model"]
    lines = [f"# Verifier-side dry run: {report['title']} in BF16 on this machine's CPU", "",
             f"{report['prompts']} prompts, up to {report['new_tokens']} greedy new tokens each; random weights.", "",
             "| layers | checkpoint GB | load s | answers s/token | capture s/token | peak RSS MiB (load / answers / capture) |",
             "|---|---|---|---|---|---|"]
    for layers, r in report["depths"].items():
        lines.append(f"| {layers} | {r['checkpoint_bytes'] / 1e9:.2f} | {r['load']['load_s']} | "
                     f"{r['answers']['s_per_token']} | {r['capture']['s_per_token']} | "
                     f"{r['load']['peak_rss_mb']:.0f} / {r['answers']['peak_rss_mb']:.0f} / {r['capture']['peak_rss_mb']:.0f} |")
    at = "at_whole_depth"
    lines.append(f"| **{whole['layers']} (fitted)** | {whole['weight_bytes'] / 1e9:.2f} (counted) | {whole['load_s'][at]} | "
                 f"{whole['answers_s_per_token'][at]} | {whole['capture_s_per_token'][at]} | "
                 f"{whole['load_peak_rss_mb'][at]:.0f} / {whole['answers_peak_rss_mb'][at]:.0f} / "
                 f"{whole['capture_peak_rss_mb'][at]:.0f} |")
    residuals = {k: v["max_residual"] for k, v in whole.items() if isinstance(v, dict)}
    lines += ["", "Fitted as a + b x layers by least squares over the depths run (largest residual per figure: "
              f"{json.dumps(residuals)}); the whole model's BF16 weight bytes are counted from its configuration. "
              "Speed probe: " + json.dumps(report["machine"]["speed_probe"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
