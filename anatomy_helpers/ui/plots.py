"""Plots of a Trace. One colour per memory category in every notebook (Okabe-Ito, colour-blind safe).

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so no
global figure is left open; a returned figure shows itself as the cell's value.
"""

from __future__ import annotations

import io
import textwrap

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Annotation

from ..core.units import format_bytes, pick_unit
from ..tracking.events import CATEGORIES, NO_MODULE, PHASES
from ..tracking.trace import Trace

CATEGORY_COLORS = {
    "parameters": "#0072B2",  # blue
    "optimizer_state": "#009E73",  # bluish green
    "gradients": "#E69F00",  # orange
    "inputs": "#56B4E9",  # sky blue
    "activations": "#D55E00",  # vermillion
    "recomputed": "#F0E442",  # yellow: activations made again in backward (checkpointing)
    "temporaries": "#CC79A7",  # reddish purple
    "kernel_scratch": "#666666",  # dark grey: inside one kernel, no tensor (torch.profiler: "unknown")
    "communication": "#332288",  # indigo: buffers that exist only for collectives (buckets, all-gathers)
}
CATEGORY_LABELS = {c: c.replace("_", " ") for c in CATEGORIES}
#: The Okabe-Ito palette (black left out: the text's colour); strategies keep one colour in every plot of them.
OKABE_ITO = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
STRATEGY_COLORS = {"ddp": "#0072B2", "zero1": "#009E73", "fsdp2_zero3": "#E69F00", "tp_fsdp": "#CC79A7"}
PHASE_SHADES = {"forward": "#f2f2f2", "backward": "#dcdcdc", "optimizer": "#c4c4c4"}
PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}
STEP_LINE = "#333"  # the dashed line where a training step starts
#: The widest figure, in inches at 100 dpi: JupyterLab's notebook column in a 1280 x 900 window is about 844 px
#: (scripts/browser_check.py checks that every panel's figure fits), so a wider figure would be shown shrunk.
FIGURE_WIDTH_IN = 8.0
OUTSIDE_MODULES = "(no module)"  # how plots name memory allocated while no module of the model ran (the batch, say)


class CourseFigure(Figure):
    """A Figure that shows itself in Jupyter without pyplot (so no global figure stays open)."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()


def _new_axes(ax, figsize):
    if ax is not None:
        return ax.figure, ax
    fig = CourseFigure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def stack_categories(ax, xs, bytes_by_category: np.ndarray, scale: float) -> None:
    """Stacked areas of ``bytes_by_category`` (n_samples x len(CATEGORIES), bytes) divided by ``scale``.

    Categories that stay at 0 bytes throughout are left out (of the plot and its legend)."""
    shown = [j for j, _ in enumerate(CATEGORIES) if bytes_by_category[:, j].any()]
    ax.stackplot(
        xs,
        *(bytes_by_category[:, j] / scale for j in shown),
        colors=[CATEGORY_COLORS[CATEGORIES[j]] for j in shown],
        labels=[CATEGORY_LABELS[CATEGORIES[j]] for j in shown],
        step="post",
        linewidth=0,
    )


def legend_of_all(axes, target, extra=(), columns: int = 1) -> None:
    """One category legend listing every category drawn in any of ``axes``, each once and in CATEGORIES order,
    then ``extra`` ((handle, label) pairs: markers, shading); the panels' own legends are removed. ``target``: an
    Axes (the legend goes right of it) or the Figure (below the panels, in ``columns`` columns: a figure that must
    stay narrow). A multi-panel figure that kept one panel's legend would leave unexplained the colours that only
    other panels draw."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    labels = [CATEGORY_LABELS[c] for c in CATEGORIES if CATEGORY_LABELS[c] in entries]
    labels += [label for label in entries if label not in labels]
    handles = [entries[label] for label in labels] + [h for h, _ in extra]
    labels += [label for _, label in extra]
    title = "category" if not extra else "what is drawn"
    if isinstance(target, Figure):
        target.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize=8, title=title,
                      title_fontsize=8)  # fmt: skip
    else:
        target.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title=title,
                      title_fontsize=8)  # fmt: skip


def phase_legend_entries() -> list[tuple]:
    """(handle, label) for the phase shading and the step-start line of :func:`plot_timeline`, for a legend (where
    the panels are too small for the phase names written on them)."""

    out = [(Patch(facecolor=PHASE_SHADES[p], edgecolor="#999"), f"shading: {p}") for p in PHASE_SHADES]
    return out + [(Line2D([], [], color=STEP_LINE, linestyle="--", linewidth=0.8), "a training step starts")]


