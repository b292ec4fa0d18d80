"""Per-pass cost of the deployed drafters as check runs them (`check.drafters: deployed`: the
bundle's QDQ graphs), by each executor check can use, and the wall time of a real SB-480 check's
drafter passes they project.

    .venv/bin/python bench/bench_deployed.py --calibrate DIR [--passes N] [--executors LIST] [--out FILE]

DIR: a calibrate stage's folder (its deployable `*.qdq.onnx` graphs and `io_spec.json`), e.g. the
full-size dry run's at E2B shapes (`bench/bench_fullsize.py ... --stages vocab,answers,convert,qat,calibrate`).
Executors: `onnxruntime` (CPU, optimisations off: SRQ rounding depends on summation order; the
reference), `onnxruntime+opt` (timing only: not the numerics check holds), `torch:cpu` and
`torch:cuda` (hyco/quant/qdq_torch.py, `check.deployed_executor: torch`; on CUDA one pass is a replayed
CUDA graph). Each graph runs `passes` times on example feeds of its io_spec shapes; the median
pass is kept, outputs copied back to the host.

The projection: SB-480 is 480 questions, 560 prompts with MT-bench's second turns, each capped at
1,024 output tokens (an upper bound: answers that end sooner take fewer rounds). A configuration
takes tokens / MAT rounds (MAT from the paper's Table 2; slm-alone one token a pass), each with its
SLM tree passes and MTP steps, plus the prompt's prefill in chunks of the prefill graph's rows (the
SLM sees at most convert.max_prompt tokens; `--prompt-tokens` is the mean prompt assumed). The
verifier's passes are not in it: they run on the server's GPU (bench/bench_verifier.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

GRAPHS = {"tree": "tree.qdq.onnx", "prefill": "prefill.qdq.onnx", "mtp_step": "mtp_step.qdq.onnx"}
PROMPTS, QUESTIONS, CAP = 560, 480, 1024  # SB-480 with MT-bench's 80 second turns; the paper's cap
# configuration: (SLM tree passes a round, MTP steps a round on the phone, MAT). MATs: the paper's
# Table 2 (SB-480); hyco-server-head's head runs on the server, so its phone does no MTP step.
CONFIGS = {"hyco": (1, 4, 4.71), "hyco-exact": (1, 4, 3.84), "hyco-2p": (2, 4, 5.27), "specedge": (4, 0, 3.53),
           "specedge-eps": (4, 0, 4.13), "specedge-pd": (6, 0, 3.69), "cloud-mtp": (0, 0, 3.05),
           "hyco-server-head": (1, 0, 4.71), "slm-alone": (1, 0, 1.0)}


def example_feeds(spec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Feeds of the graph's input shapes and dtypes: codes across their range, floats near 0."""
    feeds = {}
    for t in spec.inputs:
        x = spec.input(t.name).zeros()
        if np.issubdtype(x.dtype, np.integer):
            info = np.iinfo(x.dtype)
            x = rng.integers(max(info.min, -128), min(info.max, 255) + 1, size=x.shape).astype(x.dtype)
        else:
            x = rng.normal(0, 0.1, size=x.shape).astype(x.dtype)
        feeds[t.name] = x
    return feeds


def open_graph(path: Path, executor: str, shared: dict):
    """A session as check opens it: onnxruntime CPU (optimisations off, or on for timing only), or
    the torch executor (hyco/quant/qdq_torch.py) on a device, a CUDA graph replayed on a GPU."""
    if executor.startswith("onnxruntime"):
        from hyco.qnn.ort import ort_session

        return ort_session(path, optimize=executor.endswith("+opt"))
    from hyco.quant.qdq_torch import TorchGraph

    device = executor.split(":", 1)[1]
    return TorchGraph(path, device=device, shared=shared, cuda_graph=device.startswith("cuda"))


