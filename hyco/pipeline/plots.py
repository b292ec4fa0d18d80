"""What the stages' PNGs share: a figure built without pyplot, axis labels that say which way is
better, legends kept off the data, and a save that writes the same bytes on any machine.

A figure made here holds no pyplot state, so a test can inspect the Figure a plotting function
returns and nothing has to be closed. matplotlib is imported on first use: importing a stage
does not pay for it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

HIGHER = "higher"
LOWER = "lower"


def new_figure(width: float, height: float) -> Figure:
    """A figure with constrained layout, which also makes room for legends placed outside an axes."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def better(label: str, direction: str) -> str:
    """An axis label with, on a line of its own, the direction that is better."""
    return f"{label}\n({direction} is better)"


def legend_outside(ax: Axes, **kwargs) -> None:
    """The legend to the right of the axes, where it can cover no data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, **kwargs)


def number(value) -> float:
    """A report's figure as a float: None (not measured) becomes NaN, which matplotlib leaves undrawn."""
    return math.nan if value is None else float(value)


def measured(value: float) -> bool:
    return not math.isnan(value)


def save(fig: Figure, path: Path, dpi: int = 110) -> None:
    # no Software entry (matplotlib's version): the same figure gives the same bytes on any machine
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
