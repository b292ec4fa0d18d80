"""report.json, report.md and check.png: every configuration side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyco.artifacts import markdown_table, write_json

# Paper, Table 2 (SB-480, real models): for orientation beside the fixture's figures.
PAPER_MAT = {"cloud-mtp": 3.05, "specedge": 3.53, "specedge-eps": 4.13, "hyco": 4.71, "hyco-2p": 5.27, "hyco-exact": 3.84}

COLUMNS = ["config", "label", "rule", "mat", "paper_mat", "chain_k1", "chain_kK", "share_chain", "share_sibling",
           "share_slm", "bonus_outside_keep", "handoff_B_round", "kv_B_token", "tree_B_round",
           "passes_per_token", "draft_ms_round", "output_tokens"]


def write_report(out: Path, results: dict[str, dict], settings: dict[str, Any]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": settings, "configs": results, "paper_mat_sb480": PAPER_MAT}
    write_json(out / "report.json", report)
    rows = [_row(name, r) for name, r in results.items()]
    md = ["# Check: hybrid drafting against the reference verifier", "",
          f"{settings['prompts']} prompts (mean {settings['prompt_tokens_mean']:.0f} tokens), up to "
          f"{settings['check']['max_new_tokens']} new tokens each; temperature {settings['check']['temperature']}, "
          f"top-k {settings['check']['top_k']}, top-p {settings['check']['top_p']}; keep set "
          f"{settings['keep_set'] or 'none (full vocabulary)'} of {settings['vocab_size']}.", "",
          markdown_table(rows, COLUMNS),
          "MAT: tokens committed per round (accepted + bonus). chain_k1 / chain_kK: share of rounds whose first 1 / K "
          "chain tokens were all accepted. share_*: accepted tokens by source. Bytes: hand-off e+h per round, its "
          "K/V per committed token, and the tree message per round (8-bit wire). paper_mat: Table 2, SB-480, real models.",
          "", "![check](check.png)", ""]
    (out / "report.md").write_text("\n".join(md))
    _plot(out / "check.png", results)
    return {name: {"mat": r["mat"], "output_tokens": r["output_tokens"]} for name, r in results.items()}


def _row(name: str, r: dict) -> dict:
    chain = r["chain_acceptance_cumulative"]
    share = r["accepted_share_by_source"]
    return {
        "config": name, "label": r["label"], "rule": "exact" if r["epsilon"] >= 1 else f"eps={r['epsilon']:g}",
        "mat": r["mat"], "paper_mat": PAPER_MAT.get(name, ""), "chain_k1": chain[0] if chain else "",
        "chain_kK": chain[-1] if chain else "", "share_chain": share["chain"], "share_sibling": share["sibling"],
        "share_slm": share["slm"], "bonus_outside_keep": r["bonus_outside_keep_share"],
        "handoff_B_round": _blank(r["handoff_bytes_per_round"]), "kv_B_token": _blank(r["handoff_kv_bytes_per_committed_token"]),
        "tree_B_round": r["tree_bytes_per_round"], "passes_per_token": r["verifier_passes_per_output_token"],
        "draft_ms_round": r["drafter_ms_per_round"], "output_tokens": r["output_tokens"],
    }


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
    fig.savefig(path, dpi=100)
    plt.close(fig)
