"""The qat stage: 4-bit KL QAT of the MTP head, W4/W8 PTQ baselines, the static MTP Drafter.

`build_qat(verifier=..., assistant=..., tokenizer=..., vocab=..., answers=..., config=..., out=...)`
is the whole stage as a keyword-only function; the pipeline (`inputs`/`build`) and the CLI
(`qat/cli.py`) wrap it. Flow: the answers stage's text (the verifier's answers to vocab/'s reserved
prompts) -> teacher-forced captures (safetensors shards) -> QuantSim student (clip-searched 4-bit
weights, 16-bit activations) -> W4 PTQ / W8 PTQ / W4 QAT agreement with the float head ->
head_w4.safetensors, encodings.json, mtp_step.onnx (+ the float twin), embed_lut, io_spec.
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyco.base.errors import HycoError
from hyco.base.files import write_json
from hyco.base.memory import release_free_heap
from hyco.config.recipe import PlacementConfig, QatConfig, Recipe, to_dict
from hyco.npu.host import SHORT
from hyco.pipeline import verdict
from hyco.pipeline.artifacts import Phases, StageEnd, finish_stage, markdown_table
from hyco.qnn.ort import ort_session

CAPTURES = "captures"
LINEAR_FORMAT = "int4 values stored in int8 [out, in], float32 scale [out] per output channel, symmetric"


def load_model(path: Path, what: str, dtype: torch.dtype, device_map=None):
    from hyco.base.loading import load_pretrained

    return load_pretrained(path, what, dtype=dtype, device_map=device_map).eval()


def check_pair(v_cfg, h_cfg, tokenizer, verifier_dir: Path, assistant_dir: Path) -> None:
    """The verifier / head pair from their configs (before the head's weights are read)."""
    from hyco.qat.mtp import check_output_layer

    from hyco.config.families import family_of, head_of

    reads = head_of({"model_type": getattr(h_cfg, "model_type", None)}, f"{assistant_dir}/config.json")[0]
    verifier = family_of({"model_type": getattr(v_cfg, "model_type", None)}, f"{verifier_dir}/config.json")
    if verifier is not reads:
        raise HycoError(f"{assistant_dir}/config.json: a head of family {reads.name}'s verifier, but {verifier_dir} "
                        f"is family {verifier.name}")
    v_cfg = v_cfg.get_text_config()

    check_output_layer(h_cfg, str(assistant_dir))
    if h_cfg.backbone_hidden_size != v_cfg.hidden_size:
        raise HycoError(f"{assistant_dir}: backbone_hidden_size {h_cfg.backbone_hidden_size} does not match the "
                        f"verifier's hidden size {v_cfg.hidden_size} ({verifier_dir})")
    if h_cfg.get_text_config().vocab_size != v_cfg.vocab_size or len(tokenizer) > v_cfg.vocab_size:
        raise HycoError(f"{assistant_dir}: vocabulary {h_cfg.get_text_config().vocab_size} does not match the verifier's "
                        f"{v_cfg.vocab_size} / the tokenizer's {len(tokenizer)}")


def input_ranges(captures, teacher, sliding_window: int, percentile: float, device, negative: float,
                 sample: int = 200_000) -> dict[str, tuple[float, float]]:
    """[p_(100-q), p_q] per step-graph input over the train captures. `hidden` also covers the
    head's own next_hidden, which feeds the later steps of a burst."""
    from hyco.qat.train import model_inputs

    rng = np.random.default_rng(0)
    pools: dict[str, list[np.ndarray]] = {n: [] for n in ("token_embed", "hidden", "k_full", "v_full", "k_sliding", "v_sliding")}

    def add(name, x):
        flat = x.detach().float().cpu().numpy().reshape(-1)
        pools[name].append(flat if flat.size <= sample else rng.choice(flat, sample, replace=False))

    for cap in captures:
        add("token_embed", cap.embeds)
        add("hidden", cap.hidden)
        for short, layer in ((s, t) for t, s in SHORT.items()):
            add(f"k_{short}", cap.kv[layer][0])
            add(f"v_{short}", cap.kv[layer][1])
        with torch.no_grad():
            add("hidden", teacher(*model_inputs(cap, sliding_window, device, negative))[1])
    out = {}
    for name, parts in pools.items():
        values = np.concatenate(parts)
        out[name] = (float(np.percentile(values, 100.0 - percentile)), float(np.percentile(values, percentile)))
    return out


def capture_share(*, verifier: Path, tokenizer: Path, answers: Path, config: QatConfig, captures: Path,
                  placement: PlacementConfig | None = None) -> None:
    """A follower process of `accelerate launch` (hyco/base/launch.py): its share of the captures,
    written into the main process's `captures` folder; the main process trains."""
    from hyco.base.loading import load_tokenizer, load_verifier
    from hyco.npu.captures import capture_answers

    records, _ = read_answer_folder(Path(answers), load_tokenizer(Path(tokenizer)))
    verifier_model = load_verifier(verifier, placement or PlacementConfig())
    capture_answers(verifier_model, records, Path(captures), config.capture_point)


def read_answer_folder(folder: Path, tokenizer) -> tuple[list[dict], dict[str, Any]]:
    """The answers stage's records and report, checked: both splits present, every token id
    inside the tokenizer's vocabulary (answers written with another tokenizer are refused)."""
    from hyco.base.loading import read_json
    from hyco.data.answers import ANSWERS, ANSWERS_REPORT, read_answers

    records = read_answers(folder / ANSWERS)
    report = read_json(folder / ANSWERS_REPORT, ANSWERS_REPORT)
    for split in ("train", "eval"):
        if not any(a["split"] == split for a in records):
            raise HycoError(f"{folder / ANSWERS}: no {split} answers (vocab's reserved prompts have both splits)")
    top = max(max(a["prompt_ids"] + a["answer_ids"], default=0) for a in records)
    if top >= len(tokenizer):
        raise HycoError(f"{folder / ANSWERS}: token id {top} is outside the tokenizer's {len(tokenizer)} ids "
                        "(answers from another tokenizer)")
    return records, report


def build_qat(*, verifier: Path, assistant: Path, tokenizer: Path, vocab: Path, answers: Path, config: QatConfig,
              out: Path, allow_parity_failure: bool = False, placement: PlacementConfig | None = None) -> dict[str, Any]:
    """`answers`: the answers stage's folder (the text the head trains and is evaluated on);
    `placement`: the verifier's dtype and devices for the captures (default: BF16 on a GPU, fp32
    on the CPU). In named steps: read and check the inputs, capture the answers through the
    verifier, train the students, write the MTP Drafter and prove its graphs."""
    from hyco.base.launch import start_followers

    start = time.perf_counter()
    phase = Phases("qat")
    out = Path(out)
    start_followers(captures=str(out / CAPTURES))
    torch.manual_seed(config.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok, keep, answer_rows, answer_report, h_cfg = read_inputs(tokenizer, vocab, answers, assistant, phase)
    train, evals, kv_shapes = capture_through_verifier(verifier, assistant, tok, keep, answer_rows, h_cfg,
                                                       placement, config, out, phase)
    with phase("load head"):
        head = load_model(assistant, "assistant", torch.float32).to(device)  # fp32 master weights
    done = students_and_drafter(head, keep, train, evals, kv_shapes, h_cfg.get_text_config().sliding_window, config,
                                device, out, phase)
    results, history = done["results"], done["history"]
    report = {
        "agreement": results,
        "clip_ratio_mean": done["clip_ratios"],
        "training": {"steps": config.steps, "wall_s": round(done["train_s"], 2),
                     "s_per_step": round(done["train_s"] / max(config.steps, 1), 4), "device": device.type,
                     "first_loss": history[0]["loss"] if history else None,
                     "last_loss": history[-1]["loss"] if history else None},
        "history": history,
        "answers": {"source": answer_report["source"], "stats": answer_report["stats"],
                    "warnings": answer_report["warnings"]},
        "captures": {"train": len(train), "eval": len(evals), "capture_point": config.capture_point,
                     "train_tokens": sum(r["tokens"] for r in train.rows), "eval_tokens": sum(r["tokens"] for r in evals.rows)},
        "input_ranges": done["ranges"],
        "parity": done["parity"],
        "drafter": done["drafter"],
        "phases": phase.rows,
        "wall_s": round(time.perf_counter() - start, 2),
    }
    bits, parity = config.weight_bits, done["parity"]
    summary = {"top1": {k: round(v["top1_agreement"], 4) for k, v in results.items()},
               "qat_minus_ptq_kl": round(results[f"w{bits}_qat"]["kl"] - results[f"w{bits}_ptq"]["kl"], 6),
               "s_per_step": report["training"]["s_per_step"], "parity": parity}
    return finish_stage("qat", out, StageEnd(
        report, lambda r: summary_md(r, bits), summary, parity["failure"] and f"parity {parity['failure']}",
        plots={"loss.png": lambda path: plot_loss(path, history),
               "agreement.png": lambda path: plot_agreement(path, results, bits)},
        nondeterministic=[("summary.md", "prints this run's measured seconds per training step", None)],
        verdict=verdict_lines(results, parity, bits)), allow_parity_failure)


def verdict_lines(results: dict[str, dict], parity: dict[str, Any], bits: int) -> list[verdict.Line]:
    """The two graph proofs (float step graph against transformers' head, quantized step graph
    against its QuantSim weights), and how close the W4 head stays to the BF16 head."""
    step = parity["step_graph_proof"]
    float_ok = parity["float_vs_transformers_max_abs_logprob"] <= STEP_TOLERANCE and parity["float_top1_match"] == 1
    qat, ptq = results[f"w{bits}_qat"], results[f"w{bits}_ptq"]
    return [
        verdict.proof("float step graph vs transformers' head", float_ok,
                      f"max |log-prob diff| {parity['float_vs_transformers_max_abs_logprob']:.1e}, "
                      f"top-1 {verdict.percent(parity['float_top1_match'])} over {parity['positions']} positions",
                      f"{STEP_TOLERANCE:g}, top-1 100%"),
        verdict.proof(f"W{bits} step graph vs its QuantSim weights", step["passed"],
                      f"max |log-prob diff| {step['max_abs_logprob']:.1e}, top-k ids equal "
                      f"{verdict.percent(step['topk_ids_equal'])}", f"{step['tolerance']:g}, ids 100%"),
        verdict.Line(f"W{bits} head vs the BF16 head (held-out answers)", verdict.INFO,
                     f"top-1 {verdict.percent(qat['top1_agreement'])} after QAT, {verdict.percent(ptq['top1_agreement'])} "
                     f"by rounding alone; KL {qat['kl']:.3g} vs {ptq['kl']:.3g}"),
    ]


def read_inputs(tokenizer: Path, vocab: Path, answers: Path, assistant: Path, phase: Phases):
    """The tokenizer, keep set and answers; the head's config checked, and its file read once
    so that a damaged head fails now, not after the verifier's answers and captures."""
    from hyco.qat.mtp import check_output_layer

    from hyco.base.loading import load_config, load_tokenizer
    from hyco.data.keepset import load_keep_set

    tok_dir = Path(tokenizer)
    if not (tok_dir / "tokenizer_config.json").is_file() and not (tok_dir / "tokenizer.json").is_file():
        raise HycoError(f"tokenizer not found: {tok_dir / 'tokenizer.json'}")
    with phase("read tokenizer, keep set, answers"):
        tok = load_tokenizer(tok_dir)
        keep = load_keep_set(vocab, tok)
        answer_rows, answer_report = read_answer_folder(Path(answers), tok)
        h_cfg = load_config(assistant, "assistant")
        check_output_layer(h_cfg, str(assistant))  # before any weight is read
    with phase("check head"):
        # the head is small, and it is freed before the verifier loads
        checked = load_model(assistant, "assistant", torch.float32)
        del checked
        gc.collect()
    return tok, keep, answer_rows, answer_report, h_cfg


def capture_through_verifier(verifier: Path, assistant: Path, tok, keep, answer_rows: list[dict], h_cfg,
                             placement: PlacementConfig | None, config: QatConfig, out: Path, phase: Phases):
    """The answers teacher-forced through the verifier (captures/) and the MTP embedding LUT; the
    verifier is loaded here and gone when this returns, so its weights and the head's are never
    in memory together. Returns the train and eval capture sets and the KV shapes."""
    from hyco.base.loading import load_verifier
    from hyco.npu.captures import CaptureSet, capture_answers
    from hyco.npu.embed_lut import EMBED_LUT, write_embed_lut
    from hyco.pipeline.preflight import check_teacher

    check_teacher(Path(verifier), config.quantized_teacher)  # a BF16 teacher unless the recipe opts in
    with phase("load verifier"):
        ver = load_verifier(verifier, placement or PlacementConfig())
    check_pair(ver.config, h_cfg, tok, Path(verifier), Path(assistant))
    with phase("captures"):
        rows = capture_answers(ver, answer_rows, out / CAPTURES, config.capture_point)
    write_json(out / CAPTURES / "captures.json", {"capture_point": config.capture_point, "shards": rows})
    train, evals = CaptureSet(out / CAPTURES, rows, "train"), CaptureSet(out / CAPTURES, rows, "eval")
    if not len(train) or not len(evals):
        raise HycoError("every train or every eval answer came back empty; nothing to train or evaluate on")
    with phase("embedding LUT"):
        write_embed_lut(out / EMBED_LUT, ver, keep.keep_to_vocab)
    kv_shapes = {layer: (k.shape[0], k.shape[-1]) for layer, (k, _) in train[0].kv.items()}
    with phase("free verifier"):
        del ver
        release_free_heap()  # not calibrate's 1 MiB mmap threshold: training steps ran slower with it
    return train, evals, kv_shapes


def students_and_drafter(head, keep, train, evals, kv_shapes: dict, sliding_window: int, config: QatConfig, device,
                         out: Path, phase: Phases) -> dict[str, Any]:
    """Students (W8 PTQ, W4 PTQ with clip search, W4 QAT), then the MTP Drafter's files from the
    teacher's rows and the student's integers, and the graphs' parity. The head's 262,144-row
    tables wait on disk until graph parity's transformers reference needs them: the students
    copy the teacher's keep-set rows, the step graphs are written from the teacher's weights
    (float) and the student's (INT4)."""
    from hyco.qat.mtp import TeacherForcedHead, output_table_on_disk

    table_folder = Path(tempfile.mkdtemp(prefix="hyco-qat-table-"))
    with contextlib.ExitStack() as tables:  # entered and left inside named phases
        with phase("teacher, full tables to disk"):
            keep_ids = torch.as_tensor(keep.keep_to_vocab, dtype=torch.long)
            teacher = TeacherForcedHead(head, keep_ids).eval()
            calib = [train[i] for i in range(min(config.calibration_sequences, len(train)))]
            tables.enter_context(output_table_on_disk(head, table_folder))
        with phase("float step graph"):
            spec = write_float_step(out, head, teacher, keep, kv_shapes, config)
        students = train_students(head, teacher, keep_ids, train, evals, calib, config, device, out, phase)
        sim = students.pop("sim")
        with phase("drafter graphs"):
            drafter = write_drafter(out, head, sim, keep, spec, students["ranges"], config)
        teacher = None  # its keep-set output layer is done with
        # Parity on a calibration sequence: inside the calibrated activation ranges, so what is left
        # between the graph and the full student is the 16-bit grid, not range clipping.
        with phase("graph parity: quantized"):
            rows = parity_positions(calib[0], spec, config)
            quantized = quantized_parity(out, head, sim, rows, config)
        with phase("free student, full tables back"):
            del sim
            gc.collect()  # the student (QuantSim's reference cycles) goes before the tables come back
            tables.close()
    table_folder.rmdir()
    with phase("graph parity: float"):
        parity = float_parity(out, head, keep_ids, rows, quantized)
    return {**students, "drafter": drafter, "parity": parity}


def train_students(head, teacher, keep_ids, train, evals, calib: list, config: QatConfig, device, out: Path,
                   phase: Phases) -> dict[str, Any]:
    """W8 PTQ, W{bits} PTQ (clip search only) and W{bits} QAT, each measured on the eval and train
    captures. Returns the QAT student (`sim`), the agreement figures, the fixed input ranges,
    clip ratios and the training history."""
    from hyco.qat.evaluate import agreement
    from hyco.qat.lean_qdq import weights_quantized_once
    from hyco.qat.train import model_inputs, train_student

    sliding_window = head.config.get_text_config().sliding_window  # the head's own: its captures' windows
    with phase("students' set-up (AIMET imported)"):
        from hyco.qat.quantsim import (
            aimet_config,
            apply_clip_search,
            attach_input_quantizers,
            make_student,
            recalibrate_activations,
        )

        cfg_path = aimet_config(out / "aimet_config.json")
        example = model_inputs(train[0], sliding_window, device, config.mask_negative)
    bits = config.weight_bits

    def measure(sim, captures):
        return agreement(sim.model, teacher, captures, sliding_window, device, config.mask_negative)

    def calibrated(weight_bits: int):
        sim = make_student(head, keep_ids, example, weight_bits=weight_bits, activation_bits=config.activation_bits,
                           config_path=cfg_path, rows=teacher.lm_head)
        sim.compute_encodings(lambda m, _: [m(*model_inputs(c, sliding_window, device, config.mask_negative)) for c in calib], None)
        attach_input_quantizers(sim, ranges)
        return sim

    # Fixed input ranges first: every student sees the graph's input clipping from here on.
    with phase("W8 PTQ"):
        ranges = input_ranges(train, teacher, sliding_window, config.input_percentile, device, config.mask_negative)
        results = {}
        sim8 = calibrated(8)
        with weights_quantized_once(sim8.model):
            results["w8_ptq"] = measure(sim8, evals)
        del sim8
        gc.collect()  # QuantSim's modules hold reference cycles: free the W8 student before the W4 one is built
    with phase(f"W{bits} PTQ"):
        sim = calibrated(bits)
        clip_ratios = apply_clip_search(sim, config.clip_ratio_max, config.clip_ratio_min)
        with weights_quantized_once(sim.model):
            results[f"w{bits}_ptq"] = measure(sim, evals)
            results[f"w{bits}_ptq_train"] = measure(sim, train)
    with phase(f"W{bits} QAT"):
        train_start = time.perf_counter()
        history = train_student(sim, teacher, train, config, sliding_window, device)
        train_s = time.perf_counter() - train_start
        recalibrate_activations(sim, lambda m: [m(*model_inputs(c, sliding_window, device, config.mask_negative)) for c in calib])
        with weights_quantized_once(sim.model):
            results[f"w{bits}_qat"] = measure(sim, evals)
            results[f"w{bits}_qat_train"] = measure(sim, train)
    return {"sim": sim, "results": results, "ranges": ranges, "clip_ratios": clip_ratios, "history": history,
            "train_s": train_s}


def write_float_step(out: Path, head, teacher, keep, kv_shapes, config: QatConfig):
    """mtp_step.float.onnx, the unquantized head's drafting step (restricted output layer);
    returns its io spec. Written from the frozen teacher before any student exists: the ONNX
    export holds several times the step's fp32 weights (26B-A4B assistant's size), which after
    training set the stage's peak."""
    from hyco.qat.step_graph import MtpStep, export_float, io_spec, linear_names, rope_tables

    spec = io_spec(head, kv_shapes, config.window, keep.size, config.topk,
                   {"rope": rope_tables(head), "mask_negative": config.mask_negative,
                    "capture_point": config.capture_point, "weight_bits": config.weight_bits,
                    "activation_bits": config.activation_bits, "float_graph": "mtp_step.float.onnx"})
    teacher_linears = dict(teacher.named_modules())
    names = linear_names(len(head.model.layers), centroids=teacher.masked_embedding is not None)
    step = MtpStep(head, {n: teacher_linears[n].weight.detach().cpu() for n in names}, config.topk,
                   getattr(teacher, "cluster_of", None)).cpu().eval()
    export_float(step, spec, out / "mtp_step.float.onnx")
    return spec


def write_drafter(out: Path, head, sim, keep, spec, ranges, config: QatConfig) -> dict:
    """head_w4.safetensors, encodings.json, mtp_step.onnx (from mtp_step.float.onnx), io_spec.json."""
    from hyco.qat.quantsim import integer_weights, quantized_linears
    from hyco.qat.step_graph import fixed_input_ranges, param_name, quantize_graph, uint16_qparams
    from safetensors.torch import save_file

    from hyco.npu.io_spec import write_io_spec

    linears = quantized_linears(sim)
    ints = {name: integer_weights(layer) for name, layer in linears.items()}
    tensors = {}
    for name, (values, scale) in ints.items():
        tensors[f"{name}.weight"] = values.contiguous()
        tensors[f"{name}.weight_scale"] = scale.contiguous()
    for name, p in head.named_parameters():
        if "norm" in name:
            tensors[name] = p.detach().float().cpu().contiguous()
    for i, layer in enumerate(head.model.layers):
        tensors[f"model.layers.{i}.layer_scalar"] = layer.layer_scalar.detach().float().cpu().contiguous()
    tensors["keep_to_vocab"] = torch.as_tensor(keep.keep_to_vocab, dtype=torch.int32)
    if getattr(sim.model, "masked_embedding", None) is not None:  # each keep row's centroid
        tensors["cluster_of"] = sim.model.cluster_of.to(torch.int32)
    save_file({k: v.cpu() for k, v in tensors.items()}, str(out / "head_w4.safetensors"),
              metadata={"bits": str(config.weight_bits), "format": LINEAR_FORMAT})

    # the shipped graph: the float twin (`write_float_step`) with every weight swapped for the
    # trained student's integers
    int_np = {n: (v.cpu().numpy(), s.cpu().numpy()) for n, (v, s) in ints.items()}
    ranges = {**ranges, **fixed_input_ranges(spec, config.mask_negative)}  # every float input gets QDQ
    quantize_graph(out / "mtp_step.float.onnx", out / "mtp_step.onnx", int_np, ranges)
    write_io_spec(out / "io_spec.json", [spec])

    # encodings.json in AIMET's 1.0.0 layout: params named by their ONNX initializer, the
    # 16-bit activation encodings by module output, the fixed input ranges by graph input.
    params, acts = [], []
    for name, layer in linears.items():
        enc = layer.param_quantizers["weight"].get_encodings().to_qnn_encoding_dict("1.0.0")
        params.append({**enc, "name": param_name(name)})
    for name, module in sim.model.named_modules():
        for i, q in enumerate(getattr(module, "output_quantizers", None) or []):
            if q is not None and q.is_initialized():
                acts.append({**q.get_encodings().to_qnn_encoding_dict("1.0.0"), "name": f"{name}:output{i}"})
    captured = set(ranges) - set(fixed_input_ranges(spec, config.mask_negative))
    for inp, (lo, hi) in ranges.items():
        scale, zero = uint16_qparams(lo, hi)
        acts.append({"name": inp, "bw": 16, "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": False,
                     "scale": [scale], "offset": [-zero], "min": lo, "max": hi,
                     "source": f"p{config.input_percentile} of the train captures" if inp in captured else "fixed by construction",
                     **({"percentile": config.input_percentile} if inp in captured else {})})
    write_json(out / "encodings.json", {"version": "1.0.0", "param_encodings": params, "activation_encodings": acts,
                                        "quantizer_args": {"param_bw": config.weight_bits, "activation_bw": config.activation_bits,
                                                           "param_symmetric": True, "per_channel": True}})
    return {"linears": len(ints), "weight_bytes_int4": sum(v.numel() for v, _ in ints.values()) // 2}


def parity_positions(cap, spec, config: QatConfig, positions: int = 8) -> list[tuple]:
    """The last drafting positions of `cap` as (StepInput, step graph feeds): the ring holds the
    last `window` positions, the references get the same rows."""
    from hyco.npu.handoff import StepInput
    from hyco.runtime.mtp import rope_rows, step_feeds

    rows = []
    for t in cap.drafting_positions[-positions:].tolist():
        lo = max(0, t + 1 - config.window)
        kv = {layer: (k[:, lo:t + 1], v[:, lo:t + 1]) for layer, (k, v) in cap.kv.items()}
        start = StepInput(cap.embeds[t + 1], cap.hidden[t], kv, t + 1)
        # the ring starts at `lo`: shift positions so slots and masks match the references
        feeds = step_feeds(StepInput(start.embed, start.hidden, kv, t + 1 - lo), start.embed.numpy(),
                           start.hidden.numpy(), spec, spec.meta["rope"], config.mask_negative)
        for layer, short in SHORT.items():
            feeds[f"cos_{short}"], feeds[f"sin_{short}"] = rope_rows(spec.meta["rope"][layer], t + 1)
        rows.append((start, feeds))
    return rows


def quantized_parity(out: Path, head, sim, rows: list[tuple], config: QatConfig) -> dict:
    """Quantized graph vs QuantSim (the full student, and its weights with float activations),
    then the step graph's proof. Needs neither the head's full-vocabulary tables nor the float graph."""
    from aimet_torch.utils import remove_activation_quantizers
    from hyco.qat.lean_qdq import weights_quantized_once
    from hyco.qat.quantsim import plain

    quant_sess = ort_session(out / "mtp_step.onnx", rewrites=False)
    quant_diff = weights_diff = 0.0
    quant_top1 = weights_top1 = 0
    device = head.pre_projection.weight.device
    # the student's weights fake-quantized once for all rows, and released before the proof's own copy
    with weights_quantized_once(sim.model):
        for start, feeds in rows:
            q_lp, q_ids, _ = quant_sess.run(None, feeds)
            query = torch.cat([start.embed, start.hidden])[None, None].to(device)
            args = (query, torch.tensor([[start.position]], device=device),
                    *[torch.from_numpy(feeds[n])[None].to(device) for n in ("k_full", "v_full", "k_sliding", "v_sliding")],
                    torch.from_numpy(feeds["mask_full"])[None, None].to(device),
                    torch.from_numpy(feeds["mask_sliding"])[None, None].to(device))
            with torch.no_grad():
                s_lp = torch.log_softmax(plain(sim.model(*args)[0])[0, 0], -1).cpu()
                with remove_activation_quantizers(sim.model):
                    w_lp = torch.log_softmax(plain(sim.model(*args)[0])[0, 0], -1).cpu()
            picked = torch.from_numpy(q_ids[0])
            quant_diff = max(quant_diff, float(np.abs(q_lp[0] - s_lp[picked].numpy()).max()))
            weights_diff = max(weights_diff, float(np.abs(q_lp[0] - w_lp[picked].numpy()).max()))
            quant_top1 += int(q_ids[0, 0] == int(s_lp.argmax()))
            weights_top1 += int(q_ids[0, 0] == int(w_lp.argmax()))
    n = len(rows)
    del quant_sess  # one graph's weights in memory at a time: the proof opens its own
    proof = step_graph_proof(out, head, sim, [f for _, f in rows], config.topk)
    # the same INT4 weights with float activations: only the graph's uint16 input QDQ differs
    return {"quant_vs_quantsim_weights_max_abs_logprob": weights_diff, "quant_vs_quantsim_weights_top1_match": weights_top1 / n,
            # the full student: 16-bit activation encodings (calibrated ranges, clipping outside)
            "quant_vs_quantsim_max_abs_logprob": quant_diff, "quant_top1_match": quant_top1 / n,
            "step_graph_proof": proof}


def float_parity(out: Path, head, keep_ids, rows: list[tuple], quantized: dict) -> dict:
    """Float graph vs transformers' head (its full-vocabulary output layer, cut to the keep set
    after), joined with `quantized_parity`'s result into the report's parity section."""
    from hyco.runtime.mtp import head_step

    float_sess = ort_session(out / "mtp_step.float.onnx", rewrites=False)
    float_diff, float_top1 = 0.0, 0
    for start, feeds in rows:
        f_lp, f_ids, _ = float_sess.run(None, feeds)
        logits, _ = head_step(head, start.embed, start.hidden, start.kv, start.position)
        ref = torch.log_softmax(logits[keep_ids.to(logits.device)], -1).cpu()
        float_diff = max(float_diff, float(np.abs(f_lp[0] - ref[torch.from_numpy(f_ids[0])].numpy()).max()))
        float_top1 += int(f_ids[0, 0] == int(ref.argmax()))
    n = len(rows)
    float_ok = float_diff <= STEP_TOLERANCE and float_top1 == n
    failure = quantized["step_graph_proof"]["failure"] or (
        None if float_ok else f"float_step_graph: vs transformers max |d logprob| {float_diff:.3g} "
                              f"(tolerance {STEP_TOLERANCE:g}), top-1 {float_top1}/{n}")
    return {"positions": n, "float_vs_transformers_max_abs_logprob": float_diff, "float_top1_match": float_top1 / n,
            **quantized, "passed": failure is None, "failure": failure}


# The step graph's proof tolerance: float32 summation order only (no rounding can differ, see
# step_graph.tap_input_qdq); seen ~1e-6 on log-probs, 1e-4 leaves 100x headroom.
STEP_TOLERANCE = 1e-4


def step_graph_proof(out: Path, head, sim, feeds_list: list[dict], topk: int) -> dict:
    """mtp_step.onnx vs the module it was exported from (MtpStep) holding the QuantSim student's
    integer weights (values * scale, exactly the weight the sim computes with:
    test_quantsim_integer_weights_are_bit_exact), fed the graph's own rounded inputs (its uint16
    input QDQ outputs, tapped by a parity build). The graph has no other rounding quantizer, so
    the rule is strict: top-k ids equal, log-probs and next_hidden within STEP_TOLERANCE
    (next_hidden relative to its largest magnitude)."""
    import tempfile

    from hyco.qat.quantsim import integer_weights, quantized_linears
    from hyco.qat.step_graph import MtpStep, tap_input_qdq

    weights = {name: (v.float() * s.float()[:, None]).cpu() for name, (v, s) in
               ((name, integer_weights(layer)) for name, layer in quantized_linears(sim).items())}
    step = MtpStep(head, weights, topk, getattr(sim.model, "cluster_of", None)).cpu().eval()
    with tempfile.TemporaryDirectory(prefix="hyco-step-parity-") as tmp:
        taps = tap_input_qdq(out / "mtp_step.onnx", Path(tmp) / "mtp_step.parity.onnx")
        sess = ort_session(Path(tmp) / "mtp_step.parity.onnx", rewrites=False)
    names = [o.name for o in sess.get_outputs()]
    inputs = [i.name for i in sess.get_inputs()]
    lp_diff = hidden_diff = 0.0
    ids_equal = 0
    for feeds in feeds_list:
        got = dict(zip(names, sess.run(None, feeds), strict=True))
        rounded = [torch.from_numpy(got[taps[name]] if name in taps else feeds[name]) for name in inputs]
        with torch.no_grad():
            r_lp, r_ids, r_hidden = (t.numpy() for t in step(*step.grouped(rounded)))
        ids_equal += int(np.array_equal(got["topk_ids"], r_ids))
        lp_diff = max(lp_diff, float(np.abs(got["topk_logprobs"] - r_lp).max()))
        hidden_diff = max(hidden_diff, float(np.abs(got["next_hidden"] - r_hidden).max()
                                         / max(1.0, float(np.abs(r_hidden).max()))))
    n = len(feeds_list)
    failure = None
    if ids_equal < n or lp_diff > STEP_TOLERANCE or hidden_diff > STEP_TOLERANCE:
        failure = (f"step_graph: mtp_step.onnx vs its QuantSim weights on its own rounded inputs: top-k ids equal at "
                   f"{ids_equal}/{n} positions, max |d logprob| {lp_diff:.3g}, next_hidden {hidden_diff:.3g} "
                   f"(tolerance {STEP_TOLERANCE:g})")
    return {"rule": "no rounding quantizer between the step graph's ops (weights INT4, inputs uint16 QDQ only): "
                    "the reference gets the graph's own rounded inputs, so the tolerance is summation order's",
            "rounded_inputs": sorted(taps), "positions": n, "topk_ids_equal": ids_equal / n,
            "max_abs_logprob": lp_diff, "max_rel_next_hidden": hidden_diff, "tolerance": STEP_TOLERANCE,
            "passed": failure is None, "failure": failure}


def plot_loss(path: Path, history: list[dict]) -> None:
    from hyco.pipeline.plots import save

    save(loss_figure(history), path)


def loss_figure(history: list[dict]):
    """The training loss per optimizer step, with a running mean: one sequence a step makes the raw
    curve noisy, and the trend is what tells whether QAT converged."""
    from hyco.pipeline.plots import LOWER, better, new_figure, number

    fig = new_figure(6.4, 3.6)
    ax = fig.subplots()
    steps = [h["step"] for h in history]
    losses = [number(h.get("loss")) for h in history]
    window = max(1, len(losses) // 10)
    # the raw curve recedes behind its running mean where there is one
    ax.plot(steps, losses, lw=0.8, color="tab:blue", alpha=0.45 if window > 1 else 1.0,
            marker="." if len(losses) < 50 else None, label="per step")
    if window > 1:
        ax.plot(steps, _running_mean(losses, window), lw=1.8, color="tab:blue", label=f"mean of the last {window} steps")
    if not history:
        ax.text(0.5, 0.5, "no training steps", ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(better("KL(teacher || student) (nats per position)", LOWER))
    ax.set_title("QAT of the MTP head: training loss", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8, loc="lower left")  # the loss falls from the upper left: this corner stays empty
    return fig


def _running_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the window - 1 before it (fewer at the start); NaNs (unmeasured) skipped."""
    from hyco.pipeline.plots import measured

    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1):i + 1] if measured(v)]
        out.append(sum(seen) / len(seen) if seen else float("nan"))
    return out


def plot_agreement(path: Path, results: dict, bits: int) -> None:
    from hyco.pipeline.plots import save

    save(agreement_figure(results, bits), path)


def agreement_figure(results: dict, bits: int):
    """The head's fidelity to the float head on the evaluation captures, per quantization: top-1
    agreement and KL side by side (a head can keep its top-1 and still lose probability mass)."""
    from hyco.pipeline.plots import HIGHER, LOWER, better, measured, new_figure, number

    models = {f"w{bits}_ptq": (f"W{bits} PTQ\n(clip search)", "#999999"), f"w{bits}_qat": (f"W{bits} QAT", "#3366cc"),
              "w8_ptq": ("W8 PTQ", "#66aa66")}
    shown = [n for n in models if n in results]
    labels, colors = [models[n][0] for n in shown], [models[n][1] for n in shown]
    positions = sorted({results[n].get("positions") for n in shown} - {None})
    fig = new_figure(9, 3.8)
    top1_ax, kl_ax = fig.subplots(1, 2)
    top1 = [100 * number(results[n].get("top1_agreement")) for n in shown]
    _labelled_bars(top1_ax, labels, top1, colors, "{:.1f}%")
    top1_ax.set_ylim(0, 110)  # room for the value above a bar near 100%
    top1_ax.set_ylabel(better("top-1 agreement with the float head (%)", HIGHER))
    top1_ax.set_title("Top-1 agreement", fontsize=10)
    kl = [number(results[n].get("kl")) for n in shown]
    _labelled_bars(kl_ax, labels, kl, colors, "{:.4f}")
    kl_ax.set_ylim(0, 1.15 * max([v for v in kl if measured(v)] or [1.0]))
    kl_ax.set_ylabel(better("KL divergence (nats per position)", LOWER))
    kl_ax.set_title("KL divergence from the float head", fontsize=10)
    for ax in (top1_ax, kl_ax):
        ax.set_xlabel("MTP head weights")
        ax.grid(axis="y", alpha=0.3)
    count = f"{positions[0]:,} evaluation positions" if len(positions) == 1 else "the evaluation captures"
    fig.suptitle(f"MTP head against the float head on {count}", fontsize=10)
    return fig


def _labelled_bars(ax, labels: list[str], values: list[float], colors: list[str], fmt: str) -> None:
    """Bars with their values above them; an unmeasured (NaN) value keeps its place, marked as such."""
    from hyco.pipeline.plots import measured

    places = range(len(labels))
    heights = [v if measured(v) else 0.0 for v in values]
    ax.bar(places, heights, color=colors)
    for x, v, h in zip(places, values, heights, strict=True):
        ax.text(x, h, fmt.format(v) if measured(v) else "not measured", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(places), labels)
    ax.set_xlim(-0.6, max(len(labels), 1) - 0.4)


def summary_md(report: dict, bits: int) -> str:
    columns = ["model", "top1_agreement", "kl", "positions"]
    if any("kl_dense" in v for v in report["agreement"].values()):  # a centroid-masked head (qat/evaluate.py)
        columns[3:3] = ["kl_dense", "same_scored_tokens"]
    rows = [{"model": k, **v} for k, v in report["agreement"].items()]
    tr, par = report["training"], report["parity"]
    md = "# qat: the MTP head at 4-bit\n\n" + markdown_table(rows, columns)
    md += (f"\nTraining: {tr['steps']} steps, {tr['s_per_step']} s/step on {tr['device']} "
           f"(loss {tr['first_loss']} -> {tr['last_loss']}).\n\n"
           f"Parity on {par['positions']} positions of a calibration sequence: float graph vs transformers max |d logprob| "
           f"{par['float_vs_transformers_max_abs_logprob']:.2e}; quantized graph vs QuantSim with float activations "
           f"{par['quant_vs_quantsim_weights_max_abs_logprob']:.2e}, vs the full 16-bit-activation QuantSim "
           f"{par['quant_vs_quantsim_max_abs_logprob']:.2e} (top-1 match {par['quant_top1_match']:.2f}).\n\n"
           f"Step-graph proof ({'passed' if par['passed'] else 'FAILED: ' + str(par['failure'])}): "
           f"{par['step_graph_proof']['rule']}; max |d logprob| {par['step_graph_proof']['max_abs_logprob']:.2e}, "
           f"top-k ids equal {par['step_graph_proof']['topk_ids_equal']:.0%} "
           f"(tolerance {par['step_graph_proof']['tolerance']:g}).\n\n"
           "Files: head_w4.safetensors, encodings.json, mtp_step.onnx (INT4 weights, uint16 input QDQ), "
           "mtp_step.float.onnx, embed_lut.safetensors, io_spec.json, captures/, loss.png, agreement.png.\n")
    a = report["answers"]
    md += "\nAnswers (" + a["source"] + "): " + "; ".join(
        f"{split} {s['tokens']} tokens, {s['distinct_tokens']} distinct, top token {s['top_share']:.0%}"
        for split, s in a["stats"].items() if split != "all") + ".\n"
    md += "".join(f"\n**Warning:** {w}\n" for w in a["warnings"])
    if report.get("proof_failed"):
        md += f"\n**Proof failed** (artifacts kept with --allow-parity-failure): {report['proof_failed']}\n"
    return md


# --- pipeline hooks ------------------------------------------------------------------------------


def section(recipe: Recipe) -> dict[str, Any]:
    return {"qat": to_dict(recipe.qat), "placement": to_dict(recipe.placement)}


def inputs(recipe: Recipe, run_dir: Path) -> dict[str, Path]:
    paths = {name: recipe.path(getattr(recipe.models, name), run_dir) for name in ("verifier", "assistant", "tokenizer")}
    for name, p in paths.items():
        if p is None:
            raise HycoError(f"models.{name} must name a folder for the qat stage, but got null")
    for stage in ("vocab", "answers"):
        if stage not in recipe.stages:
            raise HycoError(f"the qat stage needs the {stage} stage's outputs; add {stage} to the recipe's stages, but "
                            f"got {list(recipe.stages)}")
        paths[stage] = Path(run_dir) / stage
    return paths


def build(recipe: Recipe, run_dir: Path, out: Path) -> dict[str, Any]:
    return build_qat(**inputs(recipe, run_dir), config=recipe.qat, out=out,
                     allow_parity_failure=recipe.allow_parity_failure, placement=recipe.placement)
