"""The server's side of the timing model, measured on whatever runs the verifier.

A sweep times the verifier's tree pass T_verify(rows, context) at the row counts the
configurations pad to (`row_buckets`) and at several context lengths, the server-side MTP head's
step T_head, and the prompt prefill T_prefill(length), each as the check runs them
(`CachedTreeModel.forward_tree`, `MtpChainTorch.propose`, `ReferenceVerifier.prefill`). On CUDA:
CUDA events around each call after warm-up, medians; on a CPU: wall time, and every figure made
from it is labelled "CPU, not a server GPU". A sweep is cached under HYCO_CACHE (default
~/.cache/hyco-convert) by the verifier's and head's files, the device, the dtype, the library
versions and the grid, so a second check on the same server reads it back.

Lookups: a round's rows are padded up to the next measured bucket (the fixed row counts a server
captures as CUDA graphs); contexts are interpolated linearly between measured lengths (and
extrapolated from the last two beyond them); prefill is the least-squares line a + b length.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hyco.artifacts import fingerprint, write_json

CPU_LABEL = "CPU, not a server GPU"


@dataclass(frozen=True)
class Grid:
    rows: tuple[int, ...] = (1, 5, 9, 17, 33)
    contexts: tuple[int, ...] = (64, 256, 1024)
    prefill: tuple[int, ...] = (32, 128, 512)
    head_steps: int = 4  # K: one chain's steps, timed together and divided
    repeats: int = 5
    warmup: int = 2


@dataclass
class ServerTimes:
    """Milliseconds. verify[(rows, context)], prefill[length], head_step; with where they came from."""

    device: str
    source: str  # "CUDA events" or CPU_LABEL
    verify: dict[tuple[int, int], float]
    prefill: dict[int, float]
    head_step: float | None
    spread: dict[str, float] = field(default_factory=dict)  # per figure: (p90 - p10) / median of its repeats
    cached: bool = False

    def verify_ms(self, rows: int, context: int) -> float:
        buckets = sorted({r for r, _ in self.verify})
        index = bisect_left(buckets, rows)
        if index == len(buckets):  # beyond the largest bucket: scale its time by the rows
            return self._at_context(buckets[-1], context) * rows / buckets[-1]
        return self._at_context(buckets[index], context)

    def _at_context(self, rows: int, context: int) -> float:
        points = sorted((c, ms) for (r, c), ms in self.verify.items() if r == rows)
        return _interpolate(points, context)

    def prefill_ms(self, length: int) -> float:
        a, b = self.prefill_line()
        return a + b * length

    def prefill_line(self) -> tuple[float, float]:
        """Least squares ms = a + b length over the measured lengths."""
        xs, ys = zip(*sorted(self.prefill.items()), strict=True)
        if len(xs) == 1:
            return 0.0, ys[0] / xs[0]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        return my - b * mx, b

    def to_json(self) -> dict:
        out = asdict(self)
        out["verify"] = [[r, c, ms] for (r, c), ms in sorted(self.verify.items())]
        out["prefill"] = [[n, ms] for n, ms in sorted(self.prefill.items())]
        return out

    @classmethod
    def from_json(cls, data: dict) -> ServerTimes:
        data = dict(data)
        data["verify"] = {(int(r), int(c)): float(ms) for r, c, ms in data["verify"]}
        data["prefill"] = {int(n): float(ms) for n, ms in data["prefill"]}
        return cls(**data)


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    if len(points) == 1:
        return points[0][1]
    index = min(max(bisect_left([p[0] for p in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[index - 1], points[index]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index or 0} {torch.cuda.get_device_name(device)}"
    return " ".join(filter(None, ["cpu", platform.machine(), platform.processor(), f"x{torch.get_num_threads()} threads"]))


def cache_key(model_dirs: list[Path], device: str, dtype: str, grid: Grid) -> str:
    """The models' files (names, sizes, mtimes), the device, dtype, library versions and grid."""
    import transformers

    parts = [device, dtype, torch.__version__, transformers.__version__, json.dumps(asdict(grid)),
             *(fingerprint(Path(d)) for d in model_dirs)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def cache_dir() -> Path:
    return Path(os.environ.get("HYCO_CACHE", Path.home() / ".cache" / "hyco-convert")) / "server-timing"


class Stopwatch:
    """Milliseconds of one call: CUDA events on a GPU (the stream's time, after the call's own
    synchronisation), wall time on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)


def _median(watch: Stopwatch, fn, grid: Grid, spread: dict, key: str) -> float:
    for _ in range(grid.warmup):
        fn()
    times = sorted(watch.time(fn) for _ in range(grid.repeats))
    median = statistics.median(times)
    lo, hi = times[int(0.1 * (len(times) - 1))], times[int(round(0.9 * (len(times) - 1)))]
    spread[key] = round((hi - lo) / median, 4) if median > 0 else 0.0
    return median


def measure(verifier_model, head, grid: Grid, *, vocab: int, seed: int = 0) -> ServerTimes:
    """Run the sweep on the verifier's own device (and the head's, when there is one)."""
    from hyco.runtime.drafters import MtpChainTorch
    from hyco.runtime.tree_pass import CachedTreeModel
    from hyco.runtime.verifier import ReferenceVerifier, Sampling

    device = next(verifier_model.parameters()).device
    watch = Stopwatch(device)
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    spread: dict[str, float] = {}
    verify, prefill = {}, {}
    with torch.inference_mode():
        for context in grid.contexts:
            runner = CachedTreeModel(verifier_model)
            runner.prefill(tokens(context))
            for rows in grid.rows:
                tree, parents = tokens(rows), [-1] + [(i - 1) // 2 for i in range(1, rows)]  # a binary tree

                def one_pass(tree=tree, parents=parents, runner=runner):
                    runner.forward_tree(tree, parents)
                    runner.commit([])
                verify[(rows, context)] = _median(watch, one_pass, grid, spread, f"verify {rows}x{context}")
        for length in grid.prefill:
            prompt = tokens(length)
            prefill[length] = _median(watch, lambda prompt=prompt: CachedTreeModel(verifier_model).prefill(prompt),
                                      grid, spread, f"prefill {length}")
        head_step = None
        if head is not None:
            verifier = ReferenceVerifier(verifier_model, Sampling(), window=None)
            chain = MtpChainTorch(head, verifier_model, keep_ids=None, window=None, quantize_wire=False)
            chain.receive(verifier.prefill(tokens(grid.contexts[-1]), g).handoff)
            steps = grid.head_steps
            head_step = _median(watch, lambda: chain.propose(steps, topk=2), grid, spread, "head chain") / steps
    source = "CUDA events" if device.type == "cuda" else CPU_LABEL
    return ServerTimes(device_name(device), source, verify, prefill, head_step, spread)


def server_times(verifier_model, head, grid: Grid, *, vocab: int, model_dirs: list[Path], dtype: str) -> ServerTimes:
    """The sweep for this verifier (and head) on this device, from the cache when it was run before."""
    device = next(verifier_model.parameters()).device
    path = cache_dir() / f"{cache_key(model_dirs, device_name(device), dtype, grid)}.json"
    if path.is_file():
        times = ServerTimes.from_json(json.loads(path.read_text()))
        times.cached = True
        return times
    times = measure(verifier_model, head, grid, vocab=vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, times.to_json())
    return times
