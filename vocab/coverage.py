"""Coverage of a keep set on held-out assistant tokens, as a number per size and as a curve.

For every size n the keep set is the one the same rule would build (always-kept tokens, then
the most frequent counted tokens), so one cumulative sum over the frequency order gives the
share of held-out assistant tokens a drafter restricted to n tokens could never propose.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hyco.keepset import frequency_order

REFERENCE_LABELS = {21_000: "21K", 45_000: "45K", 86_089: "86K"}


def outside_share_curve(counts: np.ndarray, heldout: np.ndarray, always_ids: np.ndarray,
                        last: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(sizes, outside share) for every keep-set size from the always-kept set to the full vocabulary."""
    total = heldout.sum()
    order = frequency_order(counts, last)
    others = order[~np.isin(order, always_ids)]
    covered = heldout[always_ids].sum() + np.concatenate([[0], np.cumsum(heldout[others])])
    sizes = len(always_ids) + np.arange(len(others) + 1)
    share = 1.0 - covered / total if total else np.zeros(len(sizes))
    return sizes, share


def comparison_sizes(paper_sizes: tuple[int, ...], vocab_size: int, reference_vocab: int, n_always: int) -> list[dict]:
    """The paper's sizes (21K, 45K, 86K of 262,144) scaled to this vocabulary, plus the full one.

    A scaled size below the always-kept set is raised to it (noted), since no keep set is smaller.
    """
    scale = min(1.0, vocab_size / reference_vocab)
    rows = []
    for s in paper_sizes:
        scaled = int(round(s * scale))
        label = REFERENCE_LABELS.get(s, str(s))
        if scale < 1.0:
            label += f" scaled x{scale:.4g}"
        row = {"label": label, "paper_size": s, "size": min(max(scaled, n_always), vocab_size)}
        if scaled < n_always:
            row["note"] = f"scaled size {scaled} is below the always-kept set; raised to {n_always}"
        rows.append(row)
    rows.append({"label": "full", "paper_size": reference_vocab, "size": vocab_size})
    return rows


def share_at(sizes: np.ndarray, share: np.ndarray, n: int) -> float:
    return float(share[int(n) - int(sizes[0])])


def plot_coverage(path: Path, sizes: np.ndarray, share: np.ndarray, marks: list[dict], requested: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.plot(sizes, 100 * share, color="tab:blue", lw=1.5, label="held-out assistant tokens outside the keep set")
    for m in marks:
        ax.axvline(m["size"], color="0.6", lw=0.8, ls=":")
        short = m["label"].split(" scaled")[0]  # the scale factor is in report.json
        ax.annotate(f"{short} ({m['size']})\n{100 * m['outside_share']:.2f}%", (m["size"], 100 * m["outside_share"]),
                    fontsize=7, xytext=(3, 6), textcoords="offset points")
    ax.plot([requested], [100 * share_at(sizes, share, requested)], "o", color="tab:red", label=f"requested N = {requested}")
    ax.set_xlabel("keep-set size (tokens)")
    ax.set_ylabel("outside the keep set (%)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 115)  # room for the labels above the curve
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    # No Software/date metadata: two runs must write the same bytes.
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
