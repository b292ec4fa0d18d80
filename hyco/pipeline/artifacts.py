"""Artifacts on disk: atomic stage folders, manifests, hashes, JSON and Markdown reports.

Every stage writes into a temp folder beside its final one and renames it into place only
when the stage finished, so an interrupted or failed stage never leaves a half artifact.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from hyco.base.console import STAGE_LOG, stage_log
from hyco.base.errors import HycoError, ProofFailed
from hyco.base.files import file_digests, fingerprint, sha256_json, write_json
from hyco.base.launch import world_size
from hyco.base.memory import cpu_seconds, peak_rss_mb, rss_mb
from hyco.pipeline import verdict
from hyco.pipeline.verdict import Line

MANIFEST = "manifest.json"
_TOOLCHAIN = ("torch", "transformers", "onnx", "onnxruntime", "onnxruntime-qnn", "aimet-torch", "tokenizers")


def toolchain_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _TOOLCHAIN:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


class Phases:
    """Wall seconds, CPU seconds, the process's peak RSS so far and its RSS now at the end of each
    named phase of a stage, for its report: the phase where `peak_rss_mb` jumps is the one that
    set the stage's peak; `rss_mb` is what the phase left behind; `cpu_s` / `wall_s` is how many
    cores the phase kept busy (this process and the workers it waited for), i.e. where a core
    idles.
    Each finished phase is also logged at INFO on `hyco.phases` (bench/bench_fullsize.py shows
    them; the CLI keeps stderr for errors)."""

    def __init__(self, stage: str):
        self.stage, self.rows = stage, {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start, cpu, began = time.perf_counter(), cpu_seconds(), time.time()
        yield
        row = {"wall_s": round(time.perf_counter() - start, 2), "cpu_s": round(cpu_seconds() - cpu, 2),
               "start_epoch_s": round(began, 3),  # where the phase sits in the process's life (the bench's accounting)
               "peak_rss_mb": round(peak_rss_mb(), 1), "rss_mb": round(rss_mb(), 1)}
        self.rows[name] = row
        logging.getLogger("hyco.phases").info("%s: %s %s s (CPU %s s), peak RSS so far %.0f MiB, RSS at its "
                                              "end %.0f MiB", self.stage, name, row["wall_s"], row["cpu_s"],
                                              row["peak_rss_mb"], row["rss_mb"])


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temp folder that replaces `final` only if the block succeeds.

    Leftovers of a killed process (`.NAME.tmp-PID`, `.NAME.old-PID` with PID gone) are removed
    first. When the block fails, folders this call created for `final`'s parent go too, so a
    refused input leaves no trace (not even an empty OUT)."""
    final = Path(final)
    created = _missing_ancestors(final.parent)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent, final.name)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:  # deepest first; only if still empty (another stage may have written)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid_{os.getuid()}"


@contextlib.contextmanager
def scratch_tempdir(final: Path) -> Iterator[Path]:
    """Point the process's temp files at `.NAME.scratch-PID` beside `final` for the block: Python's
    `tempfile` (the stage's own scratch folders, onnxruntime's quantizer's, torch's) and TMPDIR
    (child processes). A stage killed with SIGKILL cannot clean up; its scratch (GBs at full size:
    spilled passes, prepared graphs) then sits beside the run as a stale temp that the next run
    removes, not in /tmp forever (which may be RAM-backed). Removed when the block ends."""
    final = Path(final)
    scratch = final.parent / f".{final.name}.scratch-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    # torch inductor's compile cache is a cache, not scratch: held at torch's own default under the
    # real temp folder, since a path inside the scratch, memoized by torch, came back as an empty
    # `torchinductor_<user>` folder after the scratch was removed
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{_user()}"))
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    before = set(os.environ)
    tempfile.tempdir, os.environ["TMPDIR"] = str(scratch), str(scratch)
    try:
        yield scratch
    finally:
        tempfile.tempdir = saved[0]
        if saved[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[1]
        # A library that cached a path inside the scratch in the environment (torch inductor's
        # TORCHINDUCTOR_CACHE_DIR) would recreate it in a later stage: the path goes with it.
        for key in [k for k, v in os.environ.items() if k not in before and v.startswith(str(scratch))]:
            del os.environ[key]
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[Path]:
    """This process's exclusive use of `folder`: an flock on `.NAME.lock` beside it, so a second
    hyco-convert writing the same folder refuses at once (one line naming the lock and its holder)
    instead of interleaving artifacts. The kernel releases the lock of a killed holder; the file
    goes when the lock is released, and so do folders made only to hold it."""
    import fcntl

    folder = Path(folder)
    created = _missing_ancestors(folder.parent)
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = folder.parent / f".{folder.name}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise HycoError(f"{path}: {folder} is being written by another hyco-convert (pid {holder}); wait for it "
                            "to end or stop it") from None
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == path.stat().st_ino:
                break  # not a file its last holder unlinked while we waited to lock it
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
        for parent in created:
            with contextlib.suppress(OSError):
                parent.rmdir()


