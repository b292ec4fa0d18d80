"""HTP acceptance and simulator-vs-CPU agreement, one graph per process.

`check_in_subprocess(graph, feeds)` starts `python -m hyco.calibrate.htp` for one QDQ graph
(HTP results were seen to leak between sessions in one process): it opens the graph on the
onnxruntime-qnn plugin EP (HTP backend, soc_model 87, CPU fallback disabled, graph assignment
recorded), counts the nodes not assigned to QNN, and, given recorded feeds, runs each pass on
the HTP (the x86 simulator here) and on the CPU EP and compares top-k ids and log-probs
(`compare_passes`: the same rule as export's smoke test, held to the graph's quantization error).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hyco.quant.grids import clamp_to_grid

SOC_MODEL = "87"  # SM8850 / Hexagon v81


def qnn_available() -> str | None:
    """None when the QNN plugin EP can be loaded, else the reason."""
    try:
        import onnxruntime_qnn  # noqa: F401
    except ImportError as e:
        return f"onnxruntime-qnn is not installed ({e})"
    return None


def htp_session(path: Path, soc_model: str = SOC_MODEL):
    """The graph on the QNN HTP with CPU fallback disabled and the assignment recorded: export's
    one session builder (plugin-EP registration, SoC table), so both stages open graphs alike."""
    import onnxruntime as ort

    from hyco.qnn.contexts import session_options

    return ort.InferenceSession(str(path), session_options(int(soc_model)))


def assignment(sess) -> dict:
    """Nodes per EP from the session's graph assignment info."""
    counts: dict[str, int] = {}
    other: list[str] = []
    for sub in sess.get_provider_graph_assignment_info():
        ep = sub.ep_name
        nodes = list(sub.get_nodes()) if hasattr(sub, "get_nodes") else list(getattr(sub, "nodes", []))
        counts[ep] = counts.get(ep, 0) + len(nodes)
        if ep != "QNNExecutionProvider":
            other += [f"{getattr(n, 'op_type', '?')}:{getattr(n, 'name', '?')}" for n in nodes][:20]
    return {"per_ep": counts, "cpu_nodes": sum(v for k, v in counts.items() if k != "QNNExecutionProvider"),
            "not_on_qnn": other}


def compare_passes(htp, cpu, data, bound: float | None, grids: dict[str, dict] | None = None,
                   kv_bound: float | None = None, kv_steps: dict[str, float] | None = None) -> dict:
    """Each recorded pass on the HTP and on the CPU EP, compared by export.smoke's rule (`PassLog`):
    top-k ids equal except tie swaps, top-k log-probs within `bound`, the new K/V rows within
    `kv_bound` steps of their grids (`kv_steps`). The bounds: calibrate's
    `evaluate.perturbation_bound`, from the HTP's own per-op differences."""
    import time

    from hyco.quant.pass_compare import PassLog

    passes = sorted({k.split("/", 1)[0] for k in data.files})
    names = [o.name for o in htp.get_outputs()]
    log = PassLog(bound if bound is not None else float("inf"), kv_steps={"graph": kv_steps or {}}, kv_bound=kv_bound)
    sim_s = 0.0
    for p in passes:
        feeds = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(p + "/")}
        # as the host feeds the phone: float inputs clamped to their grids (`hyco.quant.grids`)
        feeds = {k: clamp_to_grid(v, (grids or {}).get(k)) if v.dtype == np.float32 else v for k, v in feeds.items()}
        start = time.perf_counter()
        h = htp.run(names, feeds)
        sim_s += time.perf_counter() - start
        log.record("graph", names, h, cpu.run(names, feeds))
    rows = log.rows
    return {"passes": len(rows), "rows": sum(r["rows"] for r in rows),
            "topk_ids_equal_rows": sum(r["ids_equal_rows"] for r in rows),
            "top1_equal_rows": sum(r["top1_equal"] for r in rows),
            "id_mismatches": sum(r["id_mismatches"] for r in rows), "tie_swaps": sum(r["tie_swaps"] for r in rows),
            "max_abs_logprob_diff": max(r["max_logprob_diff"] for r in rows),
            "max_kv_steps": max((r["max_kv_steps"] or 0.0) for r in rows), "kv_step_bound": kv_bound,
            "per_pass_max_abs_logprob_diff": [r["max_logprob_diff"] for r in rows],
            "bound": bound, "within_bound": None if bound is None else all(log.ok(r) for r in rows),
            "simulator_s_per_pass": sim_s / max(len(rows), 1)}