def plot_timeline(trace: Trace, *, x: str = "event", ax=None, title: str | None = None, annotate_peak: bool = True):
    """Stacked bytes per category over the trace, phases shaded, steps marked, peak annotated.

    ``x``: "event" (the allocation/free count, even spacing per memory event) or
    "time" (milliseconds since tracking began). Returns the Figure.
    """
    if x not in ("event", "time"):
        raise ValueError(f"x must be 'event' or 'time', got {x!r}")
    tl = trace.timeline
    fig, ax = _new_axes(ax, (FIGURE_WIDTH_IN, 4.2))
    if len(tl) == 0:
        raise ValueError("the trace has no samples: was anything run inside the tracker?")
    unit, scale = pick_unit(tl.total.max())
    xs = np.arange(len(tl)) if x == "event" else tl.time_s * 1e3
    stack_categories(ax, xs, tl.bytes, scale)
    top = tl.total.max() / scale * 1.18
    unnamed = _shade_phases(ax, trace, xs, top)
    if annotate_peak:
        pk = trace.peak()
        px, py = xs[pk.index], pk.bytes / scale
        ax.plot([px], [py], marker="v", color="black", markersize=6)
        right = px > xs[0] + 0.7 * (xs[-1] - xs[0])  # near the right edge: the label goes left, clear of the legend
        ax.annotate(
            f"peak {py:.1f} {unit}\n{pk.module}",
            (px, py),
            xytext=(-18 if right else 18, -28),
            textcoords="offset points",
            ha="right" if right else "left",
            fontsize=8,
            bbox={"boxstyle": "round", "fc": "white", "ec": "#888"},
            arrowprops={"arrowstyle": "-", "color": "#555"},
        )
    ax.set_ylim(0, top)
    ax.set_xlim(xs[0], xs[-1])
    ax.set_xlabel("memory event (allocation or free)" if x == "event" else "time since tracking began (ms)")
    ax.set_ylabel(f"live tensor memory ({unit})")
    n = len(trace.training_steps())
    ax.set_title(title or f"Memory through {n} training step{'s' if n != 1 else ''} on {trace.device}")
    handles, labels = ax.get_legend_handles_labels()
    if unnamed:  # some phases were too narrow to name: the legend says what their shading means
        handles += [h for h, _ in phase_legend_entries()]
        labels += [label for _, label in phase_legend_entries()]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="category",
              title_fontsize=8)  # fmt: skip
    return fig


MAX_LABELLED_STEPS = 12  # beyond this many steps, phase names would overlap: shade only, label every k-th step
MIN_NAMED_SHARE = 0.04  # a phase narrower than this share of the x axis is shaded, not named (its name would overlap)