def refuse_foreign_folder(out: Path) -> None:
    """A stage replaces its whole folder: one that holds files hyco-convert did not write (no
    manifest) is refused, so a user's files are never deleted."""
    out = Path(out)
    if out.is_dir() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise HycoError(f"{out}: exists and holds files hyco-convert did not write (no {MANIFEST}); nothing in it "
                        "was touched: give a new or empty folder")
    if out.exists() and not out.is_dir():
        raise HycoError(f"{out}: exists and is not a folder")


def _missing_ancestors(folder: Path) -> list[Path]:
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def stale_temps(folder: Path, name: str = "*") -> list[Path]:
    """`.NAME.tmp-PID` / `.NAME.old-PID` / `.NAME.scratch-PID` entries in `folder` whose process is
    gone (kill -9, power loss)."""
    stale = []
    for p in sorted(Path(folder).glob(f".{name}.*-*")):
        stem, _, pid = p.name.rpartition("-")
        if stem.endswith((".tmp", ".old", ".scratch")) and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            stale.append(p)
    return stale


def remove_stale_temps(folder: Path, name: str = "*") -> None:
    for p in stale_temps(folder, name):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def adopt_finished(out: Path, key: Mapping[str, str]) -> bool:
    """After a kill between "manifest written" and "renamed into place", the finished stage sits
    in a stale temp folder (or, mid-swap, in the `.old` one): move the one whose manifest matches
    `key` into place instead of rebuilding. True when `out` now matches."""
    out = Path(out)
    if not manifest_matches(out, key):
        for candidate in stale_temps(out.parent, out.name):
            if candidate.is_dir() and manifest_matches(candidate, key):
                if out.exists():
                    shutil.rmtree(out)  # out does not match the key: an older build or a half-deleted one
                os.replace(candidate, out)
                break
    if not manifest_matches(out, key):
        return False
    remove_stale_temps(out.parent, out.name)
    return True


# --- byte-identical reruns ------------------------------------------------------------------------

# JSON keys that hold a measurement of this run (time, memory), by naming convention; numbers only.
# Snake-case identifiers only: a tokenizer's vocabulary maps token strings such as "_s" to ids.
_MEASURED_KEY = re.compile(r"^[a-z][a-z0-9_]*(_s|_mb|_m?s_per_[a-z]+)$|^m?s_per_[a-z]+$")


_declared: dict[str, dict[str, Any]] | None = None  # the stage run_stage is building now


def declare_nondeterministic(name: str, reason: str, ignore_pointers: list[str] | None = None) -> None:
    """Record in the manifest of the stage being built that its output `name` cannot be
    byte-identical across reruns, and why (name the library). With `ignore_pointers` (JSON
    pointers into a JSON output; `*` = every key or item) only those values vary and every other
    byte must not; without, the whole file varies. Outside run_stage it does nothing."""
    if _declared is not None:
        entry: dict[str, Any] = {"reason": reason}
        if ignore_pointers is not None:
            entry["ignore_pointers"] = sorted(ignore_pointers)
        earlier = _declared.get(name)
        if earlier is not None:  # declared twice: the whole file if either says so, else both pointer sets
            entry = {"reason": f"{earlier['reason']}; {reason}"}
            if "ignore_pointers" in earlier and ignore_pointers is not None:
                entry["ignore_pointers"] = sorted(set(earlier["ignore_pointers"]) | set(ignore_pointers))
        _declared[name] = entry


def _measured_keys(obj: Any, prefix: str = "") -> list[str]:
    """JSON pointers (RFC 6901; `*` for every list item) of the measured numbers in `obj`."""
    keys = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            pointer = f"{prefix}/{str(k).replace('~', '~0').replace('/', '~1')}"
            if _MEASURED_KEY.search(str(k)) and isinstance(v, int | float) and not isinstance(v, bool):
                keys.append(pointer)
            else:
                keys += _measured_keys(v, pointer)
    elif isinstance(obj, list):
        for v in obj:
            keys += [k for k in _measured_keys(v, prefix + "/*") if k not in keys]
    return keys


def _may_hold_measured(raw: bytes) -> bool:
    """False when no key of the JSON text `raw` can match _MEASURED_KEY (each ends in `_s`, `_mb`
    or holds `s_per_`): parsing calibrate's large encodings.json to find none is many times
    slower than these scans."""
    return any(raw.find(needle) >= 0 for needle in (b'_s"', b'_mb"', b"s_per_"))


