"""Fidelity of the QDQ graphs against their float graphs, on held-out reserved EVAL prompts.

SLM graphs: a float driver (convert's graphs) and a QDQ driver (the parity twin: float I/O,
logits kept) walk each eval answer in lockstep (`drive.lockstep`: identical trees, each its
own KV ring, so the QDQ graph's KV error accumulates as on the phone); every active row is
compared: greedy top-1 agreement and KL(float || QDQ) over the keep set.
MTP step: bursts of K steps from the eval captures; the QDQ graph carries its own
next_hidden through the burst (`drive.replay_mtp`).
Per-layer SQNR: the layer outputs (the Mul by `layer_scalar`) of both graphs on the same feeds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LAYER_SCALAR = re.compile(r"layers[._](\d+)[._]+layer_scalar|layer_scalar__(\d+)")  # convert's | qat's names


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_rows(ref_logprobs: np.ndarray, q_logprobs: np.ndarray) -> np.ndarray:
    """KL(ref || q) per row. The QDQ graph's log-probs sit on a 16-bit grid whose floor clips the
    deep tail, so their exponentials do not sum to 1 (the KL came out negative on the MTP
    graph): q is renormalized first, to the distribution the quantized graph implies."""
    return (np.exp(ref_logprobs) * (ref_logprobs - log_softmax(q_logprobs))).sum(-1)


def layer_outputs(model) -> dict[str, str]:
    """'layer i' -> the tensor each decoder layer ends with (its Mul by layer_scalar)."""
    out = {}
    for node in model.graph.node:
        for x in node.input:
            m = LAYER_SCALAR.search(x)
            if node.op_type == "Mul" and m:
                out[f"layer {int(m.group(1) or m.group(2))}"] = node.output[0]
    return dict(sorted(out.items(), key=lambda kv: int(kv[0].split()[1])))


def logsoftmax_output(model) -> str | None:
    """The log-probabilities tensor: a LogSoftmax's output, or the one `log_softmax_as_exp_sum`
    wrote out (same name, made by its final Sub)."""
    return next((n.output[0] for n in model.graph.node
                 if n.op_type == "LogSoftmax" or (n.op_type == "Sub" and n.name.endswith("_log_softmax"))), None)


def layer_taps(session, tensors: list[str], feeds: list[dict], rows: list[int]) -> list[list[np.ndarray]]:
    """`tensors` of `session` (one that returns them: `stage.extra_output_session`) on each of
    `feeds`, cut to its first `rows[i]` rows."""
    if not tensors:  # (onnxruntime would return every output for an empty list)
        return [[] for _ in feeds]
    inputs = {i.name for i in session.get_inputs()}
    return [[x[:n] for x in session.run(tensors, {k: v for k, v in f.items() if k in inputs})]
            for f, n in zip(feeds, rows, strict=True)]


def sqnr_db(labels: list[str], ref: list[list[np.ndarray]], quantized: list[list[np.ndarray]]) -> dict[str, float]:
    """10 log10(sum ref^2 / sum (ref - q)^2) per layer, summed over passes (`layer_taps`' lists)."""
    signal, noise = np.zeros(len(labels)), np.zeros(len(labels))
    for a, b in zip(ref, quantized, strict=True):
        for j, (x, y) in enumerate(zip(a, b, strict=True)):
            x, y = x.astype(np.float64), y.astype(np.float64)
            signal[j] += float((x * x).sum())
            noise[j] += float(((x - y) ** 2).sum())
    return {label: (10 * math.log10(signal[j] / noise[j]) if noise[j] > 0 else math.inf)
            for j, label in enumerate(labels)}


def sqnr(ref_model, q_model, feeds: list[dict], tmp: Path, tag: str, rows: list[int] | None = None,
         weights: tuple[Path, Path] | None = None) -> dict[str, float]:
    """Per-layer SQNR of `q_model` against `ref_model` over `feeds` (first `rows[i]` rows), each
    through a session of its own. `weights`: the external-data folders of weightless models."""
    from hyco.calibrate.stage import extra_output_session

    names = layer_outputs(ref_model)
    if not names:
        return {}
    tensors, rows = list(names.values()), rows or [None] * len(feeds)
    taps = [layer_taps(extra_output_session(model, tensors, tmp, f"{tag}_{side}", folder), tensors, feeds, rows)
            for model, side, folder in ((ref_model, "ref", weights and weights[0]), (q_model, "q", weights and weights[1]))]
    return sqnr_db(list(names), *taps)


# Ops whose outputs are no activations to measure: constants, quantization nodes, shape plumbing.
NOT_ACTIVATIONS = {"Constant", "QuantizeLinear", "DequantizeLinear", "Shape", "Gather", "Unsqueeze", "Squeeze",
                   "Reshape", "Transpose", "Concat", "Slice", "Cast", "TopK", "Expand", "Tile"}


def layer_nodes(model, layer: str | None):
    """The nodes of decoder layer `layer` ('layer 6': convert's `/layers.6/...` names), or every
    node where the graph names no layers (qat's flat step graph)."""
    index = None if layer is None else layer.split()[-1]
    mine = [n for n in model.graph.node if index is not None and f"/layers.{index}/" in n.name]
    return mine or list(model.graph.node)


def dequantized_copies(model) -> dict[str, str]:
    """tensor -> the output of its QuantizeLinear -> DequantizeLinear pair (what its readers get)."""
    q_of = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    dq_of = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return {t: dq_of[q] for t, q in q_of.items() if q in dq_of}


def tensor_losses(ref_model, q_model, layer: str | None, feeds: list[dict], tmp: Path, tag: str,
                  weights: tuple[Path | None, Path | None] = (None, None)) -> list[dict[str, Any]]:
    """Where `layer` loses its decibels: for each activation its nodes compute, the SQNR of the
    QDQ graph's value against the float graph's (`sqnr_db`, all error so far) and the SQNR of its
    own grid (`grid_sqnr_db`: its 16-bit copy against its value in the QDQ graph, the rounding this
    one grid adds; the QDQ graph keeps each op's output name, its Q/DQ pair come after). Coarsest
    grid first: the first row is the tensor to look at."""
    from hyco.calibrate.stage import extra_output_session

    copies = dequantized_copies(q_model)
    q_names = {o for n in q_model.graph.node for o in n.output}
    nodes = [n for n in layer_nodes(ref_model, layer) if n.op_type not in NOT_ACTIVATIONS and n.output[0] in q_names]
    names = [n.output[0] for n in nodes]
    if not names:
        return []
    dq = [copies[t] for t in names if t in copies]
    ref = layer_taps(extra_output_session(ref_model, names, tmp, f"{tag}_ref", weights[0]), names, feeds,
                     [None] * len(feeds))
    q = layer_taps(extra_output_session(q_model, names + dq, tmp, f"{tag}_q", weights[1]), names + dq, feeds,
                   [None] * len(feeds))
    own = sqnr_db(names, ref, [x[:len(names)] for x in q])
    by_name = [dict(zip(names + dq, x, strict=True)) for x in q]
    quantized = [t for t in names if t in copies]
    grid = sqnr_db(quantized, [[x[t] for t in quantized] for x in by_name],
                   [[x[copies[t]] for t in quantized] for x in by_name])
    rows = [{"tensor": n.output[0], "op": n.op_type, "sqnr_db": round(own[n.output[0]], 2),
             "grid_sqnr_db": round(grid[n.output[0]], 2) if n.output[0] in grid else None} for n in nodes]
    return sorted(rows, key=lambda r: r["grid_sqnr_db"] if r["grid_sqnr_db"] is not None else math.inf)


SRQ_MIN_CODES = 32  # fewer int8 codes than a 5-bit grid: the checkpoint's SRQ, not our grids, is coarse


def srq_code_spans(q_model) -> list[dict[str, Any]]:
    """The checkpoint's int8 output quantizers (SRQ: a QuantizeLinear of int8 zero point in the
    float graph, kept in the QDQ graph) with how many of their codes the calibration passes span:
    the 16-bit min/max grid of the SRQ's input divided by the SRQ's step. Fewest first.

    Why: an SRQ the checkpoint fitted to its outputs spans ~170-210 codes (the tiny family; its
    writer fits 1.2 x absmax to 127). One that spans ~15 (down_proj's SRQ of an SLM whose weight
    scales were multiplied by 0.3 and its SRQ scales with them, while the gated MLP's output shrank
    as 0.3^3) turns the 8-bit KV's ~1% error into whole-code flips worth half a value: the
    deployed graph then measures 18 dB against float with every 16-bit grid of the layer at 37 dB
    or better on its own, and no activation grid can fix it, because the float graph rounds there
    too."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in q_model.graph.initializer}
    producer = {o: n for n in q_model.graph.node for o in n.output}
    spans = []
    for n in q_model.graph.node:
        zero = inits.get(n.input[2]) if n.op_type == "QuantizeLinear" and len(n.input) > 2 else None
        grid = producer.get(n.input[0])
        if zero is None or zero.data_type != TensorProto.INT8 or grid is None or grid.op_type != "DequantizeLinear":
            continue
        z = numpy_helper.to_array(inits[grid.input[2]])
        info = np.iinfo(z.dtype)
        width = (info.max - info.min) * float(numpy_helper.to_array(inits[grid.input[1]]))
        source = producer.get(grid.input[0])  # the QuantizeLinear of the 16-bit grid: its input is the op's output
        spans.append({"tensor": source.input[0] if source is not None else n.input[0], "codes": round(width / float(numpy_helper.to_array(inits[n.input[1]])), 1)})
    return sorted(spans, key=lambda r: r["codes"])


def top_margin(logprobs: np.ndarray) -> np.ndarray:
    """The float graph's top-1 minus top-2 log-prob per row: how close a row is to a tie."""
    part = np.partition(logprobs, -2, axis=-1)
    return part[..., -1] - part[..., -2]


def topk_logprob_error(ref_logprobs: np.ndarray, q_logprobs: np.ndarray, k: int) -> float:
    """max |float - QDQ| log-prob over each row's QDQ top-k tokens: what 16-bit quantization
    moves the log-probs the graph returns (the budget the HTP-vs-CPU check is held to)."""
    top = np.argpartition(-q_logprobs, k - 1, axis=-1)[..., :k]
    return float(np.abs(np.take_along_axis(ref_logprobs, top, -1) - np.take_along_axis(q_logprobs, top, -1)).max())


def perturbation_bound(graph: Path, model, feeds: list[dict], draws: int = 2, seed: int = 0,
                       amplitude: dict[str, int] | None = None, kv_outputs: dict[str, float] | None = None,
                       mean_codes: dict[str, float] | None = None) -> dict:
    """How far independent per-element code noise at every op (`hyco.quant.perturb.perturbed_model`:
    `amplitude` codes per tensor, the HTP's measured worst there, each element moved by it as
    often as the HTP's measured `mean_codes` say (`htp_rates`); else `htp.op_tolerance` at every
    element) moves the graph's sorted top-k log-probs and its new K/V rows, on onnxruntime CPU:
    `BOUND_FACTOR` x the largest |perturbed - exact| over `feeds` and `draws` seeded perturbations.
    This is what the HTP is held to end to end, in calibrate's check and export's smoke: derived
    from the graph's grids, the HTP's own per-op behaviour and this graph's sensitivity, the same
    on every run (seeded). `kv_outputs`: new K/V output name -> its grid step, for `kv_step_bound`
    (how far apart, in steps of its grid, the rows the pass writes into the ring may land)."""
    import onnx
    from hyco.calibrate.htp import activation_taps, op_tolerance

    from hyco.qnn.ort import session_for
    from hyco.quant.int4_matmul import shared_repacks
    from hyco.quant.pass_compare import steps_apart
    from hyco.quant.perturb import perturbed_model

    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # (session_for rewrites the model it is given)
    codes = {tap.codes: op_tolerance(tap) for tap in activation_taps(model)}
    rates = None
    if amplitude is not None:  # a tensor measured at 0 codes still gets one: the noise is a bound's, not a replay
        codes = {name: max(1, amplitude.get(name, t)) for name, t in codes.items()}
        rates = htp_rates(codes, mean_codes) if mean_codes is not None else None
    kv = sorted(kv_outputs or {})
    names = [o.name for o in model.graph.output if o.name.startswith("topk_logprobs")] + kv
    worst = worst_kv = 0.0
    # the exact and the noisy session read one repack of the INT4 weights (11 s of an E2B tree
    # session's 15), and one session at a time: at E4B size each holds GBs
    with shared_repacks(Path(graph).parent):
        exact = session_for(copy, Path(graph).parent, arena=False)
        inputs = {i.name for i in exact.get_inputs()}
        clean = [exact.run(names, {k: v for k, v in f.items() if k in inputs}) for f in feeds]
        exact = None
        noisy = session_for(perturbed_model(model, seed, codes, rates), Path(graph).parent, arena=False)
        for _ in range(draws):  # each run draws afresh: onnxruntime's seeded random kernels advance run by run
            for f, c in zip(feeds, clean, strict=True):
                got = noisy.run(names, {k: v for k, v in f.items() if k in inputs})
                worst = max(worst, float(np.abs(got[0].astype(np.float64) - c[0]).max()))
                worst_kv = max([worst_kv] + [steps_apart(a, b, kv_outputs[n]) for n, a, b in zip(kv, got[1:], c[1:], strict=True)])
    factor = BOUND_FACTOR if rates is None else SPARSE_BOUND_FACTOR
    return {"bound": factor * worst, "perturbed_max": worst, "factor": factor, "passes": len(feeds),
            "draws": draws, "seed": seed, "amplitude": "op_tolerance" if amplitude is None else codes,
            "rates": rates, "kv_step_bound": max(KV_STEP_FLOOR, factor * worst_kv) if kv else None,
            "kv_perturbed_steps": worst_kv}


def htp_rates(amplitude: dict[str, int], mean_codes: dict[str, float]) -> dict[str, float]:
    """Per tensor, the share of elements the noise moves by its full amplitude: the HTP's measured
    mean |codes| over that amplitude (so the noise has the HTP's mean), the mean at least
    `MEAN_FLOOR` codes (a third of the tensors measured exactly equal on the passes checked)."""
    return {name: round(min(1.0, max(MEAN_FLOOR, mean_codes.get(name, 0.0)) / t), 8) for name, t in amplitude.items()}


# The noise reaches the HTP's worst codes at every element of every tensor at once, where the HTP
# reaches them on a few (mean 0.1-0.3 codes): on the main job's bundle the perturbed top-k moved
# 0.35 / 0.36 / 0.06 nats (tree / prefill / MTP) against the HTP's 0.11 / 0.13 / 0.03 over smoke's
# passes, and on an SLM trained at another shape 0.26 / 0.35 / 0.61 against 0.08 / 0.11 / 0.11.
# So the random figure is the bound itself. (Drawn at the per-op tolerance instead, 2-8x the HTP's
# measured codes, a factor of 2 was needed and the bounds sat 7-18x over the HTP's difference.)
BOUND_FACTOR = 1.0
# With the HTP's measured means (`htp_rates`), the noise moves as many elements as the HTP does,
# each by the worst it measured there. On the sweep's trained SLM its top-k moved 0.158 nats where
# the HTP itself moved smoke's passes 0.156: the figure is the HTP's size, not a bound over it, so
# twice it is. Bounds over the HTP's own smoke difference with it (tests/test_sweep.py's CI
# variants, the main job): log-prob 1.5-4.8x (every element at up to its worst: 1.4-3.5x), K/V
# 10-12 steps (12-23; the ring has 256) where the HTP moved 3-4 (docs/measurements.md).
SPARSE_BOUND_FACTOR = 2.0
# A third of the tensors measured exactly equal on the few passes the op-by-op run checks: each
# still moves by its (at least one) code on 1 element in 100 / amplitude
MEAN_FLOOR = 0.01
# The new K/V rows leave on 8-bit grids from 16-bit values: two implementations rounding either side
# of a step's middle land one step apart, so the K/V bound is never under two steps.
KV_STEP_FLOOR = 2.0


def summarize(top1: list[np.ndarray], kl: list[np.ndarray], sqnr_db: dict[str, float],
              margins: list[np.ndarray] | None = None, topk_err: list[float] | None = None) -> dict[str, Any]:
    top1 = np.concatenate(top1) if top1 else np.zeros(0, bool)
    kl = np.concatenate(kl) if kl else np.zeros(0)
    by_margin = {}
    if margins:
        m = np.concatenate(margins)
        by_margin = {"median_top1_margin": float(np.median(m)),
                     "rows_margin_below_0.05": float((m < 0.05).mean()),
                     "top1_agreement_margin_above_0.05": float(top1[m >= 0.05].mean()) if (m >= 0.05).any() else None,
                     "top1_agreement_margin_above_0.2": float(top1[m >= 0.2].mean()) if (m >= 0.2).any() else None}
    worst = sorted(({"layer": k, "sqnr_db": v} for k, v in sqnr_db.items()), key=lambda r: r["sqnr_db"])
    return {"top1_agreement": float(top1.mean()) if top1.size else float("nan"), "rows": int(top1.size),
            "kl": float(kl.mean()) if kl.size else float("nan"), "kl_p99": float(np.percentile(kl, 99)) if kl.size else None,
            "sqnr_db": sqnr_db, "worst_layers": worst[:3], **by_margin,
            "topk_logprob_error": max(topk_err) if topk_err else None}


def pass_subset(top1: list[np.ndarray], kl: list[np.ndarray], topk_err: list[float], rows: list[int],
                prefill: list[bool], kind: bool) -> dict[str, Any]:
    """Top-1 agreement, KL and top-k log-prob error over the passes whose prefill flag is `kind`
    (a tree-only SLM's prompt passes, or its rounds'), so the pooled figure hides neither."""
    pick = [i for i, p in enumerate(prefill) if p == kind]
    if not pick:
        return {"passes": 0, "rows": 0, "top1_agreement": None, "kl": None, "topk_logprob_error": None}
    t, k = np.concatenate([top1[i] for i in pick]), np.concatenate([kl[i] for i in pick])
    return {"passes": len(pick), "rows": int(sum(rows[i] for i in pick)), "top1_agreement": float(t.mean()),
            "kl": float(k.mean()), "topk_logprob_error": max(topk_err[i] for i in pick)}


def to_codes(feeds: dict, spec) -> dict:
    """Float feeds -> the deployable graph's feeds (uint8 KV codes from io_spec's quant params)."""
    return {t.name: t.to_codes(feeds[t.name]) if t.takes_codes else feeds[t.name] for t in spec.inputs}


@dataclass
class FloatPasses:
    """The SLM fidelity's float side: the float driver's recording (its passes spilled to disk,
    its sessions dropped), the trees it built (the QDQ driver replays them), the passes SQNR
    reads and their layer outputs; and the QDQ sessions where they were opened beside the float
    passes' end (`qdq_sessions`; None: `run_slm` opens them)."""

    recorded: Any  # record_slm's driver
    script: list
    picks: dict[str, list[int]]
    ref_taps: dict[str, Any]
    qdq: dict[str, Any] | None = None


def slm_layers(convert: Path, slm_graphs: dict[str, str]) -> dict[str, dict[str, str]]:
    import onnx

    return {g: layer_outputs(onnx.load(str(convert / name), load_external_data=False)) for g, name in slm_graphs.items()}


def eval_answers(inputs: dict, config) -> list[dict]:
    return [a for a in inputs["answers"] if a["split"] == "eval"][:config.eval_prompts]


def fidelity_session(folder: Path, name: str, taps: list[str], tmp: Path, tag: str):
    """A graph's fidelity session, which also returns its layer outputs: SQNR runs the float
    driver's feeds through the same sessions (no second session per graph, slow to open at E2B size)."""
    import onnx
    from hyco.calibrate.stage import extra_output_session

    return extra_output_session(onnx.load(str(folder / name), load_external_data=False), taps, tmp, tag, weights=folder)


def float_passes(convert: Path, inputs: dict, config, negative: float, tmp: Path) -> FloatPasses:
    """convert's float graphs driven over the eval answers, the trees recorded for the QDQ
    driver. Needs nothing calibrate quantizes: it can run beside the quantization (a thread)."""
    from hyco.calibrate.drive import slm_driver
    from hyco.calibrate.stage import record_slm

    slm_graphs = inputs["slm_graphs"]  # the graphs the phone runs: tree alone also prefills
    layers = slm_layers(convert, slm_graphs)
    ref = {g: fidelity_session(convert, name, list(layers[g].values()), tmp, f"float_{g}") for g, name in slm_graphs.items()}
    script: list = []
    recorded = record_slm(slm_driver(convert, inputs["keep_ids"], ref, negative, spill=tmp / "evaluated" / "float",
                                     graphs=tuple(slm_graphs)), eval_answers(inputs, config), config, script=script)
    picks, ref_taps = {}, {}
    for g in slm_graphs:
        rec = recorded.sessions[g]
        picks[g] = np.linspace(0, len(rec.active) - 1, min(config.sqnr_passes, len(rec.active))).astype(int).tolist()
        ref_taps[g] = layer_taps(ref[g], list(layers[g].values()), [rec.passes[i][0] for i in picks[g]],
                                 [rec.active[i] for i in picks[g]])
        rec.session = None  # only its passes are read from here on
    return FloatPasses(recorded, script, picks, ref_taps)


def qdq_sessions(convert: Path, out: Path, slm_graphs: dict[str, str], tmp: Path) -> dict[str, Any]:
    """The SLM fidelity's QDQ sessions (the parity twins in `out`), which also return the layer outputs."""
    from hyco.calibrate.stage import PARITY_NAMES

    layers = slm_layers(convert, slm_graphs)
    return {g: fidelity_session(out, PARITY_NAMES[g], list(layers[g].values()), tmp, f"qdq_{g}") for g in slm_graphs}


def run_slm(convert: Path, out: Path, inputs: dict, config, negative: float, tmp: Path, phase,
            floats: FloatPasses | None = None) -> dict[str, Any]:
    """The SLM graphs' fidelity: the float passes (`floats`, or run here), then the QDQ driver
    walking the same trees (`lockstep`'s replay): two graphs' sessions open at a time, not four
    (GBs less at E2B size)."""
    from hyco.calibrate.drive import slm_driver
    from hyco.calibrate.stage import record_slm

    slm_graphs = inputs["slm_graphs"]
    graphs = tuple(slm_graphs)
    layers = slm_layers(convert, slm_graphs)
    if floats is None:
        with phase("fidelity: float SLM passes"):
            floats = float_passes(convert, inputs, config, negative, tmp)
    f_slm, picks, ref_taps, q_taps = floats.recorded, floats.picks, dict(floats.ref_taps), {}
    with phase("fidelity: QDQ SLM passes"):
        qdq, floats.qdq = floats.qdq or qdq_sessions(convert, out, slm_graphs, tmp), None
        q_slm = record_slm(slm_driver(convert, inputs["keep_ids"], qdq, negative, spill=tmp / "evaluated" / "qdq",
                                      graphs=graphs), eval_answers(inputs, config), config, replay=floats.script)
        for g in slm_graphs:  # the float driver's feeds: each pass's own quantization error, no KV drift
            rec = f_slm.sessions[g]
            q_taps[g] = layer_taps(qdq[g], list(layers[g].values()), [rec.passes[i][0] for i in picks[g]],
                                   [rec.active[i] for i in picks[g]])
        for g in graphs:
            q_slm.sessions[g].session = None
        qdq = None
    results, htp_feeds = {}, {}
    for g, name in slm_graphs.items():
        f_rec = f_slm.sessions[g]
        q_rec = q_slm.sessions[g]
        with phase(f"fidelity: {g} metrics and SQNR"):
            top1, kl, rows, margins, topk_err = [], [], [], [], []
            k = int(inputs["convert_specs"][name].meta.get("topk", 8))
            for (_, fo), (_, qo), n in zip(f_rec.passes, q_rec.passes, f_rec.active, strict=True):
                a, b = log_softmax(fo["logits"][:n]), log_softmax(qo["logits"][:n])
                top1.append(a.argmax(-1) == b.argmax(-1))
                margins.append(top_margin(a))
                kl.append(kl_rows(a, b))
                topk_err.append(topk_logprob_error(a, b, k))
                rows.append(n)
            db = sqnr_db(list(layers[g]), ref_taps.pop(g), q_taps.pop(g))
            results[g] = summarize(top1, kl, db, margins, topk_err) | {"passes": len(rows)}
            if g == "tree" and "prefill" not in slm_graphs:  # it prefills too: its prompt passes on their own
                results[g]["prefill_passes"] = pass_subset(top1, kl, topk_err, rows, f_rec.prefill, True)
                results[g]["round_passes"] = pass_subset(top1, kl, topk_err, rows, f_rec.prefill, False)
            # the HTP check runs the QDQ driver's own passes (the fullest first), read back from disk;
            # the HTP bound (`perturbation_bound`) those and 4 more spread over the rest
            fullest = sorted(range(len(rows)), key=lambda i: -rows[i])
            first = fullest[:max(config.simulator_passes, 1)]
            rest = fullest[len(first):]
            order = first + [rest[j] for j in sorted(set(np.linspace(0, len(rest) - 1, min(4, len(rest))).astype(int)))]
            htp_feeds[g] = [q_rec.passes[i][0] for i in order]
    return {"graphs": results, "htp_feeds": htp_feeds}


def run_mtp(qat: Path, out: Path, inputs: dict, config, negative: float, tmp: Path) -> dict[str, Any]:
    import onnx
    from hyco.calibrate.drive import cpu_session as ort_session  # no CPU memory arena
    from hyco.calibrate.drive import mtp_bursts, replay_mtp
    from hyco.calibrate.stage import MTP_GRAPH, PARITY_NAMES, extra_output_session, mtp_captures

    spec = inputs["qat_specs"][MTP_GRAPH]
    ref_model = onnx.load(str(tmp / "mtp.prepared.onnx"))
    q_model = onnx.load(str(out / PARITY_NAMES["mtp"]))
    lsm = logsoftmax_output(ref_model)
    evals = mtp_captures(qat, "eval")
    caps = [evals[i] for i in range(min(len(evals), config.eval_prompts))]
    rng = np.random.default_rng(config.seed + 1)
    ref_sess = ort_session(tmp / "mtp.prepared.onnx")
    bursts = mtp_bursts(ref_sess, spec, inputs["lut"], caps, steps=config.mtp_steps,
                        positions_per_capture=config.mtp_positions, window=int(spec.meta["window"]), rng=rng,
                        mask_negative=negative)
    names = [t.name for t in spec.outputs]
    a = extra_output_session(ref_model, [lsm], tmp, "mtp_eval_ref")
    b = extra_output_session(q_model, [lsm], tmp, "mtp_eval_q")

    spec_lsm = type("S", (), {"outputs": [*spec.outputs, type("T", (), {"name": lsm})()]})()
    ref_b = replay_mtp(a, spec_lsm, bursts)  # step outputs + the full log-probs, for KL
    q_b = replay_mtp(b, spec_lsm, bursts)
    top1, kl, per_step, margins, topk_err = [], [], {}, [], []
    k = int(spec.meta.get("topk", 8))
    for rb, qb in zip(ref_b, q_b, strict=True):
        for step, ((_, ro), (_, qo)) in enumerate(zip(rb, qb, strict=True)):
            agree = ro["topk_ids"][:, 0] == qo["topk_ids"][:, 0]
            top1.append(agree)
            kl.append(kl_rows(ro[lsm].astype(np.float64), qo[lsm].astype(np.float64)))
            topk_err.append(topk_logprob_error(ro[lsm].astype(np.float64), qo[lsm].astype(np.float64), k))
            margins.append(top_margin(ro[lsm].astype(np.float64)))
            per_step.setdefault(step + 1, []).append(bool(agree.all()))
    feeds = [f for burst in bursts for f, _ in burst]
    pick = np.linspace(0, len(feeds) - 1, min(config.sqnr_passes, len(feeds))).astype(int).tolist()
    db = sqnr(ref_model, q_model, [feeds[i] for i in pick], tmp, "sqnr_mtp")
    del names
    res = summarize(top1, kl, db, margins, topk_err) | {"bursts": len(bursts),
                                     "top1_per_step": {k: float(np.mean(v)) for k, v in per_step.items()}}
    return {"graphs": {"mtp": res}, "htp_feeds": {"mtp": [f for burst in q_b for f, _ in burst]}}


def run_all(convert: Path, qat: Path | None, out: Path, inputs: dict, config, slm_negative: float,
            mtp_negative: float | None, tmp: Path, phase=None, floats: FloatPasses | None = None) -> dict[str, Any]:
    """`phase`: the stage's `artifacts.Phases` (default: a log of its own). `qat` None: the SLM's
    graphs only. `floats`: the SLM's float passes, run already (else here)."""
    from hyco.pipeline.artifacts import Phases

    phase = phase or Phases("calibrate")
    slm = run_slm(convert, out, inputs, config, slm_negative, tmp, phase, floats)
    if qat is None:
        return slm
    with phase("fidelity: MTP"):
        mtp = run_mtp(qat, out, inputs, config, mtp_negative, tmp)
    return {"graphs": {**slm["graphs"], **mtp["graphs"]}, "htp_feeds": {**slm["htp_feeds"], **mtp["htp_feeds"]}}


def plot_sqnr(per_graph: dict[str, dict], path: Path) -> None:
    from hyco.pipeline.plots import save

    save(sqnr_figure(per_graph), path)


def sqnr_figure(per_graph: dict[str, dict]):
    """Each graph's per-layer output SQNR (QDQ against float) with the fidelity floor it must clear."""
    from hyco.pipeline.plots import HIGHER, better, legend_outside, new_figure, number

    fig = new_figure(8, 3.6)
    ax = fig.subplots()
    depth = 0
    for g, v in per_graph.items():
        layers = list(v.get("sqnr_db") or {})
        if not layers:  # a graph measured without per-layer taps has no line to draw
            continue
        depth = max(depth, len(layers))
        ax.plot(range(len(layers)), [number(v["sqnr_db"][k]) for k in layers], marker="o", lw=1, label=g)
    floors = {f["min_sqnr_db"] for v in per_graph.values() if (f := v.get("fidelity_floor"))
              and f.get("min_sqnr_db") is not None}
    for floor in sorted(floors):
        ax.axhline(floor, color="tab:red", ls="--", lw=1, label=f"fidelity floor ({floor:g} dB)")
    if not ax.lines:
        ax.text(0.5, 0.5, "no per-layer SQNR measured", ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks(range(max(depth, 1)))
    ax.set_xlabel("layer of each graph, in order")
    ax.set_ylabel(better("output SQNR, QDQ vs float (dB)", HIGHER))
    ax.set_title("Per-layer output SQNR on the evaluation prompts", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:
        legend_outside(ax)
    return fig
