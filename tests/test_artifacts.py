"""Atomic stage folders and manifests: no half artifact, reruns skip, edits invalidate."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyco.base.memory import peak_rss_mb
from hyco.pipeline.artifacts import atomic_dir, manifest_matches, run_stage, stage_key


def _build(files):
    def build(tmp):
        for name, text in files.items():
            (tmp / name).write_text(text)
        return {"n": len(files)}
    return build


def test_failed_build_leaves_nothing(tmp_path):
    out = tmp_path / "stage"

    def build(tmp):
        (tmp / "half.bin").write_bytes(b"x" * 10)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        run_stage("s", out, {"a": 1}, {}, build)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_failed_rebuild_keeps_the_previous_artifact(tmp_path):
    out = tmp_path / "stage"
    run_stage("s", out, {"a": 1}, {}, _build({"x.txt": "old"}))
    with pytest.raises(ValueError), atomic_dir(out) as tmp:
        (tmp / "x.txt").write_text("new")
        raise ValueError
    assert (out / "x.txt").read_text() == "old"


def test_manifest_records_outputs_and_skips_on_rerun(tmp_path):
    out, inp = tmp_path / "stage", tmp_path / "input.txt"
    inp.write_text("data")
    m = run_stage("s", out, {"a": 1}, {"input": inp}, _build({"x.txt": "hello"}))
    assert not m["skipped"]
    saved = json.loads((out / "manifest.json").read_text())
    assert saved["outputs"]["x.txt"]["bytes"] == 5
    assert saved["outputs"]["x.txt"]["sha256"] == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert saved["summary"] == {"n": 1} and saved["wall_s"] >= 0 and saved["peak_rss_mb"] > 0
    assert "torch" in saved["toolchain"]

    calls = []
    m2 = run_stage("s", out, {"a": 1}, {"input": inp}, lambda tmp: calls.append(1))
    assert m2["skipped"] and calls == []
    m3 = run_stage("s", out, {"a": 1}, {"input": inp}, _build({"x.txt": "hello"}), force=True)
    assert not m3["skipped"]


@pytest.mark.parametrize("change", ["section", "input", "output"])
def test_changes_invalidate_the_manifest(tmp_path, change):
    out, inp = tmp_path / "stage", tmp_path / "input.txt"
    inp.write_text("data")
    run_stage("s", out, {"a": 1}, {"input": inp}, _build({"x.txt": "hello"}))
    section = {"a": 1}
    if change == "section":
        section = {"a": 2}
    elif change == "input":
        inp.write_text("other data")
    else:
        (out / "x.txt").write_text("edited by hand")
    assert not manifest_matches(out, stage_key(section, {"input": inp}))


# --- kill -9: stale temp folders, a finished build caught before its rename --------------------------


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _never(tmp):
    raise AssertionError("the stage was rebuilt instead of adopted")


def test_stale_temp_of_a_killed_process_is_removed(tmp_path):
    import os

    out = tmp_path / "stage"
    dead, alive = tmp_path / f".stage.tmp-{_dead_pid()}", tmp_path / f".stage.tmp-{os.getppid()}"
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "half.bin").write_bytes(b"x" * 10)
    (tmp_path / f".stage.old-{_dead_pid()}").mkdir()
    (tmp_path / f".stage.scratch-{_dead_pid()}").mkdir()
    run_stage("s", out, {"a": 1}, {}, _build({"x.txt": "hello"}))
    names = sorted(p.name for p in tmp_path.iterdir())
    # a live process's temp folder may be a concurrent build: it stays
    assert names == sorted(["stage", alive.name]), names


@pytest.mark.parametrize("moment", ["before-rename", "mid-swap"])
def test_finished_build_killed_before_its_rename_is_adopted(tmp_path, moment):
    out = tmp_path / "stage"
    run_stage("s", out, {"a": 1}, {}, _build({"x.txt": "new"}))
    pid = _dead_pid()
    if moment == "before-rename":  # killed after the manifest was written, before os.replace
        out.rename(tmp_path / f".stage.tmp-{pid}")
    else:  # --force rebuild killed between "final -> .old" and ".tmp -> final"
        out.rename(tmp_path / f".stage.tmp-{pid}")
        (tmp_path / f".stage.old-{pid}").mkdir()
        (tmp_path / f".stage.old-{pid}" / "x.txt").write_text("older build")
    m = run_stage("s", out, {"a": 1}, {}, _never)
    assert m["skipped"] and (out / "x.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage"]


def test_half_written_temp_is_not_adopted(tmp_path):
    out = tmp_path / "stage"
    run_stage("s", out, {"a": 1}, {}, _build({"x.txt": "hello"}))
    (out / "x.txt").write_text("hel")  # killed mid-write: sizes disagree with the manifest
    out.rename(tmp_path / f".stage.tmp-{_dead_pid()}")
    m = run_stage("s", out, {"a": 1}, {}, _build({"x.txt": "hello"}))
    assert not m["skipped"] and (out / "x.txt").read_text() == "hello"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage"]


def test_refused_build_removes_the_folders_it_created(tmp_path):
    from hyco.base.errors import HycoError

    def refuse(tmp):
        raise HycoError("bad input")

    with pytest.raises(HycoError):
        run_stage("s", tmp_path / "new" / "run" / "stage", {"a": 1}, {}, refuse)
    assert list(tmp_path.iterdir()) == []


# --- byte-identical reruns ------------------------------------------------------------------------------


def test_safetensors_metadata_order_is_made_reproducible(tmp_path):
    """safetensors writes `__metadata__` in HashMap order, which changes from process to process."""
    import subprocess
    import sys

    from safetensors.numpy import load_file

    code = ("import numpy as np, sys; from safetensors.numpy import save_file; "
            "save_file({'x': np.arange(4, dtype=np.float32)}, sys.argv[1], "
            "metadata={k: k * 2 for k in 'abcdefgh'})")
    raw = set()
    for i in range(6):  # a 1-in-40320 chance that six processes agree by luck
        out = tmp_path / f"s{i}"
        out.mkdir()
        subprocess.run([sys.executable, "-c", code, str(out / "t.safetensors")], check=True)
        raw.add((out / "t.safetensors").read_bytes())
    assert len(raw) > 1, "safetensors now writes metadata in a fixed order; canonicalize_safetensors can go"
    from hyco.pipeline.artifacts import canonicalize_safetensors

    canon = set()
    for i in range(6):
        canonicalize_safetensors(tmp_path / f"s{i}")
        canon.add((tmp_path / f"s{i}" / "t.safetensors").read_bytes())
        assert load_file(str(tmp_path / f"s{i}" / "t.safetensors"))["x"].tolist() == [0, 1, 2, 3]
    assert len(canon) == 1
    # a canonical file (a LUT another stage wrote, copied) is left as it is: not rewritten, same mtime
    before = (tmp_path / "s0" / "t.safetensors").stat().st_mtime_ns
    os.utime(tmp_path / "s0" / "t.safetensors", ns=(before - 10**9, before - 10**9))
    canonicalize_safetensors(tmp_path / "s0")
    assert (tmp_path / "s0" / "t.safetensors").stat().st_mtime_ns == before - 10**9


def test_file_digests_read_each_file_once_and_see_rewrites(tmp_path, monkeypatch):
    import hashlib

    import hyco.base.files as base_files

    read = []
    real = base_files.sha256_file
    monkeypatch.setattr(base_files, "sha256_file", lambda p: read.append(Path(p).name) or real(p))
    monkeypatch.setattr(base_files, "_digests", {})
    files = []
    for i, size in enumerate((5, 3 << 20, 0, 70_000)):
        files.append(tmp_path / f"f{i}.bin")
        files[-1].write_bytes(os.urandom(size))
    os.link(files[1], tmp_path / "link.bin")  # a hard link: the same bytes, read once
    paths = [*files, tmp_path / "link.bin"]
    want = [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert base_files.file_digests(paths) == want
    assert len(read) == 4 and {"f0.bin", "f2.bin", "f3.bin"} < set(read)  # f1.bin or its link, once
    assert base_files.file_digests(paths[::-1]) == want[::-1] and len(read) == 4  # listed again: not read again
    files[0].write_bytes(b"other")  # rewritten (a new mtime): read again
    os.utime(files[0], ns=(1, 1))
    assert base_files.file_digests([files[0]]) == [hashlib.sha256(b"other").hexdigest()] and read[-1] == "f0.bin"


def test_only_json_that_may_hold_measured_keys_is_parsed():
    from hyco.pipeline.artifacts import _MEASURED_KEY, _may_hold_measured

    for key in ("wall_s", "peak_rss_mb", "drafter_ms_per_round", "s_per_pass"):
        assert _MEASURED_KEY.search(key) and _may_hold_measured(json.dumps({"a": {key: 1}}).encode())
    big = {"param_encodings": {f"w{i}": [{"scale": 0.1, "offset": -8, "bitwidth": 4}] for i in range(1000)}}
    assert not _may_hold_measured(json.dumps(big).encode())


def test_manifest_names_nondeterministic_outputs_and_why(tmp_path):
    from hyco.pipeline.artifacts import declare_nondeterministic

    def build(tmp):
        (tmp / "report.json").write_text(json.dumps({"mat": 1.5, "wall_s": 3.2, "graphs": {"a.onnx": {"finalize_s": 1}},
                                                     "rows": [{"loss": 1, "drafter_ms_per_round": 2}], "prompts": 3}))
        (tmp / "summary.md").write_text("took 3.2 s")
        declare_nondeterministic("summary.md", "prints the wall time")
        (tmp / "sim.json").write_text(json.dumps({"sim": {"diff": 0.1}, "sim_s": 2.0}))
        declare_nondeterministic("sim.json", "the simulator varies", ignore_pointers=["/sim/diff"])
        (tmp / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"_s": 17, "▁the": 5}}}))  # ids, not times
        return {}

    m = run_stage("s", tmp_path / "stage", {"a": 1}, {}, build)
    assert m["nondeterministic"] == {
        "report.json": {"reason": "measured wall-clock time / memory of this run",
                        "ignore_pointers": ["/graphs/a.onnx/finalize_s", "/rows/*/drafter_ms_per_round", "/wall_s"]},
        "summary.md": {"reason": "prints the wall time"},
        "sim.json": {"reason": "the simulator varies; measured wall-clock time / memory of this run",
                     "ignore_pointers": ["/sim/diff", "/sim_s"]},
        "stage.log": {"reason": "library output: timings, addresses and temp paths vary"}}
    declare_nondeterministic("x", "outside a stage: ignored")
    m2 = run_stage("s", tmp_path / "other", {"a": 1}, {}, _build({"x.txt": "hi"}))
    assert set(m2["nondeterministic"]) == {"stage.log"}


def test_peak_rss_of_a_child_is_its_own_not_its_parents():
    """A child started by a process that holds 600 MiB reports its own small peak. ru_maxrss
    fails this on Linux: subprocess starts children with vfork and exec keeps the parent's mark."""
    ballast = bytearray(600 * 2**20)
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])  # touch every page, so it is resident
    code = "from hyco.pipeline.artifacts import peak_rss_mb; print(peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert peak_rss_mb() > 600
    assert 1 < child < 300, f"child reported {child:.0f} MiB"
    del ballast


