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


def check_report(run_dir: Path, family: dict, bundle: Path, out: Path, configs: list[str]) -> dict:
    from hyco.runtime_check.check import run_check
    from hyco.runtime_check.stage import phone_shapes
    from ladder import LADDER

    from hyco.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml",
                         [*LADDER, "check.backend=onnxruntime", "check.prompts=3", "check.max_new_tokens=24",
                          "check.bootstrap_resamples=500"])
    run_check(verifier=family["verifier"], assistant=family["assistant"], slm=family["slm"],
              tokenizer=family["tokenizer"], vocab_dir=run_dir / "vocab", dataset=recipe.dataset, config=recipe.check,
              out=out, configs=configs, convert_dir=run_dir / "convert", qat_dir=run_dir / "qat", bundle_dir=bundle,
              **phone_shapes(recipe))
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
