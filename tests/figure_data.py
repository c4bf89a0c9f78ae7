"""Reading back what a figure draws, for the tests that check a plot's data against the numbers it claims.

Each reader takes a matplotlib Axes and returns plain numbers in the axes' data units; a test multiplies by the
unit its axis label names (:func:`unit_bytes`) and compares with bytes it computed itself from the plot's input."""

from __future__ import annotations

import re

import numpy as np
from matplotlib.collections import PolyCollection

from anatomy_helpers.tracking.events import CATEGORIES

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def unit_bytes(label: str) -> int:
    """Bytes per axis unit of a label such as "live tensor memory (MiB)" (the first unit named in brackets)."""
    found = re.search(r"\((B|KiB|MiB|GiB)\b", label)
    if found is None:
        raise ValueError(f"no byte unit in brackets in the label {label!r}")
    return UNITS[found.group(1)]


def _edges(collection: PolyCollection) -> np.ndarray:
    """The polygon's non-vertical edges as rows (x0, y0, x1, y1)."""
    rows = []
    for path in collection.get_paths():
        v = np.asarray(path.vertices, dtype=float)
        rows.append(np.hstack([v[:-1], v[1:]]))
    e = np.vstack(rows)
    return e[e[:, 0] != e[:, 2]]


def bands(collection: PolyCollection, xs) -> tuple[np.ndarray, np.ndarray]:
    """(bottom, top) of a filled area (fill_between, one stackplot layer) on the vertical line at each of ``xs``:
    the lowest and highest y where the polygon's non-vertical edges cross it (x between two samples: a step's
    flat part)."""
    e = _edges(collection)
    lo, hi = np.minimum(e[:, 0], e[:, 2]), np.maximum(e[:, 0], e[:, 2])
    xs = np.asarray(xs, dtype=float)
    bottom, top = np.empty(len(xs)), np.empty(len(xs))
    for a in range(0, len(xs), 256):  # 256 verticals at a time against every edge
        x = xs[a : a + 256, None]
        crosses = (lo <= x) & (x <= hi)
        if not crosses.any(axis=1).all():
            raise ValueError(f"the area {collection.get_label()!r} does not reach every x of {xs[a : a + 256]}")
        y = e[:, 1] + (e[:, 3] - e[:, 1]) * (x - e[:, 0]) / (e[:, 2] - e[:, 0])
        bottom[a : a + 256] = np.where(crosses, y, np.inf).min(axis=1)
        top[a : a + 256] = np.where(crosses, y, -np.inf).max(axis=1)
    return bottom, top


def areas(ax) -> dict[str, PolyCollection]:
    """The axes' labelled filled areas (stacked categories, bands), by legend label."""
    return {c.get_label(): c for c in ax.collections if isinstance(c, PolyCollection) and not c.get_label()[:1] == "_"}


def step_heights(collection: PolyCollection, xs) -> np.ndarray:
    """The thickness of a step-drawn area (``step="post"``) over each interval ``xs[i]..xs[i+1]``: the value it
    draws for sample i (the last sample's value has no width, so it is not returned; strictly increasing ``xs``)."""
    xs = np.asarray(xs, dtype=float)
    if not (np.diff(xs) > 0).all():
        raise ValueError("step_heights needs strictly increasing xs")
    bottom, top = bands(collection, (xs[:-1] + xs[1:]) / 2)
    return top - bottom


def stacked_bytes(ax, xs) -> dict[str, np.ndarray]:
    """Each stacked layer's drawn value per sample (all but the last), in bytes, by label (the y label's unit)."""
    scale = unit_bytes(ax.get_ylabel())
    return {label: step_heights(c, xs) * scale for label, c in areas(ax).items()}


def bars(ax) -> list[tuple[float, float, float, float, str]]:
    """Every bar (a Rectangle patch) as (x, y, width, height, facecolor as hex)."""
    from matplotlib.colors import to_hex
    from matplotlib.patches import Rectangle

    return [
        (p.get_x(), p.get_y(), p.get_width(), p.get_height(), to_hex(p.get_facecolor()))
        for p in ax.patches
        if isinstance(p, Rectangle)
    ]


def line(ax, label: str):
    """The one line labelled ``label``."""
    found = [ln for ln in ax.get_lines() if ln.get_label() == label]
    if len(found) != 1:
        raise AssertionError(f"{len(found)} lines labelled {label!r}: {[ln.get_label() for ln in ax.get_lines()]}")
    return found[0]


def _straight_lines(ax, along: str) -> list[float]:
    """Where every axvline (``along="x"``: its x) or axhline (``"y"``: its y) of ``ax`` is: a two-point line at one
    value that spans the axes in the other direction."""
    out = []
    for ln in ax.get_lines():
        at, span = (ln.get_xdata(), ln.get_ydata()) if along == "x" else (ln.get_ydata(), ln.get_xdata())
        at = np.asarray(at, dtype=float)
        if len(at) == 2 and at[0] == at[1] and list(span) == [0, 1]:
            out.append(float(at[0]))
    return out


def vertical_lines(ax) -> list[float]:
    """The x of every axvline."""
    return _straight_lines(ax, "x")


def horizontal_lines(ax) -> list[float]:
    """The y of every axhline."""
    return _straight_lines(ax, "y")


def numbers_in(text: str) -> list[float]:
    """The numbers a label states, in order ("peak 1.2 MiB", "+1,024 B" -> [1.2], [1024])."""
    return [float(n.replace(",", "")) for n in re.findall(r"[-+]?\d[\d,]*(?:\.\d+)?", text)]


def assert_stack_is_the_trace(ax, trace, also=()):
    """Each category's layer draws that category's live bytes at every memory event (the trace's own arrays), and
    no layer draws anything else (but the areas labelled in ``also``)."""
    tl = trace.timeline
    drawn = stacked_bytes(ax, np.arange(len(tl)))
    expected = {c.replace("_", " "): tl.category(c)[:-1] for c in CATEGORIES if tl.category(c).any()}
    assert set(drawn) - set(also) == set(expected)
    for label, values in expected.items():
        np.testing.assert_allclose(drawn[label], values, rtol=1e-9, atol=1e-6, err_msg=label)
