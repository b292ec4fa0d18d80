"""`run_check`: decode the same prompts under every configuration and report side by side.

The whole check stage as a keyword-only function; the pipeline (`stage.py`) and the CLI
(`cli.py`) wrap it. Models load once (float32, eager attention); every prompt starts from fresh
caches, and prompt i uses the same seed under every configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hyco.runtime_check.bootstrap import cluster_sums, paired_relative_ci, ratio_ci
from hyco.runtime_check.metrics import summarize
from hyco.runtime_check.report import write_report

from hyco.base.console import progress
from hyco.base.errors import HycoError
from hyco.base.workers import in_background
from hyco.config.recipe import CheckConfig, DatasetConfig, PlacementConfig, to_dict
from hyco.data.answers import eos_ids_of
from hyco.data.workloads import Subset, chat_ids, even_subset, read_workload
from hyco.runtime.configs import DecodeConfig, decode_config
from hyco.runtime.decode import DecodeLog, decode, decode_alone
from hyco.runtime.drafters import MtpChainTorch, SlmTorch, TreeDrafter, check_backend
from hyco.runtime.inputs import load_model, load_prompts
from hyco.runtime.verifier import ReferenceVerifier, Sampling


@dataclass(frozen=True)
class PhoneShapes:
    """What the phone's graphs were built with: the SLM Drafter's rings and prefill limit
    (recipe.convert) and the MTP Drafter's hand-off window and h_t capture point (recipe.qat).
    The check takes them from those sections, never from its own, so the runtime cannot
    disagree with the graphs."""

    ring_full: int
    ring_sliding: int
    max_prompt: int
    mtp_window: int
    capture_point: str

    def __post_init__(self):
        if not 1 <= self.ring_sliding <= self.ring_full or self.max_prompt < 1 or self.mtp_window < 1:
            raise HycoError(f"convert.ring_sliding must be in [1, convert.ring_full], and convert.max_prompt and "
                            f"qat.window >= 1, but got {self.ring_sliding}, {self.ring_full}, {self.max_prompt}, "
                            f"{self.mtp_window}")


@dataclass(frozen=True)
class CheckInputs:
    """What the check reads, named once (`runtime_check/stage.py` builds it from the recipe and the
    run folder) and passed down whole: the three models' folders, the tokenizer (the SLM's, and the
    verifier's unless `verifier_tokenizer` names a verifier of another family, drafted for through
    the token bridge), the phone's shapes, the chat dataset, the earlier stages' folders (None
    where the recipe runs no such stage), a file workload, and where the verifier and the server's
    head sit (`placement`; None: float32 on the CPU).

    With backend onnxruntime the drafters run on the shipped graphs: the SLM on `convert_dir`'s
    tree.onnx / prefill.onnx, the phone's MTP chain on `qat_dir`'s mtp_step.onnx, the deployed
    numerics on `bundle_dir`'s QDQ graphs; with backend qnn `convert_dir` and `qat_dir` are both
    the export bundle."""

    verifier: Path
    slm: Path
    tokenizer: Path
    phone: PhoneShapes
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    assistant: Path | None = None
    verifier_tokenizer: Path | None = None
    vocab_dir: Path | None = None
    convert_dir: Path | None = None
    qat_dir: Path | None = None
    bundle_dir: Path | None = None
    workload: Path | None = None
    placement: PlacementConfig | None = None


@dataclass(frozen=True)
class Models:
    """What one process decodes with, loaded once (`load_models`): the verifier, its head on the
    server (None unless a configuration runs it in torch), the SLM in torch (None unless the
    backend is torch), the keep set's vocabulary ids (None: the whole vocabulary) and the
    verifier's end-of-turn ids."""

    verifier: Any
    head: Any
    slm: Any
    keep_ids: torch.Tensor | None
    eos_ids: set[int]


RUN_SEED_STEP = 1000  # check.runs: run r samples with seed check.seed + 1000 r


def phone_mtp(cfg: DecodeConfig) -> bool:
    return bool(cfg.mtp_depth) and not cfg.mtp_on_server


def deployed(cfg: DecodeConfig, check: CheckConfig) -> bool:
    """The phone's drafters on the export bundle's QDQ graphs (onnxruntime CPU, or torch)."""
    return check.backend == "onnxruntime" and cfg.drafters == "deployed"


def deployed_executor(check: CheckConfig) -> tuple[str, str]:
    """(bundle_sessions backend, torch device) for the deployed graphs: `auto` is torch on a CUDA
    device where there is one (seconds become milliseconds a pass at E2B shapes), else onnxruntime."""
    from hyco.quant.qdq_torch import torch_device

    executor = check.deployed_executor
    if executor == "auto":
        executor = "torch" if torch.cuda.is_available() else "onnxruntime"
    if executor == "onnxruntime":
        return "cpu", "cpu"
    return "torch", str(torch_device(check.deployed_device))


