"""The convert stage: the E2B QAT checkpoint -> tree.onnx, prefill.onnx, luts/, rope.json,
io_spec.json, encodings.json, bitexact.json, parity.json, report.json, summary.md.

`convert(checkpoint=..., out=..., keep_set=..., config=...)` is the whole stage as a
keyword-only function; the pipeline (`inputs`/`build`) and the CLI (`convert/cli.py`) wrap it.
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hyco.base.errors import HycoError
from hyco.base.files import write_json
from hyco.base.memory import release_free_heap, return_large_blocks
from hyco.config.recipe import ConvertConfig, Recipe, to_dict
from hyco.npu.io_spec import write_io_spec
from hyco.pipeline import verdict
from hyco.pipeline.artifacts import Phases, StageEnd, finish_stage, markdown_table

GRAPHS = {"tree": "tree.onnx", "prefill": "prefill.onnx"}


def keep_ids_for(keep_set: Path | None, tokenizer: Path | None, vocab_size: int, where: Path) -> np.ndarray | None:
    """Keep-set token ids, checked against the checkpoint's tokenizer; None = whole vocabulary."""
    if keep_set is None:
        return None
    from hyco.data.keepset import load_keep_set

    ks = load_keep_set(keep_set, tokenizer=tokenizer)
    ids = np.asarray(ks.token_ids, dtype=np.int64)
    if len(ids) and ids[-1] >= vocab_size:
        raise HycoError(f"{keep_set}: keep set ids reach {ids[-1]}, but {where} has a {vocab_size}-token vocabulary")
    return ids


def rope_json(text_model, config, windows: dict[str, int]) -> dict[str, Any]:
    """What the host needs for cos/sin: transformers' own inverse frequencies per layer type."""
    out = {"layer_types": {}, "windows": windows,
           "note": "cos/sin = cos/sin(cat(p * inv_freq, p * inv_freq)) in float32; proportional RoPE's "
                   "unrotated dims have inv_freq 0 (cos 1, sin 0)"}
    for layer_type in sorted(set(config.layer_types)):
        params = dict(config.rope_parameters[layer_type])
        inv_freq = getattr(text_model.rotary_emb, f"{layer_type}_inv_freq").float().numpy()
        out["layer_types"][layer_type] = {"inv_freq": [float(v) for v in inv_freq], "head_dim": 2 * len(inv_freq),
                                          "attention_scaling": getattr(text_model.rotary_emb, f"{layer_type}_attention_scaling"),
                                          **params}
    return out


def encodings(static, kv_scales: dict[str, float]) -> dict[str, Any]:
    from hyco.convert.export_onnx import int_linears

    linears = {}
    for init, m in int_linears(static).items():
        linears[m.source] = {"onnx_initializer": init, "bits": m.bits, "container": "INT4" if m.bits <= 4 else "INT8",
                             "shape": list(m.shape), "srq_input_scale": m.input_scale,
                             "srq_output_scale": m.output_scale, "origin": m.origin}
        if m.origin != "checkpoint":
            linears[m.source]["note"] = QUANTIZED_HERE
    return {"version": 1, "weights": linears, "kv_cache_scales": kv_scales,
            "note": "bits is the checkpoint's width; convert's graphs hold 2-bit weights in INT4 containers (ONNX "
                    "INT2 per channel computes wrong numbers on the HTP), calibrate's deployable graphs as INT2 "
                    "blocks where export.two_bit_weights says so. SRQ scales are 8-bit symmetric (0 = off). origin "
                    "'hyco-convert': a linear the checkpoint left in float, quantized by hyco-convert."}


QUANTIZED_HERE = ("quantized by hyco-convert, not from the checkpoint: the checkpoint leaves this linear in float "
                  "(modules_to_not_convert); symmetric per output channel, least-squares clip, no SRQ")


def float_weight(ckpt, source: str):
    """The float weight a checkpoint stores for a linear it left unquantized (float32 torch)."""
    from hyco.base.loading import open_safetensors, read_tensor

    name = f"{source}.weight"
    path = ckpt.tensors[name][2]
    with open_safetensors(path) as f:
        return read_tensor(f, name, path).float()