def _shade_phases(ax, trace: Trace, xs: np.ndarray, top: float) -> bool:
    """Shade each phase (one collection per phase kind, so a 1,000-step trace draws as fast as a 3-step one),
    name the phases wide enough to hold their name (:data:`MIN_NAMED_SHARE`), and mark where each step starts
    (every k-th step on long traces). Returns True if a phase was left unnamed (the legend must name the shading)."""
    spans: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASE_SHADES}
    step_starts: dict[int, float] = {}
    for ph in trace.phases():
        if ph.phase == "idle":
            continue
        x0, x1 = xs[ph.start], xs[min(ph.end + 1, len(xs) - 1)]
        spans[ph.phase].append((x0, x1 - x0))
        step_starts.setdefault(ph.step, x0)
    for phase, bars in spans.items():
        # full height whatever the y limits become (plot_timelines rescales them): axes coordinates in y
        ax.broken_barh(
            bars, (0, 1), facecolors=PHASE_SHADES[phase], zorder=0, linewidth=0, transform=ax.get_xaxis_transform()
        )
    few = len(step_starts) <= MAX_LABELLED_STEPS
    unnamed = False
    if few:
        wide = MIN_NAMED_SHARE * (xs[-1] - xs[0])
        for phase, bars in spans.items():
            for x0, w in bars:
                if w < wide:
                    unnamed = True
                    continue
                ax.text(x0 + w / 2, top * 0.97, PHASE_SHORT[phase], ha="center", va="top", fontsize=8, color="#444")
    every = 1 if few else -(-len(step_starts) // MAX_LABELLED_STEPS)
    for k, (step, x0) in enumerate(step_starts.items()):
        if k % every == 0:
            ax.axvline(x0, color=STEP_LINE, linestyle="--", linewidth=0.8)
            ax.text(x0, top * 0.90, f" step {step}", ha="left", va="top", fontsize=9)
    return unnamed


def plot_module_bars(
    trace: Trace, index: int | None = None, *, step: int = 1, phase: str = "forward", depth: int = 2, ax=None
):
    """Horizontal stacked bars: live bytes by category for each module at one moment.

    The moment is sample ``index``, or by default the end of ``phase`` in ``step``.
    Bytes count under the module that allocated them (parameters under their owner).
    Returns the Figure.
    """
    if index is None:
        index = trace.phase(step, phase).end
        when = f"end of step {step}'s {phase}"
    else:
        when = f"sample {index}"
    rows = trace.live_by_module(index, depth=depth)
    names = sorted(rows, key=_module_sort_key)
    fig, ax = _new_axes(ax, (FIGURE_WIDTH_IN, 0.35 * len(names) + 1.6))
    widest = max(sum(r.values()) for r in rows.values()) if rows else 0
    unit, scale = pick_unit(widest)
    left = np.zeros(len(names))
    ys = np.arange(len(names))
    for c in CATEGORIES:
        vals = np.array([rows[n][c] for n in names]) / scale
        if vals.any():  # the total in the label: a category too small to see as a bar is still accounted for
            label = f"{CATEGORY_LABELS[c]} ({format_bytes(sum(rows[n][c] for n in names))})"
            ax.barh(ys, vals, left=left, color=CATEGORY_COLORS[c], label=label)
        left += vals
    ax.set_yticks(ys, [OUTSIDE_MODULES if n == NO_MODULE else n for n in names])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.05 * widest / scale if widest else 1)
    ax.set_xlabel(f"live bytes allocated by the module ({unit})")
    ax.set_ylabel("module that allocated them")
    ax.set_title(f"Memory by module at the {when}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="category (total)", title_fontsize=8)
    return fig


def plot_timelines(traces: dict[str, Trace], title: str | None = None):
    """One :func:`plot_timeline` per trace, stacked, on the same y scale (titles are the dict keys).

    Returns the Figure.
    """
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 2.8 * len(traces) + 0.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(traces), 1))
    top = max(t.timeline.total.max() for t in traces.values())
    unit, scale = pick_unit(top)
    for ax, (label, trace) in zip(axes, traces.items()):
        plot_timeline(trace, ax=ax, title=label)
        own_top = ax.get_ylim()[1]
        ax.set_ylim(0, top / scale * 1.18)
        for text in ax.texts:
            if isinstance(text, Annotation):  # the peak's label: above the peak when there is room (same side)
                if text.xy[1] < 0.6 * ax.get_ylim()[1]:
                    text.xyann = (text.xyann[0], 12)
            else:  # phase and step labels sit near the top: move them to the shared top
                text.set_y(text.get_position()[1] / own_top * ax.get_ylim()[1])
    # one legend, with what any panel draws (only checkpointing recomputes, say), and the phases' shading where a
    # panel could not name them all
    shading = [(h, label) for h, label in phase_legend_entries() if label.startswith("shading")]
    legends = [ax.get_legend() for ax in axes if ax.get_legend() is not None]
    unnamed = any(t.get_text().startswith("shading") for legend in legends for t in legend.get_texts())
    legend_of_all(axes, axes[0], extra=shading if unnamed else ())
    if title:
        fig.suptitle(title)
    return fig


