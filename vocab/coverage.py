"""Coverage of a keep set on held-out assistant tokens, as a number per size and as a curve.

For every size n the keep set is the one the same rule would build (always-kept tokens, then
the most frequent counted tokens), so one cumulative sum over the frequency order gives the
share of held-out assistant tokens a drafter restricted to n tokens could never propose.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hyco.data.keepset import frequency_order

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
    from hyco.pipeline.plots import save

    save(coverage_figure(sizes, share, marks, requested, title), path, dpi=100)


def coverage_figure(sizes: np.ndarray, share: np.ndarray, marks: list[dict], requested: int, title: str):
    """The outside share against the keep-set size, each comparison size marked with its size in
    this vocabulary (the paper's sizes scaled to it) and the requested size as a red point."""
    from hyco.pipeline.plots import LOWER, better, new_figure

    vocab_size = int(sizes[-1]) if len(sizes) else max([requested, *(m["size"] for m in marks)])
    fig = new_figure(7.0, 4.4)
    ax = fig.subplots()
    ax.plot(sizes, 100 * share, color="tab:blue", lw=1.5, label="held-out tokens outside the keep set")
    for m in marks:
        _mark(ax, m, vocab_size)
    outside = 100 * share_at(sizes, share, requested)
    ax.plot([requested], [outside], "o", color="tab:red", zorder=3,
            label=f"requested keep set: {requested:,} tokens, {outside:.1f}% outside")
    ax.set_xlim(0, vocab_size * 1.02)
    ax.set_ylim(0, 105)
    ax.set_xlabel(f"keep-set size (tokens, of a {vocab_size:,}-token vocabulary)")
    ax.set_ylabel(better("held-out tokens outside the keep set (%)", LOWER))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")  # the curve falls to the lower right, leaving this corner empty
    return fig


def mark_label(m: dict) -> str:
    """A comparison size as this vocabulary has it: "409 (paper's 21K, scaled)"; the full vocabulary as such."""
    if m["label"] == "full":
        return f"{m['size']:,} (full vocabulary)"
    paper = REFERENCE_LABELS.get(m["paper_size"], f"{m['paper_size']:,}")
    if m["size"] == m["paper_size"]:
        return f"{m['size']:,} (paper's {paper})"
    return f"{m['size']:,} (paper's {paper}, scaled)"


def _mark(ax, m: dict, vocab_size: int) -> None:
    x, y = m["size"], 100 * m["outside_share"]
    ax.axvline(x, color="0.6", lw=0.8, ls=":")
    ax.plot([x], [y], "o", color="0.3", ms=4)
    # a label sits right of its point, left of it in the last quarter and below it near the top, so
    # that it stays inside the axes; a white box keeps the curve from running through the text
    right_end, top = x > 0.75 * vocab_size, y > 80
    raised = "\nraised to the always-kept set" if m.get("note") else ""
    ax.annotate(f"{mark_label(m)}{raised}\n{y:.1f}% outside", (x, y), fontsize=7, textcoords="offset points",
                xytext=(-6 if right_end else 6, -6 if top else 8), ha="right" if right_end else "left",
                va="top" if top else "bottom",
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
