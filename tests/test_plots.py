"""The stages' figures, built from small reports: every axis labelled, the direction that is better
said where there is one, legends beside the data rather than over it, and each figure still drawn
when values are missing. The figures are inspected as matplotlib objects, not as pixels."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hyco.calibrate.evaluate import sqnr_figure
from hyco.convert.stage import parity_figure
from hyco.qat.stage import agreement_figure, loss_figure
from hyco.runtime_check.report import _plot, check_figure
from hyco.vocab.coverage import comparison_sizes, coverage_figure, outside_share_curve
from matplotlib.collections import LineCollection
from matplotlib.container import BarContainer, ErrorbarContainer

from hyco.fixtures.stage import bits_figure, plot_bits


def texts(fig) -> list[str]:
    """Every text drawn in the figure: titles, labels, annotations, tick labels, legend entries."""
    fig.draw_without_rendering()
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]


def labelled(ax) -> bool:
    return bool(ax.get_xlabel().strip()) and bool(ax.get_ylabel().strip())


def legend_beside(ax) -> bool:
    """The axes' legend lies wholly to the right of its data area."""
    ax.figure.draw_without_rendering()
    return ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1


def config(name: str, mat: float | None, ci: list | None, chain: list[float], shares=(0.7, 0.1, 0.2)) -> dict:
    return {"label": name, "mat": mat, "mat_ci": None if ci is None else {"value": mat, "ci": ci},
            "chain_acceptance_cumulative": chain,
            "accepted_share_by_source": dict(zip(("chain", "sibling", "slm"), shares, strict=True))}


def twelve_configs() -> dict[str, dict]:
    results = {f"config-{i}": config(f"C{i}", 2.0 + 0.3 * i, [1.8 + 0.3 * i, 2.3 + 0.3 * i], [0.9, 0.7, 0.5])
               for i in range(11)}
    results["slm-alone"] = config("SLM alone", 1.0, None, [], shares=(0.0, 0.0, 0.0))
    return results


