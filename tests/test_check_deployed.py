"""check on what ships (`check.drafters: deployed`): the export bundle's QDQ graphs on onnxruntime
CPU, against the float graphs (`X@float`), on the distilled family's CI-sized bundle."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

ROOT = Path(__file__).parents[1]


def coarse_copy(bundle: Path, out: Path, tensor: str, factor: float) -> Path:
    """A copy of `bundle` whose reference tree and prefill graphs quantize `tensor` on a grid
    `factor` times coarser (the scale its QuantizeLinear and DequantizeLinear share, times
    `factor`): 16 bits become about 16 - log2(factor) effective ones. bundle.json re-sealed."""
    shutil.copytree(bundle, out)
    meta = json.loads((out / "bundle.json").read_text())
    for graph in ("tree", "prefill"):
        name = f"reference/{graph}.qdq.onnx"
        model = onnx.load(str(out / name), load_external_data=False)
        q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
        scale = next(t for t in model.graph.initializer if t.name == q.input[1])
        scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(factor), scale.name))
        onnx.save(model, str(out / name))
        meta["files"][name] = {"bytes": (out / name).stat().st_size,
                               "sha256": hashlib.sha256((out / name).read_bytes()).hexdigest()}
    (out / "bundle.json").write_text(json.dumps(meta, indent=2))
    return out


def check_report(run_dir: Path, family: dict, bundle: Path, out: Path, configs: list[str], *sets: str) -> dict:
    from hyco.runtime_check.check import CheckInputs, PhoneShapes, run_check
    from hyco.runtime_check.stage import phone_shapes
    from ladder import LADDER

    from hyco.config.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml",
                         [*LADDER, "check.backend=onnxruntime", "check.prompts=3", "check.max_new_tokens=24",
                          "check.bootstrap_resamples=500", *sets])
    inputs = CheckInputs(verifier=family["verifier"], assistant=family["assistant"], slm=family["slm"],
                         tokenizer=family["tokenizer"], vocab_dir=run_dir / "vocab", dataset=recipe.dataset,
                         convert_dir=run_dir / "convert", qat_dir=run_dir / "qat", bundle_dir=bundle,
                         phone=PhoneShapes(**phone_shapes(recipe)))
    run_check(inputs, recipe.check, out, configs=configs)
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
def test_deployed_drafters_run_the_bundles_graphs_and_a_coarse_grid_lowers_their_mat(tiny_export_distilled,
                                                                                      tiny_family_distilled, tmp_path):
    """The SLM-only tree (SpecEdge-style, exact) on the deployed QDQ graphs and on convert's float
    graphs: both lossless, the report naming the bundle's graphs and pairing the two. With the
    head's input (the final norm's output) on a grid 65,536 times coarser in the bundle's graphs
    (one code over its range; 4,096 times moved the main job's MAT by less than its interval), the
    deployed drafts are rejected while the float twin's MAT stays the same to the last digit: the
    check measures the numerics that ship."""
    run_dir, bundle = tiny_export_distilled
    family = tiny_family_distilled
    report = check_report(run_dir, family, bundle, tmp_path / "check", ["specedge", "specedge@float"])
    assert "export bundle's tree/prefill QDQ graphs" in report["settings"]["backends"]["slm"]
    deployed, floats = report["configs"]["specedge"], report["configs"]["specedge@float"]
    for name in ("specedge", "specedge@float"):
        assert report["lossless"][name]["equal"], name
    assert deployed["mat"] > 1.3 and floats["mat"] > 1.3, (deployed["mat"], floats["mat"])
    (pair,) = report["settings"]["paired_mat"]["pairs"]
    assert (pair["config"], pair["against"]) == ("specedge", "specedge@float")
    assert pair["percent"] == pytest.approx(100 * (deployed["mat"] / floats["mat"] - 1))

    coarse = coarse_copy(bundle, tmp_path / "coarse", "/output/norm/Mul_2_output_0", 65536.0)
    again = check_report(run_dir, family, coarse, tmp_path / "check-coarse", ["specedge", "specedge@float"])["configs"]
    broken = again["specedge"]
    assert broken["mat"] < deployed["mat"] - 0.3, (broken["mat"], deployed["mat"])
    assert broken["mat"] < deployed["mat_ci"]["ci"][0], (broken["mat"], deployed["mat_ci"])
    assert again["specedge@float"]["mat"] == floats["mat"]  # the float graphs did not change: nor did their MAT


class TeeGraph:
    """The torch executor's graph, run beside onnxruntime's on the same feeds: returns torch's
    outputs and records, per output, the codes or ids that differ (of how many) and the largest
    float difference with the largest float."""

    def __init__(self, torch_graph, ort_session, log: list):
        self.torch_graph, self.ort_session, self.log = torch_graph, ort_session, log
        self.mode = torch_graph.mode

    def run(self, names, feeds):
        got, want = self.torch_graph.run(names, feeds), self.ort_session.run(names, feeds)
        for name, g, w in zip(names, got, want, strict=True):
            if g.dtype.kind == "f":
                self.log.append((name, "float", float(np.abs(g - w).max()), float(np.abs(w).max())))
            else:
                self.log.append((name, "codes", int((g != w).sum()), g.size))
        return got


@pytest.mark.slow
def test_the_torch_executor_runs_check_as_onnxruntime_does(tiny_export_distilled, tiny_family_distilled, tmp_path,
                                                          monkeypatch):
    """check.deployed_executor torch (hyco/quant/qdq_torch.py, on the CPU here) against onnxruntime CPU
    on the bundle's own QDQ graphs, HyCo's tree (both drafters) over the check's real feeds.

    Not bit-exact: onnxruntime's ReduceMean sums in Eigen's order (which varies with the CPU's
    SIMD width), torch in its own, so a mean differs in its last bit now and then and can move one
    16-bit code downstream (seen: /per_layer/norm's Sqrt, then 5e-4 after its Reciprocal).
    Bounds: top-k ids, MTP ids and KV ring codes differ in at most 0.1% of elements (seen: none);
    log-probs within 0.1 nats (seen: 0.052, on a prefill pass; the HTP is held to 0.2-1.2 nats
    by smoke), the MTP's h within 1% of its largest value (seen: 0.02%). Where no id or code
    differed, the drafts were the same, so the MAT and every acceptance figure must be equal."""
    from hyco.qnn.ort import ort_session
    from hyco.quant.qdq_torch import TorchGraph
    from hyco.runtime import qnn_backend

    run_dir, bundle = tiny_export_distilled
    log: list = []
    monkeypatch.setattr(qnn_backend, "_SHARED", {})
    monkeypatch.setattr(qnn_backend.BundleSessions, "_torch_graph",
                        lambda self, path: TeeGraph(TorchGraph(path, shared=self.folded), ort_session(path), log))
    by_torch = check_report(run_dir, tiny_family_distilled, bundle, tmp_path / "torch", ["hyco"],
                            "check.deployed_executor=torch")
    monkeypatch.setattr(qnn_backend, "_SHARED", {})
    by_ort = check_report(run_dir, tiny_family_distilled, bundle, tmp_path / "ort", ["hyco"],
                          "check.deployed_executor=onnxruntime")
    runner = by_torch["settings"]["backends"]["slm"]
    assert "torch on cpu (hyco/quant/qdq_torch.py)" in runner and all(f"{g} eager" in runner for g in ("tree", "prefill", "mtp_step"))
    assert "onnxruntime CPU" in by_ort["settings"]["backends"]["slm"]
    names = {name for name, *_ in log}
    assert {"topk_indices", "topk_ids", "next_hidden"} <= names and any(n.startswith("new_k") for n in names)
    assert len(log) > 100
    differing = sum(bad for _, kind, bad, _ in log if kind == "codes")
    assert differing <= 1e-3 * sum(size for _, kind, _, size in log if kind == "codes"), differing
    assert max(d for n, kind, d, _ in log if n == "topk_logprobs") < 0.1
    assert max(d / top for n, kind, d, top in log if n == "next_hidden") < 0.01
    t, o = by_torch["configs"]["hyco"], by_ort["configs"]["hyco"]
    assert t["mat"] > 1.5 and o["mat"] > 1.5
    if differing == 0:
        for key in ("mat", "rounds", "accepted_per_round", "chain_acceptance_cumulative", "accepted_share_by_source"):
            assert t[key] == o[key], key
    else:
        assert abs(t["mat"] - o["mat"]) < 0.05 * o["mat"]
