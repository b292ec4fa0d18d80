"""The check through the token bridge: the SLM Drafter drafting for a verifier of another family.

`run_check` hands over here when the recipe names the verifier's own tokenizer
(`models.verifier_tokenizer`). Each prompt is one user turn written twice, with each side's chat
template: the verifier's ids for the server, the SLM's for the phone. Everything measured is the
verifier's, in its tokens, as in the same-tokenizer check: the reference texts (the verifier
alone, keyed sampling), the prompt choice on their statistics, exact verification's lossless
verdict, MAT. The configurations are `configs.BRIDGE_CONFIGS`; beside MAT each bridged one
reports the bridge's own figures (`bridge_figures`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from hyco.runtime_check.check import (
    RUN_SEED_STEP,
    CheckInputs,
    Models,
    build_drafter,
    chat_items,
    choose_chat_prompts,
    config_results,
    decode_all,
    deployed,
    deployed_executor,
    keyed_seed,
    lossless_verdict,
    measure_costs,
    paired_mats,
    prompt_count,
    reference_texts,
    where,
    workload_prompts,
    workload_stats,
)
from hyco.runtime_check.report import write_report

from hyco.base.console import progress
from hyco.base.errors import HycoError
from hyco.config.recipe import CheckConfig, to_dict
from hyco.data.answers import eos_ids_of, text_stats
from hyco.data.workloads import chat_ids, even_subset, read_workload
from hyco.runtime.bridge import TokenBridge, model_end_of_turn_ids
from hyco.runtime.configs import DecodeConfig
from hyco.runtime.decode import DecodeLog, decode_bridged, verifier_alone
from hyco.runtime.inputs import load_model, load_prompt_texts
from hyco.runtime.verifier import ReferenceVerifier, Sampling


def bridge_figures(logs: list[DecodeLog], eos_ids: set[int]) -> dict[str, Any] | None:
    """The bridge's costs over a configuration's rounds: SLM draft nodes per round and the share
    lost at boundaries (no verifier node carries their text), verifier nodes per round, verifier
    tokens per SLM token over the committed text (end-of-turn tokens aside), and the host's work
    per round: the server's mapping, the phone's re-tokenization and the ring rows it rolled back."""
    rounds = [b for log in logs for b in log.bridge]
    if not rounds:
        return None
    slm_nodes = sum(b.slm_nodes for b in rounds)
    verifier_tokens = sum(sum(t not in eos_ids for t in log.tokens) for log in logs)
    slm_tokens = sum(log.slm_tokens for log in logs)
    return {"rounds": len(rounds),
            "slm_nodes_per_round": mean(b.slm_nodes for b in rounds),
            "verifier_nodes_per_round": mean(b.verifier_nodes for b in rounds),
            "lost_per_round": mean(b.lost for b in rounds),
            "lost_share": sum(b.lost for b in rounds) / slm_nodes if slm_nodes else 0.0,
            "verifier_tokens": verifier_tokens, "slm_tokens": slm_tokens,
            "verifier_tokens_per_slm_token": verifier_tokens / slm_tokens if slm_tokens else None,
            "map_ms_per_round": 1e3 * mean(b.map_s for b in rounds),
            "sync_ms_per_round": 1e3 * mean(b.sync_s for b in rounds),
            "host_ms_per_round": 1e3 * mean(b.map_s + b.sync_s for b in rounds),
            "rollback_rows_per_round": mean(b.rollback for b in rounds),
            "unfinished_rounds": sum(b.unfinished for b in rounds)}


def _vocab_size(folder: Path) -> int:
    from hyco.base.loading import read_json

    config = read_json(Path(folder) / "config.json", "config.json")
    return int((config.get("text_config") or config)["vocab_size"])


def _check_tokenizer(tok, tokenizer: Path, model: Path, vocab: int, what: str) -> None:
    if len(tok) > vocab:
        raise HycoError(f"{tokenizer}: a tokenizer of {len(tok)} tokens, but {model}/config.json ({what}) has a "
                        f"vocabulary of {vocab}: not this model's tokenizer")


def decode_bridged_all(verifier_prompts: list[list[int]], slm_prompts: list[list[int]], cfg: DecodeConfig,
                       check: CheckConfig, inputs: CheckInputs, models: Models, bridge: TokenBridge,
                       seeds: list[int]) -> list[DecodeLog]:
    """One configuration over the prompts, each from fresh caches (`verifier-alone`, or SLM-only
    trees through the bridge); the verifier samples keyed by position (`seeds`). Under
    `accelerate launch` each process decodes its share."""
    from hyco.base.launch import in_order, my_positions

    sampling = Sampling(check.temperature, check.top_k, check.top_p)
    eos_ids = models.eos_ids
    logs = []
    for i in progress(my_positions(len(verifier_prompts)), desc=cfg.name, leave=False):
        reference = ReferenceVerifier(models.verifier, sampling, capture_point=inputs.phone.capture_point, window=None,
                                      keyed_seed=seeds[i], hand_off=False)
        if cfg.verifier_alone:
            logs.append((i, verifier_alone(reference, verifier_prompts[i], check.max_new_tokens, eos_ids,
                                           probe_epsilon=check.epsilon)))
            continue
        drafter = build_drafter(cfg, check, inputs.phone, verifier=models.verifier, head=None, slm=models.slm,
                                keep_ids=models.keep_ids, convert_dir=inputs.convert_dir, bundle_dir=inputs.bundle_dir)
        logs.append((i, decode_bridged((verifier_prompts[i], slm_prompts[i]), reference, drafter, bridge,
                                       epsilon=cfg.epsilon, max_new_tokens=check.max_new_tokens, eos_ids=eos_ids,
                                       generator=torch.Generator().manual_seed(check.seed + i),
                                       probe_epsilon=check.epsilon)))
    return in_order(logs, len(verifier_prompts), f"check ({cfg.name})")


def prompt_runs(config: CheckConfig, count: int, inputs: CheckInputs, verifier_model, verifier_tok, slm_tok,
                sampling: Sampling, eos: set[int]) -> list[tuple]:
    """Per sampling run (check.runs, each its own seed): (run config, references, seeds, verifier
    prompts, SLM prompts, items, prompt selection). Chat prompts are chosen once, on the first
    run's reference texts (`choose_chat_prompts`); a file workload's questions are all asked, a
    second turn after the verifier's own first answer, written with each side's chat template."""
    workload = inputs.workload
    if config.workload.schema == "chat":
        texts = load_prompt_texts(vocab_dir=inputs.vocab_dir, dataset=inputs.dataset, count=count, all_available=True)
        turns = [[{"role": "user", "content": text}] for text in texts]
        verifier_candidates = [chat_ids(verifier_tok, t) for t in turns]
        slm_candidates = [chat_ids(slm_tok, t) for t in turns]
    elif workload is None:
        raise HycoError(f"check.workload.schema {config.workload.schema!r} needs check.workload.source (the file)")
    else:
        questions = even_subset(read_workload(workload, config.workload.schema), count, config.seed).questions
    runs, selection = [], None
    for r in range(config.runs):
        run_config = replace(config, seed=config.seed + RUN_SEED_STEP * r)
        if config.workload.schema != "chat":
            verifier_prompts, reference, items, asked = workload_prompts(questions, verifier_tok, verifier_model,
                                                                         run_config, sampling, eos)
            slm_prompts = [chat_ids(slm_tok, messages) for messages in asked]
            seeds = [keyed_seed(run_config, i) for i in range(len(verifier_prompts))]
            selection = selection or [{**item, "prompt_tokens": len(ids), **text_stats([ref])}
                                      for item, ids, (ref, _) in zip(items, verifier_prompts, reference, strict=True)]
            runs.append((run_config, reference, seeds, verifier_prompts, slm_prompts, items, selection))
            continue
        if selection is None:
            selection, chosen, reference = choose_chat_prompts(verifier_model, verifier_candidates, run_config,
                                                               sampling, eos, count)
        else:
            reference = reference_texts(verifier_model, verifier_candidates, chosen, run_config, sampling, eos,
                                        f"reference texts, run {r + 1}")
        runs.append((run_config, reference, [keyed_seed(run_config, i) for i in chosen],
                     [verifier_candidates[i] for i in chosen], [slm_candidates[i] for i in chosen],
                     chat_items(chosen), selection))
    return runs


def run_bridged_check(inputs: CheckInputs, config: CheckConfig, out: Path | None, decode_configs: list[DecodeConfig],
                      prompts: int | None) -> dict[str, Any]:
    """`run_check` for a verifier of another family (see the module doc). `inputs.tokenizer` is the
    SLM's, `inputs.verifier_tokenizer` the verifier's; `inputs.assistant`, the verifier's own head,
    only for cloud-mtp."""
    from hyco.runtime_check.check import _keep_ids

    from hyco.base.launch import start_followers
    from hyco.base.loading import load_tokenizer

    start_followers()
    verifier, verifier_tokenizer, assistant, slm = inputs.verifier, inputs.verifier_tokenizer, inputs.assistant, inputs.slm
    tokenizer, phone, workload, placement = inputs.tokenizer, inputs.phone, inputs.workload, inputs.placement
    slm_tok, verifier_tok = load_tokenizer(tokenizer), load_tokenizer(verifier_tokenizer)
    verifier_model = load_model(verifier, "verifier", placement)
    vocab_size = verifier_model.config.get_text_config().vocab_size
    slm_vocab = _vocab_size(slm)
    _check_tokenizer(verifier_tok, verifier_tokenizer, verifier, vocab_size, "models.verifier")
    _check_tokenizer(slm_tok, tokenizer, slm, slm_vocab, "models.slm")
    head = None
    if any(c.mtp_depth for c in decode_configs):
        if assistant is None:
            raise HycoError("check.configs cloud-mtp runs the verifier's own head on the server: name it in "
                            "models.assistant")
        head = load_model(assistant, "assistant", placement)
        if head.config.get_text_config().vocab_size != vocab_size:
            raise HycoError(f"{assistant}: vocabulary of {head.config.get_text_config().vocab_size} tokens, but the "
                            f"verifier {verifier} has {vocab_size} (Cloud+head runs the verifier's own head)")
    slm_model = load_model(slm, "SLM") if config.backend == "torch" and any(c.slm_passes for c in decode_configs) else None
    keep_ids = _keep_ids(inputs.vocab_dir, tokenizer, slm_vocab)  # the SLM's keep set, in its vocabulary
    eos = set(eos_ids_of(verifier_model))
    if not eos:
        raise HycoError(f"{verifier}/generation_config.json: no eos_token_id (the verifier's end of turn)")
    bridge = TokenBridge(slm_tok, verifier_tok, slm_eos=model_end_of_turn_ids(slm, slm_tok), verifier_eos=eos_ids_of(verifier_model)[0])
    sampling = Sampling(config.temperature, config.top_k, config.top_p)
    runs = prompt_runs(config, prompt_count(config, prompts), inputs, verifier_model, verifier_tok, slm_tok, sampling, eos)
    _, _, _, verifier_prompts, slm_prompts, items, selection = runs[0]
    pooled_items = [it for run in runs for it in run[5]]  # a question's runs cluster with it
    results, lossless, all_logs = {}, {}, {}
    models = Models(verifier_model, head, slm_model, keep_ids, eos)
    # Cloud+head: the verifier and its own head, no SLM, no keep set (the SLM's), no phone graphs
    server = (replace(inputs, convert_dir=None, qat_dir=None, bundle_dir=None), replace(models, slm=None, keep_ids=None))
    for cfg in progress(decode_configs, desc="configurations"):
        if cfg.mtp_depth:
            per_run = [decode_all(v_prompts, cfg, run_config, *server, seeds=seeds)
                       for run_config, _, seeds, v_prompts, _, _, _ in runs]
        else:
            per_run = [decode_bridged_all(v_prompts, s_prompts, cfg, run_config, inputs, models, bridge, seeds)
                       for run_config, _, seeds, v_prompts, s_prompts, _, _ in runs]
        # keep set None: the SLM's keep set is in its vocabulary, the verifier's bonus tokens in another
        results[cfg.name], all_logs[cfg.name] = config_results(cfg, per_run, pooled_items, None, config)
        results[cfg.name]["bridge"] = bridge_figures(all_logs[cfg.name], eos)
        if cfg.epsilon >= 1.0:
            lossless[cfg.name] = lossless_verdict(per_run, [run[1] for run in runs])
    costs = None
    if config.timing.enabled and out is not None:
        costs = measure_costs(all_logs, decode_configs, config, phone, verifier_model=verifier_model, head=head,
                              model_dirs=[Path(p) for p in (verifier, assistant) if p is not None], vocab=vocab_size,
                              bundle_dir=inputs.bundle_dir)
    slm_runner = "torch float"
    if config.backend == "onnxruntime":
        slm_runner = "onnxruntime (convert/ graphs)"
        if any(deployed(c, config) for c in decode_configs):
            backend, device = deployed_executor(config)
            runner = "onnxruntime CPU" if backend == "cpu" else f"torch on {device} (hyco/quant/qdq_torch.py)"
            slm_runner = f"{runner} on the export bundle's tree/prefill QDQ graphs (deployed numerics)"
    elif config.backend == "qnn":
        slm_runner = "QNN HTP (export bundle's tree/prefill context binaries; x86 simulator)"
    reference = runs[0][1]
    settings = {"check": to_dict(config), "phone": to_dict(phone), "configs": [c.name for c in decode_configs],
                "backends": {"slm": slm_runner, "verifier": f"transformers, {where(verifier_model)}",
                             **({"head": f"transformers, {where(head)}"} if head is not None else {})},
                "prompts": len(verifier_prompts),
                "workload": workload_stats(config, workload, items, [t for t, _ in reference]),
                "paired_mat": paired_mats(all_logs, pooled_items, config.bootstrap_resamples, config.seed),
                "slm_prompt_tokens_mean": sum(map(len, slm_prompts)) / len(slm_prompts),
                "prompt_selection": selection,
                "prompt_tokens_mean": sum(map(len, verifier_prompts)) / len(verifier_prompts),
                # the keep set is the SLM's, of its vocabulary (the verifier's is in "bridge")
                "keep_set": int(len(keep_ids)) if keep_ids is not None else None, "vocab_size": slm_vocab,
                "bridge": {"slm_vocab_size": slm_vocab, "verifier_vocab_size": vocab_size,
                           "slm_eos": sorted(bridge.slm_eos), "verifier_eos": bridge.verifier_eos,
                           "draft_tail": bridge.draft_tail,
                           "reference_text": text_stats(t for t, _ in reference)},
                "models": {"verifier": str(verifier), "verifier_tokenizer": str(verifier_tokenizer),
                           "assistant": str(assistant) if assistant else None, "slm": str(slm),
                           "slm_tokenizer": str(tokenizer)}}
    return write_report(Path(out), results, settings, lossless, costs) if out is not None else {}
