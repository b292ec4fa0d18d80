"""report.json, summary.md and check.png: every configuration side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyco.runtime_check.costs import INPUTS, plot_figure1
from hyco.runtime_check.costs import markdown as costs_markdown

from hyco.artifacts import StageEnd, finish_stage, markdown_table, write_json

# Paper, Table 2 (SB-480, Gemma 4 26B-A4B with its real drafters). Shown in a table of its own:
# the fixture's models are tiny distilled stand-ins, so their MATs are not comparable with these.
PAPER_MAT = {"cloud-mtp": 3.05, "specedge": 3.53, "specedge-eps": 4.13, "hyco": 4.71, "hyco-2p": 5.27, "hyco-exact": 3.84}

COLUMNS = ["config", "label", "rule", "mat", "mat_ci95", "mat_sd_runs", "tokens_ge_eps_row", "top_p_row", "unsampled_share", "chain_k1",
           "chain_kK", "share_chain", "share_sibling", "share_slm", "bonus_outside_keep", "handoff_B_round",
           "kv_B_token", "tree_B_round", "passes_per_token", "draft_ms_round", "pd_win_share", "output_tokens"]


def write_report(out: Path, results: dict[str, dict], settings: dict[str, Any],
                 lossless: dict[str, dict] | None = None, costs: tuple[dict, dict] | None = None) -> dict[str, Any]:
    """report.json, summary.md and check.png through the stage ending; returns the manifest's
    summary. `lossless`: per exact configuration, `check.compare_with_generate`'s verdict against
    the verifier's own keyed-sampled text (`check.keyed_generate`)."""
    out.mkdir(parents=True, exist_ok=True)
    lossless = lossless or {}
    report = {"settings": settings, "configs": results, "lossless": lossless, "paper_mat_sb480": PAPER_MAT}
    plots = {"check.png": lambda path: _plot(path, results)}
    varies = [("summary.md", "prints the drafters' measured milliseconds per round and the measured server times",
               None)]
    if costs is not None:
        inputs, report["costs"] = costs
        write_json(out / INPUTS, inputs)
        plots["figure1.png"] = lambda path: plot_figure1(path, report["costs"])
        varies += [("report.json", "Table 2 / 11 from the server's measured pass times", ["/costs"]),
                   (INPUTS, "the server's measured pass times", ["/server"]),
                   ("figure1.png", "drawn from the measured times", None)]
    summary = {"configs": {name: {"mat": r["mat"], "output_tokens": r["output_tokens"],
                                  **({"lossless": lossless[name]["equal"]} if name in lossless else {})}
                           for name, r in results.items()}}
    # no proof that stops the stage: a lossless verdict of False is the finding this stage reports
    return finish_stage("check", out, StageEnd(
        report, summary_markdown, summary, plots=plots, nondeterministic=varies),
        allow_parity_failure=False)