def build_drafter(cfg: DecodeConfig, check: CheckConfig, phone: PhoneShapes, *, verifier, head, slm, keep_ids,
                  convert_dir: Path | None = None, qat_dir: Path | None = None,
                  bundle_dir: Path | None = None) -> TreeDrafter:
    mtp = None
    wire = check.wire_bits == 8
    cpu = None
    if deployed(cfg, check):  # the bundle's reference QDQ graphs, through the qnn backend's drafters
        from hyco.runtime.qnn_backend import bundle_sessions, mtp_qnn, slm_qnn

        backend, device = deployed_executor(check)
        cpu = bundle_sessions(bundle_dir, backend=backend, isolate=False, device=device)
    if phone_mtp(cfg) and cpu is not None:
        mtp = mtp_qnn(bundle_dir, keep_ids=keep_ids, window=phone.mtp_window, capture_point=phone.capture_point,
                      quantize_wire=wire, sessions=cpu)
    elif phone_mtp(cfg) and check.backend == "qnn":  # convert_dir and qat_dir are both the export bundle
        from hyco.runtime.qnn_backend import mtp_qnn

        mtp = mtp_qnn(qat_dir, keep_ids=keep_ids, window=phone.mtp_window, capture_point=phone.capture_point,
                      quantize_wire=wire)
    elif phone_mtp(cfg) and check.backend == "onnxruntime":
        from hyco.runtime.mtp_onnx import MtpChainOnnx

        mtp = MtpChainOnnx(qat_dir, keep_ids=keep_ids, window=phone.mtp_window, capture_point=phone.capture_point,
                           quantize_wire=wire)
    elif cfg.mtp_depth:
        # Cloud+MTP: the released head on the server, full vocabulary, whole prefix, no link.
        mtp = MtpChainTorch(head, verifier, keep_ids=None if cfg.mtp_on_server else keep_ids,
                            window=None if cfg.mtp_on_server else phone.mtp_window,
                            quantize_wire=not cfg.mtp_on_server and wire)
    drafter_slm = None
    if cfg.slm_passes and cpu is not None:
        drafter_slm = slm_qnn(bundle_dir, keep_ids=keep_ids, max_prompt=phone.max_prompt, ring_full=phone.ring_full,
                              sessions=cpu)
    elif cfg.slm_passes and check.backend == "qnn":
        from hyco.runtime.qnn_backend import slm_qnn

        drafter_slm = slm_qnn(convert_dir, keep_ids=keep_ids, max_prompt=phone.max_prompt, ring_full=phone.ring_full)
    elif cfg.slm_passes and check.backend == "onnxruntime":
        from hyco.runtime.slm_onnx import SlmOnnx

        drafter_slm = SlmOnnx(convert_dir, keep_ids=keep_ids, max_prompt=phone.max_prompt, ring_full=phone.ring_full)
    elif cfg.slm_passes:
        drafter_slm = SlmTorch(slm, keep_ids=keep_ids, ring_full=phone.ring_full, ring_sliding=phone.ring_sliding,
                               max_prompt=phone.max_prompt)
    return TreeDrafter(cfg, mtp, drafter_slm)


def measure_costs(all_logs: dict[str, list[DecodeLog]], configs: list[DecodeConfig], check: CheckConfig,
                  phone: PhoneShapes, *, verifier_model, head, model_dirs: list[Path], vocab: int,
                  bundle_dir: Path | None) -> tuple[dict, dict]:
    """Table 2 / Table 11's inputs and tables (runtime_check/costs.py): the server sweep on the
    verifier's own device (cached), the phone's figures from the recipe's profile, hub report or
    the bundle's weight floor, and the network."""
    from hyco.runtime_check.costs import costs_inputs, setting_of, tables

    from hyco.base.loading import read_json
    from hyco.npu.io_spec import GRAPHS, read_io_spec
    from hyco.runtime.phone_timing import phone_times
    from hyco.runtime.server_timing import Grid, server_times
    from hyco.runtime.timing import network

    t = check.timing
    dtype = str(next(verifier_model.parameters()).dtype)
    # the row counts the configurations pad to: the chain's K + 1, the tree budget's + 1, and between
    rows = tuple(sorted({1, check.chain_depth + 1, 9, 17, check.budget + 1}))
    grid = Grid(rows=rows, contexts=tuple(t.sweep_contexts), prefill=tuple(t.sweep_prefill), repeats=t.sweep_repeats,
                cuda_graphs=t.cuda_graphs)
    server = server_times(verifier_model, head, grid, vocab=vocab, model_dirs=model_dirs, dtype=dtype)
    rows, prefill_graph, separate_rows = 1, "prefill", None
    if bundle_dir is not None and (Path(bundle_dir) / "io_spec.json").is_file():
        specs = read_io_spec(Path(bundle_dir) / "io_spec.json")
        # a tree-only bundle (one copy of the SLM's weights) prefills through its tree graph
        prefill_graph = "prefill" if GRAPHS["prefill"] in specs else "tree"
        rows = specs[GRAPHS[prefill_graph]].meta["rows"]
        separate_rows = read_json(Path(bundle_dir) / "bundle.json", "bundle.json").get("separate_prefill_rows")
    phone_figures = phone_times(bundle_dir, profile=t.phone_profile, hub_json=t.hub_report,
                                bandwidth_gbs=t.phone_bandwidth_gbs, prefill_rows=rows, prefill_graph=prefill_graph,
                                separate_prefill_rows=separate_rows)
    link = network(t.network, t.rtt_ms, t.up_mbps, t.down_mbps)
    inputs = costs_inputs(all_logs, configs, server, phone_figures, link, t.network, phone.max_prompt)
    return inputs, tables(inputs, setting_of(inputs))