# --- op by op -------------------------------------------------------------------------------------

# How many top bits of an op's output grid the HTP must keep, by kind of kernel. Matrix products
# keep 7: an activation x activation MatMul runs with its operands on 8-bit grids (the graph
# writes the second's conversion, `quantize.matmul_second_input_uint8`), so an output may sit up to
# two steps of an 8-bit grid away. Sqrt / Reciprocal / Softmax, computed through approximations,
# keep 8. Every other kernel (elementwise arithmetic, reductions, data movement, the input
# quantization) keeps 10. The measured worst of each kind is in calibrate's report (`by_op`).
KEPT_BITS = {"MatMul": 7, "Gemm": 7, "Sqrt": 8, "Reciprocal": 8, "Softmax": 8}
OTHER_KEPT_BITS = 10
CODE_TYPES = {"uint8": 2, "int8": 3, "uint16": 4, "int16": 5}  # numpy name -> onnx.TensorProto type


class Tap(NamedTuple):
    """An activation's codes: its QuantizeLinear's output, grid and the op that computed it."""

    codes: str
    scale: str
    zero: str
    dtype: str
    op: str  # the producer of the quantized tensor ("graph input" for an input)
    source_step: int = 1  # a requantization's source grid step, in these codes (the 8-bit ring's 16-bit twin: 256)


def op_tolerance(tap: Tap) -> int:
    """Codes an op's HTP output may differ from the CPU's on the same input codes: one step of a
    grid of `KEPT_BITS` bits over the same range, 2^(bits - kept) codes (512, 256 or 64 on a
    uint16 grid), and at least 1 (an 8-bit output to the code). A kernel that computes wrong
    numbers (an input beyond its grid wrapping around, the Log trap, Tanh garbage) is thousands of
    codes off. A requantization (DequantizeLinear -> QuantizeLinear onto a finer grid) may land
    one step of its source grid away. A property of the grids and the op, not of the model: the
    same on every run."""
    kept = KEPT_BITS.get(tap.op, OTHER_KEPT_BITS)
    return max(1, tap.source_step, 2 ** (np.iinfo(np.dtype(tap.dtype)).bits - kept))