def nondeterministic_outputs(folder: Path) -> dict[str, dict[str, Any]]:
    """Outputs that differ between two runs of the same recipe and seed, with the reason: JSON
    files holding measured times or memory (their JSON pointers listed; every other byte is
    reproducible) and what the stage being built declared (`declare_nondeterministic`)."""
    folder = Path(folder)
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(folder.rglob("*.json")):
        if p.name == MANIFEST:
            continue
        raw = p.read_bytes()
        if not _may_hold_measured(raw):
            continue
        try:
            keys = _measured_keys(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if keys:
            out[str(p.relative_to(folder))] = {"reason": "measured wall-clock time / memory of this run",
                                               "ignore_pointers": sorted(set(keys))}
    for name, entry in (_declared or {}).items():
        auto = out.get(name)
        if auto is not None and "ignore_pointers" in entry:  # both: one entry, both reasons
            entry = {"reason": f"{entry['reason']}; {auto['reason']}",
                     "ignore_pointers": sorted(set(entry["ignore_pointers"]) | set(auto["ignore_pointers"]))}
        out[name] = entry
    return out


def canonicalize_safetensors(folder: Path) -> None:
    """safetensors keeps `__metadata__` in a Rust HashMap, so two processes write its entries in
    different orders (same tensors, different bytes). Rewrite each header with the metadata sorted:
    same length, same content, reproducible bytes."""
    for p in sorted(Path(folder).rglob("*.safetensors")):
        with open(p, "r+b") as f:
            n = int.from_bytes(f.read(8), "little")
            old = f.read(n)
            header = json.loads(old)
            meta = header.get("__metadata__")
            if not isinstance(meta, dict) or len(meta) < 2:
                continue
            header["__metadata__"] = dict(sorted(meta.items()))
            raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
            if len(raw) > n:  # cannot happen for a reordering; leave such a file as written
                continue
            if raw + b" " * (n - len(raw)) == old:  # already canonical (a copied LUT): left untouched
                continue
            f.seek(8)
            f.write(raw + b" " * (n - len(raw)))


def list_outputs(folder: Path) -> dict[str, dict[str, Any]]:
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]
    return {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": d}
            for p, d in zip(files, file_digests(files), strict=True)}


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


@dataclass
class StageEnd:
    """What a stage's build hands to `finish_stage`, the ending every stage shares. `report`:
    report.json's content (`proof_failed`, the peak RSS and the toolchain are added);
    `markdown(report)`: summary.md; `plots`: file name -> drawing function; `nondeterministic`:
    (output, reason, JSON pointers or None) for `declare_nondeterministic`; `summary`: what the
    manifest keeps; `proof_failed`: the failed proof in one phrase, or None; `failure_hint`:
    appended to the ProofFailed message; `verdict`: the lines that open summary.md (hyco/pipeline/verdict.py),
    also kept in report.json's `verdict` for run_summary.md; `verdict_varies`: why they hold
    figures that differ between reruns (measured times, the HTP simulator's output), or ""."""

    report: dict[str, Any]
    markdown: Callable[[dict[str, Any]], str]
    summary: dict[str, Any]
    proof_failed: str | None = None
    plots: dict[str, Callable[[Path], None]] = field(default_factory=dict)
    nondeterministic: list[tuple[str, str, list[str] | None]] = field(default_factory=list)
    failure_hint: str = ""
    verdict: list[Line] = field(default_factory=list)
    verdict_varies: str = ""


def finish_stage(name: str, out: Path, end: StageEnd, allow_parity_failure: bool) -> dict[str, Any]:
    """Write report.json, the plots and summary.md into `out` and declare the stage's
    nondeterministic outputs; then decide on the proof: a failed one stops the stage
    (ProofFailed; `out` is run_stage's temp folder, so nothing moves into place) unless
    `allow_parity_failure`, which keeps the artifacts and marks the manifest through the
    returned summary's `proof_failed`. Returns the manifest's summary."""
    lines = stage_verdict(end.verdict, end.proof_failed)
    report = {**end.report, "proof_failed": end.proof_failed, "verdict": verdict.to_json(lines),
              "peak_rss_mb": round(peak_rss_mb(), 1), "toolchain": toolchain_versions()}
    write_json(Path(out) / "report.json", report)
    for file, draw in end.plots.items():
        draw(Path(out) / file)
    md = verdict.with_verdict(end.markdown(report), lines)
    if (Path(out) / STAGE_LOG).exists():
        md = md.rstrip("\n") + (f"\n\nWhat the libraries printed (warnings, INFO lines, C++ logs) is in `{STAGE_LOG}` beside "
                                 "this file, not on the terminal; manifest.json's `log` counts it.\n")
    (Path(out) / "summary.md").write_text(md)
    for file, reason, pointers in end.nondeterministic:
        declare_nondeterministic(file, reason, ignore_pointers=pointers)
    if end.verdict_varies:
        declare_nondeterministic("report.json", f"the verdict restates {end.verdict_varies}", ["/verdict"])
    if end.proof_failed and not allow_parity_failure:
        raise ProofFailed(f"{name}: {end.proof_failed}{end.failure_hint}")
    return {**end.summary, "proof_failed": end.proof_failed}