def handoff_window(cfg: DecodeConfig, phone: PhoneShapes) -> int | None:
    """Prompt rows of K/V the first reply carries to the configuration's MTP head: the phone's
    window (qat.window), or None, the whole prefix, for a head on the server (Cloud+MTP in the
    paper's Table 5 drafts from everything the verifier has seen)."""
    return None if cfg.mtp_on_server else phone.mtp_window


def keyed_seed(check: CheckConfig, prompt_index: int) -> int:
    """The position-keyed sampling seed of one prompt (`acceptance.keyed_samples`)."""
    return check.seed * 100_003 + prompt_index


def decode_all(prompts: list[list[int]], cfg: DecodeConfig, check: CheckConfig, inputs: CheckInputs, models: Models,
               seeds: list[int] | None = None) -> list[DecodeLog]:
    """Each prompt from fresh caches, `check.max_new_tokens` at most. `seeds`: per prompt, the
    verifier samples each token keyed by its position (the committed text is then the verifier's
    own keyed text whatever the drafts: `keyed_generate`). Under `accelerate launch` each process
    decodes its share of the prompts (`hyco.base.launch`)."""
    from hyco.base.launch import in_order, my_positions

    sampling = Sampling(check.temperature, check.top_k, check.top_p)
    phone, eos_ids, max_new_tokens = inputs.phone, models.eos_ids, check.max_new_tokens
    logs = []
    mine = my_positions(len(prompts))
    for i in progress(mine, desc=cfg.name, leave=False):
        drafter = build_drafter(cfg, check, phone, verifier=models.verifier, head=models.head, slm=models.slm,
                                keep_ids=models.keep_ids, convert_dir=inputs.convert_dir, qat_dir=inputs.qat_dir,
                                bundle_dir=inputs.bundle_dir)
        if cfg.alone:
            logs.append((i, decode_alone(prompts[i], drafter.slm, topk=cfg.slm_topk, sampling=sampling,
                                         seed=seeds[i] if seeds else keyed_seed(check, i), max_new_tokens=max_new_tokens,
                                         eos_ids=eos_ids)))
            continue
        reference = ReferenceVerifier(models.verifier, sampling, capture_point=phone.capture_point,
                                      window=handoff_window(cfg, phone), keyed_seed=seeds[i] if seeds else None)
        generator = torch.Generator().manual_seed(check.seed + i)
        logs.append((i, decode(prompts[i], reference, drafter, epsilon=cfg.epsilon, max_new_tokens=max_new_tokens,
                               eos_ids=eos_ids, generator=generator, probe_epsilon=check.epsilon)))
    return in_order(logs, len(prompts), f"check ({cfg.name})")


@torch.no_grad()
def keyed_generate(verifier, prompt: list[int], max_new_tokens: int, sampling: Sampling, seed: int,
                   eos_ids: set[int]) -> tuple[list[int], torch.Tensor]:
    """The verifier alone, through transformers' own forward and cache (not the tree runner the
    check verifies with), each token drawn from p~ keyed by its position: the text exact
    verification must commit. Its tokens and raw logits per step."""
    from transformers import DynamicCache

    from hyco.npu.handoff import input_device
    from hyco.runtime.acceptance import keyed_samples

    cache = DynamicCache(config=verifier.config.get_text_config())
    device = input_device(verifier)
    ids, tokens, logits = torch.tensor([prompt]), [], []
    position = len(prompt)
    while len(tokens) < max_new_tokens:
        step = verifier(input_ids=ids.to(device), cache=cache, use_cache=True).logits[0, -1:].float().cpu()
        token = int(keyed_samples(sampling.probs(step), [position], seed)[0])
        tokens.append(token)
        logits.append(step)
        if token in eos_ids:
            break
        ids, position = torch.tensor([[token]]), position + 1
    return tokens, torch.cat(logits)


