"""Slider panels and progress bars for the notebooks.

Pattern used in every notebook (nbval compares the stored output of every cell): first call the plain
function with its defaults in its own cell (stable output nbval can compare),
then build the panel with :func:`slider_panel` in a cell marked NBVAL_IGNORE_OUTPUT. The panel opens with its
controls and a one-line hint, not a second copy of the plain call's output: it measures and draws only when a
control moves, so each figure appears once.
"""

from __future__ import annotations

import hashlib
import html
import inspect
import json
import sys
from collections.abc import Callable, Iterable, Iterator

import ipywidgets as w
import numpy as np

from ..core.units import MiB
from ..training.train import make_model, make_optimizer, track_steps
from .plots import plot_timeline


def slider_panel(fn: Callable, **controls) -> w.interactive:
    """``ipywidgets.interactive(fn, ...)`` that runs ``fn`` only when a control moves (a slider when released).

    Each control is a widget, or a tuple ``(min, max, step)`` for an integer slider,
    or a list of choices for a dropdown. Controls start at ``fn``'s defaults, so the
    panel opens where the plain call in the cell above left off; parameters without a control keep
    their defaults. Returns the widget (display it as the cell's value).

    The panel opens without calling ``fn``: under its controls a one-line hint (:data:`HINT_TEXT`) says that these
    settings are the ones the plain call above measured, and that moving a control measures another. The first move
    hides the hint for good and runs ``fn``; so does every later one (moving back to the defaults too). So a
    lesson shows each figure once, where ``interactive`` alone would draw the plain call's output a second time.

    While ``fn`` runs, a line under the controls says the panel is measuring (hidden again, taking no room, when
    it is done). Each control's label is as wide as its text (ipywidgets' default 80 px cuts "micro batches" to
    "micro bat…"),
    and the controls wrap in rows above the output, so a panel of ten controls stays short enough to show with its
    figure in a 900 px high window.
    """
    params = inspect.signature(fn).parameters
    built = {}
    for name, spec in controls.items():
        if name not in params:
            raise ValueError(f"control {name!r} is not a parameter of {fn.__name__}{inspect.signature(fn)}")
        default = params[name].default
        label = name.replace("_", " ")
        if isinstance(spec, w.Widget):
            if getattr(getattr(spec, "style", None), "description_width", None) == "":  # not chosen by the caller
                spec.style.description_width = LABEL_STYLE["description_width"]
            built[name] = spec
        elif isinstance(spec, tuple) and len(spec) == 3:
            lo, hi, step = spec
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in spec) or step <= 0 or lo > hi:
                raise ValueError(
                    f"control {name!r}: a slider is (min, max, step) with whole numbers, min <= max and step > 0, "
                    f"got {spec!r}"
                )
            value = default if isinstance(default, int) and lo <= default <= hi else lo
            built[name] = w.IntSlider(
                value=value, min=lo, max=hi, step=step, description=label, continuous_update=False, style=LABEL_STYLE
            )
        elif isinstance(spec, list):
            if not spec:
                raise ValueError(f"control {name!r}: a dropdown needs at least one choice, got an empty list")
            built[name] = w.Dropdown(
                options=spec, value=default if default in spec else spec[0], description=label, style=LABEL_STYLE
            )
        else:
            raise ValueError(f"control {name!r}: expected a widget, a (min, max, step) tuple or a list, got {spec!r}")
    for name, p in params.items():
        if name not in built and p.default is not inspect.Parameter.empty:
            built[name] = w.fixed(p.default)

    labels = {name: built[name].description or name.replace("_", " ") for name in controls}
    status = w.HTML(STATUS_TEXT, layout=w.Layout(display="none", width="100%"))  # shown only while it measures
    status.add_class(STATUS_CLASS)
    hint = w.HTML(HINT_TEXT, layout=w.Layout(width="100%"))  # shown until the first move
    hint.add_class(HINT_CLASS)
    opened = []  # empty until interactive's own first call, the one it makes as it is built

    def measured(**kwargs):
        if not opened:  # the panel opening at fn's defaults: the plain call above shows that figure already
            opened.append(True)
            return None  # nothing for interactive to display
        hint.layout.display = "none"  # a control moved: from now on the output is this panel's own
        status.layout.display = ""  # a widget update reaches the page at once, while fn still runs
        try:
            figure = fn(**kwargs)
        finally:
            status.layout.display = "none"  # hidden again: it takes no room under the controls
        used = {labels[k]: v for k, v in getattr(figure, "panel_used", {}).items() if k in labels}
        _show_digest(fn.__name__, figure, used)
        return figure

    measured.__name__ = measured.__qualname__ = fn.__name__
    measured.__signature__ = inspect.signature(fn)
    # auto_display: show fn's return value (a Figure) under the controls, as `interact` does;
    # a bare `interactive` would only show what fn prints.
    panel = w.interactive(measured, {"auto_display": True}, **built)
    # controls side by side, wrapping at the notebook's width; the output on a row of its own below them
    panel.layout = w.Layout(flex_flow="row wrap", align_items="center")
    panel.out.layout.width = "100%"
    # the hint and the status line between the controls and the output
    panel.children = (*panel.children[:-1], hint, status, panel.children[-1])
    return panel


