"""Where an offline QNN HTP compile spends its time, and what one weight-shared SLM context costs
against two: tree and prefill compiled each alone, then both into one shared context, each in a
fresh interpreter with onnxruntime's verbose log (QNN EP lines included).

    .venv/bin/python bench/bench_shared_compile.py --calibrate DIR --out DIR [--soc-model 87]
        [--optimization-level 0] [--modes tree prefill shared]

DIR/--calibrate holds calibrate's tree.qdq.onnx and prefill.qdq.onnx (an E2B-shaped run's, from
bench/bench_fullsize.py). Each compile's peak RSS is the child's `ru_maxrss` (os.wait4). From each
log, per QNN EP session, the phases between the EP's own markers: `partition` (EP created ->
ComposeGraph: onnxruntime's partitioning and the QNN node builders' checks), `compose` (the QNN graph
built node by node), `finalize` (QnnGraph_finalize: the HTP compiler proper), `binary` (the context
binary fetched and written). The verbose log itself costs a few seconds of a multi-minute compile.
The issue's rule: the shared compile takes no longer than the two separate ones together. Writes
DIR/bench_report.json, DIR/bench_summary.md and DIR/logs/<mode>.log.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fullsize import cpu_identity, load_average, measure  # noqa: E402

MODES = ("tree", "prefill", "shared")
# (phase, the log line that ends it); a session starts at "Creating QNN EP"
MARKERS = (("partition", "ComposeGraph Graph name:"), ("compose", "GetGraphInfoFromModel completed"),
           ("finalize", "FinalizeGraphs completed"), ("binary", "prepare_only mode: context saved"))
SESSION_START = "Creating QNN EP"
STAMP = re.compile(r"^(?:\x1b\[[0-9;]*m)?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})")


def compile_one(mode: str, calibrate: Path, out: Path, soc_model: int, level: int) -> None:
    """In the child: the compile of `mode` with onnxruntime's log at verbose, on stderr."""
    from hyco.qnn import contexts as qnn

    quiet = qnn.session_options

    def verbose(*args, **kwargs):
        so = quiet(*args, **kwargs)
        so.log_severity_level = 0
        return so

    qnn.session_options = verbose
    if mode == "shared":
        done = qnn.compile_shared([(calibrate / "tree.qdq.onnx", "tree"), (calibrate / "prefill.qdq.onnx", "prefill")],
                                  out, soc_model=soc_model, optimization_level=level)
    else:
        done = [qnn.compile_context(calibrate / f"{mode}.qdq.onnx", out, mode, soc_model, level)]
    print(json.dumps([{"context": c.context.name, "binary": c.binary.name, "binary_bytes": c.binary.stat().st_size,
                       "compile_s": c.compile_s, "nodes": c.nodes} for c in done]), flush=True)


def session_phases(log: Path) -> list[dict[str, float]]:
    """Per QNN EP session in `log`, the seconds of each phase (MARKERS) that it reached."""
    sessions, last, at = [], None, 0
    with open(log, errors="replace") as f:
        for line in f:
            m = STAMP.match(line)
            if not m:
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            if SESSION_START in line:
                sessions.append({})
                last, at = t, 0
            elif sessions and at < len(MARKERS) and MARKERS[at][1] in line:
                sessions[-1][MARKERS[at][0]] = round(t - last, 2)
                last, at = t, at + 1
    return sessions


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    out = args.out / "binaries" / mode
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", mode, "--calibrate", str(args.calibrate),
           "--out", str(out), "--soc-model", str(args.soc_model), "--optimization-level", str(args.optimization_level)]
    log = args.out / "logs" / f"{mode}.log"
    measured = measure(cmd, log)
    row = {"mode": mode, **measured, "sessions": session_phases(log), "load_avg_after": load_average()}
    if measured["rc"] == 0:
        row["compiled"] = json.loads(next(line for line in reversed(log.read_text(errors="replace").splitlines())
                                          if line.startswith("[{")))
    return row


def summary_markdown(report: dict) -> str:
    rows = report["rows"]
    lines = ["# Offline QNN HTP compile: two SLM contexts against one weight-shared context", "",
             f"calibrate: `{report['calibrate']}`; soc_model {report['soc_model']}, HTP optimization level "
             f"{report['optimization_level']}; CPU {report['cpu']['model']}; load average before "
             f"{report['load_avg_before']}.", "",
             "| compile | wall s | CPU s | peak RSS MiB | binary bytes | per session: partition / compose / finalize / binary s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        sizes = ", ".join(f"{b:,}" for b in sorted({c["binary_bytes"] for c in r.get("compiled", [])}))
        phases = "; ".join(" / ".join(f"{s.get(p, float('nan')):.1f}" for p, _ in MARKERS) for s in r["sessions"])
        lines.append(f"| {r['mode']} | {r['wall_s']} | {r['cpu_s']} | {r['peak_rss_mb']:,.0f} | {sizes or r['rc']} | {phases} |")
    verdict = report.get("rule")
    if verdict:
        lines += ["", f"Shared compile {verdict['shared_s']} s against {verdict['separate_s']} s for the two separate "
                      f"compiles: {'met' if verdict['met'] else 'NOT met'} (the shared compile must take no longer)."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrate", type=Path, required=True, help="calibrate's output folder (tree/prefill .qdq.onnx)")
    p.add_argument("--out", type=Path, required=True, help="where the binaries, logs and report go")
    p.add_argument("--soc-model", type=int, default=87, help="QNN soc_model (87: SM8850)")
    p.add_argument("--optimization-level", type=int, default=0, help="export.htp_optimization_level")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # the child's own compile
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.one:
        compile_one(args.one, args.calibrate, args.out, args.soc_model, args.optimization_level)
        return 0
    for name in ("tree.qdq.onnx", "prefill.qdq.onnx"):
        if not (args.calibrate / name).is_file():
            print(f"error: {args.calibrate / name}: not found (calibrate's output folder?)", file=sys.stderr)
            return 2
    report = {"calibrate": str(args.calibrate), "soc_model": args.soc_model,
              "optimization_level": args.optimization_level, "cpu": cpu_identity(), "load_avg_before": load_average(),
              "rows": []}
    for mode in args.modes:
        row = run_mode(mode, args)
        report["rows"].append(row)
        print(f"{mode}: {row['wall_s']} s wall, {row['peak_rss_mb']:.0f} MiB peak, sessions {row['sessions']}", flush=True)
        if row["rc"] != 0:
            print(f"error: the {mode} compile failed (rc {row['rc']}); its log: {args.out / 'logs' / f'{mode}.log'}",
                  file=sys.stderr)
            break
    walls = {r["mode"]: r["wall_s"] for r in report["rows"] if r["rc"] == 0}
    if set(walls) == set(MODES):
        separate = round(walls["tree"] + walls["prefill"], 1)
        report["rule"] = {"shared_s": walls["shared"], "separate_s": separate, "met": walls["shared"] <= separate}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "bench_summary.md").write_text(summary_markdown(report))
    print(summary_markdown(report))
    return 0 if all(r["rc"] == 0 for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
