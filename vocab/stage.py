"""The vocab stage: build the keep set, reserve prompt conversations, report coverage.

`build_vocab(tokenizer=..., dataset=..., config=..., out=...)` is the whole stage as a
keyword-only function; the pipeline (`inputs`/`build`) and the CLI (`vocab/cli.py`) wrap it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from hyco.vocab.corpus import Deal, TokenCounter, assistant_view, deal
from hyco.vocab.coverage import comparison_sizes, mark_label, outside_share_curve, plot_coverage, share_at

from hyco.base.console import progress
from hyco.base.errors import HycoError
from hyco.base.files import fingerprint, write_json
from hyco.config.recipe import DatasetConfig, Recipe, VocabConfig, to_dict
from hyco.data.chat import PACKAGED, iter_conversations
from hyco.data.keepset import (
    CATEGORIES,
    KEEP_SET,
    KEEP_TO_VOCAB,
    PROMPTS,
    VOCAB_TO_KEEP,
    always_kept,
    always_kept_report,
    index_maps,
    load_tokenizer,
    placeholder_ids,
    select_keep_set,
    tokenizer_hash,
)
from hyco.data.splits import EVAL_BUCKETS
from hyco.pipeline import verdict
from hyco.pipeline.artifacts import StageEnd, finish_stage, markdown_table

TOKEN_COUNTS = "token_counts.npy"


def dataset_fingerprint(dataset: DatasetConfig) -> dict[str, str]:
    if dataset.source == PACKAGED:
        ident = f"{PACKAGED}=={metadata.version(PACKAGED)}"
    elif Path(dataset.source).exists():
        ident = fingerprint(Path(dataset.source))
    else:  # a dataset name in the HF cache
        ident = f"hf-cache:{dataset.source}"
    return {"source": dataset.source, "schema": dataset.schema, "split": dataset.split,
            "heldout_split": dataset.heldout_split, "fingerprint": ident}


def _count_pass(conversations, quotas: dict[str, int], seed: int, view, counters: dict[str, TokenCounter], desc: str) -> Deal:
    state = Deal(quotas=quotas)
    # disable=None: a bar on a terminal, none in logs and captured stderr (errors stay one line).
    with progress(total=sum(quotas.values()), desc=desc, unit="conv", mininterval=1.0, disable=None) as bar:
        for pool, conv in deal(conversations, quotas, seed, state):
            bar.update(1)
            if pool in counters:
                for text in conv.assistant_texts():
                    counters[pool].add(view(text))
    for counter in counters.values():
        counter.flush()
    return state


def build_vocab(*, tokenizer: Path, dataset: DatasetConfig, config: VocabConfig, out: Path) -> dict[str, Any]:
    """Write keep_set.json, the index maps, prompts.jsonl, token_counts.npy, report.json,
    coverage.png and summary.md into `out`; return a short summary for the manifest."""
    start = time.perf_counter()
    out = Path(out)
    tok = load_tokenizer(tokenizer)
    vocab_size = len(tok)
    # Everything that can be refused is refused before the corpus pass.
    always = always_kept(tok, config.always_scripts, str(tokenizer), keep_placeholders=config.keep_placeholders)
    select_keep_set(np.zeros(vocab_size, dtype=np.int64), always, config.size, f"{tokenizer}")
    if dataset.heldout_split is not None and dataset.heldout_split == dataset.split:
        raise HycoError(f"dataset.heldout_split must differ from dataset.split, but got {dataset.heldout_split!r} for both")
    view, view_label = assistant_view(tok)

    quotas = {"count": config.count_conversations, "train": config.reserved_train, "eval": config.reserved_eval,
              "heldout": config.heldout_conversations if dataset.heldout_split is None else 0}
    counters = {"count": TokenCounter(tok, vocab_size), "heldout": TokenCounter(tok, vocab_size)}
    where = f"{dataset.source} (split {dataset.split!r})"
    main = _count_pass(iter_conversations(dataset.source, dataset.schema, dataset.split), quotas, config.seed,
                       view, counters, "vocab: count")
    heldout_ids, heldout_indices = main.ids["heldout"], main.indices["heldout"]
    if dataset.heldout_split is not None:
        held = _count_pass(iter_conversations(dataset.source, dataset.schema, dataset.heldout_split),
                           {"heldout": config.heldout_conversations}, config.seed, view, counters, "vocab: held-out")
        heldout_ids, heldout_indices = held.ids["heldout"], held.indices["heldout"]
    count_tokens = counters["count"].tokens
    if count_tokens == 0:
        raise HycoError(f"{where}: no assistant turns in the {main.read} conversations read; "
                        "the keep set is counted on assistant answers")
    elapsed_count = time.perf_counter() - start

    placeholders = placeholder_ids(tok)  # uncounted ones are the last candidates of the top-up
    categories = select_keep_set(counters["count"].counts, always, config.size, str(tokenizer), last=placeholders)
    token_ids = np.sort(np.concatenate([categories[c] for c in CATEGORIES]))
    keep_to_vocab, vocab_to_keep = index_maps(token_ids, vocab_size)
    np.save(out / KEEP_TO_VOCAB, keep_to_vocab)
    np.save(out / VOCAB_TO_KEEP, vocab_to_keep)
    np.save(out / TOKEN_COUNTS, counters["count"].counts)
    reserved_ids = [c.id for _, c in main.reserved]
    keep_set = {
        "size": int(config.size),
        "token_ids": token_ids.tolist(),
        "categories": {c: int(len(categories[c])) for c in CATEGORIES},
        "tokenizer": tokenizer_hash(tok),
        "vocab_size": vocab_size,
        "dataset": dataset_fingerprint(dataset),
        "counted": len(main.ids["count"]),
        "reserved": reserved_ids,
        "reserved_indices": {p: main.indices[p] for p in ("train", "eval")},
        "counted_indices": main.indices["count"],
        "heldout_indices": heldout_indices,
        "assistant_text": view_label,
        "seed": config.seed,
    }
    write_json(out / KEEP_SET, keep_set)
    with open(out / PROMPTS, "w", encoding="utf-8") as f:
        for pool, conv in main.reserved:
            f.write(json.dumps({"id": conv.id, "index": conv.index, "split": pool,
                                "turns": [list(t) for t in conv.turns]}, ensure_ascii=False) + "\n")

    details = always_kept_report(tok, always, config.keep_placeholders)
    # Evidence for leaving placeholders out: how often the counted assistant text produced one.
    details["placeholder_occurrences_counted"] = int(counters["count"].counts[placeholders].sum())
    report, plot = _coverage_report(counters, always, config, vocab_size, keep_set, main, heldout_ids, view_label,
                                    details, placeholders)
    elapsed = time.perf_counter() - start
    summary = {
        "size": config.size, "categories": keep_set["categories"], "counted": keep_set["counted"],
        "count_tokens": count_tokens, "heldout_outside_share": report["outside_share"],
        "count_tokens_per_s": round(count_tokens / max(elapsed_count, 1e-9)), "wall_s": round(elapsed, 2),
        "requested": report["requested"], "got": report["got"],
    }
    # no proof: every refusal (keep set too small for what is always kept, no assistant text) came above
    lines = [verdict.Line("keep set", verdict.INFO,
                          f"{config.size:,} of {vocab_size:,} tokens; {verdict.percent(report['outside_share'])} of "
                          f"{report['heldout_assistant_tokens']:,} held-out assistant tokens fall outside it")]
    return finish_stage("vocab", out, StageEnd(report, _summary_markdown, summary, plots={"coverage.png": plot},
                                               verdict=lines), allow_parity_failure=False)


def _coverage_report(counters, always, config: VocabConfig, vocab_size, keep_set, main: Deal, heldout_ids, view_label,
                     details: dict, placeholders: np.ndarray) -> tuple[dict, Callable[[Path], None]]:
    """report.json's content and the drawing of coverage.png."""
    always_ids = np.unique(np.concatenate(list(always.values())))
    heldout = counters["heldout"].counts
    sizes, share = outside_share_curve(counters["count"].counts, heldout, always_ids, placeholders)
    marks = comparison_sizes(config.comparison_sizes, vocab_size, config.reference_vocab, len(always_ids))
    for m in marks:
        m["outside_share"] = share_at(sizes, share, m["size"])
    requested = share_at(sizes, share, config.size)
    report = {
        "size": config.size,
        "vocab_size": vocab_size,
        "categories": keep_set["categories"],
        "always_kept": details,
        "frequent_with_zero_count": int(np.sum(counters["count"].counts[_frequent_ids(keep_set, always_ids)] == 0)),
        "outside_share": requested,
        "comparison": marks,
        "counted_conversations": keep_set["counted"],
        "counted_assistant_tokens": counters["count"].tokens,
        "counted_assistant_chars": counters["count"].chars,
        "heldout_conversations": len(heldout_ids),
        "heldout_assistant_tokens": counters["heldout"].tokens,
        "reserved": {p: len(main.ids[p]) for p in ("train", "eval")},
        "requested": {"count": config.count_conversations, "train": config.reserved_train,
                      "eval": config.reserved_eval, "heldout": config.heldout_conversations},
        "got": {"count": keep_set["counted"], "train": len(main.ids["train"]), "eval": len(main.ids["eval"]),
                "heldout": len(heldout_ids)},
        "conversations_read": main.read,
        "conversations_skipped": main.skipped,
        # Eval prompts come only from this partition, which distillation and the other pools never read.
        "evaluation_partition": f"sha256 of the first user turn, 1 bucket in {EVAL_BUCKETS} (hyco/data/splits.py)",
        "assistant_text": view_label,
        "tokenizer": keep_set["tokenizer"],
        "dataset": keep_set["dataset"],
    }
    if counters["heldout"].tokens == 0:
        report["warning"] = "no held-out assistant tokens: coverage figures are 0 by convention"
    title = (f"Keep-set coverage on {len(heldout_ids):,} held-out conversations "
             f"({counters['heldout'].tokens:,} assistant tokens)")
    return report, lambda path: plot_coverage(path, sizes, share, marks, config.size, title)


