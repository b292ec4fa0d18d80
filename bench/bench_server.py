"""The server sweep behind check's Table 2 / Table 11 (T_verify(rows, context), T_prefill(length))
on a stand-in for a real verifier's shapes, timed exactly as check times its own verifier
(hyco/runtime/server_timing.py `measure`: transformers' StaticCache; on CUDA each verify shape one
replayed CUDA graph, CUDA events, medians). The stand-in is built on the device with random
weights (no file is written), at the model's whole depth by default:

    .venv/bin/python bench/bench_server.py --out DIR [--model 26b-a4b|31b] [--layers N] [--device cuda]
        [--dtype bfloat16] [--rows 1 5 9 17 33] [--contexts 64 1024 8192 32768] [--prefill 128 1024 8192]

`--model` as bench_verifier.py (26B-A4B's MoE, the 31B dense one). Random weights route MoE
tokens at random, still 8 experts a token, so the work is the real one's. No MTP head is built:
T_head is not in this bench (check measures it on the real head).

Beside the sweep, the server time per round each configuration asks for, at a context: a verify
pass over its rows (HyCo: the 33-row tree; Cloud+MTP: the 5-row chain plus K head steps, left
out here), and, for orientation only, the per-round server time the paper's Table 11 implies
(g x MAT: HyCo 4.80 x 4.71, Cloud+MTP 7.81 x 3.05 ms; prefill's share ignored) on the paper's
server and its AWQ 4-bit verifier, not this machine and these BF16 weights.
Writes DIR/bench_report.json and DIR/bench_summary.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_verifier import MODELS  # noqa: E402

# the paper's Table 11 g (ms per output token) and Table 2 MAT on SB-480
PAPER_ROUND_MS = {"hyco (33 rows)": (33, 4.80 * 4.71), "cloud-mtp (5 rows, head steps left out)": (5, 7.81 * 3.05)}


def stand_in(model: str, layers: int, device: str, dtype: str):
    """The verifier's text model at `layers` (every sixth layer full at the whole depth, every
    second below it, so a shallow stand-in has both kinds), made on `device` with transformers'
    random initialisation."""
    import torch

    from hyco.fixtures import models
    from hyco.fixtures.presets import PRESETS
    from hyco.fixtures.writer import family_configs

    shape, whole, period, _ = MODELS[model]
    spec = dataclasses.replace(PRESETS["e2b-shapes"], verifier=shape(layers, period if layers >= whole else 2))
    config = family_configs(spec)["verifier"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:  # made and initialised on the device (transformers' own init: std 0.02, norms at one, rotary tables)
        with torch.device(device):
            net = models.model_class(config)(config)
    finally:
        torch.set_default_dtype(previous)
    return net.eval(), config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="26b-a4b")
    parser.add_argument("--layers", type=int, help="depth (default: the whole model's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9, 17, 33])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 8192, 32768])
    parser.add_argument("--prefill", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="time the eager pass on CUDA")
    args = parser.parse_args()

    import torch

    from hyco.runtime.server_timing import Grid, measure

    layers = args.layers or MODELS[args.model][1]
    start = time.perf_counter()
    model, config = stand_in(args.model, layers, args.device, args.dtype)
    built_s = time.perf_counter() - start
    grid = Grid(rows=tuple(args.rows), contexts=tuple(args.contexts), prefill=tuple(args.prefill),
                repeats=args.repeats, cuda_graphs=not args.no_cuda_graphs)
    start = time.perf_counter()
    times = measure(model, None, grid, vocab=config.vocab_size)
    sweep_s = time.perf_counter() - start
    context = max(c for c in args.contexts if c <= 1024) if any(c <= 1024 for c in args.contexts) else args.contexts[0]
    report = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "device": times.device},
        "model": args.model, "layers": layers, "whole_depth": MODELS[args.model][1], "dtype": args.dtype,
        "parameters": sum(p.numel() for p in model.parameters()), "build_s": round(built_s, 1),
        "sweep_s": round(sweep_s, 1), "source": times.source, "grid": dataclasses.asdict(grid),
        "verify_ms": [[r, c, round(ms, 3)] for (r, c), ms in sorted(times.verify.items())],
        "prefill_ms": [[n, round(ms, 2)] for n, ms in sorted(times.prefill.items())],
        "prefill_line": [round(v, 5) for v in times.prefill_line()], "spread": times.spread,
        "round_ms_at_context": context,
        "rounds": {name: {"this_machine_ms": round(times.verify_ms(rows, context), 3), "paper_implied_ms": round(ms, 1)}
                   for name, (rows, ms) in PAPER_ROUND_MS.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "bench_summary.md").write_text(summary(report))
    print(summary(report))
    return 0


def summary(report: dict) -> str:
    contexts = sorted({c for _, c, _ in report["verify_ms"]})
    verify = {(r, c): ms for r, c, ms in report["verify_ms"]}
    lines = [f"# Server sweep: {report['model']} stand-in, {report['layers']} of {report['whole_depth']} layers, "
             f"{report['dtype']}, random weights", "",
             f"{report['parameters'] / 1e9:.2f} B parameters on {report['machine']['device']} (torch "
             f"{report['machine']['torch']}); {report['source']}; built in {report['build_s']} s, swept in "
             f"{report['sweep_s']} s.", "",
             "T_verify (ms, median of the repeats) by rows and context:", "",
             "| rows | " + " | ".join(f"ctx {c}" for c in contexts) + " |",
             "|---|" + "---|" * len(contexts)]
    for rows in sorted({r for r, _, _ in report["verify_ms"]}):
        lines.append(f"| {rows} | " + " | ".join(f"{verify[(rows, c)]:.3f}" for c in contexts) + " |")
    a, b = report["prefill_line"]
    lines += ["", "T_prefill (ms): " + ", ".join(f"{n} tokens {ms}" for n, ms in report["prefill_ms"])
              + f"; line {a:.2f} + {b:.4f} x length.", "",
              f"Server ms per round at context {report['round_ms_at_context']} (this machine) and what the paper's "
              "Table 11 g x Table 2 MAT implies on its own server and AWQ 4-bit verifier (orientation only):", "",
              "| round | this machine | paper-implied |", "|---|---|---|"]
    for name, r in report["rounds"].items():
        lines.append(f"| {name} | {r['this_machine_ms']} | {r['paper_implied_ms']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