def stage_verdict(lines: list[Line], proof_failed: str | None) -> list[Line]:
    """The stage's verdict lines; a failed proof that no line shows as FAIL gets a line of its own,
    so a summary never opens with PASSED above a failure."""
    if proof_failed and not any(line.status == verdict.FAIL for line in lines):
        return [*lines, verdict.Line("proof", verdict.FAIL, proof_failed)]
    return list(lines)


def run_stage(
    name: str,
    out: Path,
    section: Mapping[str, Any],
    inputs: Mapping[str, Path],
    build: Callable[[Path], Mapping[str, Any] | None],
    *,
    force: bool = False,
    allow_parity_failure: bool = False,
) -> dict[str, Any]:
    """Run `build(tmp_dir)` for stage `name` into `out` atomically and write its manifest.

    Skips the work when `out` already holds a manifest with the same key (section hash and
    input fingerprints) unless `force`. `build` may return a small summary dict that is
    stored in the manifest.

    A summary with `proof_failed` (a stage that was allowed to keep artifacts whose proof
    failed) marks the manifest; an input folder whose manifest is so marked is refused unless
    `allow_parity_failure`, and a marked output is never reused without it.
    """
    out = Path(out)
    refuse_failed_proofs(name, inputs, allow_parity_failure)
    refuse_foreign_folder(out)
    with folder_lock(out):
        return _run_locked(name, out, section, inputs, build, force, allow_parity_failure)


def _run_locked(name: str, out: Path, section: Mapping[str, Any], inputs: Mapping[str, Path],
                build: Callable[[Path], Mapping[str, Any] | None], force: bool,
                allow_parity_failure: bool) -> dict[str, Any]:
    key = stage_key(section, inputs)
    if not force and adopt_finished(out, key):
        manifest = json.loads((out / MANIFEST).read_text())
        if allow_parity_failure or not manifest.get("proof_failed"):
            manifest["skipped"] = True
            return manifest
    start = time.perf_counter()
    with atomic_dir(out) as tmp, scratch_tempdir(out):
        global _declared
        _declared = {}
        try:
            with stage_log(tmp / STAGE_LOG) as log:
                declare_nondeterministic(STAGE_LOG, "library output: timings, addresses and temp paths vary")
                summary = build(tmp) or {}
            canonicalize_safetensors(tmp)
            nondeterministic = nondeterministic_outputs(tmp)
        finally:
            _declared = None
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
            "processes": world_size(),  # > 1: the stage's prompts were split over an accelerate launch
            "log": log.record(),  # what the libraries said, kept off the terminal
        }
        if summary.get("proof_failed"):
            manifest["proof_failed"] = str(summary["proof_failed"])
        if nondeterministic:
            manifest["nondeterministic"] = nondeterministic
        write_json(tmp / MANIFEST, manifest)
    manifest["skipped"] = False
    return manifest


def refuse_failed_proofs(name: str, inputs: Mapping[str, Path], allow: bool) -> None:
    """Refuse an input folder written by a stage whose proof failed (manifest `proof_failed`)."""
    if allow:
        return
    for key, path in inputs.items():
        manifest = Path(path) / MANIFEST
        if not manifest.is_file():
            continue
        try:
            failed = json.loads(manifest.read_text()).get("proof_failed")
        except (json.JSONDecodeError, AttributeError):
            continue
        if failed:
            raise HycoError(f"{manifest}: input {key!r} of stage {name} was written although its proof failed "
                            f"({failed}); pass --allow-parity-failure (recipe: allow_parity_failure: true) to use it")


def stage_state(manifest: Mapping[str, Any]) -> str:
    """One phrase for a CLI line: did `run_stage` build the stage or find it up to date?"""
    if manifest.get("skipped"):
        return "unchanged (manifest matches; --force rebuilds)"
    return f"built in {manifest['wall_s']:.1f} s"


def warn_if_proof_failed(manifest: Mapping[str, Any], kept: str = "artifacts") -> None:
    """A stage built with --allow-parity-failure whose proof failed says so on stderr."""
    if manifest.get("proof_failed"):
        print(f"WARNING: proof failed, {kept} kept (--allow-parity-failure) and manifest marked: "
              f"{manifest['proof_failed']}", file=sys.stderr)


def markdown_table(rows: list[Mapping[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