def choose_prompts(candidates: list[list[int]], references: list[list[int]], count: int) -> list[dict[str, Any]]:
    """Each candidate's reference text statistics; the first `count` whose text is not mostly one
    token are chosen, then, when too few are, the least repetitive others. Agreement and
    acceptance measured on one repeated token say nothing."""
    from hyco.data.answers import MAX_TOP_SHARE, text_stats

    rows = []
    for i, ref in enumerate(references):
        st = text_stats([ref])
        rows.append({"candidate": i, "prompt_tokens": len(candidates[i]), "tokens": st["tokens"],
                     "distinct_tokens": st["distinct_tokens"], "top_share": st["top_share"],
                     "degenerate": st["top_share"] > MAX_TOP_SHARE, "chosen": False})
    for row in sorted(rows, key=lambda r: (r["degenerate"], r["top_share"] if r["degenerate"] else 0,
                                           r["candidate"]))[:count]:
        row["chosen"] = True
    return rows


def compare_with_generate(logs: list[DecodeLog], reference: list[tuple[list[int], torch.Tensor]]) -> dict[str, Any]:
    """Committed tokens against the verifier's own (`keyed_generate`: its tokens and logits),
    prompt by prompt: equal, or where they first differ with the verifier's logit margin there
    (its logit of its token minus ours; a margin near float rounding would be a tie broken
    differently, anything larger a defect)."""
    compared, first, distinct = 0, None, set()
    for i, (log, (theirs, logits)) in enumerate(zip(logs, reference, strict=True)):
        distinct.update(theirs)
        ours = log.tokens
        compared += max(len(ours), len(theirs))
        j = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                 min(len(ours), len(theirs)))
        if first is None and ours != theirs:
            margin = (float(logits[j, theirs[j]] - logits[j, ours[j]])
                      if j < len(ours) and j < len(theirs) else None)
            first = {"prompt": i, "position": j, "ours": ours[j] if j < len(ours) else None,
                     "generate": theirs[j] if j < len(theirs) else None, "logit_margin": margin}
    # distinct tokens in generate's text: agreement on a few repeated tokens is weak evidence
    return {"prompts": len(logs), "tokens_compared": compared, "distinct_tokens": len(distinct),
            "equal": first is None, "first_divergence": first}


def run_check(inputs: CheckInputs, config: CheckConfig, out: Path | None, *, configs: list[str] | None = None,
              prompts: int | None = None) -> dict[str, Any]:
    """The recipe's configurations (or `configs`) over `prompts` prompts (default `config.prompts`),
    reported into `out`; `out` None: a follower process of `accelerate launch` (its share of the
    prompts; writes nothing). A verifier of another family (`inputs.verifier_tokenizer`) is
    drafted for through the token bridge (`runtime_check/bridged.py`)."""
    check_backend(config.backend)
    names = list(configs or config.configs)
    bridged = inputs.verifier_tokenizer is not None
    decode_configs = [decode_config(n, config, bridged=bridged) for n in names]
    convert_dir, qat_dir, bundle_dir = inputs.convert_dir, inputs.qat_dir, inputs.bundle_dir
    if config.backend == "qnn" and (convert_dir is None or not (Path(convert_dir) / "bundle.json").is_file()):
        raise HycoError(f"check.backend 'qnn' runs both drafters on the QNN HTP from the export stage's bundle, but "
                        f"{convert_dir}/bundle.json does not exist (add export to the recipe's stages)")
    if config.backend == "onnxruntime":
        floats = [c for c in decode_configs if not deployed(c, config)]
        needs = {"convert": (convert_dir, any(c.slm_passes for c in floats)),
                 "qat": (qat_dir, any(phone_mtp(c) for c in floats))}
        for stage, (folder, needed) in needs.items():
            if needed and (folder is None or not (Path(folder) / "io_spec.json").is_file()):
                raise HycoError(f"check.backend 'onnxruntime' needs the {stage} stage's graphs, but "
                                f"{folder}/io_spec.json does not exist (add {stage} to the recipe's stages)")
        on_bundle = [c.name for c in decode_configs if deployed(c, config) and (c.slm_passes or phone_mtp(c))]
        if on_bundle and (bundle_dir is None or not (Path(bundle_dir) / "bundle.json").is_file()):
            raise HycoError(f"check.drafters 'deployed' ({', '.join(on_bundle)}) runs the export bundle's QDQ graphs, "
                            f"but {bundle_dir}/bundle.json does not exist (add export to the recipe's stages, or set "
                            "check.drafters to float)")
    threads = torch.get_num_threads()
    if config.threads:
        # Tiny models on a shared CPU: the thread pool's spin-waits cost more than the matmuls.
        torch.set_num_threads(config.threads)
    try:
        if bridged:
            from hyco.runtime_check.bridged import run_bridged_check

            return run_bridged_check(inputs, config, out, decode_configs, prompts)
        return _run_check(inputs, config, out, decode_configs, prompts)
    finally:
        torch.set_num_threads(threads)