def test_a_stage_s_temp_files_live_beside_its_folder_and_go_with_it(tmp_path):
    """Inside run_stage, tempfile (and TMPDIR, for child processes) point at `.NAME.scratch-PID`
    beside the stage folder: a kill -9 leaves the scratch where the next run removes it (the
    stale-temp test above), and a finished or failed stage removes it itself."""
    import os
    import tempfile

    before = tempfile.gettempdir(), os.environ.get("TMPDIR")
    seen = {}

    def build(tmp):
        seen["mkdtemp"] = Path(tempfile.mkdtemp(prefix="hyco-x-"))
        seen["TMPDIR"] = os.environ["TMPDIR"]
        (seen["mkdtemp"] / "big.bin").write_bytes(b"x" * 10)
        (tmp / "x.txt").write_text("hello")
        if seen.get("fail"):
            raise RuntimeError("stage failed")

    run_stage("s", tmp_path / "stage", {"a": 1}, {}, build)
    scratch = tmp_path / f".stage.scratch-{os.getpid()}"
    assert seen["mkdtemp"].parent == scratch and seen["TMPDIR"] == str(scratch)
    assert not scratch.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["stage"]
    assert (tempfile.gettempdir(), os.environ.get("TMPDIR")) == before
    seen["fail"] = True
    with pytest.raises(RuntimeError):
        run_stage("s", tmp_path / "stage", {"a": 2}, {}, build)
    assert not scratch.exists() and (tempfile.gettempdir(), os.environ.get("TMPDIR")) == before


