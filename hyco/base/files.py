"""Files the stages write and compare: sha256 of a file or a JSON value, a cheap fingerprint of an
input folder, and JSON written through a temp file and a rename."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


_digests: dict[tuple[int, int, int, int], str] = {}  # (device, inode, bytes, mtime ns) -> sha256


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = Path(path).stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def file_digests(paths: list[Path]) -> list[str]:
    """sha256 of each of `paths`, for the tables a stage writes of its own outputs (manifest.json,
    export's bundle.json). A file this process already hashed and that is unchanged since (same
    inode, size and mtime), or a hard link of one, is not read again: export listed its bundle
    (GBs at full size) twice. The rest are hashed side by side, a thread per core (hashlib
    releases the GIL while it hashes). Checks of integrity (`hyco.qnn.bundle.verify_bundle`) read
    every byte with `sha256_file` instead."""
    from concurrent.futures import ThreadPoolExecutor

    keys = [_identity(p) for p in paths]
    todo = dict(sorted({k: Path(p) for k, p in zip(keys, paths, strict=True) if k not in _digests}.items(),
                       key=lambda kv: -kv[0][2]))  # the largest first: the threads end together
    if todo:
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
            _digests.update(zip(todo, pool.map(sha256_file, todo.values()), strict=True))
    return [_digests[k] for k in keys]


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


def write_json(path: Path, obj: Any) -> Path:
    """Write JSON through a temp file and a rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return path