def summary_markdown(report: dict[str, Any]) -> str:
    settings, results, lossless = report["settings"], report["configs"], report["lossless"]
    rows = [_row(name, r) for name, r in results.items()]
    epsilon = settings["check"]["epsilon"]
    md = ["# Check: hybrid drafting against the reference verifier", "",
          f"{settings['prompts']} prompts (mean {settings['prompt_tokens_mean']:.0f} tokens), up to "
          f"{settings['check']['max_new_tokens']} new tokens each; temperature {settings['check']['temperature']}, "
          f"top-k {settings['check']['top_k']}, top-p {settings['check']['top_p']}; keep set "
          f"{settings['keep_set'] or 'none (full vocabulary)'} of {settings['vocab_size']}.", "",
          markdown_table(rows, COLUMNS),
          "MAT: tokens committed per round (accepted + bonus), up to and including the first EOS; with "
          "check.runs above 1 the mean of the runs' MATs (each its own sampling seed), mat_sd_runs their SD. "
          f"tokens_ge_eps_row: mean count of tokens with p~ >= {epsilon:g} (check.epsilon) per tree row, i.e. how "
          "many tokens the epsilon rule would accept at a node (the paper's rule assumes a handful); top_p_row: "
          "mean top probability of p~ per row; unsampled_share: share of committed tokens the verifier did not "
          "sample (accepted by the threshold alone; 0 under exact verification). chain_k1 / chain_kK: share of "
          "rounds whose first 1 / K chain tokens were all accepted. share_*: accepted tokens by source. Bytes: "
          "hand-off e+h per round, its K/V per committed token, and the tree message per round (8-bit wire). Rule "
          "none (slm-alone): the SLM decodes by itself, one pass and one token a round (MAT 1 by construction), "
          "nothing verified; its draft_ms_round is the host's time per token on these graphs, not a phone's. "
          "pd_win_share (specedge-pd): the share of proactive bets (the best path accepted whole, its bonus "
          "among the drafted children) whose drafting the next tree started from.", "",
          *_vacuity_warning(results, epsilon),
          *_workload_lines(settings, results),
          *_prompt_lines(settings),
          *_bridge_lines(settings, results),
          "## Lossless (exact configurations)", "", *_lossless_lines(lossless, settings), "",
          "## The paper's figures (not comparable)", "",
          "MAT from the paper's Table 2 (SB-480, Gemma 4 26B-A4B and its real drafters), for orientation only: the "
          "figures above come from the tiny fixture models on the fixture's prompts, so the two columns measure "
          "different models on different text and must not be compared number for number.", "",
          markdown_table([{"config": n, "label": results[n]["label"], "paper_mat": PAPER_MAT[n]}
                          for n in results if n in PAPER_MAT], ["config", "label", "paper_mat"]),
          "![check](check.png)", ""]
    if "costs" in report:
        md += costs_markdown(report["costs"]) + ["![Figure 1](figure1.png)", ""]
    return "\n".join(md)


# More tokens than this at or above epsilon per row: the threshold accepts most drafts whatever
# they are (the paper's verifier puts a handful of tokens above 0.005).
VACUOUS_TOKENS_PER_ROW = 10


def _vacuity_warning(results: dict[str, dict], epsilon: float) -> list[str]:
    loose = {n: r["tokens_at_epsilon_per_row"] for n, r in results.items()
             if r["epsilon"] < 1 and r["tokens_at_epsilon_per_row"] > VACUOUS_TOKENS_PER_ROW}
    if not loose:
        return []
    listed = ", ".join(f"{n} {v:.1f}" for n, v in loose.items())
    return [f"**Warning**: the verifier's p~ puts more than {VACUOUS_TOKENS_PER_ROW} tokens per row at or above "
            f"epsilon {epsilon:g} ({listed}), so the epsilon rule accepts almost any draft there and those MATs "
            "say little about drafting; compare the exact configurations.", ""]


def _lossless_lines(lossless: dict[str, dict], settings: dict[str, Any]) -> list[str]:
    if not lossless:
        return ["No exact configuration ran, so losslessness was not checked."]
    lines = [f"Every token is sampled with a generator keyed by its position, so the text exact verification commits "
             "does not depend on the drafts. Each exact configuration's committed tokens on the "
             f"{settings['prompts']} prompts were compared with the verifier's own text, sampled alone through "
             "transformers' forward and cache:", ""]
    for name, v in lossless.items():
        head = (f"- {name}: {v['tokens_compared']} tokens over {v['prompts']} prompts ({v['distinct_tokens']} "
                f"distinct in the verifier's text), {v['accepted_draft_tokens']} of them accepted drafts: ")
        if v["equal"]:
            lines.append(head + "identical, lossless.")
        else:
            d = v["first_divergence"]
            margin = "" if d["logit_margin"] is None else f", verifier logit margin there {d['logit_margin']:.3g}"
            lines.append(head + f"NOT identical: prompt {d['prompt']} first differs at output token {d['position']} "
                         f"(ours {d['ours']}, the verifier's {d['generate']}{margin}).")
    return lines


BRIDGE_COLUMNS = ["config", "rounds", "slm_nodes_per_round", "verifier_nodes_per_round", "lost_per_round", "lost_share",
                  "verifier_tokens_per_slm_token", "map_ms_per_round", "sync_ms_per_round", "host_ms_per_round",
                  "rollback_rows_per_round", "unfinished_rounds"]


