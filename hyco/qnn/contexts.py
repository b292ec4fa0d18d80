"""onnxruntime-qnn 2.7 sessions on the QNN HTP backend: compile a QDQ graph offline into a QNN
context binary, and open one for running (the x86 simulator here, the NPU on a Snapdragon host).

Only the plugin-EP API reaches QNN (`providers=["QNNExecutionProvider"]` silently runs on the CPU
EP), so every session goes through `register_execution_provider_library` + `get_ep_devices` +
`add_provider_for_devices`. Every session disables CPU fallback and records the graph assignment,
which `check_assignment` reads: a node left on another EP fails with the op named.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError
from hyco.config.recipe import HTP_OPTIMIZATION_LEVELS

# soc_model -> (chip, Hexagon arch). QNN silently compiles for v68 when the arch is unknown, so a
# SoC outside this table is refused rather than guessed (platform notes: 43/57/69/87 were run).
SOCS: dict[int, tuple[str, int]] = {
    43: ("SM8550", 73),
    57: ("SM8650", 75),
    69: ("SM8750", 79),
    87: ("SM8850", 81),
}

_registered = False


def soc_info(soc_model: int, htp_arch: int | None = None) -> tuple[str, int]:
    """(chip, arch) for `soc_model`; a given `htp_arch` must be that SoC's."""
    if soc_model not in SOCS:
        known = ", ".join(f"{k} ({v[0]}, v{v[1]})" for k, v in SOCS.items())
        raise HycoError(f"export.soc_model must be one of {known}, but got {soc_model} (QNN would silently "
                        "fall back to Hexagon v68 for an arch it does not know)")
    chip, arch = SOCS[soc_model]
    if htp_arch is not None and htp_arch != arch:
        raise HycoError(f"export.htp_arch must be {arch} for soc_model {soc_model} ({chip}), but got {htp_arch}")
    return chip, arch


def settle_soc(chip: str) -> dict[str, Any]:
    """What the installed QNN libraries call `chip`: a one-node graph compiled with `soc_model` given
    as the chip's name (onnxruntime-qnn's own name table, `SocModelFromName` in
    libonnxruntime_providers_qnn.so) and read back from its context binary through libQnnSystem.so
    (socModel, and the context metadata's dspArch). Sources disagree on SM8850's number (87 or 88);
    the libraries that build and load the binaries decide, and this asks them."""
    import tempfile

    import onnx
    import onnxruntime as ort
    import onnxruntime_qnn
    from onnx import TensorProto, helper

    from hyco.qnn.system import binary_info

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "soc_probe", [x], [y])
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "probe.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), model)
        so = ort.SessionOptions()
        so.log_severity_level = 4
        for k, v in {"ep.context_enable": "1", "ep.context_file_path": str(Path(tmp) / "probe_ctx.onnx"),
                     "ep.context_embed_mode": "0", "session.disable_cpu_ep_fallback": "1"}.items():
            so.add_session_config_entry(k, v)
        so.add_provider_for_devices(qnn_devices(), {"backend_path": onnxruntime_qnn.get_qnn_htp_path(),
                                                    "soc_model": chip, **prepare_options(0)})
        try:
            ort.InferenceSession(str(model), sess_options=so)
        except Exception as e:  # onnxruntime's own types; the cause is in the text
            raise HycoError(f"the installed QNN libraries do not know the chip {chip!r} ({str(e).splitlines()[0][:160]})") from None
        info = binary_info(next(Path(tmp).glob("*.bin")))
    if not info["soc_model"]:  # a name outside its table compiles anyway, for socModel 0
        raise HycoError(f"the installed QNN libraries do not know the chip {chip!r} (a probe built for it reads back "
                        "as socModel 0)")
    return {"chip": chip, "soc_model": info["soc_model"], "htp_arch": info["htp_arch"], "qnn_build": info["build_id"],
            "how": f"a probe graph compiled with soc_model {chip!r} (onnxruntime-qnn's chip-name table, "
                   "libonnxruntime_providers_qnn.so) reads back through libQnnSystem.so as socModel "
                   f"{info['soc_model']}, dspArch {info['htp_arch']}"}


def qnn_devices():
    import onnxruntime as ort
    import onnxruntime_qnn

    global _registered
    if not _registered:
        ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
        _registered = True
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devices:
        raise HycoError("onnxruntime-qnn registered no QNNExecutionProvider device (is onnxruntime-qnn installed?)")
    return devices


