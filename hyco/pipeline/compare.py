"""Two run folders of one recipe, compared byte for byte (sha256) but for what may differ:

- in every manifest.json (the stage's run record): wall_s, peak_rss_mb, argv, processes, skipped, log (the
  count of library lines: a warning Python shows once per process may fall in another stage) and the input
  fingerprints (mtimes of files a rebuilt earlier stage rewrote); in its summary, fields that are
  measurements of time or memory (names ending in _s, _per_s, per_step, _mb);
- run_report.json / run_summary.md: the run's log (statuses, timings);
- a file the stage's manifest lists under `nondeterministic`, with the reason: compared with the
  JSON pointers the entry names removed, every other byte equal.

Used by the rerun tests (kill -9, determinism) and bench/compare_runs.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

RUN_LOGS = ("run_report.json", "run_summary.md")
_VOLATILE_MANIFEST = ("wall_s", "peak_rss_mb", "argv", "skipped", "key", "processes", "log")
_MEASURED = re.compile(r"(_s|_per_s|per_step|_mb)$")


def _drop_measured(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_measured(v) for k, v in obj.items() if not _MEASURED.search(k)}
    if isinstance(obj, list):
        return [_drop_measured(v) for v in obj]
    return obj


def _drop_pointers(obj: Any, pointers: list[str]) -> Any:
    """`obj` without the values at `pointers` (JSON pointers, `*` = every key or item)."""
    def drop(node, parts):
        if not parts:
            return
        head, rest = parts[0].replace("~1", "/").replace("~0", "~"), parts[1:]
        if head == "*":
            keys = list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else []
        else:
            keys = [head] if isinstance(node, dict) and head in node else []
        for k in reversed(list(keys)):
            if rest:
                drop(node[k], rest)
            else:
                del node[k]

    obj = json.loads(json.dumps(obj))
    for pointer in pointers:
        drop(obj, pointer.split("/")[1:])
    return obj


def comparable_manifest(path: Path) -> dict[str, Any]:
    m = json.loads(path.read_text())
    kept = {k: v for k, v in m.items() if k not in _VOLATILE_MANIFEST}
    # a declared nondeterministic file's hash varies with it; its content is compared on its own
    kept["outputs"] = {k: (v if k not in m.get("nondeterministic", {}) else "declared nondeterministic")
                       for k, v in m.get("outputs", {}).items()}
    kept["section_key"] = m["key"]["section"]
    kept["summary"] = _drop_measured(m.get("summary", {}))
    return kept


def differences(a: Path, b: Path) -> list[str]:
    """Every way run folder `b` differs from `a` beyond what the module docstring allows."""
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    diffs = [f"only in {a}: {p}" for p in sorted(files_a - files_b)]
    diffs += [f"only in {b}: {p}" for p in sorted(files_b - files_a)]
    nondeterministic: dict[Path, dict] = {}
    for rel in files_a & files_b:
        if rel.name == "manifest.json":
            for name, why in json.loads((a / rel).read_text()).get("nondeterministic", {}).items():
                nondeterministic[rel.parent / name] = why
    for rel in sorted(files_a & files_b):
        if str(rel) in RUN_LOGS:
            continue
        if rel.name == "manifest.json":
            ma, mb = comparable_manifest(a / rel), comparable_manifest(b / rel)
            if ma != mb:
                keys = sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))
                diffs.append(f"{rel}: manifests differ in {keys}")
            continue
        da, db = (a / rel).read_bytes(), (b / rel).read_bytes()
        if da == db:
            continue
        why = nondeterministic.get(rel)
        if why is not None and why.get("ignore_pointers") is None:
            continue  # the whole file is declared, with its reason
        if why is not None:
            ja, jb = (_drop_pointers(json.loads(d), why["ignore_pointers"]) for d in (da, db))
            if ja == jb:
                continue
        diffs.append(f"{rel}: bytes differ" + (f" (declared nondeterministic: {why})" if why else ""))
    return diffs