def plot_optimizer_phase(traces: Trace | dict[str, Trace], steps: tuple[int, ...] = (1, 2), title: str | None = None):
    """Zoom on optimizer phases: stacked live bytes per category, one panel per (trace, step).

    ``traces`` is one Trace or ``{label: Trace}``. Each panel starts at the moment just before
    ``optimizer.step()`` (every gradient alive) and ends after ``zero_grad()``. Returns the Figure.
    """
    if isinstance(traces, Trace):
        traces = {"": traces}
    panels = [(label, tr, s) for label, tr in traces.items() for s in steps]
    phases = [tr.optimizer_phase(s) for _, tr, s in panels]
    samples = [  # the moment just before the phase, then every sample of it
        np.vstack([[tr.at(ph.start - 1)[c] for c in CATEGORIES], tr.timeline.bytes[ph.start : ph.end + 1]])
        for (_, tr, _), ph in zip(panels, phases)
    ]
    top = max(int(rows.sum(axis=1).max()) for rows in samples)
    unit, scale = pick_unit(top)
    fig = CourseFigure(figsize=(min(4.2 * len(panels), FIGURE_WIDTH_IN), 4), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (label, _, s), ph, rows in zip(axes, panels, phases, samples):
        xs = np.arange(len(rows))
        stack_categories(ax, xs, rows, scale)
        ax.set_xlim(0, max(len(xs) - 1, 1))
        ax.set_title(f"{label + ': ' if label else ''}step {s}", fontsize=10)
        if len(panels) == 1:
            ax.set_xlabel("memory event in the optimizer phase")
        ax.text(
            0.02,
            0.97,
            f"state {ph.state_before / scale:.1f} -> {ph.state_after / scale:.1f} {unit}\n"
            f"temporaries +{ph.temporaries / scale:.1f} {unit}",
            transform=ax.transAxes,
            va="top",
            fontsize=8,
            bbox={"boxstyle": "round", "fc": "white", "ec": "#888"},
        )
    axes[0].set_ylabel(f"live tensor memory ({unit})")
    axes[0].set_ylim(0, top / scale * 1.3)
    legend_of_all(axes, axes[-1])
    if len(panels) > 1:  # one label under all panels: per panel, the long label ran into its neighbour's
        fig.supxlabel("memory event in the optimizer phase (each panel its own)", fontsize=10)
    fig.suptitle(title or "The optimizer phase: optimizer.step() through zero_grad()")
    return fig


def plot_budget_run(trace: Trace, budget: int, *, failed: bool | None = None, title: str | None = None):
    """The timeline of ``trace`` with the budget drawn across it; if the run ``failed`` (by default: if its
    last sample is over the budget), the allocation that went over is marked. Returns the Figure."""
    tl = trace.timeline
    if len(tl) == 0:  # it failed before step 1: only what was alive at the start, against the budget
        return _plot_baseline_vs_budget(trace, budget, title)
    fig = plot_timeline(trace, title=title, annotate_peak=False)
    ax = fig.axes[0]
    unit, scale = pick_unit(tl.total.max())
    top = max(ax.get_ylim()[1], budget / scale * 1.15)
    ax.set_ylim(0, top)
    ax.axhline(budget / scale, color="#B00020", linewidth=1.2)
    x0, x1 = ax.get_xlim()
    ax.text(
        x0 + 0.3 * (x1 - x0),
        budget / scale,
        f"budget {budget / scale:.1f} {unit}",
        color="#B00020",
        va="bottom",
        fontsize=8,
    )
    if failed is None:
        failed = bool(len(tl)) and int(tl.total[-1]) > budget
    if failed:
        i = len(tl) - 1
        ax.plot([i], [tl.total[i] / scale], marker="X", color="#B00020", markersize=9)
        ax.annotate(
            f"out of budget: step {int(tl.step[i])}, {PHASES[int(tl.phase[i])]},\n"
            f"{tl.module_names[int(tl.module[i])]} asks for {int(trace.alloc_deltas[i]) / scale:.2f} {unit}",
            (i, tl.total[i] / scale),
            xytext=(-12, -34),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            bbox={"boxstyle": "round", "fc": "white", "ec": "#B00020"},
        )
    return fig


def _plot_baseline_vs_budget(trace: Trace, budget: int, title: str | None):
    """One stacked bar of the bytes alive when tracking began, and the budget line: the model did not fit."""
    unit, scale = pick_unit(max(sum(trace.baseline.values()), budget))
    fig, ax = _new_axes(None, (8, 2.6))
    left = 0.0
    for c in CATEGORIES:
        width = trace.baseline[c] / scale
        if width:
            ax.barh([0], [width], left=left, color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c])
        left += width
    ax.axvline(budget / scale, color="#B00020", linewidth=1.2)
    ax.text(budget / scale, 0.45, f" budget {budget / scale:.1f} {unit}", color="#B00020", fontsize=8)
    ax.set_yticks([0], ["alive before step 1"])
    ax.set_xlabel(f"live tensor memory ({unit})")
    ax.set_title(title or "Out of budget before training starts: the model itself does not fit")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def _module_sort_key(name: str):
    # embeddings first, blocks in numeric order, then the rest as the model runs them
    order = ["tok_emb", "pos_emb", "drop", "blocks", "ln_f", "lm_head", "model", "optimizer", "-"]
    parts = name.split(".")
    head = order.index(parts[0]) if parts[0] in order else len(order)
    num = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
    return (head, num, name)


#: The device's lines are drawn when they lie within this many times the tallest bar; further up they would squeeze
#: the bars flat (a toy model's 0.1 GiB under a T4's 14.5 GiB), so the legend gives the value and says it is off the
#: scale instead.
DEVICE_LINE_RANGE = 3.0