#: What a panel shows while it measures (a new setting's dry run can take seconds: lesson 09's 15-25 s), and its
#: CSS class (the browser test finds it by it).
STATUS_TEXT = "<i>measuring with the new setting&hellip; (a setting already measured comes back at once)</i>"
STATUS_CLASS = "anatomy-panel-status"

#: What a panel shows when it opens, until a control moves (it opens at the plain call's settings, so it does not
#: draw that figure again), and its CSS class (the browser test checks it).
HINT_TEXT = "<i>These are the settings measured above; move a control to measure another setting.</i>"
HINT_CLASS = "anatomy-panel-hint"


#: Widget labels as wide as their text (ipywidgets' own default is a fixed 80 px that truncates longer names).
LABEL_STYLE = {"description_width": "initial"}


#: The CSS class of the hidden element a panel writes after each run (scripts/browser_check.py reads it).
DIGEST_CLASS = "anatomy-panel-digest"


def figure_digest(figure) -> str:
    """A hash of what a figure draws: the data of its lines, bars, areas and images, not its text.

    A panel that re-measures draws other data when a control moves; one that ignores the control but echoes its
    value in a title or a printout keeps the same digest (the browser test tells them apart by it). Numbers a panel
    computed that its figure need not draw (a device's memory, off the scale of a small model's bars) count too:
    the figure's ``panel_numbers`` attribute (a sequence of numbers), where the panel sets one.
    """

    from matplotlib.collections import Collection  # drawn on first use: rank processes never draw
    from matplotlib.image import AxesImage  # drawn on first use: rank processes never draw
    from matplotlib.lines import Line2D  # drawn on first use: rank processes never draw
    from matplotlib.patches import Patch  # drawn on first use: rank processes never draw

    h = hashlib.sha256()
    h.update(np.asarray(getattr(figure, "panel_numbers", ()), dtype=float).tobytes())
    for ax in getattr(figure, "axes", []):
        for artist in ax.get_children():
            if isinstance(artist, Line2D):
                data = [artist.get_xydata()]
            elif isinstance(artist, Patch) and artist is not ax.patch:
                data = [artist.get_path().vertices, artist.get_patch_transform().get_matrix()]
            elif isinstance(artist, Collection):
                data = [p.vertices for p in artist.get_paths()] + [artist.get_offsets()]
            elif isinstance(artist, AxesImage):
                data = [artist.get_array()]
            else:
                continue
            for a in data:
                h.update(np.round(np.asarray(a, dtype=float), 6).tobytes())
    return h.hexdigest()[:16]


def digest_html(name: str, figure, used: dict | None = None) -> str:
    """The hidden element a panel writes after each run: its name, :func:`figure_digest`, and the values it used
    (``{control label: value}``, from the figure's ``panel_used``: what the panel computed with, read from what it
    built, so a panel that silently changes a setting, e.g. clamps a sequence length, reports the changed value;
    the browser test checks each against its control's)."""
    values = html.escape(json.dumps({k: str(v) for k, v in (used or {}).items()}), quote=True)
    return (
        f'<span class="{DIGEST_CLASS}" data-panel="{name}" data-digest="{figure_digest(figure)}" '
        f'data-used="{values}" hidden></span>'
    )


def _show_digest(name: str, figure, used: dict | None = None) -> None:
    """Display :func:`digest_html` (only inside a kernel)."""
    if not _in_kernel():
        return
    from IPython.display import HTML, display  # a notebook's display: not on import

    display(HTML(digest_html(name, figure, used)))


def _in_kernel() -> bool:
    """Whether we run inside a Jupyter kernel (which can show widgets), not merely with ipykernel imported."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def progress(iterable: Iterable, total: int | None = None, desc: str = "") -> Iterator:
    """Yield from ``iterable`` with a progress bar (a widget in Jupyter, a line on stderr elsewhere)."""
    items = list(iterable) if total is None else iterable
    total = len(items) if total is None else total
    in_notebook = _in_kernel()
    bar = None
    if in_notebook:
        from IPython.display import display  # a notebook's display: not on import

        bar = w.IntProgress(min=0, max=total, description=desc)
        display(bar)
    for i, item in enumerate(items, 1):
        yield item
        if bar is not None:
            bar.value = i
        else:
            print(f"\r{desc} {i}/{total}", end="" if i < total else "\n", file=sys.stderr, flush=True)
    if bar is not None:
        bar.bar_style = "success"


def track_and_plot(
    batch_size: int = 8, seq_len: int = 128, n_layer: int = 4, optimizer: str = "adamw", steps: int = 2, device=None
):
    """Track ``steps`` steps of a fresh default-width model and plot them; prints the peak.

    The function behind notebook 00's slider panel. Returns the timeline Figure.
    """
    model = make_model(device=device, seq_len=seq_len, n_layer=n_layer)
    trace = track_steps(model, make_optimizer(model, optimizer), steps=steps, batch_size=batch_size)
    pk = trace.peak()
    print(
        f"batch {batch_size} x seq {seq_len}, {n_layer} layers, {optimizer}: peak {pk.bytes / MiB:.2f} MiB "
        f"(activations {pk.breakdown['activations'] / MiB:.2f} MiB) at step {pk.step}, {pk.phase}, in {pk.module}"
    )
    return plot_timeline(trace, title=f"batch {batch_size}, seq_len {seq_len}, {n_layer} layers, {optimizer}")
