"""calibrate's fidelity floor: a deployed graph whose KL against its float graph, or one of whose
layers' SQNR, crosses the recipe's floor stops the stage with one line naming the graph, the
metric, the worst layer and the tensor that loses the most decibels."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from hyco.calibrate.evaluate import tensor_losses
from hyco.calibrate.stage import floor_failure, proof_failures
from onnx import TensorProto, helper, numpy_helper


def _layer_graph(coarse: str | None) -> onnx.ModelProto:
    """x -> /layers.0/a (Mul) -> /layers.0/b (Add) -> /layers.0/c (Tanh) -> y; with `coarse`, that
    tensor passes through a Q/DQ pair on a grid of 1/8 (its consumers read the DQ output, as
    onnxruntime's QDQ quantizer rewires them)."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["/layers.0/a_out"], name="/layers.0/a"),
             helper.make_node("Add", ["/layers.0/a_out", "w"], ["/layers.0/b_out"], name="/layers.0/b"),
             helper.make_node("Tanh", ["/layers.0/b_out"], ["y"], name="/layers.0/c")]
    inits = [numpy_helper.from_array(np.full((4,), 0.3, np.float32), "w")]
    if coarse:
        inits += [numpy_helper.from_array(np.array(0.125, np.float32), "s"),
                  numpy_helper.from_array(np.array(0, np.int8), "z")]
        for n in nodes:
            n.input[:] = [f"{coarse}_dq" if i == coarse else i for i in n.input]
        nodes += [helper.make_node("QuantizeLinear", [coarse, "s", "z"], [f"{coarse}_q"]),
                  helper.make_node("DequantizeLinear", [f"{coarse}_q", "s", "z"], [f"{coarse}_dq"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_tensor_losses_name_the_tensor_whose_grid_is_coarse(tmp_path):
    feeds = [{"x": np.random.default_rng(i).normal(size=(3, 4)).astype(np.float32)} for i in range(3)]
    rows = tensor_losses(_layer_graph(None), _layer_graph("/layers.0/a_out"), "layer 0", feeds, tmp_path, "t")
    assert rows[0]["tensor"] == "/layers.0/a_out" and rows[0]["grid_sqnr_db"] < 30, rows  # the 1/8 grid
    assert rows[0]["sqnr_db"] > 100  # its own value is computed from exact inputs
    by = {r["tensor"]: r for r in rows}
    assert by["/layers.0/b_out"]["sqnr_db"] < 35 and by["/layers.0/b_out"]["grid_sqnr_db"] is None  # reads the copy
    rows = tensor_losses(_layer_graph(None), _layer_graph(None), "layer 0", feeds, tmp_path, "u")
    assert all(r["sqnr_db"] > 100 and r["grid_sqnr_db"] is None for r in rows)


FLOOR = {"max_kl": 0.015, "min_sqnr_db": 20.0}


def _row(kl: float, db: float, tensors=None) -> dict:
    floor = {**FLOOR, "kl": kl, "worst_layer": {"layer": "layer 6", "sqnr_db": db}, "kl_ok": kl <= 0.015,
             "sqnr_ok": db >= 20.0}
    floor["passed"] = floor["kl_ok"] and floor["sqnr_ok"]
    if tensors:
        floor["worst_tensors"] = tensors
    return {"fidelity_floor": floor, "weights_bitexact": {"all_equal": True}, "mask_margin": {"max_masked_mass": 0.0},
            "htp": {}, "htp_accepted": None, "cpu_nodes": None}


def test_the_floors_message_names_graph_metric_layer_and_tensor():
    worst = [{"tensor": "/layers.6/mlp/down/MatMul_output_0", "op": "MatMul", "sqnr_db": 12.3, "grid_sqnr_db": 14.0}]
    assert proof_failures({"prefill.qdq.onnx": _row(0.002, 31.0)}) is None
    line = proof_failures({"prefill.qdq.onnx": _row(0.03, 12.3, worst), "tree.qdq.onnx": _row(0.002, 31.0)})
    assert line == ("prefill.qdq.onnx: below the fidelity floor: KL against its float graph 0.0300 nats > 0.015 and "
                    "SQNR 12.3 dB < 20.0 dB (worst layer: layer 6 at 12.3 dB; worst tensor: "
                    "/layers.6/mlp/down/MatMul_output_0 (MatMul, its own grid 14.0 dB, 12.3 dB against float))")
    assert floor_failure("g", _row(0.5, 25.0)["fidelity_floor"]).startswith("g: below the fidelity floor: KL ")


def test_a_tree_only_slm_whose_prompt_passes_cross_the_floor_is_refused_though_its_pooled_kl_holds():
    """A tree-only SLM's prompt passes are a minority of its rows: pooled with the rounds they can
    hide. `pass_subset` splits the passes by kind and the floor holds the prompt's KL on its own."""
    from hyco.calibrate.evaluate import pass_subset

    top1 = [np.array([True, False]), np.array([True, True, True])]
    kl = [np.array([0.04, 0.02]), np.array([0.001, 0.001, 0.001])]
    prompt = pass_subset(top1, kl, [0.5, 0.1], [2, 3], [True, False], True)
    assert prompt == {"passes": 1, "rows": 2, "top1_agreement": 0.5, "kl": pytest.approx(0.03), "topk_logprob_error": 0.5}
    assert pass_subset(top1, kl, [0.5, 0.1], [2, 3], [True, False], False)["kl"] == pytest.approx(0.001)
    assert pass_subset(top1, kl, [0.5, 0.1], [2, 3], [False, False], True)["passes"] == 0
    row = _row(0.0126, 31.0)  # pooled over all five rows: under the floor
    row["fidelity_floor"].update(prefill_passes_kl=0.03, prefill_kl_ok=False, passed=False)
    line = proof_failures({"tree.qdq.onnx": row})
    assert line == "tree.qdq.onnx: below the fidelity floor: KL on its prompt (prefill) passes 0.0300 nats > 0.015 " \
                   "(worst layer: layer 6 at 31.0 dB)", line


@pytest.mark.slow  # a calibration (~1 min)
def test_calibrate_refuses_a_graph_quantized_on_a_bad_grid(tiny_calibrated, tmp_path):
    """8-bit activations where the graphs need 16: the floor (its defaults) stops the stage, one
    line, exit 1, nothing moved into place; the message names the layer and the tensor."""
    run, out = tiny_calibrated, tmp_path / "calibrate"
    args = [x for k in ("convert", "qat", "vocab", "answers") for x in (f"--{k}", str(run / k))]
    sets = ["calibrate.activation_bits=8", "calibrate.prompts=2", "calibrate.eval_prompts=1",
            "calibrate.max_new_tokens=16", "calibrate.sqnr_passes=2", "calibrate.fidelity_seeds=1"]
    done = subprocess.run([sys.executable, "-m", "hyco.pipeline.cli", "calibrate", *args, "--out", str(out), "--no-htp-check",
                           *[x for s in sets for x in ("--set", s)]], capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("hyco-convert calibrate:")]
    assert len(lines) == 1 and "proof failed" in lines[0] and "below the fidelity floor" in lines[0], done.stderr[-3000:]
    assert "worst layer: layer " in lines[0] and "worst tensor: " in lines[0], lines[0]
    assert not out.exists()
    ladder = json.loads((run / "calibrate" / "report.json").read_text())  # the same inputs at 16 bits, no floor
    assert ladder["fidelity_floor"]["max_kl"] is None


def _srq_graph(span: float) -> onnx.ModelProto:
    """x -> 16-bit Q/DQ on [-span/2, span/2] (a calibrated min/max grid) -> the checkpoint's int8
    SRQ Q/DQ of step 1 -> y: the SRQ's input spans `span` of its codes."""
    s16 = span / 65535
    inits = [numpy_helper.from_array(np.array(s16, np.float32), "s16"), numpy_helper.from_array(np.array(32768, np.uint16), "z16"),
             numpy_helper.from_array(np.array(1.0, np.float32), "s8"), numpy_helper.from_array(np.array(0, np.int8), "z8")]
    nodes = [helper.make_node("Mul", ["x", "s8"], ["/layers.0/down/MatMul_output_0"]),
             helper.make_node("QuantizeLinear", ["/layers.0/down/MatMul_output_0", "s16", "z16"], ["q16"]),
             helper.make_node("DequantizeLinear", ["q16", "s16", "z16"], ["dq16"]),
             helper.make_node("QuantizeLinear", ["dq16", "s8", "z8"], ["q8"]),
             helper.make_node("DequantizeLinear", ["q8", "s8", "z8"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_an_srq_that_spans_few_of_its_codes_is_found_and_named_in_the_floors_message():
    from hyco.calibrate.evaluate import SRQ_MIN_CODES, srq_code_spans

    spans = srq_code_spans(_srq_graph(15.0))
    assert spans == [{"tensor": "/layers.0/down/MatMul_output_0", "codes": 15.0}], spans
    assert srq_code_spans(_srq_graph(200.0))[0]["codes"] == 200.0
    assert srq_code_spans(_layer_graph("/layers.0/a_out")) == []  # an int8 Q/DQ on a float input: no 16-bit grid, not an SRQ here
    row = _row(0.002, 18.3)["fidelity_floor"]
    said = "int8 output quantizer (SRQ) at /layers.0/down/MatMul_output_0 spans 15 of its 255 codes"
    assert said in floor_failure("g", {**row, "srq_fewest_codes": spans})
    fitted = [{"tensor": "/layers.0/down/MatMul_output_0", "codes": float(SRQ_MIN_CODES)}]
    assert "SRQ" not in floor_failure("g", {**row, "srq_fewest_codes": fitted})
