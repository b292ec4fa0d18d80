"""The traced parity rule (convert/parity.py) on checkpoints it was not tuned on, and the stop on
a failed proof.

- The distilled tiny fixture and a peaky variant written here (norm weights 1 + 0.3 * randn,
  every linear's weight scale x3 with its output SRQ scale x3, int2 down_proj, int8 lm_head)
  pass the traced rule on the default rings (128 / 64) and on rings shrunk to 32 / 16; the
  undistilled fixture is covered by test_convert.py's shared conversion.
- `convert` on a graph broken on purpose exits 1 and leaves OUT absent; with
  --allow-parity-failure it exits 0, warns and marks the manifest, and a later stage refuses
  the marked folder unless given the same flag.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hyco.convert.parity import TIE_TOLERANCE

from hyco.config.recipe import ConvertConfig
from hyco.pipeline.cli import main

# The tiny recipe's convert section (recipes/tiny.yaml): rings 128 / 64, parity rings 32 / 16
TINY = ConvertConfig(rows=33, prefill_chunk=16, ring_full=128, ring_sliding=64, max_prompt=128, topk=8,
                     parity_ring_full=32, use_keep_set=False)


def write_peaky(src: Path, dst: Path, seed: int = 0) -> Path:
    """A copy of the tiny SLM with peakier weights: norm weights 1 + 0.3 * randn, every
    linear's weight scale (and its output SRQ scale, so codes keep their range) x3, every
    down_proj requantized to int2, lm_head int8 (the fixture's width, checked)."""
    from safetensors.torch import load_file, save_file

    from hyco.formats.gemma_quant import pack, quantize_rows, unpack

    g = torch.Generator().manual_seed(seed)
    config = json.loads((src / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["module_quant_configs"]["^lm_head$"]["num_bits"] == 8
    old_bits = dict(quant["module_quant_configs"])
    dst.mkdir(parents=True)
    from hyco.convert.load import module_bits

    for shard in sorted(src.glob("model-*.safetensors")):
        tensors = load_file(str(shard))
        for name in list(tensors):
            t = tensors[name]
            if re.search(r"norm\.weight$", name):
                tensors[name] = 1.0 + 0.3 * torch.randn(t.shape, generator=g)
            elif name.endswith(".weight_scale"):
                module = name[:-len(".weight_scale")]
                scale = t * 3.0
                if module.endswith("mlp.down_proj"):
                    bits = module_bits(module, {**quant, "module_quant_configs": old_bits})
                    width = tensors[f"{module}.weight"].shape[-1] * (8 // bits)
                    weight = unpack(tensors[f"{module}.weight"], bits, width).float() * scale
                    ints, scale = quantize_rows(weight, 2)
                    tensors[f"{module}.weight"] = pack(ints, 2)
                tensors[name] = scale.float().contiguous()
            elif name.endswith(".output_activation_scale"):
                tensors[name] = t * 3.0
        save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
    quant["module_quant_configs"] = {r"\.mlp\.down_proj$": {"num_bits": 2}, **old_bits}
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    return dst


def assert_traced_parity(out: Path) -> dict:
    """Every check passed the traced rule on both ring sizes; returns parity.json."""
    parity = json.loads((out / "parity.json").read_text())
    checks = parity["checks"]
    assert set(checks) == {"prefill_chain", "tree", "past_ring", "tree_past_the_ring", "prompt_past_the_ring"}
    assert parity["passed"] and parity["srq_points"] > 0, parity["failure"]
    for name, c in checks.items():
        assert c["passed"] and c["failure"] is None, (name, c["failure"])
        assert c["max_abs_diff"] <= 1e-4 and c["argmax_agreement"] == 1.0, name
        assert c["max_srq_input_rel_diff"] <= 1e-4, name  # forced ties leave no trace downstream
        for t in c["ties"]:  # each listed tie is a real one: both sides on the same .5 boundary
            k = min(t["graph_code"], t["reference_code"]) + 0.5
            assert abs(t["graph_code"] - t["reference_code"]) == 1
            assert abs(t["graph_value"] - k) <= TIE_TOLERANCE and abs(t["reference_value"] - k) <= TIE_TOLERANCE, t
    for name in ("prefill_chain", "tree"):
        assert checks[name]["rings"] == {"full_attention": 128, "sliding_attention": 64}
    for name in ("past_ring", "tree_past_the_ring", "prompt_past_the_ring"):
        assert checks[name]["rings"] == {"full_attention": 32, "sliding_attention": 16}
        assert checks[name]["context"] > 32 and "exceeds a ring" in checks[name]["reference"]
    assert parity["verdict"].startswith(f"bit-exact up to {parity['ties']} rounding tie")
    assert f"bit-exact up to {parity['ties']} rounding tie" in (out / "summary.md").read_text()
    return parity


@pytest.mark.slow  # a whole conversion with parity (~75 s on a busy 2-core machine)
def test_peaky_checkpoint_passes_traced_parity(tiny_text_family, tmp_path):
    from hyco.convert.stage import convert
    from safetensors.torch import load_file

    ck = write_peaky(tiny_text_family["slm"], tmp_path / "peaky")
    norms = torch.cat([v.reshape(-1) for s in ck.glob("model-*.safetensors") for k, v in load_file(str(s)).items()
                       if k.endswith("norm.weight")])
    assert 0.25 < float(norms.std()) < 0.35  # the variant really is peakier than the fixture
    convert(checkpoint=ck, out=tmp_path / "out", config=TINY)
    bitexact = json.loads((tmp_path / "out" / "bitexact.json").read_text())
    rows = bitexact["graphs"]["tree.onnx"]
    assert bitexact["all_equal"] and all(r["bits"] == 2 for s, r in rows.items() if s.endswith("down_proj"))
    assert rows["lm_head"]["bits"] == 8
    assert_traced_parity(tmp_path / "out")


@pytest.mark.slow
def test_distilled_checkpoint_passes_traced_parity(tiny_family_distilled, tmp_path):
    from hyco.convert.stage import convert

    convert(checkpoint=tiny_family_distilled["slm"], out=tmp_path / "out", config=TINY)
    assert_traced_parity(tmp_path / "out")


def _break_first_srq_scale(monkeypatch):
    """Test hook: the written graphs get their first SRQ scale 1% too large, after the
    bit-exact weights were written (so only the parity proof can see it)."""
    import onnx
    from hyco.convert import stage
    from onnx import numpy_helper

    finalize_all = stage.finalize_all

    def broken(raw, out, static):
        sizes = finalize_all(raw, out, static)
        for name in stage.GRAPHS.values():
            model = onnx.load(str(out / name), load_external_data=False)
            t = next(t for t in model.graph.initializer if t.name.endswith(".srq_out"))
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(1.01), t.name))
            onnx.save_model(model, str(out / name))
        return sizes

    monkeypatch.setattr(stage, "finalize_all", broken)


def _convert_cli(checkpoint: Path, out: Path, *extra: str) -> int:
    return main(["convert", "--checkpoint", str(checkpoint), "--out", str(out), "--rows", "4",
                 "--prefill-chunk", "4", "--ring-full", "16", "--ring-sliding", "8", *extra])


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_broken_graph_stops_convert_unless_allowed(tiny_family, tmp_path, monkeypatch, capsys):
    from hyco.pipeline.artifacts import run_stage

    _break_first_srq_scale(monkeypatch)
    out = tmp_path / "out"
    assert _convert_cli(tiny_family["slm"], out) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars: one line
    assert err.startswith("hyco-convert convert: proof failed: convert: parity "), err
    assert re.search(r"(prefill_chain|tree): SRQ code differs and is not a rounding tie", err), err
    assert not out.exists() and not list(tmp_path.glob(".out*"))

    assert _convert_cli(tiny_family["slm"], out, "--allow-parity-failure") == 0
    captured = capsys.readouterr()
    assert "WARNING: proof failed" in captured.err
    manifest = json.loads((out / "manifest.json").read_text())
    assert "not a rounding tie" in manifest["proof_failed"]
    assert json.loads((out / "parity.json").read_text())["passed"] is False

    # A later stage refuses the marked folder unless given the same flag
    def later(tmp):
        (tmp / "x").write_text("x")

    with pytest.raises(Exception, match="allow-parity-failure"):
        run_stage("check", tmp_path / "later", {}, {"convert": out}, later)
    assert not (tmp_path / "later").exists()
    run_stage("check", tmp_path / "later", {}, {"convert": out}, later, allow_parity_failure=True)
    assert (tmp_path / "later" / "x").is_file()


def test_run_stops_at_a_failed_proof(tmp_path, monkeypatch):
    """`run` stops at the stage whose proof fails (nothing moved into place, later stages not
    run); with allow_parity_failure the stage is kept, its manifest marked, and the later
    stage, given the same flag, accepts it."""
    from types import SimpleNamespace

    from hyco.base.errors import ProofFailed
    from hyco.config.recipe import Recipe
    from hyco.pipeline import run as pipeline

    ran = []

    def build_convert(recipe, run_dir, out):
        ran.append("convert")
        (out / "tree.onnx").write_text("graph")
        if not recipe.allow_parity_failure:
            raise ProofFailed("convert: parity tree: SRQ code differs and is not a rounding tie")
        return {"proof_failed": "parity tree: SRQ code differs and is not a rounding tie"}

    def build_qat(recipe, run_dir, out):
        ran.append("qat")
        (out / "mtp_step.onnx").write_text("graph")

    fake = {"convert": SimpleNamespace(inputs=lambda r, d: {}, build=build_convert, section=lambda r: {}),
            "qat": SimpleNamespace(inputs=lambda r, d: {"convert": Path(d) / "convert"}, build=build_qat,
                                   section=lambda r: {})}
    monkeypatch.setattr(pipeline, "load_stage", fake.__getitem__)
    recipe = Recipe(name="t", out=str(tmp_path), stages=("convert", "qat"))
    run = tmp_path / "run"
    with pytest.raises(ProofFailed, match="parity tree"):
        pipeline.run_recipe(recipe, run, log=lambda *_: None)
    assert ran == ["convert"] and not (run / "convert").exists() and not (run / "qat").exists()
    ran.clear()
    logs = []
    pipeline.run_recipe(recipe, run, allow_parity_failure=True, log=logs.append)
    assert ran == ["convert", "qat"] and any("WARNING" in line for line in logs)
    assert "rounding tie" in json.loads((run / "convert" / "manifest.json").read_text())["proof_failed"]
    # the marked stage is not reused, and the later stage refuses it, without the flag
    ran.clear()
    with pytest.raises(ProofFailed):
        pipeline.run_recipe(recipe, run, log=lambda *_: None)
    assert ran == ["convert"]


def test_step_graph_parity_build_taps_inputs_and_refuses_activation_rounding(tmp_path):
    """qat's step-graph proof rests on "the graph rounds only its inputs": the parity build
    exposes each input's QDQ output, and a QuantizeLinear on an activation is refused."""
    import onnx
    import onnxruntime as ort
    from hyco.qat.step_graph import tap_input_qdq
    from onnx import TensorProto, helper, numpy_helper

    def graph(activation_qdq: bool) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(np.array(1 / 512, np.float32), "s"),
                 numpy_helper.from_array(np.array(32768, np.uint16), "z")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x__q"]),
                 helper.make_node("DequantizeLinear", ["x__q", "s", "z"], ["x__dq"]),
                 helper.make_node("Mul", ["x__dq", "x__dq"], ["sq"])]
        if activation_qdq:
            nodes += [helper.make_node("QuantizeLinear", ["sq", "s", "z"], ["sq_q"]),
                      helper.make_node("DequantizeLinear", ["sq_q", "s", "z"], ["y"])]
        else:
            nodes.append(helper.make_node("Identity", ["sq"], ["y"]))
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])

    onnx.save(graph(False), str(tmp_path / "ok.onnx"))
    taps = tap_input_qdq(tmp_path / "ok.onnx", tmp_path / "ok.parity.onnx")
    assert taps == {"x": "x__dq"}
    x = np.array([[0.1, -0.3, 1 / 1024, 2.0]], np.float32)
    y, x_dq = ort.InferenceSession(str(tmp_path / "ok.parity.onnx")).run(["y", "x__dq"], {"x": x})
    np.testing.assert_array_equal(x_dq, np.rint(x * 512) / 512)  # the graph's own rounded input
    np.testing.assert_array_equal(y, x_dq * x_dq)  # everything after it is float
    onnx.save(graph(True), str(tmp_path / "bad.onnx"))
    with pytest.raises(RuntimeError, match="rounds an activation"):
        tap_input_qdq(tmp_path / "bad.onnx", tmp_path / "bad.parity.onnx")
