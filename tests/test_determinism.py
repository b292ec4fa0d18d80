"""Byte-identical reruns: the same recipe and seed, run twice from nothing in fresh processes,
write the same bytes in every artifact (tests/reruns.py says what a comparison leaves out:
manifests' timing fields, the run log, and files a manifest declares `nondeterministic`)."""

import json
import shutil

import pytest
from reruns import fresh_run

from hyco.pipeline.compare import differences


@pytest.mark.slow
def test_two_fresh_runs_write_identical_artifacts(reference_run):
    reference, path = reference_run
    shutil.rmtree(path, ignore_errors=True)
    fresh_run(path)
    try:
        diffs = differences(reference, path)
        assert not diffs, "\n".join(diffs)
        declared = {}
        for manifest in sorted(path.glob("*/manifest.json")):
            declared.update({f"{manifest.parent.name}/{k}": v
                             for k, v in json.loads(manifest.read_text()).get("nondeterministic", {}).items()})
        for name, why in declared.items():  # each exception names its cause
            assert why.get("reason"), name
        # export: only the QNN context binaries vary (their bytes depend on the QNN sessions opened
        # earlier in the process), so bundle.json is compared but for their hashes, and every other
        # file of the bundle (EPContext wrappers, LUTs, io_spec, reference graphs) byte for byte
        manifest = json.loads((path / "export" / "manifest.json").read_text())
        binaries = {f"bundle/{n}" for n in manifest["summary"]["binaries"]}
        assert len(binaries) == 2 and all(n.endswith(".bin") for n in binaries)  # tree (it prefills too), mtp_step
        assert {k for k, v in declared.items() if k.startswith("export/") and v.get("ignore_pointers") is None} == \
            {f"export/{n}" for n in (*binaries, "summary.md", "stage.log")}
        assert {p.split("/")[-1] for p in declared["export/bundle/bundle.json"]["ignore_pointers"]} == \
            {"sha256", "compile_s"}
        compared = [k for k in manifest["outputs"] if k.startswith("bundle/") and k not in manifest["nondeterministic"]]
        assert any(k.endswith("_ctx.onnx") for k in compared) and "bundle/reference/tree.qdq.onnx" in compared
    finally:
        shutil.rmtree(path, ignore_errors=True)
