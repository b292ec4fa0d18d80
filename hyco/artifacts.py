"""Artifacts on disk: atomic stage folders, manifests, hashes, JSON and Markdown reports.

Every stage writes into a temp folder beside its final one and renames it into place only
when the stage finished, so an interrupted or failed stage never leaves a half artifact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import resource
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from hyco.errors import HycoError

MANIFEST = "manifest.json"
_CHUNK = 1 << 20
_TOOLCHAIN = ("torch", "transformers", "onnx", "onnxruntime", "onnxruntime-qnn", "aimet-torch", "tokenizers")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(path: Path) -> str:
    """Cheap identity of an input file or folder: relative names, sizes and mtimes.

    Real checkpoints are many GB, so inputs are not hashed byte by byte; any rewrite changes
    the mtime and therefore the fingerprint, which is what reruns need.
    """
    path = Path(path)
    if not path.exists():
        return "missing"
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    rows = []
    for p in files:
        st = p.stat()
        rows.append((str(p.relative_to(path)) if p != path else p.name, st.st_size, st.st_mtime_ns))
    return sha256_json(rows)


def toolchain_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _TOOLCHAIN:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_json(path: Path, obj: Any) -> Path:
    """Write JSON through a temp file and a rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_json(path: Path, what: str = "file") -> Any:
    path = Path(path)
    if not path.is_file():
        raise HycoError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HycoError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temp folder that replaces `final` only if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def list_outputs(folder: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[str(p.relative_to(folder))] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def stage_key(section: Mapping[str, Any], inputs: Mapping[str, Path]) -> dict[str, str]:
    return {
        "section": sha256_json(dict(section)),
        "inputs": sha256_json({k: fingerprint(Path(v)) for k, v in sorted(inputs.items())}),
    }


def manifest_matches(folder: Path, key: Mapping[str, str]) -> bool:
    """True when `folder` holds a finished stage built from the same section and inputs."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    if manifest.get("key") != dict(key):
        return False
    # An output deleted or edited by hand invalidates the stage.
    for name, meta in manifest.get("outputs", {}).items():
        p = Path(folder) / name
        if not p.is_file() or p.stat().st_size != meta["bytes"]:
            return False
    return True


def run_stage(
    name: str,
    out: Path,
    section: Mapping[str, Any],
    inputs: Mapping[str, Path],
    build: Callable[[Path], Mapping[str, Any] | None],
    *,
    force: bool = False,
) -> dict[str, Any]:
    """Run `build(tmp_dir)` for stage `name` into `out` atomically and write its manifest.

    Skips the work when `out` already holds a manifest with the same key (section hash and
    input fingerprints) unless `force`. `build` may return a small summary dict that is
    stored in the manifest.
    """
    out = Path(out)
    key = stage_key(section, inputs)
    if not force and manifest_matches(out, key):
        manifest = json.loads((out / MANIFEST).read_text())
        manifest["skipped"] = True
        return manifest
    start = time.perf_counter()
    with atomic_dir(out) as tmp:
        summary = build(tmp) or {}
        manifest = {
            "stage": name,
            "key": key,
            "section": dict(section),
            "inputs": {k: str(v) for k, v in inputs.items()},
            "summary": dict(summary),
            "outputs": list_outputs(tmp),
            "wall_s": round(time.perf_counter() - start, 3),
            # Process-wide peak up to the end of this stage; run a stage alone
            # (`hyco-convert <stage>`) for a figure that is this stage's own.
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "toolchain": toolchain_versions(),
            "argv": sys.argv,
        }
        write_json(tmp / MANIFEST, manifest)
    manifest["skipped"] = False
    return manifest


def stage_state(manifest: Mapping[str, Any]) -> str:
    """One phrase for a CLI line: did `run_stage` build the stage or find it up to date?"""
    if manifest.get("skipped"):
        return "unchanged (manifest matches; --force rebuilds)"
    return f"built in {manifest['wall_s']:.1f} s"


def markdown_table(rows: list[Mapping[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