def plot_fit(report, title: str | None = None):
    """Stacked bars (tensor bytes by category at each phase's peak) for step 1 and step 2, the allocator's
    overhead on top (hatched), and the device's usable memory and capacity as lines when they are within
    :data:`DEVICE_LINE_RANGE` times the tallest bar (else the legend names them as off the scale). The y-axis
    scales to what is drawn; the lines are named in the legend, clear of the bars. ``report``: a
    ``prediction.fit.FitReport`` (lessons 06 and 09)."""
    tallest = max(max(p.reserved, p.tensors) for p in report.phases)
    lines = [  # (bytes, what, line style)
        (report.usable, f"usable on {report.device}", "--"),
        (report.capacity, f"capacity of {report.device}", ":"),
    ]
    drawn = [line for line in lines if line[0] <= DEVICE_LINE_RANGE * tallest]
    unit, scale = pick_unit(max([tallest] + [b for b, _, _ in drawn]))
    fig = CourseFigure(figsize=(8, 2.9), layout="constrained")  # fits a 1280 px window's notebook column (844 px)
    ax = fig.add_subplot()
    xs = np.arange(len(report.phases))
    shown = [c for c in CATEGORIES if any(p.breakdown.get(c, 0) for p in report.phases)]
    bottom = np.zeros(len(xs))
    for c in shown:
        vals = np.array([p.breakdown.get(c, 0) for p in report.phases]) / scale
        ax.bar(xs, vals, bottom=bottom, color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c], width=0.7)
        bottom += vals
    over = np.array([max(p.reserved - p.tensors, 0) for p in report.phases]) / scale
    ax.bar(
        xs,
        over,
        bottom=bottom,
        color="white",
        edgecolor="#888888",
        hatch="//",
        width=0.7,
        label="reserved, not allocated (simulated, uncapped)",
    )
    handles, labels = ax.get_legend_handles_labels()
    for nbytes, what, style in lines:
        if (nbytes, what, style) in drawn:
            handles.append(ax.axhline(nbytes / scale, color="black", linestyle=style, linewidth=1.2))
            labels.append(f"{what}: {format_bytes(nbytes)}")
        else:  # an empty handle: the legend says where the line would be
            handles.append(Patch(facecolor="none", edgecolor="none"))
            labels.append(f"{what}: {format_bytes(nbytes)},\n  off the scale ({nbytes / tallest:.0f}x the tallest bar)")
    ax.set_ylim(0, max([tallest] + [b for b, _, _ in drawn]) / scale * 1.1)
    fail = report.first_failure
    if fail is not None and fail in report.phases:
        i = report.phases.index(fail)
        ax.annotate(
            "runs out first",
            (i, report.usable / scale),
            xytext=(i, report.usable / scale * 0.55),
            ha="center",
            fontsize=8,
            arrowprops=dict(arrowstyle="->"),
        )
    ax.set_xticks(xs, [f"step {p.step}\n{p.phase}" for p in report.phases])
    ax.set_xlabel("phase of the training step")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    # wrapped: a long configuration's title would widen the figure past its notebook column
    ax.set_title(textwrap.fill(title or f"Will it fit? {report.label} on {report.device}", 90), fontsize=9)
    return fig


def plot_scaling(curves: dict, title: str | None = None):
    """Modelled step time and efficiency against the number of ranks: ``curves`` maps a strategy to its
    ``sync_model.StepTime`` rows (one per N). Left: the step (solid) and its compute alone (dotted), ms; right: the
    share of the step spent computing. Log-scaled N. Returns the Figure."""
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 3.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    spare = [c for c in OKABE_ITO if c not in STRATEGY_COLORS.values()]
    for i, (name, rows) in enumerate(curves.items()):
        colour = STRATEGY_COLORS.get(name, spare[i % len(spare)])
        ns = [r.n for r in rows]
        left.plot(ns, [r.step * 1e3 for r in rows], marker="o", color=colour, label=f"{name}: step")
        left.plot(ns, [(r.forward + r.backward) * 1e3 for r in rows], ":", color=colour, label=f"{name}: compute")
        right.plot(ns, [r.efficiency for r in rows], marker="o", color=colour, label=name)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks N")
    left.set_ylabel("step time (ms)")
    right.set_ylabel("compute / step")
    right.set_ylim(0, 1.05)
    left.legend(fontsize=7)
    fig.suptitle(title or "Modelled step time vs number of ranks (sync_model.py: a model, not a measurement)")
    return fig
