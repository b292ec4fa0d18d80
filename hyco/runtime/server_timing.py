"""The server's side of the timing model, measured on whatever runs the verifier.

A sweep times the verifier's tree pass T_verify(rows, context) at the row counts the
configurations pad to (check.py: 1, K + 1, 9, 17, budget + 1) and at several context lengths, the
server-side MTP head's step T_head (`StaticHeadChain`: K greedy steps on the device, as a server
runs its head), and the prompt prefill T_prefill(length). Verify and prefill run on transformers'
StaticCache (`StaticVerifyPass`, `prefill_static`), as a serving stack's cache holds keys: fixed
shapes, a sliding layer attending over its window only (the check's own DynamicCache keeps every
key so it can roll back, and would time a sliding layer over the whole context). On CUDA each
verify shape, and the head's K steps, are one captured CUDA graph, replayed, as the paper's server
runs its fixed row counts; CUDA events around each call after warm-up, medians. On a CPU: wall
time, and every figure made from it is labelled "CPU, not a server GPU". A sweep is cached under
HYCO_CACHE (default ~/.cache/hyco-convert) by the verifier's and head's files, the device, the
dtype, the library versions and the grid, so a second check on the same server reads it back.

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

from hyco.base.files import fingerprint, write_json
from hyco.npu.handoff import input_device
from hyco.quant.cuda_graphs import capture, refusal
from hyco.runtime.mtp import fill_on_device, shared_kv

CPU_LABEL = "CPU, not a server GPU"


@dataclass(frozen=True)
class Grid:
    rows: tuple[int, ...] = (1, 5, 9, 17, 33)
    contexts: tuple[int, ...] = (64, 256, 1024)
    prefill: tuple[int, ...] = (32, 128, 512)
    head_steps: int = 4  # K: one chain's steps, timed together and divided
    repeats: int = 5
    warmup: int = 2
    cuda_graphs: bool = True  # on CUDA, replay each verify shape as one captured graph


@dataclass
class ServerTimes:
    """Milliseconds. verify[(rows, context)], prefill[length], head_step; with where they came from."""

    device: str
    source: str  # CUDA events (CUDA graphs replayed, or eager and why) or CPU_LABEL
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

    def time(self, fn, before=None) -> float:
        """`before` runs first, outside the timed span (a replay's reset)."""
        if before is not None:
            before()
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


def _median(watch: Stopwatch, fn, grid: Grid, spread: dict, key: str, before=None) -> float:
    for _ in range(grid.warmup):
        watch.time(fn, before)
    times = sorted(watch.time(fn, before) for _ in range(grid.repeats))
    median = statistics.median(times)
    lo, hi = times[int(0.1 * (len(times) - 1))], times[int(round(0.9 * (len(times) - 1)))]
    spread[key] = round((hi - lo) / median, 4) if median > 0 else 0.0
    return median


def prefill_static(model, cache, ids: list[int], chunk: int = 512) -> None:
    """Commit `ids` to a StaticCache in chunks of `chunk` rows, keeping only the last row's logits
    (a 32K prompt's full logits would be 34 GB at Gemma's vocabulary)."""
    device = input_device(model)
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            model(input_ids=torch.tensor([piece], device=device), cache=cache, use_cache=True,
                  position_ids=torch.arange(start, start + len(piece), device=device)[None], logits_to_keep=1)


class StaticVerifyPass:
    """One verifier pass of len(rows) rows after a context, on transformers' StaticCache: the
    fixed-shape pass a server captures as a CUDA graph. Full layers attend over the context and
    the rows, sliding layers over their window, as a serving stack's cache does; the check's own
    DynamicCache keeps every key for rollback, which would time sliding layers over the whole
    context. The rows run as a chain under transformers' causal mask: a tree's mask has the same
    shape, so the same cost. `reset()` puts the cache back as the context left it (the lengths,
    and the keys a full sliding window shifted), so every `run()` repeats the same pass."""

    def __init__(self, model, context_ids: list[int], rows: list[int], chunk: int = 512):
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        self.model = model.eval()
        device = input_device(model)
        context = len(context_ids)
        self.cache = StaticCache(config=model.config, max_cache_len=context + len(rows))
        prefill_static(model, self.cache, context_ids, chunk)
        self.inputs = {"input_ids": torch.tensor([rows], device=device),
                       "position_ids": torch.arange(context, context + len(rows), device=device)[None]}
        self.saved = []
        for layer in self.cache.layers:
            if not (isinstance(layer, StaticLayer) and layer.is_initialized):  # a KV-shared layer reads its owner's
                continue
            length = getattr(layer, "cumulative_length_int", None)
            shifts = length is not None and length + len(rows) > layer.max_cache_len
            kv = (layer.keys.clone(), layer.values.clone()) if shifts else None
            self.saved.append((layer, layer.cumulative_length.clone(), length, kv))

    @torch.inference_mode()
    def reset(self) -> None:
        for layer, length, length_int, kv in self.saved:
            layer.cumulative_length.copy_(length)
            if length_int is not None:
                layer.cumulative_length_int = length_int
            if kv is not None:
                layer.keys.copy_(kv[0])
                layer.values.copy_(kv[1])

    def run(self) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(**self.inputs, cache=self.cache, use_cache=True).logits


class StaticHeadChain:
    """K greedy steps of the MTP head where the server runs it (Cloud+MTP, hyco-server-head), on
    the device alone: the hand-off's K/V placed there once, each step's argmax and the verifier's
    scaled embedding of it feeding the next step, as `draft_chain` drafts them (its head_step,
    transformers' call, at the burst's one position). The check's own chain copies the K/V to the
    device at every step and returns each step's top-k to the host; a server's head reads the
    verifier's cache where it lies. Nothing here leaves the device, so the K steps capture as one
    CUDA graph. `reset()` has nothing to undo: no step writes a cache."""

    def __init__(self, head, verifier, start, steps: int):
        self.head, self.verifier, self.steps = head.eval(), verifier, steps
        device, dtype = head.pre_projection.weight.device, head.pre_projection.weight.dtype
        self.kv = shared_kv(start.kv, device, dtype)
        self.position = torch.tensor([[start.position]], device=device)
        self.embed, self.hidden = start.embed.to(device, dtype), start.hidden.to(device, dtype)

    def reset(self) -> None:
        pass

    def run(self) -> torch.Tensor:
        """The K greedy tokens, on the device."""
        embedding, where = self.verifier.get_input_embeddings(), input_device(self.verifier)
        embed, hidden, tokens = self.embed, self.hidden, []
        with torch.inference_mode(), fill_on_device(self.head):
            for _ in range(self.steps):
                # no padding mask: head_step's is all ones, the same masks, and transformers reads a
                # given one back to the host to see whether it may skip it
                out = self.head(inputs_embeds=torch.cat([embed, hidden], -1).reshape(1, 1, -1), attention_mask=None,
                                position_ids=self.position, shared_kv_states=self.kv, use_cache=False)
                # the unscored tokens of a centroid-masked head sit below its best: the argmax is the scored one's
                token = out.logits[0, -1].argmax()
                tokens.append(token)
                # embed_tokens' call: an offloaded table's hook takes its ids where input_device says
                embed = embedding(token.reshape(1, 1).to(where))[0, 0].to(embed.device, embed.dtype)
                hidden = out.last_hidden_state[0, -1]
        return torch.stack(tokens)


def captured(static: StaticVerifyPass | StaticHeadChain):
    """static.run as one CUDA graph (two warm-ups, each after a reset). Returns the replay and the
    output buffer every replay writes."""
    graph, output = capture(static.run, static.reset, warmups=2)
    return graph.replay, output


class CaptureFailed(Exception):
    """A pass that CUDA graph capture refused; the message says how."""


def _runner(static: StaticVerifyPass | StaticHeadChain, graphs: bool):
    if not graphs:
        return static.run
    try:
        return captured(static)[0]
    except RuntimeError as error:
        torch.cuda.synchronize()
        raise CaptureFailed(refusal(error)) from error


def measure(verifier_model, head, grid: Grid, *, vocab: int, seed: int = 0) -> ServerTimes:
    """Run the sweep on the verifier's own device (and the head's, when there is one). Where a
    verify shape or the head's chain cannot be captured as a CUDA graph (a model with host syncs, a
    device map over several GPUs), the whole sweep is timed eager instead, and the source says why."""
    device = next(verifier_model.parameters()).device
    if device.type != "cuda":
        return _sweep(verifier_model, head, grid, vocab, seed, device, graphs=False, source=CPU_LABEL)
    if grid.cuda_graphs:
        try:
            return _sweep(verifier_model, head, grid, vocab, seed, device, graphs=True,
                          source="CUDA events, CUDA graphs replayed")
        except CaptureFailed as why:
            return _sweep(verifier_model, head, grid, vocab, seed, device, graphs=False,
                          source=f"CUDA events, eager (CUDA graph capture failed: {why})")
    return _sweep(verifier_model, head, grid, vocab, seed, device, graphs=False, source="CUDA events, eager")


def _sweep(verifier_model, head, grid: Grid, vocab: int, seed: int, device: torch.device, *, graphs: bool,
           source: str) -> ServerTimes:
    from transformers import StaticCache

    from hyco.runtime.drafters import HandoffWindow
    from hyco.runtime.verifier import ReferenceVerifier, Sampling

    watch = Stopwatch(device)
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    spread: dict[str, float] = {}
    verify, prefill = {}, {}
    for context in grid.contexts:
        context_ids = tokens(context)
        for rows in grid.rows:
            static = StaticVerifyPass(verifier_model, context_ids, tokens(rows))
            verify[(rows, context)] = _median(watch, _runner(static, graphs), grid, spread, f"verify {rows}x{context}",
                                              before=static.reset)
            del static  # and its graph: one shape's buffers at a time
    for length in grid.prefill:
        prompt, holder = tokens(length), {}

        def fresh_cache(holder=holder, n=length):  # outside the timed span; its buffers are zeroed on
            holder["cache"] = StaticCache(config=verifier_model.config, max_cache_len=n)  # first use: a memset

        prefill[length] = _median(watch, lambda prompt=prompt, holder=holder: prefill_static(verifier_model, holder["cache"], prompt),
                                  grid, spread, f"prefill {length}", before=fresh_cache)
    head_step = None
    if head is not None:
        window = HandoffWindow(window=None, quantize_wire=False)  # the server's head sees the whole prefix
        with torch.inference_mode():
            window.receive(ReferenceVerifier(verifier_model, Sampling(), window=None).prefill(tokens(grid.contexts[-1]), g).handoff)
        chain = StaticHeadChain(head, verifier_model, window.step_input(), grid.head_steps)
        head_step = _median(watch, _runner(chain, graphs), grid, spread, "head chain") / grid.head_steps
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