def prompt_count(config: CheckConfig, prompts: int | None) -> int:
    count = config.prompts if prompts is None else prompts
    if count < 1:  # 0 is a count, not "unset": a check of no prompt measures nothing
        raise HycoError(f"the prompt count must be >= 1, but got {count}")
    return count


def load_models(inputs: CheckInputs, *, head: bool, slm: bool) -> Models:
    """The verifier, and the server's head and the torch SLM where asked, each refused unless its
    vocabulary is the verifier's (the drafters share its tokenizer); the keep set read against it."""
    verifier = load_model(inputs.verifier, "verifier", inputs.placement)
    head_model = load_model(inputs.assistant, "assistant", inputs.placement) if head else None
    slm_model = load_model(inputs.slm, "SLM") if slm else None
    vocab_size = verifier.config.get_text_config().vocab_size
    for model, path in ((slm_model, inputs.slm), (head_model, inputs.assistant)):
        if model is not None and model.config.get_text_config().vocab_size != vocab_size:
            raise HycoError(f"{path}: vocabulary of {model.config.get_text_config().vocab_size} tokens, but the "
                            f"verifier {inputs.verifier} has {vocab_size} (the drafters must share its tokenizer)")
    return Models(verifier, head_model, slm_model, _keep_ids(inputs.vocab_dir, inputs.tokenizer, vocab_size),
                  set(eos_ids_of(verifier)))


def _run_check(inputs: CheckInputs, config: CheckConfig, out: Path | None, decode_configs: list[DecodeConfig],
               prompts: int | None) -> dict[str, Any]:
    from hyco.base.launch import start_followers
    from hyco.base.loading import load_tokenizer
    from hyco.data.answers import text_stats

    start_followers()
    names = [c.name for c in decode_configs]
    verifier, assistant, slm, phone = inputs.verifier, inputs.assistant, inputs.slm, inputs.phone
    vocab_dir, dataset, workload, bundle_dir = inputs.vocab_dir, inputs.dataset, inputs.workload, inputs.bundle_dir
    tok = load_tokenizer(inputs.tokenizer)
    torch_head = config.backend == "torch" or any(c.mtp_on_server for c in decode_configs)
    models = load_models(inputs, head=torch_head and any(c.mtp_depth for c in decode_configs),
                         slm=any(c.slm_passes for c in decode_configs) and config.backend == "torch")
    verifier_model, head, keep_ids, eos = models.verifier, models.head, models.keep_ids, models.eos_ids
    vocab_size = verifier_model.config.get_text_config().vocab_size
    count = prompt_count(config, prompts)
    sampling = Sampling(config.temperature, config.top_k, config.top_p)
    subset = None  # a file workload's questions, picked evenly over its categories
    if config.workload.schema == "chat":
        candidates = load_prompts(tok, vocab_dir=vocab_dir, dataset=dataset, count=count, all_available=True)
    else:
        if workload is None:
            raise HycoError(f"check.workload.schema {config.workload.schema!r} needs check.workload.source (the file)")
        subset = even_subset(read_workload(workload, config.workload.schema), count, config.seed)
        questions = subset.questions
    # Each run samples with its own seed (check.runs); the chat prompts are chosen once, on the first
    # run's reference texts. A file workload's second turns follow each run's own first answers.
    runs, selection = [], None
    for r in range(config.runs):
        run_config = replace(config, seed=config.seed + RUN_SEED_STEP * r)
        if config.workload.schema == "chat":
            if selection is None:
                selection, chosen, reference = choose_chat_prompts(verifier_model, candidates, run_config, sampling,
                                                                   eos, count)
            else:
                reference = reference_texts(verifier_model, candidates, chosen, run_config, sampling, eos,
                                            f"reference texts, run {r + 1}")
            prompt_ids = [candidates[i] for i in chosen]
            seeds = [keyed_seed(run_config, i) for i in chosen]
            items = chat_items(chosen)
        else:
            prompt_ids, reference, items, _ = workload_prompts(questions, tok, verifier_model, run_config, sampling,
                                                               eos)
            seeds = [keyed_seed(run_config, i) for i in range(len(prompt_ids))]
            if selection is None:
                selection = [{**item, "prompt_tokens": len(ids), **text_stats([ref])}
                             for item, ids, (ref, _) in zip(items, prompt_ids, reference, strict=True)]
        runs.append((run_config, prompt_ids, reference, items, seeds))
    pooled_items = [it for run in runs for it in run[3]]  # a question's runs cluster with it
    keep = None if keep_ids is None else keep_ids.numpy()
    results, lossless, all_logs = {}, {}, {}
    share = second_process_share(decode_configs, config, [verifier, assistant, slm])
    request = {"inputs": inputs, "head": head is not None, "slm": models.slm is not None, "configs": share,
               "runs": [(run_config, ids, seeds) for run_config, ids, _, _, seeds in runs]}
    beside = in_background(decode_share, request, "check's second process") if share else None
    decoded = {}
    for cfg in progress([c for c in decode_configs if c not in share], desc="configurations"):
        decoded[cfg.name] = [decode_all(ids, cfg, run_config, inputs, models, seeds=seeds)
                             for run_config, ids, _, _, seeds in runs]
    if beside is not None:
        decoded.update(beside.result())
    for cfg in decode_configs:  # in the recipe's order, wherever each was decoded
        per_run = decoded[cfg.name]
        results[cfg.name], all_logs[cfg.name] = config_results(cfg, per_run, pooled_items, keep, config)
        if cfg.epsilon >= 1.0 and not cfg.alone:
            lossless[cfg.name] = lossless_verdict(per_run, [run[2] for run in runs])
    _, prompt_ids, reference, items, _ = runs[0]
    costs = None
    if config.timing.enabled and out is not None:
        costs = measure_costs(all_logs, decode_configs, config, phone, verifier_model=verifier_model, head=head,
                              model_dirs=[Path(verifier), Path(assistant)], vocab=vocab_size, bundle_dir=bundle_dir)
    graphs = config.backend == "onnxruntime"
    backends = {"slm": "onnxruntime (convert/ graphs)" if graphs else "torch float",
                "mtp": "onnxruntime (qat/ mtp_step.onnx, INT4)" if graphs else "torch float (qat/mtp.py)",
                "verifier": f"transformers, {where(verifier_model)}"}
    if graphs and config.drafters == "deployed":
        backend, device = deployed_executor(config)
        runner = "onnxruntime CPU" if backend == "cpu" else f"torch on {device} (hyco/quant/qdq_torch.py)"
        if backend == "torch":
            from hyco.runtime.qnn_backend import bundle_sessions

            modes = bundle_sessions(bundle_dir, backend=backend, isolate=False, device=device).modes()
            runner += "".join(f", {role} {mode}" for role, mode in modes.items())
        backends.update(slm=f"{runner} on the export bundle's tree/prefill QDQ graphs (16-bit activations, "
                            "8-bit KV rings: deployed numerics)",
                        mtp=f"{runner} on the export bundle's mtp_step QDQ graph (deployed numerics)")
    if config.backend == "qnn":
        backends.update(slm="QNN HTP (export bundle's tree/prefill context binaries; x86 simulator)",
                        mtp="QNN HTP (export bundle's mtp_step context binary; x86 simulator)")
    # the SLM alone commits one token a pass by construction: no MAT to pair
    paired = paired_mats({n: v for n, v in all_logs.items() if not results[n]["alone"]}, pooled_items,
                         config.bootstrap_resamples, config.seed)
    settings = {"check": to_dict(config), "phone": to_dict(phone), "configs": names, "backends": backends, "prompts": len(prompt_ids),
                "second_process": [c.name for c in share],
                "workload": workload_stats(config, workload, items, [t for t, _ in reference], subset),
                "paired_mat": paired,
                "prompt_selection": selection,
                "prompt_tokens_mean": float(np.mean([len(p) for p in prompt_ids])),
                "keep_set": int(len(keep_ids)) if keep_ids is not None else None, "vocab_size": vocab_size,
                "models": {"verifier": str(verifier), "assistant": str(assistant), "slm": str(slm)}}
    return write_report(Path(out), results, settings, lossless, costs) if out is not None else {}