def session_options(soc_model: int, *, extra: dict[str, str] | None = None, provider: dict[str, str] | None = None,
                    fallback: bool = False):
    import onnxruntime as ort
    import onnxruntime_qnn

    so = ort.SessionOptions()
    so.log_severity_level = 4  # a refused node is reported through check_assignment, not the C++ log
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "0" if fallback else "1")
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    for k, v in (extra or {}).items():
        so.add_session_config_entry(k, v)
    soc_info(soc_model)  # refuse a SoC outside the table before QNN guesses an arch
    # soc_model alone selects the arch (87 -> v81); an `htp_arch` option QNN does not know would
    # silently fall back to v68, so it is never passed.
    options = {"backend_path": onnxruntime_qnn.get_qnn_htp_path(), "soc_model": str(soc_model), **(provider or {})}
    so.add_provider_for_devices(qnn_devices(), options)
    return so


def check_assignment(session, graph: Path) -> int:
    """Every node must sit on QNN; returns the node count. Names the first op that does not."""
    info = session.get_provider_graph_assignment_info()
    total, off = 0, []
    for sub in info:
        nodes = list(sub.get_nodes())
        total += len(nodes)
        if sub.ep_name != "QNNExecutionProvider":
            off += [f"{n.op_type} {n.name!r}" for n in nodes]
    if off:
        raise HycoError(f"{graph}: {len(off)} node(s) would fall back off the QNN HTP, first {off[0]}")
    return total


def _create(path: Path, so, what: str, soc_model: int):
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(path), sess_options=so)
    except Exception as e:  # onnxruntime raises its own exception types, all with the cause in the text
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "fallback to CPU EP has been explicitly disabled" in first:
            # Ask again with fallback allowed, only to learn which nodes QNN refused.
            probe = ort.InferenceSession(str(path), sess_options=session_options(soc_model, fallback=True))
            check_assignment(probe, path)
        raise HycoError(f"{path}: QNN HTP {what} failed ({first})") from None


@dataclass
class Compiled:
    context: Path  # the EPContext wrapper model (<name>_ctx.onnx)
    binary: Path  # the QNN context binary beside it
    compile_s: float
    nodes: int


def prepare_options(optimization_level: int) -> dict[str, str]:
    """QNN EP options of an offline compile. `optimization_level`: the HTP graph finalization's
    (0: QNN's default; 1 compiles faster into a less optimized graph, 3 is the slowest). On the
    E2B-shaped tree graph level 1 compiles much faster than the default into a binary of about the
    same size; level 2 is no faster than the default. What level 1 costs on the phone is not
    measured here (no device): the default is what ships."""
    if optimization_level not in HTP_OPTIMIZATION_LEVELS:
        raise HycoError(f"export.htp_optimization_level must be one of {HTP_OPTIMIZATION_LEVELS}, but got "
                        f"{optimization_level}")
    options = {"enable_htp_prepare_only": "1"}
    if optimization_level:
        options["htp_graph_finalization_optimization_mode"] = str(optimization_level)
    return options


def compile_context(graph: Path, out_dir: Path, name: str, soc_model: int, optimization_level: int = 0) -> Compiled:
    """QDQ graph -> `<out_dir>/<name>_ctx.onnx` + its QNN context binary (prepare only, nothing
    runs), at the HTP `optimization_level` (`prepare_options`). Written under a temp name in
    `out_dir` first, then moved into place."""
    provider = prepare_options(optimization_level)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{name}.compile"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    ctx = tmp / f"{name}_ctx.onnx"
    so = session_options(soc_model, extra={"ep.context_enable": "1", "ep.context_file_path": str(ctx),
                                           "ep.context_embed_mode": "0"},
                         provider=provider)
    start = time.perf_counter()
    try:
        session = _create(graph, so, "compile", soc_model)
        seconds = time.perf_counter() - start
        nodes = check_assignment(session, graph)
        del session
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no partial context left behind
        raise
    bins = sorted(tmp.glob("*.bin"))
    if not ctx.is_file() or len(bins) != 1:
        raise HycoError(f"{graph}: QNN compile wrote {[p.name for p in tmp.iterdir()]}, expected {ctx.name} and one .bin")
    binary = out_dir / bins[0].name
    for p in (bins[0], ctx):
        p.replace(out_dir / p.name)
    tmp.rmdir()
    return Compiled(out_dir / ctx.name, binary, round(seconds, 3), nodes)


def compile_isolated(graph: Path, out_dir: Path, name: str, *, soc_model: int, optimization_level: int = 0) -> Compiled:
    """`compile_context` in a fresh process (`hyco.base.workers`). The QNN compiler keeps memory after
    its session is gone (E2B-shaped tree: GBs still resident after its compile); each compile's
    memory goes with its process. Its peak, plus this process's RSS, counts in this process's
    peak figure; errors come back as raised in the child."""
    return compile_in_processes([(graph, name)], out_dir, soc_model=soc_model, optimization_level=optimization_level)[0]