def test_peak_rss_never_reads_lower_than_before(monkeypatch):
    """VmHWM lags (the kernel folds the current RSS into its high-water mark lazily): a second
    read 0.1 MiB lower must not make a phase's 'peak so far' fall (a tiny calibrate's phases
    read 784.8 then 784.7 MiB)."""
    import hyco.base.memory as memory

    reads = iter([1_000_000, 999_900, 1_200_000])  # kB, as /proc/self/status gives them

    class Status:
        def __init__(self, _):
            pass

        def read_text(self):
            return f"Name:\tpython\nVmHWM:\t{next(reads)} kB\n"

    monkeypatch.setattr(memory, "_highest_rss_mb", (os.getpid(), 0.0))
    monkeypatch.setattr(memory, "Path", Status)
    assert [memory.peak_rss_mb() for _ in range(3)] == [1_000_000 / 1024, 1_000_000 / 1024, 1_200_000 / 1024]


def test_a_waited_child_s_peak_counts_in_this_process_s(monkeypatch):
    import hyco.base.memory as memory

    monkeypatch.setattr(memory, "_highest_rss_mb", (os.getpid(), 0.0))
    own = memory.peak_rss_mb()
    memory.note_child_peak(10_000.0)
    assert memory.peak_rss_mb() >= 10_000.0 + memory.rss_mb() * 0.5 > own


def test_a_child_s_peak_counts_with_the_parent_s_rss_from_before_it_ran(monkeypatch):
    """Workers that ran while this process held more than it holds now: their peaks add to the
    larger of the two (hyco.base.workers passes the RSS it had when they started)."""
    import hyco.base.memory as memory

    monkeypatch.setattr(memory, "_highest_rss_mb", (os.getpid(), 0.0))
    memory.note_child_peak(1_000.0, parent_mb=50_000.0)
    assert memory.peak_rss_mb() == 51_000.0
