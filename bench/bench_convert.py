"""Peak memory of the convert stage on a mid-size QAT-format SLM (E2B's hidden width).

    .venv/bin/python bench/bench_convert.py [--hidden 1536] [--layers 6] [--work DIR]

Writes an E2B-shaped SLM checkpoint (hidden 1536, 8 heads x 256, per-layer width 256, half the
layers KV-shared with 2-bit double-wide MLPs, int2/4/8 mix, the tiny fixture tokenizer's 4,096
tokens) with the fixture writer (`hyco.fixtures.writer.write_slm`, a custom preset object, no
edit to hyco/fixtures), then runs the convert stage on it (parity off) in a fresh subprocess
and prints one table: checkpoint bytes (packed), graph + external-data bytes, wall time, peak
RSS, and peak RSS minus the RSS of a process that only imports what convert imports (torch,
onnx, transformers' Gemma 4 modeling and quantization code), as a
multiple of the packed checkpoint bytes and of the int8-unpacked integer weight bytes; then
the same with glibc's mmap threshold at 128 KiB, so freed blocks go back to the system and the
peak shows the bytes live at once rather than the allocator's retained free heap. The
child also samples its RSS per phase (load, static module, each export, each finalize,
bitexact) so the table says which phase sets the peak.

The checkpoint is kept in --work (default /tmp/hyco-bench-convert) and reused while its shapes
match. Default run: ~2-3 minutes on the 2-core development machine, first run included.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# --- the checkpoint ------------------------------------------------------------------------------


def slm_shape(hidden: int, layers: int):
    from hyco.fixtures.presets import SlmShape

    return SlmShape(hidden=hidden, intermediate=4 * hidden, num_layers=layers, full_period=3,
                    num_kv_shared_layers=layers // 2, heads=8, kv_heads=1, head_dim=256, global_head_dim=512,
                    per_layer_input=256, sliding_window=512)


def write_checkpoint(folder: Path, hidden: int, layers: int) -> Path:
    """The SLM through the fixture writer; calibration on random ids (the SRQ scales only
    need to be nonzero and in range here, not meaningful)."""
    import torch

    from hyco.fixtures import models
    from hyco.fixtures.cache import cached_family
    from hyco.fixtures.presets import PRESETS, Preset
    from hyco.fixtures.writer import copy_tokenizer, write_slm

    tiny = PRESETS["tiny"]
    shape = slm_shape(hidden, layers)
    stamp = folder / "bench_shape.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"hidden": hidden, "layers": layers}:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    preset = Preset(name=f"bench-{hidden}x{layers}", tokenizer=tiny.tokenizer, slm=shape,
                    verifier=tiny.verifier, assistant=tiny.assistant)
    tokenizer = cached_family("tiny", seed=0)["tokenizer"]
    config = models.slm_config(shape, tiny.tokenizer.vocab_size)
    calib = torch.randint(0, tiny.tokenizer.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    print(f"writing a {hidden}x{layers} checkpoint into {folder} (not timed) ...", flush=True)
    write_slm(folder, config, preset, models.random_source(0, "slm"), calib)
    copy_tokenizer(tokenizer, folder)
    stamp.write_text(json.dumps({"hidden": hidden, "layers": layers}))
    return folder


def checkpoint_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of all tensors as stored, bytes of the quantized linears' ints unpacked to int8),
    from the safetensors headers only (no torch in the parent: see `run_child`)."""
    from hyco.convert.load import module_bits, read_checkpoint

    ckpt = read_checkpoint(folder)
    packed = sum(os.path.getsize(p) for p in folder.glob("*.safetensors"))
    unpacked = 0
    for name, (_, shape, _) in ckpt.tensors.items():
        module = name[: -len(".weight")]
        if name.endswith(".weight") and f"{module}.weight_scale" in ckpt.tensors:
            rows, width = shape
            unpacked += rows * width * (8 // module_bits(module, ckpt.quant))
    return packed, unpacked


# --- the measured child --------------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PhaseSampler:
    """Samples RSS every 20 ms; `phase(name)` wraps a function to record the max during it."""

    def __init__(self):
        self.peak, self.phases, self.stop = 0.0, [], False
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.02)

    def phase(self, name, fn):
        def wrapped(*args, **kwargs):
            before = rss_mb()
            self.peak = before
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.phases.append({"phase": name, "rss_before_mb": round(before), "peak_mb": round(max(self.peak, rss_mb())),
                                "rss_after_mb": round(rss_mb()), "s": round(time.perf_counter() - start, 1)})
            self.peak = rss_mb()
            return result
        return wrapped