def time_graph(path: Path, spec, *, executor: str, passes: int, shared: dict) -> dict:
    """One graph's median pass (every core of this machine)."""
    import torch

    start = time.perf_counter()
    session = open_graph(path, executor, shared)
    load_s = time.perf_counter() - start
    feeds = example_feeds(spec, np.random.default_rng(0))
    names = [t.name for t in spec.outputs]
    session.run(names, feeds)  # warm-up: the arena and the packed weights (a CUDA graph's capture)
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        session.run(names, feeds)  # outputs come back to the host: the time includes the copy
        times.append(time.perf_counter() - start)
    out = {"load_s": round(load_s, 2), "median_ms": round(1e3 * statistics.median(times), 2),
           "min_ms": round(1e3 * min(times), 2), "passes": passes}
    if executor.startswith("torch"):
        ops = session.ops_per_pass(feeds)
        out["aten_ops"] = sum(ops.values())  # on a GPU, kernel launches a pass
    if executor.startswith("torch:cuda"):
        out["cuda_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def project(ms: dict[str, float], prefill_rows: int, max_prompt: int, prompt_tokens: int) -> dict[str, dict]:
    """Hours of an SB-480 check's drafter passes per configuration, from per-pass milliseconds
    (`ms` without "prefill": a tree-only SLM, whose tree graph prefills in passes of its rows)."""
    prefill_chunks = math.ceil(min(prompt_tokens, max_prompt) / prefill_rows)
    prefill_pass = ms.get("prefill", ms["tree"])
    out = {}
    for name, (slm, mtp, mat) in CONFIGS.items():
        rounds = PROMPTS * CAP / mat
        per_round_ms = slm * ms["tree"] + mtp * ms["mtp_step"]
        prefill_ms = PROMPTS * prefill_chunks * prefill_pass if slm else 0.0
        out[name] = {"rounds": round(rounds), "per_round_ms": round(per_round_ms, 1),
                     "hours": round((rounds * per_round_ms + prefill_ms) / 3.6e6, 2)}
    return out


def main() -> None:
    from hyco.npu.io_spec import read_io_spec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", type=Path, required=True, help="a calibrate stage's folder")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=300, help="mean prompt length assumed for prefill")
    parser.add_argument("--max-prompt", type=int, default=1024, help="convert.max_prompt")
    parser.add_argument("--executors", default="onnxruntime,onnxruntime+opt,torch:cpu",
                        help="comma-separated: onnxruntime (as check runs it), onnxruntime+opt (timing only), "
                             "torch:cpu, torch:cuda")
    parser.add_argument("--out", type=Path, help="JSON report (default: print only)")
    args = parser.parse_args()
    specs = read_io_spec(args.calibrate / "io_spec.json")
    graphs = {g: n for g, n in GRAPHS.items() if n in specs}  # no prefill graph: calibrated tree-only
    rows, timings = {}, {}
    executors = args.executors.split(",")
    for executor in executors:
        shared: dict = {}  # the torch executor's tree and prefill share their folded weights
        for graph, name in graphs.items():
            t = time_graph(args.calibrate / name, specs[name], executor=executor, passes=args.passes, shared=shared)
            timings[f"{graph}@{executor}"] = t
            ops = f", {t['aten_ops']:,} ATen ops a pass" if "aten_ops" in t else ""
            print(f"{graph:9s} {executor:16s}: median {t['median_ms']:9.1f} ms (min {t['min_ms']:.1f}), "
                  f"open {t['load_s']:.1f} s{ops}", flush=True)
        del shared
    prefill_rows = specs[graphs.get("prefill", GRAPHS["tree"])].meta["rows"]
    for executor in executors:
        ms = {g: timings[f"{g}@{executor}"]["median_ms"] for g in graphs}
        rows[executor] = project(ms, prefill_rows, args.max_prompt, args.prompt_tokens)
    print(f"\nSB-480 ({PROMPTS} prompts x at most {CAP} tokens; paper MATs), drafter-pass hours on this machine (the verifier not included):")
    for tag, table in rows.items():
        print(f"  {tag}: " + ", ".join(f"{n} {v['hours']:.1f} h" for n, v in table.items())
              + f"; all {sum(v['hours'] for v in table.values()):.1f} h")
    report = {"calibrate": str(args.calibrate), "timings": timings, "prefill_rows": prefill_rows,
              "prompt_tokens_assumed": args.prompt_tokens, "projection": rows, "configs": CONFIGS}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
