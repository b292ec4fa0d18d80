"""`hyco-convert run` end to end on the embedded default's recipe, shrunk to CI size: every
stage in order, manifests, the run report, skipping on rerun, rebuilding on change."""

import json

import pytest
from ladder import LADDER, STAGES, run_args

from hyco.pipeline.cli import main


@pytest.fixture(scope="module")
def run_dir(ladder):
    """The fast tier's ladder (tests/ladder.py): the tiny recipe itself with its costly parts cut
    (no distillation, few prompts, two QAT steps, no parity, no HTP check, no smoke run at the end of
    export: tests/test_smoke.py runs it on a bundle, tests/test_export.py checks that a failed one
    stops the stage). Every stage and every code path between them still runs."""
    return ladder


def test_every_stage_writes_its_folder_and_manifest(run_dir):
    report = json.loads((run_dir / "run_report.json").read_text())
    stages = [s["stage"] for s in report["stages"]]
    assert stages == STAGES
    for name in stages:
        manifest = json.loads((run_dir / name / "manifest.json").read_text())
        assert manifest["stage"] == name and manifest["outputs"]
        for rel, meta in manifest["outputs"].items():
            assert (run_dir / name / rel).stat().st_size == meta["bytes"]
        # every stage ends the same way (`finish_stage`): report.json with its proof's verdict, the
        # peak RSS and the toolchain, and a summary.md
        stage_report = json.loads((run_dir / name / "report.json").read_text())
        assert {"proof_failed", "peak_rss_mb", "toolchain"} <= set(stage_report), name
        assert stage_report["proof_failed"] is None and manifest["summary"]["proof_failed"] is None, name
        assert (run_dir / name / "summary.md").read_text().startswith("# "), name
    assert (run_dir / "run_summary.md").read_text().startswith("# Run of recipe `tiny`")
    # no temp folder survives a finished run, and no report names one (they name final paths)
    assert not [p for p in run_dir.iterdir() if ".tmp-" in p.name]
    # nor a stage's scratch folder, nor anything a library recreated inside one after it went
    assert not [p for p in run_dir.iterdir() if ".scratch-" in p.name]
    written = [p for p in run_dir.rglob("*") if p.suffix in (".md", ".json") and p.is_file()]
    assert len(written) > 2 * len(stages)
    assert not [p for p in written if any(t in p.read_text() for t in (".tmp-", ".scratch-"))]


def test_the_stages_hand_each_other_their_artifacts(run_dir):
    # Every linear of every graph carries the checkpoint's integers and scales, bit for bit.
    bitexact = json.loads((run_dir / "convert" / "bitexact.json").read_text())
    weights = set(json.loads((run_dir / "convert" / "encodings.json").read_text())["weights"])
    assert bitexact["all_equal"] is True
    assert set(bitexact["graphs"]) == {"tree.onnx", "prefill.onnx"}
    for graph, rows in bitexact["graphs"].items():
        assert set(rows) == weights and "lm_head" in rows, graph
        for source, row in rows.items():
            assert row["ints_equal"] is True and row["scales_equal"] is True, (graph, source)
    assert (run_dir / "convert" / "tree.onnx").is_file() and (run_dir / "qat" / "mtp_step.onnx").is_file()
    # export compiled calibrate's tree and MTP graphs for SM8850 (tree-only: one copy of the SLM's
    # weights, the tree graph prefills too) into a bundle that lists every file it holds
    bundle = json.loads((run_dir / "export" / "bundle" / "bundle.json").read_text())
    assert bundle["soc_model"] == 87 and set(bundle["graphs"]) == {"tree", "mtp_step"}
    for g in bundle["graphs"].values():
        for part in g["parts"]:
            assert bundle["files"][part["binary"]]["bytes"] == part["binary_bytes"] > 0
    assert bundle["files"]["reference/tree.qdq.onnx"]["sha256"] == \
        json.loads((run_dir / "calibrate" / "manifest.json").read_text())["outputs"]["tree.qdq.onnx"]["sha256"]
    export = json.loads((run_dir / "export" / "manifest.json").read_text())
    assert export["summary"]["smoke_passed"] is None  # the ladder turns the smoke run off
    # declared whole: the context binaries (and the summary's timings); bundle.json only at their hashes
    declared = export["nondeterministic"]
    assert {k for k, v in declared.items() if v.get("ignore_pointers") is None} == \
        {"summary.md", "stage.log", *(f"bundle/{n}" for n in export["summary"]["binaries"])}
    assert {p.split("/")[-1] for p in declared["bundle/bundle.json"]["ignore_pointers"]} == {"sha256", "compile_s"}
    check = json.loads((run_dir / "check" / "report.json").read_text())
    text = json.dumps(check)
    for name in ("hyco", "hyco-exact", "cloud-mtp"):
        assert f'"{name}"' in text
    # the check ran the phone's drafters on the integer graphs, as the tiny recipe asks
    assert "onnxruntime" in text
    # and says whether the exact configurations decoded losslessly (keyed sampling, against the
    # verifier's own text), on prompts chosen by that text's statistics, which it reports
    assert set(check["lossless"]) == {"hyco-exact", "cloud-mtp"}
    assert all(v["equal"] is True and v["tokens_compared"] > 0 for v in check["lossless"].values())
    selection = check["settings"]["prompt_selection"]
    assert sum(r["chosen"] for r in selection) == check["settings"]["prompts"] and len(selection) >= 2
    assert "## Prompts" in (run_dir / "check" / "summary.md").read_text()


def test_rerun_skips_and_a_changed_section_rebuilds(run_dir, capsys):
    before = json.loads((run_dir / "vocab" / "manifest.json").read_text())
    assert main(run_args(run_dir)) == 0
    out = capsys.readouterr().out
    assert out.count("skipped (manifest matches)") == len(STAGES)
    assert json.loads((run_dir / "vocab" / "manifest.json").read_text()) == before
    # a changed section reruns its stage and the stages that read it
    try:
        assert main(run_args(run_dir, [*LADDER, "check.max_new_tokens=6"])) == 0
        out = capsys.readouterr().out
        assert out.count("skipped (manifest matches)") == len(STAGES) - 1 and "[check] built" in out
    finally:
        assert main(run_args(run_dir)) == 0  # the shared ladder back as the session built it