def child(checkpoint: Path, out: Path) -> None:
    import hyco.convert.export_onnx as export_onnx
    import hyco.convert.load as load
    import hyco.convert.rewrites as rewrites
    import hyco.convert.stage as stage
    import onnx  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from hyco.config.recipe import ConvertConfig

    sampler = PhaseSampler()
    load.load_model = sampler.phase("load (from_pretrained)", load.load_model)
    rewrites.build_static_model = sampler.phase("static module", rewrites.build_static_model)
    export_onnx.export_raw = sampler.phase("export (TorchScript)", export_onnx.export_raw)
    export_onnx.finalize = sampler.phase("finalize (INT4, opset 21)", export_onnx.finalize)
    stage.bitexact = sampler.phase("bitexact", stage.bitexact)
    start = time.perf_counter()
    stage.convert(checkpoint=checkpoint, out=out, config=ConvertConfig(parity=False, use_keep_set=False))
    wall = time.perf_counter() - start
    sampler.stop = True
    report = json.loads((out / "report.json").read_text())
    print(json.dumps({"wall_s": wall, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "sampled_peak_mb": max(p["peak_mb"] for p in sampler.phases),
                      "bitexact": report["bitexact_all_equal"], "graphs": report["graphs"],
                      "phases": sampler.phases}))


def baseline() -> None:
    """The code convert runs before it holds any weight: torch, onnx, and transformers' Gemma 4
    modeling and quantization modules (importing those alone costs ~220 MiB, most of what an
    earlier version of this bench reported as unexplained above the ints)."""
    import hyco.convert.stage  # noqa: F401
    import onnx  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import transformers.integrations.gemma_quant  # noqa: F401
    from transformers import Gemma4ForCausalLM  # noqa: F401

    print(json.dumps({"maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_child(*args: str, env: dict | None = None) -> dict:
    """A fresh interpreter per measurement. Linux carries a process's ru_maxrss across fork and
    exec, so the parent never imports torch: a child's peak must not start at the parent's."""
    result = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        sys.exit(f"child {args[:1]} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "hyco-bench-convert")
    parser.add_argument("--child", nargs=2, metavar=("CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write", metavar="CHECKPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(Path(args.child[0]), Path(args.child[1]))
    if args.baseline:
        return baseline()

    if args.write:
        write_checkpoint(Path(args.write), args.hidden, args.layers)
        return print(json.dumps({}))

    ckpt = args.work / f"slm-{args.hidden}x{args.layers}"
    run_child("--write", str(ckpt), "--hidden", str(args.hidden), "--layers", str(args.layers))
    packed, unpacked = checkpoint_bytes(ckpt)
    base = run_child("--baseline")["maxrss_mb"]
    out = args.work / "convert-out"
    shutil.rmtree(out, ignore_errors=True)
    run = run_child("--child", str(ckpt), str(out))
    # glibc keeps freed blocks under 32 MiB in its heap, so RSS also counts memory that is free
    # but not returned. With every block over 128 KiB mmap'd (returned on free), the peak is
    # what was live at once.
    shutil.rmtree(out, ignore_errors=True)
    live = run_child("--child", str(ckpt), str(out), env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    live_base = run_child("--baseline", env={"MALLOC_MMAP_THRESHOLD_": "131072"})["maxrss_mb"]
    live_extra = (live["maxrss_mb"] - live_base) * 2**20
    graph_bytes = sum(g["onnx_bytes"] + g["data_bytes"] for g in run["graphs"].values())
    extra = (run["maxrss_mb"] - base) * 2**20
    mb = lambda b: f"{b / 2**20:.0f} MiB"
    rows = [("checkpoint (packed safetensors)", mb(packed)),
            ("integer weights unpacked to int8", mb(unpacked)),
            ("graphs + external data (tree + prefill)", mb(graph_bytes)),
            ("convert wall time", f"{run['wall_s']:.1f} s"),
            ("peak RSS (ru_maxrss)", f"{run['maxrss_mb']:.0f} MiB (sampled every 20 ms: {run['sampled_peak_mb']:.0f})"),
            ("baseline RSS (import torch, onnx, transformers' Gemma 4)", f"{base:.0f} MiB"),
            ("peak - baseline", mb(extra)),
            ("  / packed checkpoint", f"{extra / packed:.2f} x"),
            ("  / int8-unpacked weights", f"{extra / unpacked:.2f} x"),
            ("peak - baseline, glibc mmap threshold 128 KiB", mb(live_extra)),
            ("  (live bytes) / int8-unpacked weights", f"{live_extra / unpacked:.2f} x"),
            ("  (live bytes) / packed checkpoint", f"{live_extra / packed:.2f} x"),
            ("bitexact.json all equal", f"{run['bitexact']} (mmap-threshold run: {live['bitexact']})")]
    print(f"\nconvert, hidden {args.hidden}, {args.layers} layers, parity off")
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print("\nphases (RSS MiB: before / peak during / after, seconds):")
    for title, r in (("default allocator", run), ("glibc mmap threshold 128 KiB", live)):
        print(f"  {title}:")
        for p in r["phases"]:
            print(f"    {p['phase']:<28} {p['rss_before_mb']:>6} / {p['peak_mb']:>6} / {p['rss_after_mb']:>6}  {p['s']:>6} s")


if __name__ == "__main__":
    main()
