"""HTP acceptance and simulator-vs-CPU agreement, one graph per process.

`check_in_subprocess(graph, feeds)` starts `python -m hyco.calibrate.htp` for one QDQ graph
(HTP results were seen to leak between sessions in one process): it opens the graph on the
onnxruntime-qnn plugin EP (HTP backend, soc_model 87, CPU fallback disabled, graph assignment
recorded), counts the nodes not assigned to QNN, and, given recorded feeds, runs each pass on
the HTP (the x86 simulator here) and on the CPU EP and compares top-k ids and log-probs.
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


def _check(graph: Path, feeds_path: Path | None, out: Path) -> None:
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
        cpu = ort_session(graph)
        data = np.load(feeds_path)
        passes = sorted({k.split("/", 1)[0] for k in data.files})
        names = [o.name for o in sess.get_outputs()]
        lp_name = "topk_logprobs"
        id_name = "topk_indices" if "topk_indices" in names else "topk_ids"
        rows = ids_equal = top1_equal = 0
        max_diff, per_pass, gaps = 0.0, [], []
        import time

        sim_s = 0.0
        for p in passes:
            feeds = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(p + "/")}
            start = time.perf_counter()
            h = dict(zip(names, sess.run(names, feeds), strict=True))
            sim_s += time.perf_counter() - start
            c = dict(zip(names, cpu.run(names, feeds), strict=True))
            eq = (h[id_name] == c[id_name]).all(-1)
            rows += eq.size
            ids_equal += int(eq.sum())
            top1 = h[id_name][:, 0] == c[id_name][:, 0]
            top1_equal += int(top1.sum())
            # why a row's top-1 differs: its top-2 log-probs on the CPU are within the noise?
            gaps += [float(c[lp_name][r, 0] - c[lp_name][r, 1]) for r in np.flatnonzero(~top1)]
            diff = float(np.abs(h[lp_name] - c[lp_name]).max())
            max_diff = max(max_diff, diff)
            per_pass.append(diff)
        result["simulator_vs_cpu"] = {"passes": len(passes), "rows": rows, "topk_ids_equal_rows": ids_equal,
                                      "top1_equal_rows": top1_equal, "max_abs_logprob_diff": max_diff,
                                      "per_pass_max_abs_logprob_diff": per_pass,
                                      "top1_gap_of_differing_rows": gaps,
                                      "simulator_s_per_pass": sim_s / max(len(passes), 1)}
    out.write_text(json.dumps(result))


def check_in_subprocess(graph: Path, feeds: list[dict[str, np.ndarray]] | None = None, timeout: float = 900) -> dict:
    """Run `_check` on `graph` in a fresh interpreter; `feeds` are saved to a temp .npz."""
    with tempfile.TemporaryDirectory(prefix="hyco-htp-") as tmp:
        tmp = Path(tmp)
        args = [sys.executable, "-m", "hyco.calibrate.htp", str(graph), str(tmp / "result.json")]
        if feeds:
            np.savez(tmp / "feeds.npz", **{f"{i:04d}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
            args.append(str(tmp / "feeds.npz"))
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not (tmp / "result.json").is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"graph": graph.name, "accepted": False, "error": " | ".join(tail)[:600], "cpu_nodes": None}
        return json.loads((tmp / "result.json").read_text())


if __name__ == "__main__":
    _check(Path(sys.argv[1]), Path(sys.argv[3]) if len(sys.argv) > 3 else None, Path(sys.argv[2]))