def _bridge_lines(settings: dict[str, Any], results: dict[str, dict]) -> list[str]:
    """The token bridge's own figures (runtime_check/bridged.py), where the check ran through it."""
    bridge = settings.get("bridge")
    if not bridge:
        return []
    rows = [{"config": n, **r["bridge"]} for n, r in results.items() if r.get("bridge")]
    text = bridge["reference_text"]
    return ["## Token bridge", "",
            f"The SLM ({bridge['slm_vocab_size']:,}-token vocabulary, {settings['models']['slm_tokenizer']}) drafts for "
            f"a verifier of another family ({bridge['verifier_vocab_size']:,} tokens, "
            f"{settings['models']['verifier_tokenizer']}); every figure above is in the verifier's tokens. Prompts: "
            f"mean {settings['prompt_tokens_mean']:.0f} verifier / {settings['slm_prompt_tokens_mean']:.0f} SLM tokens. "
            f"The verifier's reference texts: {text['tokens']} tokens, {text['distinct_tokens']} distinct, the most "
            f"frequent {100 * text['top_share']:.1f}%.", "",
            markdown_table(rows, BRIDGE_COLUMNS),
            "slm_nodes / verifier_nodes: draft nodes per round in the phone's tree and in the tree the server "
            "verifies (re-tokenized paths, shared prefixes merged, trimmed to the budget); lost: SLM nodes whose "
            "text no verifier node carries (cut at a boundary, markup, an unfinished character); "
            "verifier_tokens_per_slm_token: over the committed text (end-of-turn aside); map_ms: the server's "
            "mapping of the tree, sync_ms: the phone's re-tokenization of the committed text, both on this host; "
            "rollback_rows: SLM ring rows rolled back and re-run per round (the unstable last word); "
            "unfinished_rounds: rounds that drafted nothing because the text ended inside a character.", ""]


def _prompt_lines(settings: dict[str, Any]) -> list[str]:
    rows = settings.get("prompt_selection") or []
    if not rows or "chosen" not in rows[0]:  # a file workload: every question, no choosing
        return []
    chosen = [r for r in rows if r["chosen"]]
    short = sum(r["degenerate"] for r in chosen)
    return ["## Prompts", "",
            f"The {len(chosen)} prompts are the first of the {len(rows)} reserved evaluation prompts whose reference text "
            "(the verifier's own sampled answer, below) is at most half one token"
            + (f"; {short} chosen ones are not (too few candidates pass)" if short else "") + ":", "",
            markdown_table(rows, ["candidate", "prompt_tokens", "tokens", "distinct_tokens", "top_share",
                                  "degenerate", "chosen"])]


def _row(name: str, r: dict) -> dict:
    chain = r["chain_acceptance_cumulative"]
    share = r["accepted_share_by_source"]
    return {
        "config": name, "label": r["label"],
        "rule": "none" if r.get("alone") else "exact" if r["epsilon"] >= 1 else f"eps={r['epsilon']:g}",
        "mat": r["mat"], "mat_ci95": _ci(r["mat_ci"]["ci"]), "mat_sd_runs": _blank(r.get("mat_sd_runs")), "tokens_ge_eps_row": r["tokens_at_epsilon_per_row"], "top_p_row": r["top_probability_per_row"],
        "unsampled_share": r["committed_unsampled_share"], "chain_k1": chain[0] if chain else "",
        "chain_kK": chain[-1] if chain else "", "share_chain": share["chain"], "share_sibling": share["sibling"],
        "share_slm": share["slm"], "bonus_outside_keep": r["bonus_outside_keep_share"],
        "handoff_B_round": _blank(r["handoff_bytes_per_round"]), "kv_B_token": _blank(r["handoff_kv_bytes_per_committed_token"]),
        "tree_B_round": r["tree_bytes_per_round"], "passes_per_token": r["verifier_passes_per_output_token"],
        "draft_ms_round": r["drafter_ms_per_round"], "output_tokens": r["output_tokens"],
        "pd_win_share": r["pd_win_share"] if r.get("pd_passes") else "",
    }


