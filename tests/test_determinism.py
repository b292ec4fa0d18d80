"""Byte-identical reruns: the same recipe and seed, run twice from nothing in fresh processes,
write the same bytes in every artifact (tests/reruns.py says what a comparison leaves out:
manifests' timing fields, the run log, and files a manifest declares `nondeterministic`)."""

import json
import shutil

import pytest
from reruns import differences, fresh_run


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
    finally:
        shutil.rmtree(path, ignore_errors=True)
