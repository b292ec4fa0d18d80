"""The export stage: calibrate's QDQ graphs -> QNN context binaries for the recipe's SoC, in a
self-describing bundle (OUT/bundle/), then a smoke run on that bundle.

`export(ExportInputs(calibrate=..., convert=..., vocab=..., ...), out, config)` is the whole
stage as a function; the pipeline (`inputs`/`build`) and the CLI
(`export/cli.py`) wrap it. Nothing runs on the HTP while compiling (prepare only); the smoke
test at the end loads the binaries on the HTP backend (the x86 simulator here).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError
from hyco.base.files import write_json
from hyco.base.memory import return_large_blocks
from hyco.config.recipe import ExportConfig, Recipe, ships_prefill, to_dict
from hyco.npu.io_spec import GRAPHS, GraphSpec, read_io_spec, write_io_spec
from hyco.pipeline import verdict
from hyco.pipeline.artifacts import (
    Phases,
    StageEnd,
    declare_nondeterministic,
    finish_stage,
    markdown_table,
    toolchain_versions,
)
from hyco.pipeline.stages import stage_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")


def _copy(src: Path, dst: Path, what: str) -> None:
    if not src.is_file():
        raise HycoError(f"{src}: {what} not found")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def _copy_graph(src: Path, dst_dir: Path) -> None:
    """A graph and its external-data file(s), by the locations the graph names."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    _copy(src, dst_dir / src.name, "graph")
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    for loc in sorted(locations):
        _copy(src.parent / loc, dst_dir / loc, f"external data of {src.name}")


def bundle_graphs(qat: Path | None, slm_graphs: str) -> dict[str, str]:
    """The roles the bundle ships: the SLM's tree graph, its prefill graph unless the tree graph
    prefills too (export.slm_graphs tree-only), and the MTP step graph when the recipe has an MTP
    Drafter (qat)."""
    return {role: name for role, name in GRAPHS.items()
            if (role != "mtp_step" or qat is not None) and (role != "prefill" or ships_prefill(slm_graphs))}


