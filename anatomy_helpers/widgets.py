"""Slider panels and progress bars for the notebooks.

Pattern used in every notebook (nbval compares the stored output of every cell): first call the plain
function with its defaults in its own cell (stable output nbval can compare),
then build the panel with :func:`slider_panel` in a cell marked NBVAL_IGNORE_OUTPUT.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Iterator

import ipywidgets as w

from .plots import plot_timeline
from .train import make_model, make_optimizer, track_steps
from .units import MiB


def slider_panel(fn: Callable, **controls) -> w.interactive:
    """``ipywidgets.interactive(fn, ...)`` that re-runs only when a slider is released.

    Each control is a widget, or a tuple ``(min, max, step)`` for an integer slider,
    or a list of choices for a dropdown. Controls start at ``fn``'s defaults, so the
    panel opens where the plain call left off; parameters without a control keep
    their defaults. Returns the widget (display it as the cell's value).
    """
    params = inspect.signature(fn).parameters
    built = {}
    for name, spec in controls.items():
        if name not in params:
            raise ValueError(f"control {name!r} is not a parameter of {fn.__name__}{inspect.signature(fn)}")
        default = params[name].default
        label = name.replace("_", " ")
        if isinstance(spec, w.Widget):
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
                value=value, min=lo, max=hi, step=step, description=label, continuous_update=False
            )
        elif isinstance(spec, list):
            if not spec:
                raise ValueError(f"control {name!r}: a dropdown needs at least one choice, got an empty list")
            built[name] = w.Dropdown(options=spec, value=default if default in spec else spec[0], description=label)
        else:
            raise ValueError(f"control {name!r}: expected a widget, a (min, max, step) tuple or a list, got {spec!r}")
    for name, p in params.items():
        if name not in built and p.default is not inspect.Parameter.empty:
            built[name] = w.fixed(p.default)
    # auto_display: show fn's return value (a Figure) under the controls, as `interact` does;
    # a bare `interactive` would only show what fn prints.
    return w.interactive(fn, {"auto_display": True}, **built)


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
        from IPython.display import display

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