def reference_texts(verifier_model, candidates: list[list[int]], indices: list[int], run_config: CheckConfig,
                    sampling: Sampling, eos: set[int], desc: str) -> list:
    """The candidates' reference texts (the verifier alone, keyed sampling), split over processes."""
    from hyco.base.launch import in_order, my_positions

    mine = my_positions(len(indices))
    return in_order([(j, keyed_generate(verifier_model, candidates[indices[j]], run_config.max_new_tokens, sampling,
                                        keyed_seed(run_config, indices[j]), eos))
                     for j in progress(mine, desc=desc, leave=False)], len(indices), "check (reference texts)")


def choose_chat_prompts(verifier_model, candidates: list[list[int]], run_config: CheckConfig, sampling: Sampling,
                        eos: set[int], count: int) -> tuple[list[dict], list[int], list]:
    """Every candidate's reference text (the prompts are chosen by its statistics, and exact
    verification must commit exactly it): the selection table, the chosen candidates and their
    references."""
    references = reference_texts(verifier_model, candidates, list(range(len(candidates))), run_config, sampling, eos,
                                 "reference texts")
    selection = choose_prompts(candidates, [t for t, _ in references], count)
    chosen = [row["candidate"] for row in selection if row["chosen"]]
    return selection, chosen, [references[i] for i in chosen]


def chat_items(chosen: list[int]) -> list[dict]:
    return [{"question_id": str(i), "category": "chat", "turn": 1} for i in chosen]