@dataclass(frozen=True)
class ExportInputs:
    """The folders export reads: calibrate's QDQ graphs and encodings, convert's LUTs and rope
    spec, vocab's keep set, qat's MTP Drafter files (None: the SLM's graphs only, no MTP Drafter on
    the phone), the tokenizer the bundle ships, and the smoke run's reference verifier (with its
    own tokenizer when it is of another family: the token bridge)."""

    calibrate: Path
    convert: Path
    vocab: Path
    qat: Path | None = None
    tokenizer: Path | None = None
    verifier: Path | None = None
    verifier_tokenizer: Path | None = None

    @classmethod
    def of(cls, paths: Mapping[str, Path | None]) -> ExportInputs:
        """From a stage's or the CLI's named paths (other names, and None, left out)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: Path(v) for k, v in paths.items() if k in names and v is not None})


def gather_inputs(bundle: Path, inputs: ExportInputs, config: ExportConfig) -> dict[str, GraphSpec]:
    """Copy the non-graph pieces into the bundle; return the specs of calibrate's graphs it ships
    (`inputs.qat` None: the SLM's graphs only)."""
    calibrate, convert, qat, vocab, tokenizer = inputs.calibrate, inputs.convert, inputs.qat, inputs.vocab, inputs.tokenizer
    specs = read_io_spec(calibrate / "io_spec.json")
    roles = bundle_graphs(qat, config.slm_graphs)
    for role, name in roles.items():
        if name not in specs or not (calibrate / name).is_file():
            why = ("calibrate builds the prefill graph only for export.slm_graphs separate or shared: run it with "
                   f"the same export.slm_graphs ({config.slm_graphs})") if role == "prefill" else "run calibrate first"
            raise HycoError(f"{calibrate}: no {name} ({role} graph) in io_spec.json or on disk ({why})")
    if qat is None and GRAPHS["mtp_step"] in specs:
        raise HycoError(f"{calibrate / 'io_spec.json'}: calibrate made an MTP step graph, but export got no qat "
                        "folder (its embedding LUT and encodings ship with it)")
    specs = {name: specs[name] for name in roles.values()}
    for name in roles.values():  # every path in the bundle is inside it (it moves as one folder)
        if specs[name].meta.get("keep_set"):
            specs[name].meta["keep_set"] = "keep_set.json"
    write_io_spec(bundle / "io_spec.json", list(specs.values()))
    for name in ("encodings.json",):
        _copy(calibrate / name, bundle / "encodings" / f"calibrate.{name}", "calibrate encodings")
    _copy(convert / "encodings.json", bundle / "encodings" / "convert.encodings.json", "convert encodings")
    if qat is not None:
        _copy(qat / "encodings.json", bundle / "encodings" / "qat.encodings.json", "qat encodings")
        _copy(qat / "embed_lut.safetensors", bundle / "embed_lut.safetensors", "MTP embedding LUT")
    _copy(convert / "rope.json", bundle / "rope.json", "rope spec")
    for lut in sorted((convert / "luts").glob("*.safetensors")):
        _copy(lut, bundle / "luts" / lut.name, "CPU LUT")
    if not (bundle / "luts" / "embed_tokens.safetensors").is_file():
        raise HycoError(f"{convert / 'luts' / 'embed_tokens.safetensors'}: CPU LUT not found")
    for name in ("keep_set.json", "keep_to_vocab.npy", "vocab_to_keep.npy"):
        _copy(vocab / name, bundle / name, "keep set")
    if (vocab / "prompts.jsonl").is_file():  # the reserved evaluation prompts, for the smoke test
        _copy(vocab / "prompts.jsonl", bundle / "prompts.jsonl", "prompts")
    if tokenizer is not None:
        found = [n for n in TOKENIZER_FILES if (tokenizer / n).is_file()]
        if "tokenizer.json" not in found:
            raise HycoError(f"{tokenizer / 'tokenizer.json'}: tokenizer not found")
        for n in found:
            _copy(tokenizer / n, bundle / "tokenizer" / n, "tokenizer file")
    if config.reference_graphs:
        for name in roles.values():
            _copy_graph(calibrate / name, bundle / "reference")
    return specs


def compile_graphs(bundle: Path, calibrate: Path, specs: dict[str, GraphSpec], config: ExportConfig,
                   phase: Phases | None = None) -> dict[str, Any]:
    from hyco.export.split import split_graph

    from hyco.qnn.bundle import check_binary_io, weight_bytes
    from hyco.qnn.contexts import compile_in_processes
    from hyco.qnn.system import binary_info

    graphs = {}
    shared = {}
    if config.slm_graphs == "shared":  # tree and prefill: one binary, one copy of their common weights
        from hyco.qnn.contexts import compile_shared_isolated

        roles = ("tree", "prefill")
        if any(weight_bytes(calibrate / GRAPHS[r]) > config.max_context_bytes for r in roles):
            raise HycoError("export.slm_graphs shared: tree or prefill exceeds export.max_context_bytes; a split "
                            "graph cannot share its context (set export.slm_graphs to tree-only or separate)")
        with phase("compile tree+prefill (one shared context)") if phase else contextlib.nullcontext():
            compiled = compile_shared_isolated([(calibrate / GRAPHS[r], r) for r in roles], bundle,
                                               soc_model=config.soc_model,
                                               optimization_level=config.htp_optimization_level)
        shared = dict(zip(roles, compiled, strict=True))
    planned = {}  # role -> [(part graph, its spec, its context's stem)]
    for role, name in GRAPHS.items():
        if name not in specs:  # no MTP Drafter (a recipe without qat)
            continue
        source = calibrate / name
        at_least = config.compile_parts if role in ("tree", "prefill") else 1
        if role not in shared and (weight_bytes(source) > config.max_context_bytes or at_least > 1):
            with phase(f"split {role}") if phase else contextlib.nullcontext():
                parts = split_graph(source, bundle / ".split" / role, config.max_context_bytes, specs[name], at_least)
        else:
            parts = [(source, specs[name])]
        planned[role] = [(g, s, role if len(parts) == 1 else f"{role}.part{i}") for i, (g, s) in enumerate(parts)]
    # The parts holding the KV-shared layers and the head compile slowest (E2B shapes in 3 parts:
    # 32, 65 and 97 s in layer order, two at a time): started first, the workers end close
    # together, the small MTP step last
    jobs = [(g, stem) for role, parts in planned.items() if role not in shared for g, _, stem in reversed(parts)]
    at_once = compile_workers(config, [weight_bytes(g) for g, _ in jobs])
    with phase(f"compile {len(jobs)} contexts, {at_once} at once") if phase else contextlib.nullcontext():
        done = dict(zip((stem for _, stem in jobs), compile_in_processes(
            jobs, bundle, soc_model=config.soc_model, optimization_level=config.htp_optimization_level,
            at_once=at_once), strict=True)) if jobs else {}
    for role, parts in planned.items():
        name, weights = GRAPHS[role], weight_bytes(calibrate / GRAPHS[role])
        rows = []
        for graph, part_spec, stem in parts:
            compiled = shared.get(role) or done[stem]
            check_session_bytes(compiled.binary, stem, config)
            info = binary_info(compiled.binary)
            check_binary_io(info, part_spec, str(compiled.binary), str(calibrate / "io_spec.json"))
            rows.append({"context": compiled.context.name, "binary": compiled.binary.name,
                         "binary_bytes": compiled.binary.stat().st_size, "compile_s": compiled.compile_s,
                         "nodes": compiled.nodes, "weight_bytes": weight_bytes(graph),
                         "qnn_graphs": [g["name"] for g in info["graphs"]], "qnn_build": info["build_id"],
                         "core_api": info["core_api"], "backend_api": info["backend_api"],
                         "soc_model": info["soc_model"], "context_blob_bytes": info["context_blob_bytes"],
                         "io": part_spec.to_dict(), "binary_io": info["graphs"][0]})
        graphs[role] = {"spec": name, "reference": f"reference/{name}" if config.reference_graphs else None,
                        "weight_bytes": weights, "shared_context": role in shared, "parts": rows}
        if role in shared:
            graphs[role]["verified"] = False
            graphs[role]["note"] = ("shares one context binary with " + " and ".join(r for r in shared if r != role)
                                    + "; UNVERIFIED: the x86 simulator cannot load a shared context, so no run here "
                                    "has loaded it (a device run through qai-hub must)")
    shutil.rmtree(bundle / ".split", ignore_errors=True)
    return graphs


# A QNN compile's peak RSS over its graph's weight bytes: E2B-shaped tree 4,774 MiB for 796 MB of
# weights (6.3x, the parent process included), E4B-shaped 10,280 MiB for 1,843 MB (5.8x).
COMPILE_BYTES_PER_WEIGHT_BYTE = 6.5


def compile_workers(config: ExportConfig, weights: list[int]) -> int:
    """How many compiles run side by side: `export.compile_workers` (0: one per core), no more
    than there are, and no more than fit together in `export.compile_memory_gb` (else this
    machine's memory) at COMPILE_BYTES_PER_WEIGHT_BYTE each, the largest first; at least one."""
    import os

    from hyco.pipeline.preflight import machine_memory_gb

    wanted = min(config.compile_workers or os.cpu_count() or 1, max(1, len(weights)))
    budget = (config.compile_memory_gb or machine_memory_gb()) * 1024**3
    largest = sorted(weights, reverse=True)
    fits = 1
    while fits < wanted and COMPILE_BYTES_PER_WEIGHT_BYTE * sum(largest[:fits + 1]) <= budget:
        fits += 1
    return fits


def check_session_bytes(binary: Path, part: str, config: ExportConfig) -> None:
    """A context binary the phone could not load in one HTP session is refused here, not on the
    phone: the weights were split under max_context_bytes, but the graph's own bytes ride on top."""
    size = binary.stat().st_size
    if size > config.max_session_bytes:
        raise HycoError(f"{binary}: the {part} context binary is {size:,} bytes, over export.max_session_bytes "
                        f"{config.max_session_bytes:,} (HTP sessions fail to load around 3.5-4 GB): lower "
                        f"export.max_context_bytes to split it into smaller parts")


def declare_binaries(graphs: dict[str, Any], qnn_sdk: str) -> None:
    """A QNN context binary's bytes depend on the QNN sessions the process created before it: two
    fresh processes that compile the same graphs in the same order write identical binaries, but
    a second compile in one process, or one after calibrate's HTP sessions (an uninterrupted `run`,
    unlike a rerun that skips calibrate), differs (in a small share of its bytes; same size, same
    graph I/O read back). The EPContext wrappers are reproducible; so is every other byte of
    bundle.json but the binaries' hashes."""
    from hyco.qnn.bundle import BUNDLE_JSON

    binaries = sorted({p["binary"] for g in graphs.values() for p in g["parts"]})
    why = (f"QNN HTP context binary from onnxruntime-qnn's prepare (QNN {qnn_sdk}): its bytes depend on the QNN "
           "sessions created earlier in the process (same size and graph I/O)")
    for name in binaries:
        declare_nondeterministic(f"bundle/{name}", why)
    declare_nondeterministic(f"bundle/{BUNDLE_JSON}", f"holds the sha256 of each context binary ({why})",
                             ignore_pointers=[f"/files/{n.replace('~', '~0').replace('/', '~1')}/sha256"
                                              for n in binaries])


def verifier_identity(verifier: Path) -> dict[str, str]:
    """What bundle.json records of the reference verifier: its folder's name and its config's
    sha256, never a path (the bundle moves; the verifier is the server's and is given to `smoke`
    with --verifier)."""
    from hyco.base.files import sha256_file

    config = verifier / "config.json"
    if not config.is_file():
        raise HycoError(f"{config}: not found (reference verifier)")
    return {"name": verifier.resolve().name, "config_sha256": sha256_file(config)}


def export(inputs: ExportInputs, out: Path, config: ExportConfig, *, allow_parity_failure: bool = False,
           final: Path | None = None) -> dict[str, Any]:
    """Write OUT/bundle/ (binaries + everything the runtime reads + bundle.json), report.json and
    summary.md; then, with `config.smoke_prompts` and a `verifier`, smoke-test the bundle on the
    HTP backend. A disagreeing smoke run is the stage's failed proof: ProofFailed after the reports
    are written (into run_stage's temp folder, so nothing moves into place), unless
    `allow_parity_failure`: then the summary carries `proof_failed` and the manifest is marked.
    `final`: where `out` will be once the stage is done (it is built in a temp folder), the
    folder the reports name. Returns a short summary for the manifest."""
    from hyco.qnn.bundle import footprint_markdown

    start = time.perf_counter()
    # glibc's 1 MiB mmap threshold: each compile's GBs go back to the system before the next
    return_large_blocks()
    chip, arch, settled = settled_soc(config)
    two_bit = shipped_two_bit(inputs.calibrate, config)
    out = Path(out)
    bundle = out / "bundle"
    bundle.mkdir(parents=True, exist_ok=True)
    phase = Phases("export")
    meta = write_bundle(bundle, config, chip, arch, settled, phase, two_bit, inputs)
    graphs = meta["graphs"]
    smoke = None
    verifier, verifier_tokenizer = inputs.verifier, inputs.verifier_tokenizer
    if config.smoke_prompts and verifier is not None and config.slm_graphs != "shared":
        from hyco.export.smoke import smoke as run_smoke

        with phase("smoke"):
            smoke = run_smoke(bundle=bundle, verifier=verifier, prompts=config.smoke_prompts,
                              verifier_tokenizer=verifier_tokenizer,
                              rounds=config.smoke_rounds, tolerance=config.logprob_tolerance, isolate=config.isolate,
                              out=out / "smoke", named_as=Path(final or out) / "bundle", soc_model=config.soc_model)
    failed = None
    if smoke is not None and not smoke["passed"]:
        worst = ", ".join(f"{g} max |dlogprob| {v['max_logprob_diff']}"
                          + (f" (bound {v['bound']})" if "bound" in v else "") + f", {v['id_mismatches']} id mismatches"
                          for g, v in smoke["by_graph"].items())
        failed = f"{smoke['headline']} ({worst})"
    rows = [{"graph": role, "part": p["binary"], "weight_bytes": p["weight_bytes"], "binary_bytes": p["binary_bytes"],
             "context_blob_bytes": p["context_blob_bytes"], "compile_s": p["compile_s"], "nodes": p["nodes"]}
            for role, g in graphs.items() for p in g["parts"]]
    report = {"soc_model": config.soc_model, "chip": chip, "htp_arch": arch, "qnn_sdk": meta["qnn_sdk"],
              "slm_graphs": config.slm_graphs,
              "htp_optimization_level": config.htp_optimization_level,
              "graphs": rows, "two_bit_weights": meta["two_bit_weights"], "footprint": meta["footprint"], "smoke": smoke,
              "phases": phase.rows,
              "wall_s": round(time.perf_counter() - start, 2)}

    def summary_md(report: dict[str, Any]) -> str:
        level = config.htp_optimization_level or "0 (QNN's default: its binary matched level 2's in a probe)"
        md = (f"# export: QNN context binaries for soc_model {config.soc_model} ({chip}, Hexagon v{arch})\n\n"
              f"QNN SDK {meta['qnn_sdk']}; HTP optimization level {level}; "
              f"bundle in `bundle/` ({len(meta['files'])} files, see bundle.json). "
              f"Wall {report['wall_s']} s.\n\n" + markdown_table(rows, list(rows[0]))
              + "\n\n## On the phone, against the paper's Table 3\n\n" + footprint_markdown(meta["footprint"]))
        if failed:
            md += f"\n**Proof failed, bundle kept (allow_parity_failure)**: {failed}\n"
        if smoke is not None:
            md += "\n" + smoke["summary_md"]
        return md

    varying = [("summary.md", "prints this run's wall time and compile times"
                + ("; and the smoke run's HTP simulator figures" if smoke is not None else ""), None)]
    if smoke is not None:
        sim = ("the smoke run's figures: onnxruntime-qnn's HTP simulator output varies between processes (same "
               "feeds; calibrate declares the same), and its load and pass times are measured")
        varying += [("report.json", sim, ["/proof_failed", "/smoke"]), ("smoke/report.json", sim, None),
                    ("smoke/summary.md", sim, None)]
    summary = {"soc_model": config.soc_model, "binaries": {r["part"]: r["binary_bytes"] for r in rows},
               "compile_s": round(sum(r["compile_s"] for r in rows), 2),
               "smoke_passed": None if smoke is None else smoke["passed"]}
    return finish_stage("export", out, StageEnd(
        report, summary_md, summary, failed, nondeterministic=varying,
        failure_hint="; --allow-parity-failure keeps the bundle and smoke/ (manifest marked)",
        verdict=verdict_lines(report, config), verdict_varies="the smoke run's HTP simulator figures"),
        allow_parity_failure)


def verdict_lines(report: dict[str, Any], config: ExportConfig) -> list[verdict.Line]:
    """The smoke run through the binaries against onnxruntime CPU, and what the phone holds."""
    from hyco.qnn.bundle import footprint_line

    smoke = report["smoke"]
    qnn = ".".join(report["qnn_sdk"].lstrip("v").split(".")[:2])
    binaries = (f"{len(report['graphs'])} context binaries for {report['chip']} (soc {report['soc_model']}, "
                f"Hexagon v{report['htp_arch']}), QNN {qnn}")
    copies = {"tree-only": "one copy of the SLM's weights: the tree graph also prefills (export.slm_graphs tree-only)",
              "shared": "one copy of the SLM's weights: tree and prefill in one weight-shared context",
              "separate": "the SLM's weights twice: tree and prefill contexts (export.slm_graphs separate)"}
    lines = [verdict.Line("built", verdict.INFO, f"{binaries}; {copies[report['slm_graphs']]}")]
    if smoke is None:
        why = "off (export.slm_graphs shared: a shared context does not load on the x86 simulator)" \
            if config.slm_graphs == "shared" else "off (export.smoke_prompts: 0, or no verifier given)"
        lines.append(verdict.proof("smoke through the binaries", None, "", off=why))
    else:
        by = smoke["by_graph"]
        diffs = " / ".join(f"{g} {v['max_logprob_diff']:.3f} (bound {v['bound']:.3f})" for g, v in by.items())
        kv = max((v["max_kv_steps"] for v in by.values() if v.get("kv_step_bound")), default=None)
        kv_bound = min((v["kv_step_bound"] for v in by.values() if v.get("kv_step_bound")), default=None)
        kv_said = f"; K/V {kv:.0f} steps (bound {kv_bound:.0f})" if kv is not None else ""
        lines.append(verdict.proof(
            "smoke through the binaries (HTP simulator vs onnxruntime CPU)", smoke["passed"],
            f"{sum(v.get('passes', 0) for v in by.values())} passes, {sum(v['id_mismatches'] for v in by.values())} disagreeing; max |log-prob diff| "
            f"{diffs}{kv_said}", "each graph's bound from calibrate; committed streams equal"))
    session = report["footprint"].get("session")
    if session:
        lines.append(verdict.proof("one HTP session holds the bundle", session["fits"],
                                   f"{session['resident_bytes'] / 1e6:,.1f} MB over {len(session['contexts'])} contexts",
                                   f"export.max_session_bytes {session['budget_bytes'] / 1e6:,.0f} MB"))
    lines.append(verdict.Line("on the phone", verdict.INFO, footprint_line(report["footprint"])))
    two = report["two_bit_weights"]
    lines.append(verdict.Line("2-bit weights", verdict.INFO, f"{shipped_label(two)}: {two['why']}"))
    return lines


def shipped_label(two: dict[str, Any]) -> str:
    if two["encoding"] != "int2-blocks":
        return "INT4 containers"
    kept = sum(len(g["kept_in_int4"]) for g in two["graphs"].values())
    return f"INT2 blocks of {two['block_size']}" + (f" ({kept} kept in INT4 containers, bundle.json says why)" if kept else "")


def shipped_two_bit(calibrate: Path, config: ExportConfig) -> dict[str, Any]:
    """How the SLM's 2-bit weights ship: what export.two_bit_weights decides here
    (`hyco.qnn.int2_probe.decide`), which must be how calibrate wrote its graphs (io_spec's
    `two_bit_weights`; graphs without it hold INT4 containers), with what each graph holds."""
    from hyco.qnn.int2_probe import decide, export_keys

    decision = decide(**export_keys(config))
    specs = read_io_spec(calibrate / "io_spec.json")
    held = {name: specs[name].meta.get("two_bit_weights") for role, name in GRAPHS.items()
            if role != "mtp_step" and name in specs}  # the MTP step graph has no 2-bit weights
    for name, got in held.items():
        encoding = (got or {}).get("encoding", "int4-containers")
        if (encoding, (got or {}).get("block_size")) != (decision.encoding, decision.block_size):
            said = f"INT2 blocks of {got['block_size']}" if encoding == "int2-blocks" else "INT4 containers"
            raise HycoError(f"{calibrate / name}: holds the 2-bit weights as {said}, but export ships them as "
                            f"{decision.label()} ({decision.why}): run calibrate again with the same export settings "
                            "(export.two_bit_weights, int2_block_size, soc_model)")
    graphs = {name: {k: got[k] for k in ("rewritten", "kept_in_int4")} for name, got in held.items() if got}
    return {**decision.to_dict(), "graphs": graphs,
            "rewritten": sorted({w for g in graphs.values() for w in g["rewritten"]})}


def settled_soc(config: ExportConfig) -> tuple[str, int, dict[str, Any]]:
    """The recipe's SoC by name and Hexagon arch, and what the installed QNN libraries build for
    that name; refused where the two disagree, and for the qai-hub backend (`export --hub`)."""
    from hyco.qnn.contexts import settle_soc, soc_info

    chip, arch = soc_info(config.soc_model, config.htp_arch)
    settled = settle_soc(chip)
    if (settled["soc_model"], settled["htp_arch"]) != (config.soc_model, arch):
        raise HycoError(f"export.soc_model {config.soc_model} is {chip} (v{arch}) in hyco-convert's table, but the installed "
                        f"QNN libraries build {chip} as soc_model {settled['soc_model']}, v{settled['htp_arch']}: the table "
                        "is stale for this QNN release")
    if config.backend == "qai-hub":
        raise HycoError("export.backend 'qai-hub': use `hyco-convert export --hub` (compile and profile jobs on "
                        f"{config.device!r}); the pipeline compiles offline with onnxruntime-qnn")
    return chip, arch, settled


def write_bundle(bundle: Path, config: ExportConfig, chip: str, arch: int, settled: dict[str, Any], phase: Phases,
                 two_bit: dict[str, Any], inputs: ExportInputs) -> dict[str, Any]:
    """The bundle's inputs gathered, its graphs compiled, and bundle.json (binaries, footprint,
    SoC, reference verifier) written. Returns bundle.json's content."""
    from hyco.qnn.bundle import (
        BUNDLE_JSON,
        BUNDLE_VERSION,
        device_footprint,
        file_table,
        phone_session,
        refuse_over_budget,
    )

    with phase("gather inputs"):
        specs = gather_inputs(bundle, inputs, config)
    graphs = compile_graphs(bundle, inputs.calibrate, specs, config, phase)
    meta = {"version": BUNDLE_VERSION, "soc_model": config.soc_model, "chip": chip, "htp_arch": arch, "soc_settled": settled,
            "htp_optimization_level": config.htp_optimization_level,
            "qnn_sdk": graphs["tree"]["parts"][0]["qnn_build"],
            "onnxruntime_qnn": toolchain_versions().get("onnxruntime-qnn"),
            "reference_verifier": verifier_identity(inputs.verifier) if inputs.verifier else None,
            "note": "binaries compiled offline with onnxruntime-qnn (EPContext, embed mode 0); graph I/O and SoC "
                    "read back from each .bin through libQnnSystem. reference/ holds the QDQ graphs for the smoke "
                    "test's CPU run and is not needed on the phone.",
            # the rows a separate prefill graph would take (convert builds it either way): check's
            # timing states what one copy of the weights costs in prefill against it
            "slm_graphs": config.slm_graphs, "separate_prefill_rows": read_io_spec(inputs.convert / "io_spec.json")
            ["prefill.onnx"].meta["rows"] if config.slm_graphs == "tree-only" else None,
            "two_bit_weights": two_bit, "graphs": graphs,
            "files": file_table(bundle)}
    meta["footprint"] = device_footprint(graphs, meta["files"], bundle / "encodings" / "convert.encodings.json",
                                         config.footprint_targets, two_bit)
    meta["footprint"]["session"] = phone_session(meta["footprint"], config.max_session_bytes)
    refuse_over_budget(meta["footprint"]["session"])
    write_json(bundle / BUNDLE_JSON, meta)
    declare_binaries(graphs, meta["qnn_sdk"])
    return meta


# --- pipeline hooks ------------------------------------------------------------------------------


def section(recipe: Recipe) -> dict[str, Any]:
    return {"export": to_dict(recipe.export)}


def inputs(recipe: Recipe, run_dir: Path) -> dict[str, Path]:
    for stage in ("vocab", "convert", "calibrate"):
        if stage not in recipe.stages:
            raise HycoError(f"the export stage needs the {stage} stage's outputs; add {stage} to the recipe's stages")
    # without qat (no MTP Drafter on the phone: the token bridge's recipes) the SLM's graphs only
    paths = {stage: stage_dir(run_dir, stage) for stage in ("calibrate", "convert", "qat", "vocab")
             if stage in recipe.stages}
    for name in ("tokenizer", "verifier", "verifier_tokenizer"):
        path = recipe.path(getattr(recipe.models, name), run_dir)
        if path is not None:
            paths[name] = path
    return paths


def build(recipe: Recipe, run_dir: Path, out: Path) -> dict[str, Any]:
    return export(ExportInputs.of(inputs(recipe, run_dir)), out, recipe.export,
                  allow_parity_failure=recipe.allow_parity_failure, final=stage_dir(run_dir, "export"))
