"""Atomic stage folders and manifests: no half artifact, reruns skip, edits invalidate."""

import json

import pytest

from hyco.artifacts import atomic_dir, manifest_matches, run_stage, stage_key


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