def compile_in_processes(graphs: list[tuple[Path, str]], out_dir: Path, *, soc_model: int, optimization_level: int = 0,
                         at_once: int = 1) -> list[Compiled]:
    """Each (graph, name) through `compile_context`, each in a fresh process, `at_once` of them
    side by side: the QNN compiler is single-threaded, and a fresh process writes the same bytes
    whatever ran beside it."""
    from hyco.base.workers import in_processes

    return in_processes(compile_context, [(g, out_dir, name, soc_model, optimization_level) for g, name in graphs],
                        f"{graphs[0][0]}: compiling it" + (f" and {len(graphs) - 1} more" if len(graphs) > 1 else ""),
                        at_once=at_once)


def open_context(context: Path, *, soc_model: int):
    """An HTP session on a compiled EPContext model, CPU fallback off and assignment checked."""
    if not Path(context).is_file():
        raise HycoError(f"{context}: context model not found")
    session = _create(Path(context), session_options(soc_model), "load", soc_model)
    check_assignment(session, Path(context))
    return session


def compile_shared(graphs: list[tuple[Path, str]], out_dir: Path, *, soc_model: int,
                   optimization_level: int = 0) -> list[Compiled]:
    """Several QDQ graphs with the same weights -> one shared QNN context binary (one copy of the
    weights) and one EPContext wrapper each. The x86 simulator cannot load such a binary
    (platform notes), so nothing here proves it runs: the bundle labels it unverified."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / ".shared.compile"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    compiled = []
    try:
        for i, (graph, name) in enumerate(graphs):
            ctx = tmp / f"{name}_ctx.onnx"
            extra = {"ep.context_enable": "1", "ep.context_file_path": str(ctx), "ep.context_embed_mode": "0",
                     "ep.share_ep_contexts": "1"}
            if i == len(graphs) - 1:
                extra["ep.stop_share_ep_contexts"] = "1"  # the last session writes the one binary
            start = time.perf_counter()
            session = _create(graph, session_options(soc_model, extra=extra,
                                                     provider=prepare_options(optimization_level)),
                              "compile", soc_model)
            seconds = time.perf_counter() - start
            compiled.append((ctx, round(seconds, 3), check_assignment(session, graph)))
            del session
        bins = sorted(tmp.glob("*.bin"))
        if len(bins) != 1:
            raise HycoError(f"{graphs[0][0]}: shared QNN compile wrote {[p.name for p in tmp.iterdir()]}, expected one .bin")
        for p in [bins[0], *(c[0] for c in compiled)]:
            p.replace(out_dir / p.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [Compiled(out_dir / ctx.name, out_dir / bins[0].name, s, n) for ctx, s, n in compiled]


def compile_shared_isolated(graphs: list[tuple[Path, str]], out_dir: Path, *, soc_model: int,
                            optimization_level: int = 0) -> list[Compiled]:
    """`compile_shared` in a fresh process, for the reason `compile_isolated` gives: the QNN
    compiler's memory goes with the process, and the binary's bytes do not depend on the HTP
    sessions this process made before."""
    from functools import partial

    from hyco.base.workers import in_processes

    job = partial(compile_shared, soc_model=soc_model, optimization_level=optimization_level)
    return in_processes(job, [(graphs, out_dir)],
                        f"{graphs[0][0]}: compiling it with {len(graphs) - 1} more graph(s) into one shared context")[0]


class ChainedSession:
    """Runs a split graph's parts in order, feeding each the graph inputs and earlier parts'
    outputs it names; the same `run(names, feeds)` as one session."""

    def __init__(self, parts: list[tuple[object, list[str], list[str]]]):
        self.parts = parts  # (session, input names, output names)

    def run(self, names, feeds):
        env = dict(feeds)
        for session, inputs, outputs in self.parts:
            env.update(zip(outputs, session.run(outputs, {k: env[k] for k in inputs}), strict=True))
        return [env[n] for n in names]


def compile_and_run(model, folder: Path, soc_model: int, x) -> dict[str, Any]:
    """`model` compiled into a QNN context binary for `soc_model` (prepare only), then run once on
    the HTP (the x86 simulator here) on the array `x`: its output, the binary's bytes and the compile seconds."""
    import onnx

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "graph.onnx"
    onnx.save(model, str(path))
    compiled = compile_context(path, folder, "graph", soc_model)
    session = open_context(compiled.context, soc_model=soc_model)
    y = session.run(None, {"x": x})[0]
    return {"y": y, "binary_bytes": compiled.binary.stat().st_size, "compile_s": compiled.compile_s}
