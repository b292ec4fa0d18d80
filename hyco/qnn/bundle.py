"""The bundle: everything the phone (or the smoke test) needs, and `bundle.json` describing it.

bundle.json lists every file with its sha256 and size, and per graph the SoC, the QNN build,
the graph names and I/O read back from the context binary itself (libQnnSystem), checked
against io_spec.json, plus the weight bytes one pass reads. `verify_bundle` re-checks all of it
before anything runs: a flipped byte, a missing LUT or an io_spec that disagrees with a binary
fails with one line naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hyco.base.errors import HycoError
from hyco.base.files import file_digests, sha256_file
from hyco.base.loading import read_json
from hyco.npu.io_spec import GraphSpec, read_io_spec

BUNDLE_JSON = "bundle.json"
BUNDLE_VERSION = 1
# What the runtime reads besides the graphs (SLM LUTs, rotary, keep set), and the MTP Drafter's
# table where the bundle ships its step graph.
REQUIRED = ("io_spec.json", "rope.json", "luts/embed_tokens.safetensors", "keep_set.json", "keep_to_vocab.npy",
            "vocab_to_keep.npy")
MTP_REQUIRED = ("embed_lut.safetensors",)


# What the phone holds, by Table 3's rows; the target bytes are the recipe's (export.footprint_targets)
FOOTPRINT_ROWS = {"slm": "SLM NPU graph", "mtp_graph": "MTP graph at W4", "mtp_lut": "MTP embedding LUT (8-bit)",
                  "mtp_drafter": "MTP Drafter (graph + LUT)"}
MTP_LUT = "embed_lut.safetensors"


def device_footprint(graphs: dict[str, Any], files: dict[str, Any], encodings: Path | None = None,
                     targets: dict[str, float] | None = None, two_bit: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the phone holds, read from the binaries: each context's resident bytes (libQnnSystem's
    contextBlobSize: the weights and the compiled graph HTP loads), per graph and in total with a
    context two graphs share counted once; the CPU's LUT files; what the 2-bit weights cost as they
    ship (`two_bit_cost`); and the comparison with Table 3. The NPU figures come from the .bin
    files, not from the ONNX graphs."""
    contexts: dict[str, int] = {}
    per_graph = {}
    for role, g in graphs.items():
        per_graph[role] = sum(p["context_blob_bytes"] for p in g["parts"])
        for p in g["parts"]:
            contexts[p["binary"]] = p["context_blob_bytes"]
    luts = {name: row["bytes"] for name, row in files.items() if name.startswith("luts/") or name == MTP_LUT}
    slm = sum(contexts[p["binary"]] for role in ("tree", "prefill") for p in graphs.get(role, {}).get("parts", [])
              if not (role == "prefill" and p["binary"] in {q["binary"] for q in graphs["tree"]["parts"]}))
    mtp = per_graph.get("mtp_step")  # None: a bundle without an MTP Drafter
    ours = {"slm": slm, "mtp_graph": mtp, "mtp_lut": luts.get(MTP_LUT),
            "mtp_drafter": None if mtp is None else mtp + luts.get(MTP_LUT, 0)}
    from hyco.config.recipe import TABLE3_E2B

    table3 = [{"item": FOOTPRINT_ROWS[key], "paper_bytes": int(paper), "bundle_bytes": ours[key],
               "vs_paper": None if ours[key] is None else round(ours[key] / paper - 1, 4)}
              for key, paper in (TABLE3_E2B if targets is None else targets).items()]
    return {"resident_per_graph": per_graph, "resident_per_context": contexts,
            "two_bit_weights": two_bit_cost(encodings, two_bit) if encodings is not None else None,
            "npu_resident_total": sum(contexts.values()), "cpu_luts": luts, "cpu_lut_total": sum(luts.values()),
            "table3": table3,
            "how": "NPU: each context binary's contextBlobSize read through libQnnSystem (a context two graphs share "
                   "counts once in the totals); CPU: the LUT files' bytes. Table 3's SLM row is the SLM's contexts: tree "
                   "alone where it also prefills (export.slm_graphs tree-only), else tree + prefill."}


