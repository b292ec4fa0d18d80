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

import numpy as np

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
    from hyco.export.qnn import session_options

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


def compare_passes(htp, cpu, data, bound: float | None) -> dict:
    """Each recorded pass on the HTP and on the CPU EP, compared by export.smoke's rule (`PassLog`):
    top-k ids equal except swaps between tokens whose CPU log-probs are within `bound`, sorted
    top-k log-probs within `bound`. `bound` (calibrate: the graph's own top-k log-prob error vs
    its float graph on the eval prompts, `evaluate.topk_logprob_error`): the HTP, a second
    integer implementation of the same QDQ graph, may not move a log-prob further from the CPU
    than 16-bit quantization moved it from float."""
    import time

    from hyco.export.smoke import PassLog

    passes = sorted({k.split("/", 1)[0] for k in data.files})
    names = [o.name for o in htp.get_outputs()]
    log = PassLog(bound if bound is not None else float("inf"))
    sim_s = 0.0
    for p in passes:
        feeds = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(p + "/")}
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
            "per_pass_max_abs_logprob_diff": [r["max_logprob_diff"] for r in rows],
            "bound": bound, "within_bound": None if bound is None else all(log.ok(r) for r in rows),
            "simulator_s_per_pass": sim_s / max(len(rows), 1)}


def _check(graph: Path, feeds_path: Path | None, out: Path, bound: float | None = None) -> None:
    import onnx
    from hyco.convert.export_onnx import ort_session

    total = len(onnx.load(str(graph), load_external_data=False).graph.node)
    result: dict = {"graph": graph.name, "nodes": total, "soc_model": SOC_MODEL}
    try:
        sess = htp_session(graph)
    except Exception as e:
        result.update({"accepted": False, "error": str(e).splitlines()[0][:400], "cpu_nodes": total})
        out.write_text(json.dumps(result))
        return
    result.update(assignment(sess), accepted=True)
    if feeds_path is not None:
        result["simulator_vs_cpu"] = compare_passes(sess, ort_session(graph), np.load(feeds_path), bound)
    out.write_text(json.dumps(result))


def check_in_subprocess(graph: Path, feeds: list[dict[str, np.ndarray]] | None = None, timeout: float = 900,
                        bound: float | None = None) -> dict:
    """Run `_check` on `graph` in a fresh interpreter; `feeds` are saved to a temp .npz; `bound`:
    see `compare_passes`."""
    with tempfile.TemporaryDirectory(prefix="hyco-htp-") as tmp:
        tmp = Path(tmp)
        args = [sys.executable, "-m", "hyco.calibrate.htp", str(graph), str(tmp / "result.json")]
        if feeds:
            np.savez(tmp / "feeds.npz", **{f"{i:04d}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
            args.append(str(tmp / "feeds.npz"))
            if bound is not None:
                args.append(repr(float(bound)))
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not (tmp / "result.json").is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"graph": graph.name, "accepted": False, "error": " | ".join(tail)[:600], "cpu_nodes": None}
        return json.loads((tmp / "result.json").read_text())


if __name__ == "__main__":
    _check(Path(sys.argv[1]), Path(sys.argv[3]) if len(sys.argv) > 3 else None, Path(sys.argv[2]),
           float(sys.argv[4]) if len(sys.argv) > 4 else None)