def requantized(ckpt, source: str, bits: int) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """hyco-convert's quantization of a float linear, redone from the file: (ints, scales, its
    error against the float weight: max |w - w_q| and ||w - w_q|| / ||w||)."""
    from hyco.convert.rewrites import quantize_float_weight

    w = float_weight(ckpt, source)
    ints, scale = quantize_float_weight(w, bits)
    err = w - ints.float() * scale[:, None]
    return ints.numpy(), scale.numpy(), {"max_abs": float(err.abs().max()),
                                         "relative_rms": float(err.norm() / w.norm().clamp_min(1e-30))}


def bitexact(out: Path, graph: str, enc: dict[str, Any], ckpt, keep_ids) -> dict[str, Any]:
    """Per linear: do the graph's ints and scales equal the checkpoint's? (`tensor_bitexact`, two
    tensors at a time: numpy unpacks and compares with the GIL released, so both cores work.)"""
    import onnx

    model = onnx.load(str(out / graph), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    sources = sorted(enc["weights"])
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="bitexact") as pool:
        proven = pool.map(lambda s: tensor_bitexact(s, enc["weights"][s], inits, out, ckpt, keep_ids), sources)
        return dict(zip(sources, proven, strict=True))


def tensor_bitexact(source: str, e: dict[str, Any], inits: dict, out: Path, ckpt, keep_ids) -> dict[str, Any]:
    """One linear's ints and scales, read back from the written ONNX (`inits`, weights in `out`)
    and from the checkpoint's safetensors, both memory-mapped, in row blocks (only the keep rows
    of a restricted head), unpacked with the numpy reader in host.py (independent of the exporter
    and of transformers), against each other."""
    import onnx
    from hyco.convert.load import tied_embedding

    from hyco.formats.int4 import unpack_int4
    from hyco.npu.host import mmap_safetensors, unpack_ints

    ints_t, scale_t = inits[e["onnx_initializer"]], inits[e["onnx_initializer"][:-len("ints")] + "scale"]
    shape = tuple(ints_t.dims)
    graph_scale = initializer_array(scale_t, out)
    # A tied output layer's ints and scales are embed_tokens' table (convert/load.py, check_tied_head).
    ints_name, scale_name = f"{source}.weight", f"{source}.weight_scale"
    if source == "lm_head" and ckpt.tied_head:
        ints_name, scale_name = (f"{tied_embedding(ckpt)}.embedding_quantized",
                                 f"{tied_embedding(ckpt)}.embedding_scale")
    bits = ckpt.bits.get(source, e["bits"])  # the checkpoint's width, not the graph's claim
    error = None
    if e.get("origin", "checkpoint") != "checkpoint":
        # Not the checkpoint's ints: proven against hyco-convert's quantization redone from the
        # float weight in the file, and its error against that weight reported.
        bits, ints_name, scale_name = e["bits"], f"{source}.weight", None
        ints, ck_scale, error = requantized(ckpt, source, bits)
        ck_packed = ints
    else:
        ck_packed = mmap_safetensors(ckpt.tensors[ints_name][2], [ints_name])[0][ints_name]
        ck_scale = np.asarray(mmap_safetensors(ckpt.tensors[scale_name][2], [scale_name])[0][scale_name]).reshape(-1)
    ck_rows = np.arange(ck_packed.shape[0])
    if source == "lm_head" and keep_ids is not None:  # the keep rows only
        ck_rows, ck_scale = np.asarray(keep_ids), ck_scale[keep_ids]
    int4 = ints_t.data_type == onnx.TensorProto.INT4
    stored = initializer_bytes(ints_t, out) if int4 else initializer_array(ints_t, out)
    ints_equal = len(shape) == 2 and len(ck_rows) == shape[0]
    # Row blocks of ~8 M values: the unpacking transients of a 86K-row head stay small, and the
    # two threads of `bitexact` together hold what one block of 16 M values did.
    # INT4 rows of an odd width do not start on a byte: compare those whole.
    step = shape[0] if int4 and shape[1] % 2 else max(1, (8 << 20) // max(1, shape[1]))
    for r0 in range(0, shape[0] if ints_equal else 0, step):
        r1 = min(shape[0], r0 + step)
        if int4:
            g = unpack_int4(stored[r0 * shape[1] // 2: -(-r1 * shape[1] // 2)], (r1 - r0) * shape[1])
            g = g.reshape(r1 - r0, shape[1])
        else:
            g = stored[r0:r1]
        ck = np.asarray(ck_packed[ck_rows[r0:r1]])
        ck = ck if error is not None else unpack_ints(ck, bits, shape[1])
        ints_equal = ints_equal and ck.shape == g.shape and np.array_equal(ck, g)
        if not ints_equal:
            break
    row = {"bits": bits, "container": onnx.TensorProto.DataType.Name(ints_t.data_type),
           "shape": list(shape), "checkpoint_tensors": [n for n in (ints_name, scale_name) if n],
           "origin": e.get("origin", "checkpoint"), "ints_equal": bool(ints_equal),
           "scales_equal": bool(ck_scale.shape == graph_scale.shape
                                and np.array_equal(ck_scale.view(np.uint32), graph_scale.view(np.uint32)))}
    if error is not None:
        row.update(note=QUANTIZED_HERE, error_vs_float=error)
    return row


def same_weights(out: Path, graph: str, proven: str, enc: dict[str, Any], proven_rows: dict[str, Any]) -> dict[str, Any]:
    """Per linear: `graph`'s ints and scales compared byte for byte with those of `proven`, whose
    rows `bitexact` proved against the checkpoint (the prefill graph holds the tree graph's
    weights: unpacking both against the checkpoint is many times slower at E2B size). A row is
    bit-exact only where both hold."""
    import onnx

    models = {g: onnx.load(str(out / g), load_external_data=False) for g in (graph, proven)}
    inits = {g: {t.name: t for t in m.graph.initializer} for g, m in models.items()}
    rows = {}
    for source, e in sorted(enc["weights"].items()):
        names = (e["onnx_initializer"], e["onnx_initializer"][:-len("ints")] + "scale")
        equal = []
        for name in names:
            a, b = inits[graph].get(name), inits[proven].get(name)
            equal.append(a is not None and b is not None and a.data_type == b.data_type and a.dims == b.dims
                         and _bytes_equal(initializer_bytes(a, out), initializer_bytes(b, out)))
        row = proven_rows[source]
        rows[source] = {**row, "ints_equal": bool(row["ints_equal"] and equal[0]),
                        "scales_equal": bool(row["scales_equal"] and equal[1]), "proof": f"bytes equal {proven}'s"}
    return rows


def _bytes_equal(a, b, block: int = 64 << 20) -> bool:
    """Two initializers' bytes (`initializer_bytes`: bytes or memory maps), a block at a time."""
    a, b = (np.frombuffer(x, np.uint8) if isinstance(x, bytes) else x for x in (a, b))
    return len(a) == len(b) and all(np.array_equal(a[i:i + block], b[i:i + block]) for i in range(0, len(a), block))


def initializer_bytes(t, folder: Path):
    """An initializer's raw bytes, read from its external-data file through a memory map (not
    loaded into the proto: protobuf keeps a cleared field's bytes in the message's arena, so
    reading tensor after tensor into one model grew by the whole graph)."""
    import onnx

    if t.data_location != onnx.TensorProto.EXTERNAL:
        return t.raw_data
    info = {e.key: e.value for e in t.external_data}
    return np.memmap(folder / info["location"], dtype=np.uint8, mode="r", offset=int(info.get("offset", 0)),
                     shape=(int(info["length"]),))


def initializer_array(t, folder: Path) -> np.ndarray:
    """A (non-INT4) initializer as a numpy array, external data read through a memory map."""
    import onnx
    from onnx import helper, numpy_helper

    if t.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).newbyteorder("<")
    return np.frombuffer(initializer_bytes(t, folder), dtype=dtype).reshape(tuple(t.dims))


def export_all(static, config: ConvertConfig, raw: Path) -> list:
    """Raw exports of the tree and prefill graphs into `raw`; `finalize_all` writes them."""
    from hyco.convert.export_onnx import export_raw

    specs = []
    for key, rows in (("tree", config.rows), ("prefill", config.prefill_chunk)):
        specs.append(export_raw(static, rows, raw / key, GRAPHS[key]))
        release_free_heap()
    return specs


def finalize_all(raw: Path, out: Path, static) -> dict[str, Any]:
    """Write the raw exports' weights from the module (ints from their packed bytes), one tensor at a time."""
    from hyco.convert.export_onnx import finalize, int_linears

    params, linears = static.state_dict(), int_linears(static)
    sizes = {}
    for key, name in GRAPHS.items():
        start = time.perf_counter()
        finalize(raw / key / name, out / name, params, linears)
        release_free_heap()
        import onnx

        nodes = len(onnx.load(str(out / name), load_external_data=False).graph.node)
        sizes[name] = {"nodes": nodes, "onnx_bytes": (out / name).stat().st_size,
                       "data_bytes": (out / (name + ".data")).stat().st_size,
                       "finalize_s": round(time.perf_counter() - start, 2)}
    return sizes


def run_parity(ckpt, keep_ids, out: Path, ring_graphs: Path | None, rope,
               only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The traced parity checks (convert/parity.py) of the graphs in `out` (deployable rings)
    and `ring_graphs` (the same weights with rings shrunk below the checks' contexts)."""
    import torch
    from hyco.convert.load import load_model
    from hyco.convert.parity import run_checks

    from hyco.base.loading import read_json

    model, text, _ = load_model(ckpt)
    model.set_attn_implementation("eager")
    enc = read_json(out / "encodings.json")
    # The reference takes the graph's values for linears quantized here, so parity proves the
    # surgery; the quantization's own error against float is bitexact.json's error_vs_float.
    take_quantized_here(model, ckpt, enc)
    keep = np.arange(text.config.vocab_size) if keep_ids is None else keep_ids
    # The reference runs are short sequences: one thread avoids spin-waiting on a busy CPU
    # (two contended threads made a tiny forward many times slower than one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_checks(model, keep, graphs=out, luts=out / "luts", rope=rope,
                          enc=enc, ring_graphs=ring_graphs, only=only)
    finally:
        torch.set_num_threads(threads)


def take_quantized_here(model, ckpt, enc: dict[str, Any]) -> list[str]:
    """Give the linears the checkpoint left in float (encodings.json origin "hyco-convert") the
    dequantized values the graph computes with; returns their names."""
    import torch

    taken = []
    with torch.no_grad():
        for source, e in enc["weights"].items():
            if e.get("origin", "checkpoint") != "checkpoint":
                ints, scale, _ = requantized(ckpt, source, e["bits"])
                model.get_submodule(source).weight.copy_(torch.from_numpy(ints).float() * torch.from_numpy(scale)[:, None])
                taken.append(source)
    return taken


def convert(*, checkpoint: Path, out: Path, config: ConvertConfig, keep_set: Path | None = None,
            tokenizer: Path | None = None, allow_parity_failure: bool = False) -> dict[str, Any]:
    """Write the stage's artifacts into `out`; return a short summary for the manifest.

    A failed proof (integer weights not bit-exact, or the traced parity rule) raises
    ProofFailed after the reports are written into `out` (a temp folder under run_stage, so
    nothing moves into place), unless `allow_parity_failure`: then the summary carries
    `proof_failed` and run_stage marks the manifest.

    Memory: the weights are held once, packed as the checkpoint stores them. from_pretrained
    maps the safetensors (file pages, resident as they are read), the embedding tables are
    copied to luts/ file to file, and build_static_model hands each layer's packed tensors to the
    static module (IntLinear.packed, no copy) and drops transformers' layer. The tracer sees
    zero-stride int stand-ins and records no weight, and torch's ONNX shape inference is kept
    from copying them (compat_torch.onnx_shape_inference_without); finalize writes one initializer at
    a time from the packed bytes; bitexact reads both sides through memory maps in row blocks.
    The transients on top: the trace's float activations (prefill rows x head rows), finalize's
    largest initializer twice (its INT4 bytes and the proto's copy), bitexact's 16 M-value blocks.
    tests/test_convert_memory.py holds the peak above the imports within 2x the packed bytes
    (holding the linears as int8 as well would break it); bench/bench_fullsize.py measures full
    E2B shapes."""
    import torch

    from hyco.formats.ct_format import gemma_layout, is_ct

    start = time.perf_counter()
    phase = Phases("convert")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    return_large_blocks()
    source, weight_format = checkpoint, "compressed-tensors (-ct)" if is_ct(checkpoint) else "gemma (-transformers)"
    with phase("read checkpoint, LUTs"):
        checkpoint = gemma_layout(checkpoint)  # a -ct folder: its proven -transformers transcode
        ckpt, load_report, tc, keep_ids, luts, kv_scales = read_inputs(checkpoint, config, keep_set, tokenizer, out)
    with tempfile.TemporaryDirectory(prefix="hyco-convert-") as tmp:
        graphs = write_graphs(ckpt, tc, keep_ids, kv_scales, config, keep_set, out, Path(tmp), phase)
        per_graph, all_equal, parity = prove(ckpt, keep_ids, graphs, config, out, Path(tmp), phase)
    tree = per_graph[GRAPHS["tree"]]
    report = {"checkpoint": str(source), "weight_format": weight_format, "read_from": str(checkpoint),
              "layout": load_report["layout"], "load": load_report,
              "export_s": graphs["export_s"],
              "keep_set": {"path": str(keep_set) if keep_ids is not None else None,
                           "size": int(len(keep_ids)) if keep_ids is not None else tc.vocab_size},
              "luts": luts, "graphs": graphs["sizes"], "bitexact_all_equal": all_equal,
              "quantized_here": {k: r for k, r in tree.items() if r["origin"] != "checkpoint"},
              "parity_passed": None if parity is None else parity["passed"],
              "windows": graphs["windows"], "phases": phase.rows, "wall_s": round(time.perf_counter() - start, 2)}
    failed = None
    if not all_equal:
        bad = [f"{g}:{src}" for g, rows in per_graph.items() for src, r in rows.items()
               if not (r["ints_equal"] and r["scales_equal"])]
        failed = f"bitexact: {len(bad)} integer weight tensors differ from the checkpoint (first: {bad[0]})"
    elif parity is not None and not parity["passed"]:
        failed = f"parity {parity['failure']}"
    summary = {"bitexact_all_equal": all_equal, "parity_passed": report["parity_passed"],
               "parity_ties": None if parity is None else parity["ties"],
               "tree_rows": config.rows, "prefill_rows": config.prefill_chunk, "keep_size": report["keep_set"]["size"],
               "extra_tensors": len(load_report["extra"])}
    return finish_stage("convert", out, StageEnd(
        report, lambda r: summary_md(r, parity), summary, failed,
        nondeterministic=[("summary.md", "prints this run's wall time, peak RSS and finalize times (report.json)",
                           None)], verdict=verdict_lines(per_graph, parity)), allow_parity_failure)


def verdict_lines(per_graph: dict[str, dict[str, Any]], parity: dict[str, Any] | None) -> list[verdict.Line]:
    """Bit-exactness tensor by tensor over both graphs, and the traced parity against transformers."""
    from hyco.convert.parity import TOLERANCE

    rows = [r for graph in per_graph.values() for r in graph.values()]
    equal = sum(bool(r["ints_equal"] and r["scales_equal"]) for r in rows)
    lines = [verdict.proof("integer weights bit-exact", equal == len(rows),
                           f"{equal}/{len(rows)} weight tensors over {len(per_graph)} graphs",
                           "every int and scale equal to the checkpoint's")]
    if parity is None:
        return [*lines, verdict.proof("parity vs transformers", None, "", off="off (convert.parity: false)")]
    checks = parity["checks"].values()
    worst = max(c["max_abs_diff"] for c in checks)
    argmax = min(c["argmax_agreement"] for c in checks)
    return [*lines, verdict.proof(
        "parity vs transformers (onnxruntime CPU)", parity["passed"],
        f"max |logit diff| {worst:.1e}, argmax {verdict.percent(argmax)}, {parity['ties']} rounding ties traced",
        f"{TOLERANCE:g} with ties forced, argmax 100%")]


def read_inputs(checkpoint: Path, config: ConvertConfig, keep_set: Path | None, tokenizer: Path | None, out: Path):
    """The checkpoint's layout and completeness, its text config, the keep set, the LUTs (written
    to out/luts) and the KV cache scales."""
    from hyco.convert.load import completeness, kv_cache_scales, read_checkpoint, text_config
    from hyco.convert.luts import write_luts

    ckpt = read_checkpoint(checkpoint)
    load_report = completeness(ckpt)
    if ckpt.float_linears and config.float_linear_bits is None:
        raise HycoError(f"{ckpt.folder / 'config.json'}: modules_to_not_convert leaves {len(ckpt.float_linears)} "
                        f"linear(s) in float (first: {sorted(ckpt.float_linears)[0]}), and convert.float_linear_bits "
                        "is null; the NPU graph takes integer weights only")
    load_report["float_linears"] = sorted(ckpt.float_linears)
    tc = text_config(ckpt.folder)
    keep_ids = keep_ids_for(keep_set, tokenizer or ckpt.folder, tc.vocab_size, ckpt.folder) if config.use_keep_set else None
    luts = write_luts(ckpt, tc, out / "luts")
    kv_scales = kv_cache_scales(ckpt, load_report["kv_cache_scales"])
    return ckpt, load_report, tc, keep_ids, luts, kv_scales


def write_graphs(ckpt, tc, keep_ids, kv_scales, config: ConvertConfig, keep_set: Path | None, out: Path, tmp: Path,
                 phase: Phases) -> dict[str, Any]:
    """The static module, traced into the tree and prefill graphs (and, for parity, their twins
    with shrunk rings into tmp/ring) and finalized with the weights; rope.json, io_spec.json and
    encodings.json beside them. The static module holds the only copy of the weights and is gone
    when this returns."""
    from hyco.convert.load import load_model
    from hyco.convert.rewrites import build_static_model, effective_windows

    with phase("load model, static module"):
        model, text, lm_head = load_model(ckpt)
        windows = effective_windows(tc, config.ring_full, config.ring_sliding)
        rope = rope_json(text, tc, windows)
        write_json(out / "rope.json", rope)
        static = build_static_model(text, lm_head, config, text_prefix=ckpt.layout.text_prefix, keep_ids=keep_ids)
        del model, text, lm_head  # the static module now holds the only copy of the weights (packed)
        release_free_heap()
    start_export = time.perf_counter()
    ring_specs = None
    with phase("trace graphs"):
        specs = export_all(static, config, tmp / "graphs")
        for spec in specs:  # the phone never prefills more than its full ring holds
            spec.meta.update({"max_prompt": min(config.max_prompt, config.ring_full),
                              "keep_set": str(keep_set) if keep_ids is not None else None})
        if config.parity:
            # Same weights, rings shrunk below the parity context, for the "past the ring" check.
            from hyco.convert.static_model import RingShape

            ring_full = config.parity_ring_full
            ring_sliding = max(1, ring_full // 2)
            static.rings = RingShape(ring_full, ring_sliding, effective_windows(tc, ring_full, ring_sliding),
                                     config.mask_negative)
            small = ConvertConfig(rows=config.rows, prefill_chunk=min(config.prefill_chunk, ring_sliding))
            ring_specs = export_all(static, small, tmp / "ring_raw")
    with phase("finalize graphs (weights written)"):
        enc = encodings(static, kv_scales)
        sizes = finalize_all(tmp / "graphs", out, static)
        if config.parity:
            finalize_all(tmp / "ring_raw", tmp / "ring", static)
        del static  # the module's ints were the only full copy of the weights
        release_free_heap()
    for spec in specs:
        sizes[spec.graph]["rows"] = spec.meta["rows"]
    export_s = round(time.perf_counter() - start_export, 2)
    write_io_spec(out / "io_spec.json", specs)
    write_json(out / "encodings.json", enc)
    return {"sizes": sizes, "export_s": export_s, "encodings": enc, "rope": rope, "windows": windows,
            "ring_specs": ring_specs}


def prove(ckpt, keep_ids, graphs: dict[str, Any], config: ConvertConfig, out: Path, tmp: Path, phase: Phases):
    """The bit-exact proof (bitexact.json) and, with `config.parity`, traced parity against
    transformers (parity.json, parity.png). Returns (per-graph bit-exactness, all equal, parity)."""
    from hyco.npu.host import Rope

    enc = graphs["encodings"]
    with phase("bit-exact proof"):
        tree = bitexact(out, GRAPHS["tree"], enc, ckpt, keep_ids)
        per_graph = {GRAPHS["tree"]: tree, GRAPHS["prefill"]: same_weights(out, GRAPHS["prefill"], GRAPHS["tree"],
                                                                            enc, tree)}
    all_equal = all(r["ints_equal"] and r["scales_equal"] for g in per_graph.values() for r in g.values())
    write_json(out / "bitexact.json", {"all_equal": all_equal, "graphs": per_graph})
    parity = None
    if config.parity:
        with phase("parity"):
            write_io_spec(tmp / "ring" / "io_spec.json", graphs["ring_specs"])
            parity = run_parity(ckpt, keep_ids, out, tmp / "ring", Rope.from_json(graphs["rope"]))
            write_json(out / "parity.json", parity)
            plot_parity(parity, out / "parity.png")
    return per_graph, all_equal, parity


def plot_parity(parity: dict[str, Any], path: Path) -> None:
    from hyco.pipeline.plots import save

    save(parity_figure(parity), path)


def parity_figure(parity: dict[str, Any]):
    """Per check, the max abs logit difference against transformers at each compared position, ties
    forced, on a log scale with the tolerance every position must stay under."""
    from hyco.convert.parity import TOLERANCE

    from hyco.pipeline.plots import LOWER, better, legend_outside, new_figure

    fig = new_figure(8.5, 3.6)
    ax = fig.subplots()
    # a check that stopped before comparing has no differences; an unmeasured one (None) is NaN, undrawn
    compared = {name: np.asarray(c["per_position_abs_diff"], dtype=float) for name, c in parity["checks"].items()
                if c.get("per_position_abs_diff")}
    for name, diffs in compared.items():
        # an exact match (0) would vanish from a log axis: drawn at 1e-9 instead
        ax.plot(np.maximum(diffs, 1e-9), marker=".", ms=4, lw=0.6, alpha=0.8, label=f"{name} ({len(diffs)} positions)")
    tolerance = next((c["tolerance"] for c in parity["checks"].values() if c.get("tolerance") is not None), TOLERANCE)
    ax.axhline(tolerance, color="tab:red", ls="--", lw=1, label=f"tolerance ({tolerance:g})")
    measured = [float(np.nanmax(d)) for d in compared.values() if not np.isnan(d).all()]
    worst = max(measured, default=None)
    if worst is None:
        ax.text(0.5, 0.3, "no check compared a position", ha="center", va="center", transform=ax.transAxes,
                color="0.4")
    else:
        ax.annotate(_worst_note(worst, tolerance), (0.01, tolerance), xycoords=("axes fraction", "data"),
                    xytext=(0, -4), textcoords="offset points", va="top", fontsize=8, color="tab:red")
    ax.set_yscale("log")
    # the tolerance line inside the axes, not on its edge
    ax.set_ylim(top=3 * max(tolerance, worst or 0.0))
    ax.set_xlabel("position compared (in each check's order)")
    ax.set_ylabel(better("max |logit difference| (log scale)", LOWER))
    ax.set_title("ONNX graph (onnxruntime CPU) vs ring-limited transformers, ties forced", fontsize=10)
    ax.grid(alpha=0.3, which="major")
    legend_outside(ax)
    return fig


def _worst_note(worst: float, tolerance: float) -> str:
    if worst == 0:
        return "every position exact"
    if worst > tolerance:
        return f"worst position {worst:.2g}: over the tolerance"
    return f"worst position {worst:.2g}, {tolerance / worst:.0f}x under the tolerance"


def summary_md(report: dict[str, Any], parity: dict[str, Any] | None) -> str:
    md = f"# convert: `{report['checkpoint']}` ({report['layout']})\n\n"
    md += (f"Keep set: {report['keep_set']['size']} tokens. Bit-exact integer weights: "
           f"{'all equal' if report['bitexact_all_equal'] else 'MISMATCH (see bitexact.json)'}. "
           f"Wall {report['wall_s']} s, peak RSS {report['peak_rss_mb']:.0f} MiB.\n\n")
    md += markdown_table([{"graph": g, **s} for g, s in report["graphs"].items()],
                         ["graph", "rows", "nodes", "onnx_bytes", "data_bytes", "finalize_s"])
    if towers := report["load"].get("towers_left_on_disk"):
        by = ", ".join(f"`{k}` {v['tensors']} tensors / {v['bytes']:,} B" for k, v in towers["by_tower"].items())
        md += (f"\nTowers left on disk (never loaded; a text-only conversion): {towers['tensors']} tensors, "
               f"{towers['bytes']:,} bytes ({by}).\n")
    if report["load"]["extra"]:
        md += f"\nExtra checkpoint tensors not used by the graphs ({len(report['load']['extra'])}): " \
              + ", ".join(f"`{n}`" for n in report["load"]["extra"][:10]) + "\n"
    for source, row in report.get("quantized_here", {}).items():
        err = row["error_vs_float"]
        md += (f"\n`{source}`: {QUANTIZED_HERE} (int{row['bits']}; error against the float weight: max "
               f"{err['max_abs']:.3g}, relative rms {err['relative_rms']:.3g}). Parity runs transformers with the same "
               "values.\n")
    if report.get("proof_failed"):
        md += f"\n**Proof failed** (artifacts kept with --allow-parity-failure): {report['proof_failed']}\n"
    if parity is not None:
        md += (f"\n## Parity vs transformers (onnxruntime CPU, optimizations off)\n\n"
               f"**{parity['verdict']}** over {parity['srq_points']} SRQ points per pass.\n\n")
        rows = [{"check": k, **v, "ties": len(v["ties"]),
                 "before_forcing_max_diff": v.get("before_forcing", {}).get("max_abs_diff"),
                 "before_forcing_argmax": v.get("before_forcing", {}).get("argmax_agreement")}
                for k, v in parity["checks"].items()]
        md += markdown_table(rows, ["check", "positions", "context", "ties", "before_forcing_max_diff",
                                    "before_forcing_argmax", "max_abs_diff", "max_srq_input_rel_diff", "argmax_agreement",
                                    "passed"])
        md += (f"\nRule: {parity['rule']}. Reference: {parity['reference']}. Each tie (pass, position, layer, "
               "tensor, both pre-rounding values) is listed in parity.json. See parity.png.\n")
    return md


# --- pipeline hooks ------------------------------------------------------------------------------


def section(recipe: Recipe) -> dict[str, Any]:
    return {"convert": to_dict(recipe.convert)}


def inputs(recipe: Recipe, run_dir: Path) -> dict[str, Path]:
    slm = recipe.path(recipe.models.slm, run_dir)
    if slm is None:
        raise HycoError("models.slm must name the E2B QAT checkpoint folder for the convert stage, but got null")
    paths = {"checkpoint": slm}
    if recipe.convert.use_keep_set and "vocab" in recipe.stages:
        paths["keep_set"] = Path(run_dir) / "vocab" / "keep_set.json"
    tokenizer = recipe.path(recipe.models.tokenizer, run_dir)
    if tokenizer is not None:
        paths["tokenizer"] = tokenizer
    return paths


def build(recipe: Recipe, run_dir: Path, out: Path) -> dict[str, Any]:
    paths = inputs(recipe, run_dir)
    return convert(checkpoint=paths["checkpoint"], out=out, config=recipe.convert,
                   keep_set=paths.get("keep_set"), tokenizer=paths.get("tokenizer"),
                   allow_parity_failure=recipe.allow_parity_failure)