def two_bit_cost(encodings: Path, shipped: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What the SLM's 2-bit weights cost as they ship (convert's encodings.json lists every integer
    weight with its bits). `shipped`: bundle.json's `two_bit_weights` (the encoding, why, and the
    weights each graph holds in INT2 blocks, `hyco.quant.int2_blocks`); None: INT4 containers, the same
    ints and scales at twice their size, as convert's own graphs hold them."""
    if not Path(encodings).is_file():
        return None
    weights = list(read_json(Path(encodings), "encodings.json")["weights"].values())
    two = [w for w in weights if w["bits"] == 2]
    size = lambda w: w["shape"][0] * w["shape"][1]
    blocked = {n.removesuffix("_t") for n in (shipped or {}).get("rewritten", [])}
    in_blocks = [w for w in two if w["onnx_initializer"] in blocked]
    block = (shipped or {}).get("block_size") or 0
    total, int2 = sum(map(size, two)), sum(map(size, in_blocks))
    as_shipped = int2 // 4 + (total - int2) // 2
    return {"encoding": (shipped or {}).get("encoding", "int4-containers"), "block_size": block or None,
            "weights_at_2_bits": len(two), "weights_in_int2_blocks": len(in_blocks),
            "bytes_at_2_bits": total // 4, "bytes_as_shipped": as_shipped, "block_scales": int2 // block if block else 0,
            "bytes_in_int4_containers": total // 2, "extra_bytes": as_shipped - total // 4,
            "integer_weight_bytes_at_own_width": sum(size(w) * w["bits"] // 8 for w in weights),
            "why": (shipped or {}).get("why", "INT4 containers: the ints in [-2, 1] in INT4, with the same scales")}


def two_bit_sentence(two: dict[str, Any]) -> str:
    """How the 2-bit weights ship, in one sentence for the footprint's Markdown."""
    mb = lambda b: f"{b / 1e6:,.1f} MB" if b >= 1e6 else f"{b / 1e3:,.1f} kB"
    if two["weights_in_int2_blocks"]:
        rest = two["weights_at_2_bits"] - two["weights_in_int2_blocks"]
        kept = (f"; {rest} whose input dim is off the block grid stay in INT4 containers "
                f"({mb(two['bytes_as_shipped'])} of ints in all)") if rest else ""
        return (f"The SLM's 2-bit weights ship as INT2 blocks of {two['block_size']}: {mb(two['bytes_at_2_bits'])} of "
                f"ints at 2 bits plus one scale per block ({two['block_scales']:,} scales), where INT4 containers take "
                f"{mb(two['bytes_in_int4_containers'])}{kept} ({two['why']}).")
    return (f"The SLM's 2-bit weights travel in INT4 containers: {mb(two['bytes_in_int4_containers'])} where 2 bits "
            f"would take {mb(two['bytes_at_2_bits'])} (+{mb(two['extra_bytes'])} per context holding them; {two['why']}).")


def phone_session(footprint: dict[str, Any], budget: int) -> dict[str, Any]:
    """The HTP session the phone loads the bundle into: one process loads the SLM's graphs and the
    MTP step together, and every context it loads shares that session's memory (it fails to load,
    error 1002 on the device, around 3.5-4 GB). Each context counted once."""
    contexts = footprint["resident_per_context"]
    total = sum(contexts.values())
    return {"contexts": dict(contexts), "resident_bytes": total, "budget_bytes": budget, "fits": total <= budget}


def refuse_over_budget(session: dict[str, Any]) -> None:
    """One line naming the contexts, their bytes and the ways out, for a bundle no HTP session holds."""
    if session["fits"]:
        return
    mb = lambda b: f"{b / 1e6:,.1f} MB"
    listed = ", ".join(f"{name} {mb(b)}" for name, b in session["contexts"].items())
    raise HycoError(f"the phone loads {listed} into one HTP session: {mb(session['resident_bytes'])} together, over "
                    f"export.max_session_bytes {session['budget_bytes']:,} (sessions fail to load around 3.5-4 GB); "
                    "ways out: one copy of the SLM's weights (export.slm_graphs: tree-only), "
                    "2-bit weights at 2 bits (export.two_bit_weights: int2-blocks), or smaller KV rings (convert.ring_full, convert.ring_sliding)")


def footprint_line(footprint: dict[str, Any]) -> str:
    """One line of what the phone holds, beside the targets (the paper's Table 3 unless the recipe
    states its own)."""
    mb = lambda b: f"{b / 1e6:,.1f} MB"
    line = f"NPU {mb(footprint['npu_resident_total'])} resident, CPU LUTs {mb(footprint['cpu_lut_total'])}"
    paper = {r["item"]: r["paper_bytes"] for r in footprint["table3"]}
    slm, mtp = paper.get(FOOTPRINT_ROWS["slm"]), paper.get(FOOTPRINT_ROWS["mtp_drafter"])
    if slm and mtp:
        line += f"; the targets: SLM {mb(slm)} + MTP Drafter {mb(mtp)}"
    two = footprint.get("two_bit_weights")
    if two:
        line += ("; 2-bit weights as INT2 blocks of " + str(two["block_size"]) if two["weights_in_int2_blocks"]
                 else f"; 2-bit weights in INT4 containers (+{mb(two['extra_bytes'])})")
    scale = scale_note(footprint)
    return f"{line} ({scale})" if scale else line


def scale_note(footprint: dict[str, Any]) -> str | None:
    """A bundle a tenth of its targets or less holds a smaller model than theirs (the tiny family
    against the paper's E2B): said so, since its "-99.8% vs paper" column reads like an alarm."""
    ours = footprint["npu_resident_total"] + footprint["cpu_lut_total"]
    targets = sum(r["paper_bytes"] for r in footprint["table3"]
                  if r["item"] in (FOOTPRINT_ROWS["slm"], FOOTPRINT_ROWS["mtp_drafter"]))
    if not ours or targets < 10 * ours:
        return None
    return (f"this bundle is {targets / ours:,.0f}x smaller than the targets: a smaller model, so the difference is "
            "one of scale, not a regression")


def footprint_markdown(footprint: dict[str, Any]) -> str:
    mb = lambda b: "-" if b is None else f"{b / 1e6:,.1f} MB"
    rows = ["| item | paper | this bundle | vs paper |", "|---|---|---|---|"]
    rows += [f"| {r['item']} | {mb(r['paper_bytes'])} | {mb(r['bundle_bytes'])} | "
             + ("-" if r["vs_paper"] is None else f"{100 * r['vs_paper']:+.1f}%") + " |" for r in footprint["table3"]]
    per_graph = ", ".join(f"{g} {mb(b)}" for g, b in footprint["resident_per_graph"].items())
    two = footprint.get("two_bit_weights")
    extra = " " + two_bit_sentence(two) if two else ""
    scale = scale_note(footprint)
    note = f"{scale[0].upper()}{scale[1:]}.\n\n" if scale else ""
    if session := footprint.get("session"):
        note += (f"The phone's one HTP session holds every context: {mb(session['resident_bytes'])} of its "
                 f"{mb(session['budget_bytes'])} budget (export.max_session_bytes).\n\n")
    return (note + "\n".join(rows) + f"\n\nNPU resident per graph: {per_graph}; in total {mb(footprint['npu_resident_total'])} "
            f"(a shared context once). CPU LUTs {mb(footprint['cpu_lut_total'])}. {footprint['how']}{extra}\n")


def weight_bytes(graph: Path) -> int:
    """Bytes of every initializer (INT4 packed two per byte, INT2 four): what one pass reads from memory."""
    import onnx
    from onnx import TensorProto

    bits = {TensorProto.INT2: 2, TensorProto.UINT2: 2, TensorProto.INT4: 4, TensorProto.UINT4: 4, TensorProto.INT8: 8, TensorProto.UINT8: 8,
            TensorProto.INT16: 16, TensorProto.UINT16: 16, TensorProto.FLOAT16: 16, TensorProto.BFLOAT16: 16,
            TensorProto.INT32: 32, TensorProto.FLOAT: 32, TensorProto.INT64: 64, TensorProto.DOUBLE: 64,
            TensorProto.BOOL: 8}
    model = onnx.load(str(graph), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        if t.data_type not in bits:
            raise HycoError(f"{graph}: initializer {t.name!r} has an unexpected data type {t.data_type}")
        total += (int(np.prod(t.dims, dtype=np.int64)) * bits[t.data_type] + 7) // 8
    return total


def binary_dtype(t) -> str:
    """How a QNN binary describes an io_spec tensor: integer codes on a quantization grid are
    fixed-point tensors there (uint8 -> ufixed8); everything else keeps its type."""
    if t.quant is not None and t.dtype in ("uint8", "uint16"):
        return "ufixed" + t.dtype[4:]
    return t.dtype


def check_binary_io(info: dict[str, Any], spec: GraphSpec, binary: str, spec_file: str) -> None:
    """The binary's graph I/O (names, shapes, dtypes, quantization grids) must be io_spec's, in
    any order; a shared context holds several graphs, and one of them must match."""
    errors = []
    for graph in info["graphs"]:
        try:
            return _check_graph_io(graph, spec, binary, spec_file)
        except HycoError as e:
            errors.append(e)
    if not errors:
        raise HycoError(f"{binary}: holds no graph")
    raise errors[0]


def _check_graph_io(graph: dict[str, Any], spec: GraphSpec, binary: str, spec_file: str) -> None:
    for kind, expected in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        actual = {t["name"]: t for t in graph[kind]}
        for t in expected:
            got = actual.pop(t.name, None)
            if got is None:
                raise HycoError(f"{spec_file}: {spec.graph} {kind[:-1]} {t.name!r} is not in {binary} "
                                f"(binary has {', '.join(x['name'] for x in graph[kind])})")
            want = binary_dtype(t)
            if tuple(got["shape"]) != tuple(t.shape) or got["dtype"] != want:
                raise HycoError(f"{spec_file}: {spec.graph} {kind[:-1]} {t.name!r} is {want}{list(t.shape)}, but "
                                f"{binary} has {got['dtype']}{got['shape']}")
            if want.startswith("ufixed"):  # QNN: value = scale * (code + offset), offset = -zero_point
                q = t.quant
                if got.get("offset") != -int(q["zero_point"]) or not np.isclose(got.get("scale", 0), q["scale"], rtol=1e-6):
                    raise HycoError(f"{spec_file}: {spec.graph} {kind[:-1]} {t.name!r} has scale {q['scale']} zero "
                                    f"point {q['zero_point']}, but {binary} has scale {got.get('scale')} offset "
                                    f"{got.get('offset')}")
        if actual:
            raise HycoError(f"{binary}: {kind[:-1]} {sorted(actual)[0]!r} is not in {spec_file} ({spec.graph})")


def file_table(bundle: Path) -> dict[str, dict[str, Any]]:
    files = [p for p in sorted(bundle.rglob("*")) if p.is_file() and p.name != BUNDLE_JSON]
    return {str(p.relative_to(bundle)): {"bytes": p.stat().st_size, "sha256": d}
            for p, d in zip(files, file_digests(files), strict=True)}


def verify_bundle(bundle: Path, soc_model: int | None = None) -> dict[str, Any]:
    """Check every file against bundle.json and every binary against io_spec; returns bundle.json.
    `soc_model`: the SoC the caller runs for; a bundle built for another is refused, and so is a
    binary whose own socModel or Hexagon arch (read through libQnnSystem) is not the bundle's."""
    from hyco.qnn.contexts import SOCS
    from hyco.qnn.system import binary_info

    bundle = Path(bundle)
    meta = read_json(bundle / BUNDLE_JSON, BUNDLE_JSON)
    if meta.get("version") != BUNDLE_VERSION:
        raise HycoError(f"{bundle / BUNDLE_JSON}: version must be {BUNDLE_VERSION}, but got {meta.get('version')}")
    if soc_model is not None and meta.get("soc_model") != soc_model:
        name = lambda m: SOCS.get(m, ("an unknown chip",))[0]
        raise HycoError(f"{bundle / BUNDLE_JSON}: built for soc_model {meta.get('soc_model')} ({name(meta.get('soc_model'))}), "
                        f"but this run targets soc_model {soc_model} ({name(soc_model)}): export it again for that SoC")
    for name in REQUIRED + (MTP_REQUIRED if "mtp_step" in meta.get("graphs", {}) else ()):
        if name not in meta["files"]:
            raise HycoError(f"{bundle / BUNDLE_JSON}: lists no {name} (the runtime needs it)")
    for name, row in meta["files"].items():
        path = bundle / name
        if not path.is_file():
            raise HycoError(f"{path}: missing from the bundle")
        if path.stat().st_size != row["bytes"]:
            raise HycoError(f"{path}: {path.stat().st_size} bytes, but bundle.json says {row['bytes']}")
        if sha256_file(path) != row["sha256"]:
            raise HycoError(f"{path}: sha256 differs from bundle.json (corrupt or modified)")
    specs = read_io_spec(bundle / "io_spec.json")
    for role, g in meta["graphs"].items():
        if g["spec"] not in specs:
            raise HycoError(f"{bundle / 'io_spec.json'}: no graph {g['spec']!r} (bundle.json's {role})")
        if len(g["parts"]) > 1:  # a split graph: its parts' outer I/O must be io_spec's
            parts_io = {t["name"]: t for part in g["parts"] for kind in ("inputs", "outputs") for t in part["io"][kind]}
            for t in (*specs[g["spec"]].inputs, *specs[g["spec"]].outputs):
                got = parts_io.get(t.name)
                if got is None or tuple(got["shape"]) != t.shape or got["dtype"] != t.dtype or got.get("quant") != t.quant:
                    raise HycoError(f"{bundle / 'io_spec.json'}: {g['spec']} tensor {t.name!r} ({t.dtype}{list(t.shape)}) "
                                    f"is not what the parts of {role} in bundle.json take or return")
        for part in g["parts"]:
            info = binary_info(bundle / part["binary"])
            if info["soc_model"] is not None and info["soc_model"] != meta["soc_model"]:
                raise HycoError(f"{bundle / part['binary']}: built for soc_model {info['soc_model']}, but the bundle "
                                f"targets {meta['soc_model']}")
            if info.get("htp_arch") is not None and info["htp_arch"] != meta["htp_arch"]:
                raise HycoError(f"{bundle / part['binary']}: built for Hexagon v{info['htp_arch']}, but the bundle "
                                f"targets v{meta['htp_arch']}")
            part_spec = GraphSpec.from_dict(part["io"]) if len(g["parts"]) > 1 else specs[g["spec"]]
            check_binary_io(info, part_spec, str(bundle / part["binary"]), str(bundle / "io_spec.json"))
    return meta
