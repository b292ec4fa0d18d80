"""report.json, summary.md and check.png: every configuration side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyco.runtime_check.costs import INPUTS, plot_figure1
from hyco.runtime_check.costs import markdown as costs_markdown

from hyco.base.files import write_json
from hyco.pipeline import verdict
from hyco.pipeline.artifacts import StageEnd, finish_stage, markdown_table

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
        report, summary_markdown, summary, plots=plots, nondeterministic=varies, verdict=verdict_lines(report),
        verdict_varies="the server's measured pass times (Delta-g, tok/s)" if costs is not None else ""),
        allow_parity_failure=False)


HEADLINE, BASELINE = "hyco", "cloud-mtp"


def verdict_lines(report: dict[str, Any]) -> list[verdict.Line]:
    """Lossless where it must be, the headline MAT against Cloud+MTP with their intervals, and
    whether HyCo pays off: its Delta-g and delivery speed with the sources of their times."""
    lossless, results, workload = report["lossless"], report["configs"], report["settings"].get("workload")
    equal = [n for n, v in lossless.items() if v["equal"]]
    first = next(iter(lossless.values()), {})
    lines = [verdict.proof("lossless: exact configurations commit the verifier's own text", len(equal) == len(lossless)
                           if lossless else None,
                           f"{len(equal)}/{len(lossless)} configurations, {first.get('tokens_compared')} tokens each "
                           f"({first.get('distinct_tokens')} distinct)", "every token equal",
                           off="no exact configuration in check.configs")]
    if HEADLINE in results and BASELINE in results:
        lines.append(mat_line(results, workload))
    costs = report.get("costs")
    if costs and HEADLINE in costs["rows"]:
        lines.append(payoff_line(costs))
    return lines


def mat_line(results: dict[str, Any], workload: dict[str, Any] | None) -> verdict.Line:
    """The headline MATs with their intervals, and the text they were measured on."""
    figure = f"{_mat(results[HEADLINE])} vs {_mat(results[BASELINE])}"
    text = (workload or {}).get("reference_text")
    if not text:
        return verdict.Line("MAT, HyCo vs Cloud+MTP (95% CI)", verdict.INFO, figure)
    figure += (f"; {workload['prompts']} prompts ({workload['schema']}); reference text {text['tokens']} tokens, "
               f"{text['distinct_tokens']} distinct, the most frequent {verdict.percent(text['top_share'])}")
    if text["degenerate"]:
        figure += "; degenerate text (one token over half of it, or under 20 distinct): these MATs measure little"
    return verdict.Line("MAT, HyCo vs Cloud+MTP (95% CI)", verdict.WARN if text["degenerate"] else verdict.INFO, figure)


def _mat(r: dict[str, Any]) -> str:
    ci = r.get("mat_ci") or {}
    low, high = (ci.get("ci") or (None, None))
    return f"{r['mat']:.2f}" + (f" [{low:.2f}-{high:.2f}]" if low is not None else "")


def payoff_line(costs: dict[str, Any]) -> verdict.Line:
    """Table 2's question in one line: does HyCo cut the server's time per token, at what speed."""
    rows, reference = costs["rows"], costs["reference"]
    hyco, base, alone = rows[HEADLINE], rows.get(reference, {}), rows.get("slm-alone", {})
    dg = hyco.get("delta_g_percent")
    word = "n/a" if dg is None else "yes" if dg < 0 else "no"
    figure = (f"{word}: Delta-g {dg:+.1f}% against {base.get('label', reference)} (g {hyco['g_ms']:.2f} vs "
              f"{base.get('g_ms', float('nan')):.2f} ms per token)" if dg is not None else "n/a: no reference g")
    if hyco.get("tok_s") is not None:
        figure += f", {hyco['tok_s']:.1f} tok/s" + (f" vs the SLM alone's {alone['tok_s']:.1f}" if alone.get("tok_s") else "")
    sources = costs["sources"]
    where = "server timed on this CPU, not a server GPU" if costs["server_on_cpu"] else f"server: {sources['server']}"
    figure += f" ({where}; phone: {sources.get('phone tree', 'n/a').split(',')[0]})"
    return verdict.Line("pays off: server time per token (Table 2)", verdict.INFO, figure, "Delta-g < 0")


def summary_markdown(report: dict[str, Any]) -> str:
    settings, results, lossless = report["settings"], report["configs"], report["lossless"]
    rows = [_row(name, r) for name, r in results.items()]
    epsilon = settings["check"]["epsilon"]
    md = ["# Check: hybrid drafting against the reference verifier", "",
          f"{settings['prompts']} prompts (mean {settings['prompt_tokens_mean']:.0f} tokens), up to "
          f"{settings['check']['max_new_tokens']} new tokens each; temperature {settings['check']['temperature']}, "
          f"top-k {settings['check']['top_k']}, top-p {settings['check']['top_p']}; keep set "
          f"{settings['keep_set'] or 'none (full vocabulary)'} of {settings['vocab_size']}.", "",
          *(costs_markdown(report["costs"]) + ["![Figure 1](figure1.png)", ""] if "costs" in report else []),
          "## Acceptance per configuration", "", "![check](check.png)", "",
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
                          for n in results if n in PAPER_MAT], ["config", "label", "paper_mat"])]
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
          f"prompts ({w['second_turns']} second turns, each asked after the verifier's own first answer); "
          + (f"questions: {w['selection']}; " if w.get("selection") else "") + "categories "
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
    from hyco.pipeline.plots import save

    save(check_figure(results), path, dpi=100)


ROWS_AT_LEAST = 6  # a check of one or two configurations keeps bars of the usual thickness


def check_figure(results: dict[str, dict]):
    """check.png: MAT with its 95% interval, where the accepted draft tokens came from, and MTP chain
    acceptance per depth. One horizontal bar per configuration, so a dozen names stay legible."""
    from hyco.pipeline.plots import new_figure

    names = list(results)
    # the height grows with the configurations, a row of bars each
    fig = new_figure(16, 2.0 + 0.34 * max(len(names), ROWS_AT_LEAST))
    mat_ax, source_ax, chain_ax = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.3, 1, 1]})
    _mat_bars(mat_ax, names, results)
    source_ax.sharey(mat_ax)
    _source_bars(source_ax, names, results)
    _chain_lines(chain_ax, names, results)
    return fig


def _mat_bars(ax, names: list[str], results: dict[str, dict]) -> None:
    from hyco.pipeline.plots import HIGHER, better, measured, number

    mats = [number(results[n].get("mat")) for n in names]
    intervals = [_mat_interval(results[n]) for n in names]
    rows = range(len(names))
    ax.barh(rows, mats, color="tab:blue", height=0.6)
    # configurations without an interval (a check of one question) get a bar and no whisker
    whiskered = [i for i in rows if intervals[i] and measured(mats[i])]
    if whiskered:
        below = [max(mats[i] - intervals[i][0], 0.0) for i in whiskered]
        above = [max(intervals[i][1] - mats[i], 0.0) for i in whiskered]
        ax.errorbar([mats[i] for i in whiskered], whiskered, xerr=[below, above], fmt="none", ecolor="black",
                    capsize=3, lw=1)
    ends = [max([m, *(ci or [])]) if measured(m) else 0.0 for m, ci in zip(mats, intervals, strict=True)]
    for i in rows:
        ax.text(ends[i], i, f" {mats[i]:.2f}" if measured(mats[i]) else " not measured", va="center", fontsize=8)
    # one token a round is what decoding without a drafter commits
    ax.axvline(1.0, color="0.5", ls=":", lw=1)
    ax.set_xlim(0, 1.18 * max([1.0, *ends]))  # room for the value after the longest whisker
    ax.set_yticks(list(rows), names)
    ax.set_ylim(max(len(names), ROWS_AT_LEAST) - 0.5, -0.5)  # the first configuration at the top
    ax.set_xlabel(better("MAT: tokens committed per verifier round", HIGHER)
                  + "\nwhiskers: 95% interval; dotted line: 1 token a round (no drafting)")
    ax.set_ylabel("configuration")
    ax.set_title("MAT per configuration", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _mat_interval(r: dict) -> tuple[float, float] | None:
    ci = (r.get("mat_ci") or {}).get("ci")
    if not ci or any(v is None for v in ci):
        return None
    return float(ci[0]), float(ci[1])


SOURCES = {"chain": ("tab:green", "MTP chain"), "sibling": ("tab:orange", "chain siblings"),
           "slm": ("tab:purple", "SLM")}


def _source_bars(ax, names: list[str], results: dict[str, dict]) -> None:
    from hyco.pipeline.plots import legend_outside, measured, number

    rows = range(len(names))
    left = [0.0] * len(names)
    for source, (color, label) in SOURCES.items():
        values = [100 * number((results[n].get("accepted_share_by_source") or {}).get(source)) for n in names]
        ax.barh(rows, values, left=left, height=0.6, color=color, label=label)
        left = [a + (v if measured(v) else 0.0) for a, v in zip(left, values, strict=True)]
    for i, total in enumerate(left):
        if total == 0:  # the SLM alone, or a run that accepted nothing: no bar to read
            ax.text(2, i, "no accepted draft tokens", va="center", fontsize=8, color="0.4")
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the accepted draft tokens (%)")
    ax.set_ylabel("configuration")
    ax.set_title("Drafter of each accepted token", fontsize=10)
    if names:  # an empty bar set has no colour for the legend to show
        legend_outside(ax)


def _chain_lines(ax, names: list[str], results: dict[str, dict]) -> None:
    from hyco.pipeline.plots import HIGHER, better, legend_outside, number

    markers = "osD^v<>ph*"
    depth = 1
    for i, n in enumerate(names):
        chain = results[n].get("chain_acceptance_cumulative") or []
        if chain:
            depth = max(depth, len(chain))
            # configurations with the same curve (a drafter and its float twin) stay told apart by marker
            ax.plot(range(1, len(chain) + 1), [100 * number(v) for v in chain], marker=markers[i % len(markers)],
                    ms=5, lw=1.2, label=n)
    if not ax.lines:
        ax.text(0.5, 0.5, "no configuration drafts an MTP chain", ha="center", va="center",
                transform=ax.transAxes, color="0.4")
    ax.set_xticks(range(1, depth + 1))
    ax.set_xlim(0.7, depth + 0.3)
    ax.set_ylim(0, 105)
    ax.set_xlabel("chain depth k (draft tokens along the MTP chain)")
    ax.set_ylabel(better("rounds accepting chain tokens 1..k (%)", HIGHER))
    ax.set_title("MTP chain acceptance by depth", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:
        legend_outside(ax)