def _frequent_ids(keep_set, always_ids) -> np.ndarray:
    return np.setdiff1d(np.asarray(keep_set["token_ids"]), always_ids)


def _summary_markdown(report: dict) -> str:
    c, a = report["categories"], report["always_kept"]
    rows = [{"keep set": mark_label(m), "size": m["size"], "outside (%)": round(100 * m["outside_share"], 3)}
            for m in report["comparison"]]
    rows.insert(0, {"keep set": "requested", "size": report["size"], "outside (%)": round(100 * report["outside_share"], 3)})
    short = [p for p, n in report["requested"].items() if report["got"][p] < n]
    left_out = (f" Left out: {a['placeholders_left_out']} placeholder tokens ({', '.join(f'`{t}`' for t in a['placeholder_examples'])}, ...; "
                f"{a['placeholder_occurrences_counted']} occurrences in the counted text; vocab.keep_placeholders "
                "keeps them)." if a["placeholders_left_out"] else "")
    text = (
        f"# Keep set: {report['size']} of {report['vocab_size']} tokens\n\n"
        f"{c['special']} special + {c['chat']} chat-template markers + {c['placeholder']} placeholder + "
        f"{c['byte']} byte + {c['script']} script + {c['frequent']} frequent tokens.{left_out} "
        f"Chat markers: {', '.join(f'`{t}`' for t in a['chat_markers']) or 'none'}; "
        f"special: {', '.join(f'`{t}`' for t in a['special_tokens'][:12])}"
        f"{' ...' if len(a['special_tokens']) > 12 else ''}. "
        f"Frequencies counted on {report['counted_assistant_tokens']} assistant tokens of {report['counted_conversations']} conversations "
        f"({report['assistant_text']}). Reserved prompt conversations: {report['reserved']['train']} train, "
        f"{report['reserved']['eval']} eval (never counted).\n\n"
        f"Held-out assistant tokens outside the keep set ({report['heldout_conversations']} conversations, "
        f"{report['heldout_assistant_tokens']} tokens); curve in coverage.png:\n\n"
        + markdown_table(rows, ["keep set", "size", "outside (%)"])
    )
    if short:
        text += f"\nFewer conversations than requested for: {', '.join(short)} (the corpus ran out).\n"
    return text


# --- the pipeline's view ------------------------------------------------------------------


def section(recipe: Recipe) -> dict[str, Any]:
    return {"vocab": to_dict(recipe.vocab), "dataset": to_dict(recipe.dataset)}


def inputs(recipe: Recipe, run_dir: Path) -> dict[str, Path]:
    paths = {"tokenizer": recipe.path(recipe.models.tokenizer, run_dir)}
    if paths["tokenizer"] is None:
        raise HycoError("models.tokenizer must name a tokenizer folder for the vocab stage, but got null")
    if recipe.dataset.source != PACKAGED and Path(recipe.dataset.source).exists():
        paths["dataset"] = Path(recipe.dataset.source)
    return paths


def build(recipe: Recipe, run_dir: Path, out: Path) -> dict[str, Any]:
    return build_vocab(tokenizer=inputs(recipe, run_dir)["tokenizer"], dataset=recipe.dataset, config=recipe.vocab, out=out)