def activation_taps(model) -> list[Tap]:
    """Every activation QuantizeLinear that is not a graph output: the tensors two implementations
    of the graph can compare code for code."""
    from onnx import helper

    inits = {t.name: t for t in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    producer = {o: n for n in model.graph.node for o in n.output}
    from onnx import numpy_helper

    def source_step(q) -> int:
        dq = producer.get(q.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[1] not in inits:
            return 1
        ratio = float(numpy_helper.to_array(inits[dq.input[1]])) / float(numpy_helper.to_array(inits[q.input[1]]))
        return max(1, round(ratio))

    return [Tap(n.output[0], n.input[1], n.input[2],
                np.dtype(helper.tensor_dtype_to_np_dtype(inits[n.input[2]].data_type)).name,
                producer[n.input[0]].op_type if n.input[0] in producer else "graph input", source_step(n))
            for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits
            and n.output[0] not in outputs and inits[n.input[2]].data_type in CODE_TYPES.values()]


def tapped_model(model, taps):
    """`model` returning every tap's values too, through a DequantizeLinear of its own (a
    QuantizeLinear's codes as a graph output move nodes off the HTP)."""
    import onnx
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for codes, scale, zero, *_ in taps:
        m.graph.node.append(helper.make_node("DequantizeLinear", [codes, scale, zero], [codes + "__tap"],
                                             name=codes + "__tap"))
        m.graph.output.append(helper.make_tensor_value_info(codes + "__tap", onnx.TensorProto.FLOAT, None))
    return m


def teacher_forced_model(model, taps):
    """`model` with every op reading its quantized inputs from graph inputs `<codes>__in` and every
    tap's codes as outputs: one CPU pass computes each op from the codes another implementation
    produced (its own inputs), so differences cannot accumulate from op to op."""
    import onnx
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = {t.codes for t in taps}
    for node in m.graph.node:
        if node.op_type != "QuantizeLinear":
            for j, x in enumerate(node.input):
                if x in names:
                    node.input[j] = x + "__in"
    for codes, _, _, dtype, *_ in taps:
        m.graph.input.append(helper.make_tensor_value_info(codes + "__in", CODE_TYPES[dtype], None))
        m.graph.output.append(helper.make_tensor_value_info(codes, CODE_TYPES[dtype], None))
    return m


def compare_ops(graph: Path, model, htp_session_of, feeds: list[dict]) -> dict:
    """Each tap's HTP codes against the CPU's codes for the same op from the HTP's input codes
    (`teacher_forced_model`), on `feeds`; every op must stay within `op_tolerance` codes."""
    from collections import defaultdict

    from onnx import numpy_helper

    from hyco.qnn.ort import ort_session

    taps = activation_taps(model)
    inits = {t.name: t for t in model.graph.initializer}
    htp = htp_session_of(tapped_model(model, taps), graph.parent / f".{graph.name}.tapped.onnx")
    cpu = ort_session(_save_beside(teacher_forced_model(model, taps), graph.parent / f".{graph.name}.forced.onnx"))
    worst: dict[str, dict] = {}
    tap_names = [t.codes + "__tap" for t in taps]
    htp_inputs = {i.name for i in htp.get_inputs()}
    for f in feeds:
        got = dict(zip(tap_names, htp.run(tap_names, {k: v for k, v in f.items() if k in htp_inputs}), strict=True))
        codes = {}
        for name, scale, zero, dtype, *_ in taps:
            s = numpy_helper.to_array(inits[scale]).astype(np.float64)
            z = numpy_helper.to_array(inits[zero]).astype(np.float64)
            # the HTP returns the tap dequantized in reduced precision: a top code can read back a
            # little above the grid, which must not wrap when cast
            info = np.iinfo(dtype)
            codes[name] = np.clip(np.rint(got[name + "__tap"].astype(np.float64) / s + z), info.min, info.max).astype(dtype)
        cpu_feeds = {**{k: v for k, v in f.items() if k in {i.name for i in cpu.get_inputs()}},
                     **{k + "__in": v for k, v in codes.items()}}
        names = [t.codes for t in taps]
        for tap, c in zip(taps, cpu.run(names, cpu_feeds), strict=True):
            diff = np.abs(c.astype(np.int64) - codes[tap.codes].astype(np.int64))
            row = worst.setdefault(tap.codes, {"max_codes": 0, "mean_codes": 0.0, "tolerance": op_tolerance(tap),
                                               "op": tap.op})
            row["max_codes"] = max(row["max_codes"], int(diff.max()))
            row["mean_codes"] = max(row["mean_codes"], float(diff.mean()))
    by_op: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "max_codes": 0, "worst": None})
    for name, row in worst.items():
        entry = by_op[row["op"]]
        entry["tensors"] += 1
        if row["max_codes"] >= entry["max_codes"]:
            entry.update(max_codes=row["max_codes"], worst=name, tolerance=row["tolerance"])
    beyond = sorted((n for n, r in worst.items() if r["max_codes"] > r["tolerance"]), key=lambda n: -worst[n]["max_codes"])
    return {"tensors": len(worst), "passes": len(feeds), "kept_bits": {**KEPT_BITS, "other": OTHER_KEPT_BITS},
            "beyond_tolerance": [{"tensor": n, **worst[n]} for n in beyond[:10]], "within_tolerance": not beyond,
            "max_codes": {n: r["max_codes"] for n, r in worst.items()},
            "mean_codes": {n: r["mean_codes"] for n, r in worst.items()},
            "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1]["max_codes"]))}


def _save_beside(model, path: Path) -> Path:
    """A weightless `model` saved where its external data resolves (the graph's own folder)."""
    import onnx

    onnx.save(model, str(path))
    return path


def _check(graph: Path, feeds_path: Path | None, out: Path, options: dict) -> None:
    """`options`: `bound`, `kv_bound`, `kv_steps` (`compare_passes`) and `per_op` (`compare_ops` instead)."""
    import onnx
    from hyco.calibrate.quantize import boundary_qparams

    from hyco.qnn.ort import ort_session

    model = onnx.load(str(graph), load_external_data=False)
    total = len(model.graph.node)
    result: dict = {"graph": graph.name, "nodes": total, "soc_model": SOC_MODEL}
    try:
        sess = htp_session(graph)
    except Exception as e:
        result.update({"accepted": False, "error": str(e).splitlines()[0][:400], "cpu_nodes": total})
        out.write_text(json.dumps(result))
        return
    result.update(assignment(sess), accepted=True)
    if options.get("per_op") and feeds_path is not None:
        del sess  # one HTP session per process (results leak between them)
        data = np.load(feeds_path)
        passes = sorted({k.split("/", 1)[0] for k in data.files})
        grids = boundary_qparams(model)
        feeds = [{k.split("/", 1)[1]: clamp_to_grid(data[k], grids.get(k.split("/", 1)[1])) if data[k].dtype == np.float32
                  else data[k] for k in data.files if k.startswith(p + "/")} for p in passes]

        def open_on_htp(m, path):
            return htp_session(_save_beside(m, path))
        try:
            result["ops"] = compare_ops(graph, model, open_on_htp, feeds)
        finally:
            for suffix in ("tapped", "forced"):
                (graph.parent / f".{graph.name}.{suffix}.onnx").unlink(missing_ok=True)
    elif feeds_path is not None:
        result["simulator_vs_cpu"] = compare_passes(sess, ort_session(graph), np.load(feeds_path), options.get("bound"),
                                                    boundary_qparams(model), options.get("kv_bound"),
                                                    options.get("kv_steps"))
    out.write_text(json.dumps(result))


def check_in_subprocess(graph: Path, feeds: list[dict[str, np.ndarray]] | None = None, timeout: float = 900,
                        bound: float | None = None, per_op: bool = False, kv_bound: float | None = None,
                        kv_steps: dict[str, float] | None = None) -> dict:
    """Run `_check` on `graph` in a fresh interpreter; `feeds` are saved to a temp .npz; `bound`,
    `kv_bound`, `kv_steps`: see `compare_passes`; `per_op`: compare op by op instead (`compare_ops`)."""
    with tempfile.TemporaryDirectory(prefix="hyco-htp-") as tmp:
        tmp = Path(tmp)
        args = [sys.executable, "-m", "hyco.calibrate.htp", str(graph), str(tmp / "result.json")]
        if feeds:
            np.savez(tmp / "feeds.npz", **{f"{i:04d}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
            (tmp / "options.json").write_text(json.dumps({"bound": bound, "kv_bound": kv_bound, "kv_steps": kv_steps,
                                                          "per_op": per_op}))
            args += [str(tmp / "feeds.npz"), str(tmp / "options.json")]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not (tmp / "result.json").is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"graph": graph.name, "accepted": False, "error": " | ".join(tail)[:600], "cpu_nodes": None}
        return json.loads((tmp / "result.json").read_text())


if __name__ == "__main__":
    _check(Path(sys.argv[1]), Path(sys.argv[3]) if len(sys.argv) > 3 else None, Path(sys.argv[2]),
           json.loads(Path(sys.argv[4]).read_text()) if len(sys.argv) > 4 else {})
