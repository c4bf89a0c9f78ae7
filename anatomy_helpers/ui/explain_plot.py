"""The figure of an explained recording (prediction/explain.py): the course's timeline in its colours, with the bytes
the lifetime rules could not place drawn on top as "unclassified" and the allocator's reserved memory as a line."""

from __future__ import annotations

import numpy as np

from ..core.units import pick_unit
from ..prediction.explain import UNCLASSIFIED, Explained
from .plots import plot_timeline

#: Unclassified bytes: light grey, hatched, so that it never reads as one of the course's categories.
UNCLASSIFIED_COLOR = "#BBBBBB"
RESERVED_COLOR = "#000000"


def plot_explained(ex: Explained, title: str | None = None):
    """Stacked bytes per category over the recording's memory events (phases shaded, steps marked, as
    :func:`~anatomy_helpers.ui.plots.plot_timeline` draws a tracked step), the unclassified bytes on top, and the
    reserved bytes where the recording has them (a snapshot, a CUDA profile). Returns the Figure."""
    tl = ex.trace.timeline
    n = len(ex.trace.training_steps())
    fig = plot_timeline(ex.trace, annotate_peak=False, title=title or f"{ex.events.kind}: {n} steps explained")
    ax = fig.axes[0]
    top = max(int(tl.total.max()), int(tl.cuda_reserved.max()) if tl.cuda_reserved is not None else 0)
    unit, scale = pick_unit(tl.total.max())
    xs = np.arange(len(tl))
    classified = tl.bytes.sum(axis=1)
    if ex.unclassified.any():
        ax.fill_between(xs, classified / scale, tl.total / scale, step="post", facecolor=UNCLASSIFIED_COLOR,
                        hatch="//", edgecolor="#888888", linewidth=0, label=UNCLASSIFIED)  # fmt: skip
    if tl.cuda_reserved is not None:
        ax.step(xs, tl.cuda_reserved / scale, where="post", color=RESERVED_COLOR, linewidth=0.9, label="reserved")
        ax.set_ylabel(f"memory ({unit}): tensors stacked, reserved as a line")
    ax.set_ylim(0, top / scale * 1.18)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="category", title_fontsize=8)
    return fig