def config_results(cfg: DecodeConfig, per_run: list[list[DecodeLog]], items: list[dict], keep,
                   config: CheckConfig) -> tuple[dict, list[DecodeLog]]:
    """One configuration's report entry from its logs per run, and the runs' logs pooled."""
    logs = [log for logs in per_run for log in logs]
    mats = [summarize(logs, keep, config.chain_depth)["mat"] for logs in per_run]
    return {"label": cfg.label, "epsilon": cfg.epsilon, "slm_passes": cfg.slm_passes, "mtp_depth": cfg.mtp_depth,
            "alone": cfg.alone, "pd_passes": cfg.pd_passes, **summarize(logs, keep, config.chain_depth),
            # MAT is the mean over runs (one run: its MAT), with the runs' SD
            "mat": float(np.mean(mats)), "mat_runs": mats,
            "mat_sd_runs": float(np.std(mats, ddof=1)) if len(mats) > 1 else None,
            "mat_ci": mat_ci(logs, items, config.bootstrap_resamples, config.seed),
            "by_category": by_category(logs, items, keep, config)}, logs


def lossless_verdict(per_run: list[list[DecodeLog]], references: list[list]) -> dict[str, Any]:
    """Evidence for "exact verification is lossless": with each token sampled keyed by its
    position, the rounds must commit exactly the verifier's own text (`keyed_generate`), run by run."""
    verdicts = [compare_with_generate(logs, reference) for logs, reference in zip(per_run, references, strict=True)]
    return {**verdicts[0], "equal": all(v["equal"] for v in verdicts), "runs": len(verdicts),
            "prompts": sum(v["prompts"] for v in verdicts),
            "tokens_compared": sum(v["tokens_compared"] for v in verdicts),
            "first_divergence": next((v["first_divergence"] for v in verdicts if not v["equal"]), None),
            "accepted_draft_tokens": sum(len(r.accepted_sources) for logs in per_run for g in logs for r in g.rounds)}


def where(model) -> str:
    """The model's dtype and devices as placed (accelerate's device map: modules per device)."""
    placed = getattr(model, "hf_device_map", None)
    if placed:
        names = [f"cuda:{d}" if isinstance(d, int) else str(d) for d in placed.values()]
        devices = ", ".join(f"{d}: {names.count(d)} modules" for d in dict.fromkeys(names))
    else:
        devices = str(next(model.parameters()).device)
    return f"{str(model.dtype).removeprefix('torch.')} on {devices}"


def workload_prompts(questions, tok, verifier_model, config: CheckConfig, sampling: Sampling, eos: set[int]):
    """Each question's turns as prompts, with the verifier's keyed reference text for each: a second
    turn is asked after the verifier's own answer to the first (its reference text, decoded), as in
    MT-bench. Returns prompt ids, references (tokens, logits), per prompt its question, category
    and turn, and the messages it was asked with (for another tokenizer's chat template: the
    token bridge's SLM). Under `accelerate launch` each process answers its share of the questions (a
    question's turns stay together: the second follows the first's answer); every prompt keeps its
    place, and so its sampling seed, in the whole workload's order."""
    from hyco.base.launch import in_order, my_positions

    firsts = np.cumsum([0] + [len(q.turns) for q in questions])  # each question's first prompt index

    def answer(j: int) -> list[tuple[list[int], tuple, dict]]:
        q, messages, out = questions[j], [], []
        for turn, text in enumerate(q.turns, 1):
            messages.append({"role": "user", "content": text})
            ids = chat_ids(tok, messages)
            ref = keyed_generate(verifier_model, ids, config.max_new_tokens, sampling,
                                 keyed_seed(config, int(firsts[j]) + turn - 1), eos)
            out.append((ids, ref, {"question_id": q.question_id, "category": q.category, "turn": turn},
                        list(messages)))
            messages.append({"role": "assistant", "content": tok.decode(ref[0], skip_special_tokens=True)})
        return out

    mine = my_positions(len(questions))
    answered = in_order([(j, answer(j)) for j in progress(mine, desc="reference texts", leave=False)],
                        len(questions), "check (reference texts)")
    turns = [t for per_question in answered for t in per_question]
    return [t[0] for t in turns], [t[1] for t in turns], [t[2] for t in turns], [t[3] for t in turns]


