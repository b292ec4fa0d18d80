"""The `qnn` drafter backend: both drafters through an export bundle's QNN context binaries on the
QNN HTP backend (the x86 simulator on a workstation, the NPU on a Snapdragon host).

Same drafters as the onnxruntime backend (`SlmOnnx`, `MtpChainOnnx`: host-side LUTs, rotary,
rings and masks from the bundle), with sessions opened from bundle.json: a split graph's parts
are chained. HTP results were seen to leak between sessions in one process on the simulator
(platform notes), so by default every context runs in its own worker process and the drafters
talk to it over a pipe (`WorkerSession`); the same class opens the bundle's QDQ reference graphs
on onnxruntime CPU for the smoke test's comparison.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyco.base.errors import HycoError
from hyco.base.loading import read_json
from hyco.npu.io_spec import GRAPHS, GraphSpec, read_io_spec
from hyco.quant.grids import clamp_to_grid
from hyco.runtime.mtp_onnx import MtpChainOnnx
from hyco.runtime.slm_onnx import SlmOnnx

PRESTART_MAX_BYTES = 256 * 1024**2  # context bytes of a bundle whose HTP workers may load side by side

SPEC_KEYS = GRAPHS  # role -> io_spec key (calibrate's file names)


def _open(path: str, backend: str, soc_model: int):
    if backend == "qnn":
        from hyco.qnn.contexts import open_context

        return open_context(Path(path), soc_model=soc_model)
    from hyco.qnn.ort import ort_session

    return ort_session(Path(path))


def _serve(conn, path: str, backend: str, soc_model: int) -> None:
    """Worker loop: open one graph, then answer ("run", names, feeds) until ("close",)."""
    try:
        start = time.perf_counter()
        session = _open(path, backend, soc_model)
        conn.send(("ready", time.perf_counter() - start))
    except Exception as e:  # reported to the parent, which raises it as a HycoError
        conn.send(("error", str(e)))
        return
    while True:
        message = conn.recv()
        if message[0] == "close":
            return
        _, names, feeds = message
        try:
            start = time.perf_counter()
            out = session.run(names, feeds)
            conn.send(("ok", out, time.perf_counter() - start))
        except Exception as e:
            conn.send(("error", str(e)))


class GraphSession:
    """One graph (context binary or reference QDQ graph) behind `run(names, feeds)`, in this
    process or in a worker; records load time and per-pass times."""

    def __init__(self, path: Path, *, backend: str, soc_model: int, isolate: bool, opener=None, wait: bool = True):
        """`opener(path)`: opens the graph in this process instead of `_open` (the torch executor).
        `wait` False (isolated only): the worker starts loading and `ready()` waits for it, so
        several workers load at once."""
        self.path, self.backend = Path(path), backend
        self.pass_s: list[float] = []
        self.process = None
        self.load_s: float | None = None
        if opener is not None:
            start = time.perf_counter()
            self.session = opener(self.path)
            self.load_s = time.perf_counter() - start
        elif isolate:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.process = ctx.Process(target=_serve, args=(child, str(path), backend, soc_model), daemon=True)
            self.process.start()
            if wait:
                self.ready()
        else:
            start = time.perf_counter()
            self.session = _open(str(path), backend, soc_model)
            self.load_s = time.perf_counter() - start

    def ready(self) -> GraphSession:
        """An isolated worker's graph loaded (its load time read), or its error raised."""
        if self.process is not None and self.load_s is None:
            reply = self.conn.recv()
            if reply[0] == "error":
                self.close()
                raise HycoError(reply[1])
            self.load_s = reply[1]
        return self

    def run(self, names, feeds):
        self.ready()
        if self.process is None:
            start = time.perf_counter()
            out = self.session.run(names, feeds)
            self.pass_s.append(time.perf_counter() - start)
            return out
        self.conn.send(("run", list(names), feeds))
        reply = self.conn.recv()
        if reply[0] == "error":
            raise HycoError(f"{self.path}: {reply[1]}")
        self.pass_s.append(reply[2])
        return reply[1]

    def close(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.conn.send(("close",))
            self.process.join(timeout=10)
        self.process = None


def float_view(spec: GraphSpec) -> GraphSpec:
    """The graph as the host drivers see it: integer-code I/O (calibrate's uint8 KV) as float32."""
    view = lambda ts: tuple(replace(t, dtype="float32") if t.takes_codes else t for t in ts)
    return replace(spec, inputs=view(spec.inputs), outputs=view(spec.outputs))


class CodesSession:
    """Quantizes float feeds to the graph's integer-code inputs and dequantizes its code outputs,
    on io_spec's grids (value = scale * (code - zero_point)): the host keeps float rings, and a
    value taken from a code output goes back to the same code."""

    def __init__(self, session, spec: GraphSpec):
        self.session = session
        self.inputs = {t.name: t for t in spec.inputs if t.takes_codes}
        self.outputs = {t.name: t for t in spec.outputs if t.takes_codes}
        self.clamped = {t.name: t.quant for t in spec.inputs if t.quant is not None and not t.takes_codes}

    def run(self, names, feeds):
        feeds = dict(feeds)
        for name, quant in self.clamped.items():  # the HTP wraps a float input beyond its grid
            feeds[name] = clamp_to_grid(feeds[name], quant)
        for name, t in self.inputs.items():
            feeds[name] = t.to_codes(feeds[name])
        out = self.session.run(names, feeds)
        return [self.outputs[name].from_codes(o) if name in self.outputs else o for name, o in zip(names, out, strict=True)]


class BundleSessions:
    """Opens a bundle's graphs once and hands them to every drafter built on the bundle (the
    check builds one drafter per prompt; the sessions are stateless, the rings live on the host)."""

    def __init__(self, bundle: Path, *, backend: str = "qnn", isolate: bool = True, device: str = "auto"):
        """backend: `qnn` (the context binaries), `cpu` (the reference QDQ graphs on onnxruntime
        CPU) or `torch` (the same graphs through `hyco.quant.qdq_torch` on `device`)."""
        if backend not in ("qnn", "cpu", "torch"):
            raise HycoError(f"backend must be 'qnn', 'cpu' or 'torch', but got {backend!r}")
        self.bundle, self.backend, self.isolate = Path(bundle), backend, isolate
        self.device = device
        self.folded: dict = {}  # the torch executor's weights, shared by graphs that hold the same ones
        self.meta = read_json(self.bundle / "bundle.json", "bundle.json")
        self.specs = read_io_spec(self.bundle / "io_spec.json")
        self.graphs: dict[str, Any] = {}
        self.parts: dict[str, list[GraphSession]] = {}
        self._started: dict[str, list[GraphSession]] = {}  # isolated workers loading, not yet waited for

    def prestart(self) -> BundleSessions:
        """Every graph's isolated HTP workers started at once, to load side by side (each takes
        seconds to start); `open` then waits for the one it needs. Only for small bundles: the
        simulator holds several times a context's bytes while loading, so full-size contexts
        load one at a time to keep the peak memory of one."""
        contexts = sum((self.bundle / p["context"]).stat().st_size
                       for g in self.meta["graphs"].values() for p in g["parts"])
        if self.backend == "qnn" and self.isolate and contexts <= PRESTART_MAX_BYTES:
            for role in self.meta["graphs"]:
                if role not in self.parts and role not in self._started:
                    self._started[role] = self._start(role)
        return self

    def _start(self, role: str) -> list[GraphSession]:
        return [GraphSession(self.bundle / p["context"], backend="qnn", soc_model=self.meta["soc_model"],
                             isolate=self.isolate, wait=False) for p in self.meta["graphs"][role]["parts"]]

    def open(self, spec_key: str):
        role = next((r for r, k in SPEC_KEYS.items() if k == spec_key), None)
        if role is None or role not in self.meta["graphs"]:
            raise HycoError(f"{self.bundle / 'bundle.json'}: no graph for {spec_key!r}")
        if role not in self.graphs:
            g = self.meta["graphs"][role]
            if self.backend in ("cpu", "torch"):
                if not g.get("reference"):
                    raise HycoError(f"{self.bundle / 'bundle.json'}: the bundle ships no reference QDQ graph for "
                                    f"{role} (export.reference_graphs was off)")
                parts = [GraphSession(self.bundle / g["reference"], backend=self.backend, soc_model=0, isolate=False,
                                      opener=self._torch_graph if self.backend == "torch" else None)]
                self.graphs[role] = parts[0]
            else:
                parts = [part.ready() for part in self._started.pop(role, None) or self._start(role)]
                if len(parts) == 1:
                    self.graphs[role] = parts[0]
                else:
                    from hyco.qnn.contexts import ChainedSession

                    self.graphs[role] = ChainedSession([
                        (s, [t["name"] for t in p["io"]["inputs"]], [t["name"] for t in p["io"]["outputs"]])
                        for s, p in zip(parts, g["parts"], strict=True)])
            self.parts[role] = parts
            self.graphs[role] = CodesSession(self.graphs[role], self.specs[spec_key])
        return self.graphs[role]

    def _torch_graph(self, path: Path):
        from hyco.quant.qdq_torch import TorchGraph, torch_device

        device = torch_device(self.device)
        return TorchGraph(path, device=device, shared=self.folded, cuda_graph=device.type == "cuda")

    def modes(self) -> dict[str, str]:
        """How the torch executor ran each graph opened: replayed as a CUDA graph, or eager and why."""
        modes = {role: getattr(parts[0].session, "mode", None) for role, parts in self.parts.items()
                 if self.backend == "torch" and parts}
        return {role: mode for role, mode in modes.items() if mode}

    def timings(self) -> dict[str, dict[str, Any]]:
        out = {}
        for role, parts in self.parts.items():
            passes = [sum(t) for t in zip(*(p.pass_s for p in parts), strict=False)] if parts else []
            out[role] = {"load_s": round(sum(p.load_s for p in parts), 3), "passes": len(passes),
                         "pass_s_mean": round(float(np.mean(passes)), 4) if passes else None,
                         "pass_s_max": round(float(np.max(passes)), 4) if passes else None}
        return out

    def close(self) -> None:
        for parts in [*self.parts.values(), *self._started.values()]:
            for p in parts:
                p.close()
        self._started = {}


_SHARED: dict[tuple[str, str, bool, str], BundleSessions] = {}


def bundle_sessions(bundle: Path, *, backend: str = "qnn", isolate: bool = True, device: str = "auto") -> BundleSessions:
    key = (str(Path(bundle).resolve()), backend, isolate, device)
    if key not in _SHARED:
        _SHARED[key] = BundleSessions(bundle, backend=backend, isolate=isolate, device=device)
    return _SHARED[key]


def slm_qnn(bundle: Path, *, keep_ids: torch.Tensor | None, max_prompt: int, ring_full: int | None = None,
            sessions: BundleSessions | None = None) -> SlmOnnx:
    sessions = sessions or bundle_sessions(bundle)
    slm = SlmOnnx(bundle, keep_ids=keep_ids, max_prompt=max_prompt, ring_full=ring_full,
                  graphs=(SPEC_KEYS["tree"], SPEC_KEYS["prefill"]), open_session=sessions.open)
    slm.specs = {g: float_view(spec) for g, spec in slm.specs.items()}  # CodesSession I/O
    return slm


def mtp_qnn(bundle: Path, *, keep_ids: torch.Tensor | None, window: int, capture_point: str, quantize_wire: bool,
            sessions: BundleSessions | None = None) -> MtpChainOnnx:
    sessions = sessions or bundle_sessions(bundle)
    mtp = MtpChainOnnx(bundle, keep_ids=keep_ids, window=window, capture_point=capture_point,
                       quantize_wire=quantize_wire, graph=SPEC_KEYS["mtp_step"], spec_key=SPEC_KEYS["mtp_step"],
                       open_session=sessions.open)
    mtp.spec = float_view(mtp.spec)
    return mtp