def _ci(interval: list[float], digits: int = 2) -> str:
    return f"{interval[0]:.{digits}f}-{interval[1]:.{digits}f}"


def _workload_lines(settings: dict[str, Any], results: dict[str, dict]) -> list[str]:
    """The workload's statistics, MAT per category and the paired MAT differences, with their
    question-level bootstrap intervals."""
    w, paired = settings.get("workload"), settings.get("paired_mat") or {}
    if not w:
        return []
    text = w["reference_text"]
    md = ["## Workload and confidence intervals", "",
          f"{w['schema']}{' from ' + w['source'] if w['source'] else ''}: {w['questions']} questions, {w['prompts']} "
          f"prompts ({w['second_turns']} second turns, each asked after the verifier's own first answer); categories "
          + ", ".join(f"{c} {n}" for c, n in w["categories"].items()) + f". The verifier's reference texts: "
          f"{text['tokens']} tokens, {text['distinct_tokens']} distinct, the most frequent {100 * text['top_share']:.1f}%.",
          "",
          f"Intervals: 95%, question-level bootstrap ({settings['check']['bootstrap_resamples']:,} resamples; a "
          "question's turns resampled together; MAT recomputed from the resampled questions' totals).", ""]
    if paired.get("vs_baseline"):
        md += [f"MAT against {paired['baseline']} on the same questions (paired):", "",
               markdown_table([{"config": n, "mat_vs_baseline_percent": round(v["percent"], 2),
                                "ci95_percent": _ci(v["ci_percent"], 1), "questions": v["clusters"]}
                               for n, v in paired["vs_baseline"].items()],
                              ["config", "mat_vs_baseline_percent", "ci95_percent", "questions"])]
    if paired.get("pairs"):
        md += ["Deployed against float drafters, and the phone's MTP head against the server's (paired):", "",
               markdown_table([{"config": v["config"], "against": v["against"], "mat_percent": round(v["percent"], 2),
                                "ci95_percent": _ci(v["ci_percent"], 1), "questions": v["clusters"]}
                               for v in paired["pairs"]], ["config", "against", "mat_percent", "ci95_percent", "questions"])]
    categories = list(next(iter(results.values()))["by_category"]) if results else []
    if len(categories) > 1:
        rows = [{"category": c, "questions": next(iter(results.values()))["by_category"][c]["questions"],
                 **{n: _mat_with_ci(r["by_category"][c]) for n, r in results.items()}}
                for c in categories]
        md += ["MAT per category (95% interval; none for a category of one question):", "",
               markdown_table(rows, ["category", "questions", *results])]
    return md


def _mat_with_ci(figures: dict) -> str:
    mat = f"{figures['mat']:.2f}"
    return f"{mat} ({_ci(figures['mat_ci'])})" if figures["questions"] > 1 else mat


def _blank(value):
    return "" if value is None else value


def _plot(path: Path, results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(names, [results[n]["mat"] for n in names], color="tab:blue")
    axes[0].set_title("MAT (tokens per round)")
    axes[0].tick_params(axis="x", rotation=30)
    for n in names:
        chain = results[n]["chain_acceptance_cumulative"]
        if chain:
            axes[1].plot(range(1, len(chain) + 1), chain, marker="o", label=n)
    axes[1].set_title("chain acceptance, cumulative per depth")
    axes[1].set_xlabel("depth k")
    axes[1].set_xticks(range(1, 1 + max((len(results[n]["chain_acceptance_cumulative"]) for n in names), default=1)))
    axes[1].set_ylim(0, 1)
    if axes[1].lines:
        axes[1].legend()
    bottom = [0.0] * len(names)
    for source, color in (("chain", "tab:green"), ("sibling", "tab:orange"), ("slm", "tab:purple")):
        values = [results[n]["accepted_share_by_source"][source] for n in names]
        axes[2].bar(names, values, bottom=bottom, label=source, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[2].set_title("accepted tokens by source")
    axes[2].tick_params(axis="x", rotation=30)
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})  # no version string: same bytes anywhere
    plt.close(fig)