def _per_question(logs: list[DecodeLog], items: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    clusters = [it["question_id"] for it in items]
    _, committed = cluster_sums([sum(r.committed for r in log.rounds) for log in logs], clusters)
    _, rounds = cluster_sums([len(log.rounds) for log in logs], clusters)
    return committed, rounds


def mat_ci(logs: list[DecodeLog], items: list[dict], resamples: int, seed: int) -> dict:
    """MAT with its question-level bootstrap interval (a question's turns resampled together)."""
    return ratio_ci(*_per_question(logs, items), resamples=resamples, seed=seed)


def paired_mats(all_logs: dict[str, list[DecodeLog]], items: list[dict], resamples: int, seed: int) -> dict:
    """Every configuration's MAT against the baseline's (Cloud+MTP where it ran, else the first),
    in percent, with the paired bootstrap interval over the same questions."""
    if not all_logs:
        return {}
    base = "cloud-mtp" if "cloud-mtp" in all_logs else next(iter(all_logs))

    def paired(a: str, b: str) -> dict:
        return paired_relative_ci(*_per_question(all_logs[a], items), *_per_question(all_logs[b], items),
                                  resamples=resamples, seed=seed)

    # the paper's two numerics questions: deployed drafters against their float twins (X vs X@float),
    # and the phone's head against the server's (hyco vs hyco-server-head)
    twins = [(n.partition("@")[0], n) for n in all_logs if "@" in n and n.partition("@")[0] in all_logs]
    if "hyco" in all_logs and "hyco-server-head" in all_logs:
        twins.append(("hyco", "hyco-server-head"))
    return {"baseline": base, "vs_baseline": {n: paired(n, base) for n in all_logs if n != base},
            "pairs": [{"config": a, "against": b, **paired(a, b)} for a, b in twins]}


def by_category(logs: list[DecodeLog], items: list[dict], keep, config: CheckConfig) -> dict[str, dict]:
    out = {}
    for category in dict.fromkeys(it["category"] for it in items):
        mine = [i for i, it in enumerate(items) if it["category"] == category]
        sub, sub_items = [logs[i] for i in mine], [items[i] for i in mine]
        figures = summarize(sub, keep, config.chain_depth)
        out[category] = {"prompts": len(mine), "questions": len({it["question_id"] for it in sub_items}),
                         "mat": figures["mat"], "output_tokens": figures["output_tokens"],
                         "mat_ci": mat_ci(sub, sub_items, config.bootstrap_resamples, config.seed)["ci"]}
    return out


def workload_stats(config: CheckConfig, workload: Path | None, items: list[dict], texts: list[list[int]],
                   subset: Subset | None = None) -> dict:
    """What the figures were computed on: the workload, its questions (`subset`: how a file's were
    picked), turns and categories, and the verifier's reference texts' statistics (a text mostly
    one token measures nothing)."""
    from hyco.data.answers import text_stats

    return {"schema": config.workload.schema, "source": str(workload) if workload else None,
            "selection": subset.text() if subset is not None else None,
            "questions": len({it["question_id"] for it in items}), "prompts": len(items),
            "second_turns": sum(it["turn"] == 2 for it in items),
            "categories": {c: sum(it["category"] == c for it in items) for c in dict.fromkeys(it["category"] for it in items)},
            "reference_text": text_stats(texts)}


# Models under this many bytes on disk load in a second process in seconds, beside the first.
SMALL_CHECKPOINTS = 256 * 1024**2


def second_process_share(decode_configs: list[DecodeConfig], config: CheckConfig, folders: list) -> list[DecodeConfig]:
    """The configurations a second process decodes beside this one (every second, from the second:
    it starts late by its imports and loads), or none: only small models on a CPU with cores to
    spare, each process on one thread (`check.threads` 1), so the numbers are this process's."""
    from hyco.base.launch import launched
    from hyco.pipeline.preflight import checkpoint_bytes

    if (config.processes == 1 or config.threads != 1 or launched() or torch.cuda.is_available()
            or (os.cpu_count() or 1) < 2 or len(decode_configs) < 4 or config.backend != "onnxruntime"):
        return []
    if sum(checkpoint_bytes(Path(f)) for f in folders if f is not None) >= SMALL_CHECKPOINTS:
        return []
    return decode_configs[1::2][: len(decode_configs) // 2 - 1]


def decode_share(request: dict[str, Any]) -> dict[str, list[list[DecodeLog]]]:
    """In a second process: the models loaded as the first loads them, and `request["configs"]`
    decoded on the same prompts, runs and seeds (`_run_check`)."""
    from hyco.base.loading import load_tokenizer

    torch.set_num_threads(1)
    inputs = request["inputs"]
    load_tokenizer(inputs.tokenizer)  # refused here as in the first process, should it be unreadable
    models = load_models(inputs, head=request["head"], slm=request["slm"])
    return {cfg.name: [decode_all(ids, cfg, run_config, inputs, models, seeds=seeds)
                       for run_config, ids, seeds in request["runs"]] for cfg in request["configs"]}


def _keep_ids(vocab_dir: Path | None, tokenizer: Path, vocab_size: int) -> torch.Tensor | None:
    if vocab_dir is None or not (Path(vocab_dir) / "keep_set.json").is_file():
        return None
    from hyco.data.keepset import load_keep_set

    keep = load_keep_set(vocab_dir, tokenizer)
    if int(keep.token_ids.max()) >= vocab_size:
        raise HycoError(f"{vocab_dir}/keep_set.json: ids reach {int(keep.token_ids.max())}, beyond the verifier's {vocab_size}")
    return torch.from_numpy(keep.token_ids.astype(np.int64))