def test_check_figure_draws_mat_as_horizontal_bars_with_their_intervals():
    results = twelve_configs()
    fig = check_figure(results)
    mat_ax, source_ax, chain_ax = fig.axes
    bars = [c for c in mat_ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == 1 and bars[0].orientation == "horizontal" and len(bars[0]) == 12
    whiskers = [c for c in mat_ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(whiskers) == 1
    segments = [s for line in whiskers[0].lines[2] if isinstance(line, LineCollection) for s in line.get_segments()]
    assert len(segments) == 11  # one per configuration with an interval; slm-alone has none
    lo, hi = segments[0][:, 0]
    assert (lo, hi) == pytest.approx((1.8, 2.3))
    assert [t.get_text() for t in mat_ax.get_yticklabels()] == list(results)
    assert "higher is better" in mat_ax.get_xlabel()
    assert all(labelled(ax) for ax in (mat_ax, source_ax, chain_ax))
    assert "higher is better" in chain_ax.get_ylabel()
    assert all(c.orientation == "horizontal" for c in source_ax.containers)
    assert legend_beside(source_ax) and legend_beside(chain_ax)
    assert all(ax.get_title() for ax in fig.axes)


def test_check_figure_draws_one_configuration_without_an_interval_or_a_mat():
    fig = check_figure({"hyco": config("HyCo", None, None, [0.9, 0.8])})
    mat_ax, _, chain_ax = fig.axes
    assert not any(isinstance(c, ErrorbarContainer) for c in mat_ax.containers)
    assert [t.get_text().strip() for t in mat_ax.texts] == ["not measured"]
    assert len(chain_ax.lines) == 1
    fig = check_figure({"slm-alone": config("SLM alone", 1.0, [1.0, 1.0], [], shares=(0.0, 0.0, 0.0))})
    assert "no configuration drafts an MTP chain" in texts(fig)


def test_check_png_is_written_with_the_same_bytes_twice(tmp_path):
    results = twelve_configs()
    _plot(tmp_path / "a.png", results)
    _plot(tmp_path / "b.png", results)
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def coverage_inputs(n_always: int):
    """A 4,096-token vocabulary whose held-out counts fall with the frequency order."""
    vocab = 4096
    counts = np.arange(vocab, 0, -1).astype(np.int64)
    sizes, share = outside_share_curve(counts, counts.copy(), np.arange(n_always))
    marks = comparison_sizes((21_000, 45_000, 86_089), vocab, 262_144, n_always)
    for m in marks:
        m["outside_share"] = float(share[m["size"] - int(sizes[0])])
    return sizes, share, marks


def test_coverage_figure_labels_the_paper_sizes_as_this_vocabulary_has_them():
    sizes, share, marks = coverage_inputs(n_always=300)
    fig = coverage_figure(sizes, share, marks, 1000, "coverage")
    ax = fig.axes[0]
    notes = [t.get_text() for t in ax.texts]
    assert any(n.startswith("328 (paper's 21K, scaled)") for n in notes)
    assert any(n.startswith("1,345 (paper's 86K, scaled)") for n in notes)
    assert any(n.startswith("4,096 (full vocabulary)") for n in notes)
    # "86K" only as the paper's size, never as if it were a size of this vocabulary
    assert all("paper's 86K" in t for t in texts(fig) if "86K" in t)
    assert "4,096" in ax.get_xlabel() and "tokens" in ax.get_xlabel()
    assert "outside the keep set (%)" in ax.get_ylabel() and "lower is better" in ax.get_ylabel()
    assert any("1,000" in t for t in texts(fig))  # the requested size, in the legend


def test_coverage_figure_notes_a_scaled_size_raised_to_the_always_kept_set():
    sizes, share, marks = coverage_inputs(n_always=409)
    notes = [t.get_text() for t in coverage_figure(sizes, share, marks, 409, "coverage").axes[0].texts]
    assert any(n.startswith("409 (paper's 21K, scaled)\nraised to the always-kept set") for n in notes)


def graph(sqnr: dict | None) -> dict:
    return {"fidelity_floor": {"min_sqnr_db": 20.0}, **({} if sqnr is None else {"sqnr_db": sqnr})}


def test_sqnr_figure_marks_the_floor_and_skips_a_graph_without_layers():
    fig = sqnr_figure({"tree.qdq.onnx": graph({"layer 0": 40.0, "layer 1": None, "layer 2": 33.0}),
                       "prefill.qdq.onnx": graph(None)})
    ax = fig.axes[0]
    assert labelled(ax) and "dB" in ax.get_ylabel() and "higher is better" in ax.get_ylabel()
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["tree.qdq.onnx", "fidelity floor (20 dB)"]
    assert math.isnan(ax.lines[0].get_ydata()[1])
    assert legend_beside(ax)
    assert "no per-layer SQNR measured" in texts(sqnr_figure({}))


def test_loss_figure_says_lower_is_better_and_smooths_a_long_run():
    history = [{"step": i, "loss": 0.06 - 0.001 * i} for i in range(30)]
    history[5]["loss"] = None
    ax = loss_figure(history).axes[0]
    assert labelled(ax) and "lower is better" in ax.get_ylabel() and "nats" in ax.get_ylabel()
    assert [line.get_label() for line in ax.lines] == ["per step", "mean of the last 3 steps"]
    assert "no training steps" in texts(loss_figure([]))


def test_agreement_figure_marks_a_missing_value_and_says_which_way_is_better():
    results = {"w4_ptq": {"top1_agreement": 0.79, "kl": 0.064, "positions": 768},
               "w4_qat": {"top1_agreement": 0.86, "kl": None, "positions": 768}}
    fig = agreement_figure(results, 4)
    top1_ax, kl_ax = fig.axes
    assert labelled(top1_ax) and labelled(kl_ax)
    assert "higher is better" in top1_ax.get_ylabel() and "lower is better" in kl_ax.get_ylabel()
    assert [t.get_text() for t in top1_ax.texts] == ["79.0%", "86.0%"]
    assert [t.get_text() for t in kl_ax.texts] == ["0.0640", "not measured"]
    assert "768 evaluation positions" in fig.get_suptitle()


def test_parity_figure_draws_each_compared_check_under_its_tolerance():
    parity = {"checks": {"tree": {"per_position_abs_diff": [2e-6, 0.0, 3e-6], "tolerance": 1e-4},
                         "stopped": {"passed": False}}}
    ax = parity_figure(parity).axes[0]
    assert labelled(ax) and "lower is better" in ax.get_ylabel() and ax.get_yscale() == "log"
    assert [line.get_label() for line in ax.lines] == ["tree (3 positions)", "tolerance (0.0001)"]
    assert ax.get_ylim()[1] > 1e-4  # the tolerance line inside the axes
    assert any("33x under the tolerance" in t.get_text() for t in ax.texts)
    assert legend_beside(ax)
    assert "no check compared a position" in texts(parity_figure({"checks": {}}))


def test_bits_figure_counts_each_width_and_still_draws_with_none(tmp_path):
    ax = bits_figure({"2": 714_752, "4": 653_312, "8": 34_816}).axes[0]
    assert labelled(ax)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["int2", "int4", "int8"]
    assert ax.texts[0].get_text() == "714,752 (51%)\n174 KiB packed"
    assert "no quantized weights" in texts(bits_figure({}))
    plot_bits({"4": 10}, tmp_path / "bits.png")
    assert (tmp_path / "bits.png").stat().st_size > 1000
