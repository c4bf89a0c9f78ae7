"""Lesson 01, the forward pass: activations pile up block by block, and how they scale.

The saved-tensor tables and the term-by-term comparison with Korthikanti et al. (2022) are core
(:mod:`anatomy_helpers.prediction.saved`, :mod:`anatomy_helpers.prediction.formulas`): the checkpointing lesson uses
them too. What is here only lesson 01 uses: one tracked forward, block boundaries, the build-up plot, and exact batch /
sequence-length fits. Units are bytes unless a name says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch.nn as nn

from ..core.data import get_batch
from ..core.units import pick_unit
from ..prediction.saved import SavedRow, TermComparison, activations_by_part, distinct_bytes, first_savers, saved_rows
from ..tracking.events import model_part
from ..tracking.trace import Trace
from ..tracking.tracker import StepTracker
from ..training.train import make_model, make_optimizer
from ..ui.plots import CATEGORY_COLORS, FIGURE_WIDTH_IN, CourseFigure

# ---------------------------------------------------------------------------------------------
# Measuring a forward pass
# ---------------------------------------------------------------------------------------------


def track_forward(model: nn.Module, batch_size: int = 8, seq_len: int | None = None, *, seed: int = 0):
    """Track one forward pass (with loss) of ``model`` on a course batch.

    Returns ``(trace, x, y)``. The graph is dropped before returning, so nothing stays alive.
    ``seq_len`` defaults to the model's context length. A throwaway SGD optimizer satisfies the
    tracker (it is never stepped).
    """
    device = next(model.parameters()).device
    x, y = get_batch(batch_size, seq_len or model.cfg.seq_len, seed=seed, device=device)
    with StepTracker(model, make_optimizer(model, "sgd")) as tracker:
        out = model(x, y)
    del out
    return tracker.trace, x, y


def forward_activation_bytes(model: nn.Module, batch_size: int, seq_len: int | None = None) -> int:
    """Bytes of the distinct storages one forward (with loss) saves as activations, measured."""
    trace, _, _ = track_forward(model, batch_size, seq_len)
    return distinct_bytes(saved_rows(trace))


def block_boundaries(trace: Trace, step: int = 1) -> dict[str, int]:
    """Sample index at which each part of the forward starts: ``blocks.<i>`` and ``ln_f``.

    A part starts at the first memory event inside one of its modules. The activation bytes
    live just before ``blocks.<i+1>`` starts, minus those just before ``blocks.<i>``, are what
    block i added.
    """
    idx = trace.window(step, "forward")
    names = trace.timeline.module_names
    out: dict[str, int] = {}
    for i in idx.tolist():
        name = names[trace.timeline.module[i]]
        part = "ln_f" if name == "ln_f" else model_part(name) or ""
        if part.startswith("blocks.") or part == "ln_f":
            out.setdefault(part, i)
    return out


def activations_at_block_starts(trace: Trace, step: int = 1) -> dict[str, int]:
    """Live activation bytes just before each block (and ``ln_f``) starts in ``step``'s forward."""
    acts = trace.timeline.category("activations")
    return {
        part: int(acts[i - 1]) if i > 0 else trace.baseline["activations"]
        for part, i in block_boundaries(trace, step).items()
    }


def plot_activation_buildup(trace: Trace, rows: list[SavedRow] | None = None, step: int = 1, title: str | None = None):
    """Left: live activation bytes through the forward pass, block boundaries marked.
    Right: activation bytes saved by each part of the model (first saver of each storage).

    ``rows`` default to ``trace.saved``. Returns the Figure.
    """
    rows = saved_rows(trace) if rows is None else rows
    idx = trace.window(step, "forward")
    if len(idx) == 0:
        raise ValueError(f"the trace has no forward samples in step {step}")
    acts = trace.timeline.category("activations")[idx]
    parts = activations_by_part(rows)
    unit, scale = pick_unit(max(int(acts.max()), max(parts.values(), default=0)))
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 4), layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=[1.6, 1])
    xs = np.arange(len(idx))
    color = CATEGORY_COLORS["activations"]
    ax.fill_between(xs, acts / scale, step="post", color=color, alpha=0.35, linewidth=0)
    ax.step(xs, acts / scale, where="post", color=color, label="activations (live)")
    bounds = block_boundaries(trace, step)
    top = acts.max() / scale
    starts = [(name, int(np.searchsorted(idx, i))) for name, i in bounds.items()]
    for k, (name, x0) in enumerate(starts):
        ax.axvline(x0, color="#333", linestyle="--", linewidth=0.8)
        x1 = starts[k + 1][1] if k + 1 < len(starts) else len(idx)
        label = name.replace("blocks.", "block ") if name != "ln_f" else "head"
        ax.text((x0 + x1) / 2, top * 1.04, label, ha="center", va="bottom", fontsize=8)
        if x0 > 0:
            ax.plot([x0 - 1], [acts[x0 - 1] / scale], "o", color="black", markersize=4)
    ax.set_ylim(0, top * 1.15)
    ax.set_xlim(0, len(idx) - 1)
    ax.set_xlabel("memory event in the forward pass (allocation or free)")
    ax.set_ylabel(f"live activation bytes ({unit})")
    ax.set_title("Activations pile up block by block")
    names = list(parts)
    vals = np.array([parts[n] for n in names]) / scale
    ys = np.arange(len(names))
    bx.barh(ys, vals, color=color)
    for y, v in zip(ys, vals):
        bx.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    bx.set_yticks(ys, [n.replace("blocks.", "block ") for n in names])
    bx.invert_yaxis()
    bx.margins(x=0.2)
    bx.set_xlabel(f"activation bytes saved ({unit})")
    bx.set_title("Saved for backward, by part")
    if title:
        fig.suptitle(title)
    return fig


def plot_saved_by_module(rows: list[SavedRow], prefix: str = "blocks.0"):
    """Horizontal bars: activation bytes each sub-module under ``prefix`` saved first (MiB). Returns the Figure."""
    sub: dict[str, int] = {}
    for r in first_savers(rows):
        if r.module.startswith(prefix):
            sub[r.module] = sub.get(r.module, 0) + r.storage_bytes
    names = list(sub)
    unit, scale = pick_unit(max(sub.values(), default=0))
    fig = CourseFigure(figsize=(8, 0.35 * len(names) + 1.5), layout="constrained")
    ax = fig.add_subplot()
    vals = np.array([sub[n] for n in names]) / scale
    ys = np.arange(len(names))
    ax.barh(ys, vals, color=CATEGORY_COLORS["activations"])
    for y, v in zip(ys, vals):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    ax.set_yticks(ys, names)
    ax.invert_yaxis()
    ax.margins(x=0.15)
    ax.set_xlabel(f"activation bytes saved, distinct storages ({unit})")
    ax.set_title(f"What {prefix} saves for backward, by sub-module")
    return fig


# ---------------------------------------------------------------------------------------------
# Scaling with batch size and sequence length
# ---------------------------------------------------------------------------------------------


def fit_line(xs: list[int], ys: list[int]) -> tuple[Fraction, Fraction, bool]:
    """Exact line through the first two points: ``(slope, intercept, all_points_on_it)``."""
    if len(xs) < 2:
        raise ValueError("a line needs at least two points")
    slope = Fraction(ys[1] - ys[0], xs[1] - xs[0])
    intercept = ys[0] - slope * xs[0]
    return slope, intercept, all(slope * x + intercept == y for x, y in zip(xs, ys))


def fit_quadratic(xs: list[int], ys: list[int]) -> tuple[tuple[Fraction, Fraction, Fraction], bool]:
    """Exact ``c0 + c1*x + c2*x**2`` through the first three points: ``((c0, c1, c2), all_points_on_it)``."""
    if len(xs) < 3:
        raise ValueError("a quadratic needs at least three points")
    (x0, x1, x2), (y0, y1, y2) = xs[:3], ys[:3]
    d01 = Fraction(y1 - y0, x1 - x0)
    d12 = Fraction(y2 - y1, x2 - x1)
    c2 = (d12 - d01) / (x2 - x0)
    c1 = d01 - c2 * (x0 + x1)
    c0 = y0 - c1 * x0 - c2 * x0 * x0
    return (c0, c1, c2), all(c0 + c1 * x + c2 * x * x == y for x, y in zip(xs, ys))


@dataclass
class Scaling:
    """Measured activation bytes of one model configuration over batch sizes and sequence lengths."""

    attn_impl: str
    config: dict  # make_model keyword arguments
    seq_len: int  # sequence length of the batch sweep
    batch_size: int  # batch size of the sequence-length sweep
    batch_sizes: list[int] = field(default_factory=list)
    batch_bytes: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    seq_bytes: list[int] = field(default_factory=list)

    def batch_fit(self) -> tuple[Fraction, Fraction, bool]:
        """(bytes per sample, batch-independent bytes, exactly affine?)."""
        return fit_line(self.batch_sizes, self.batch_bytes)

    def seq_fit(self) -> tuple[tuple[Fraction, Fraction, Fraction], bool]:
        """((c0, c1, c2), exactly quadratic?) for bytes = c0 + c1*s + c2*s^2."""
        return fit_quadratic(self.seq_lens, self.seq_bytes)

    def summary(self) -> str:
        lines = [f"{self.attn_impl}: {self.config}"]
        if len(self.batch_sizes) >= 2:
            slope, intercept, ok = self.batch_fit()
            lines.append(
                f"  seq {self.seq_len}, batch {self.batch_sizes}: bytes = {_num(slope)} * b + {_num(intercept)}"
                + ("  (exact at every point)" if ok else "  (NOT a line)")
            )
        if len(self.seq_lens) >= 3:
            (c0, c1, c2), ok = self.seq_fit()
            lines.append(
                f"  batch {self.batch_size}, seq {self.seq_lens}: "
                f"bytes = {_num(c0)} + {_num(c1)} * s + {_num(c2)} * s^2"
                + ("  (exact at every point)" if ok else "  (NOT a quadratic)")
            )
        return "\n".join(lines)


def _num(q: Fraction) -> str:
    return f"{q.numerator:,}" if q.denominator == 1 else f"{float(q):,.2f}"


def _even_points(top: int, n: int = 4) -> list[int]:
    return sorted({max(1, round(top * k / n)) for k in range(1, n + 1)})


def measure_scaling(
    attn_impl: str = "manual",
    batch_sizes: Iterable[int] = (1, 2, 3, 4),
    seq_lens: Iterable[int] = (32, 64, 96, 128),
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device=None,
    iterate: Callable = iter,
    **config,
) -> Scaling:
    """Measure forward activation bytes over ``batch_sizes`` (at ``seq_len``) and ``seq_lens`` (at ``batch_size``).

    One model is built (``make_model(attn_impl=..., seq_len=max(seq_lens, seq_len), **config)``) and
    fed shorter sequences for the sequence sweep. ``batch_size`` defaults to the largest batch,
    ``seq_len`` to the longest sequence. ``iterate`` wraps the list of runs (e.g. ``progress``).
    """
    batch_sizes, seq_lens = sorted(set(batch_sizes)), sorted(set(seq_lens))
    batch_size = batch_size or batch_sizes[-1]
    seq_len = seq_len or seq_lens[-1]
    model = make_model(device=device, attn_impl=attn_impl, seq_len=max(seq_len, seq_lens[-1]), **config)
    res = Scaling(attn_impl, {"attn_impl": attn_impl, **config}, seq_len, batch_size)
    runs = [("b", b, seq_len) for b in batch_sizes] + [("s", batch_size, s) for s in seq_lens]
    cache: dict[tuple[int, int], int] = {}
    for kind, b, s in iterate(runs):
        if (b, s) not in cache:
            cache[b, s] = forward_activation_bytes(model, b, s)
        if kind == "b":
            res.batch_sizes.append(b)
            res.batch_bytes.append(cache[b, s])
        else:
            res.seq_lens.append(s)
            res.seq_bytes.append(cache[b, s])
    return res


def plot_scaling(results: list[Scaling], title: str | None = None):
    """Activation bytes vs batch size (left) and sequence length (right): measured points, exact fits.

    The fitted curves are the exact line / quadratic through the measured points; for a fit with
    an s^2 term its linear part is drawn dotted, so the gap is the quadratic term. Returns the Figure.
    """
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 4), layout="constrained")
    ax, bx = fig.subplots(1, 2)
    color = CATEGORY_COLORS["activations"]
    styles = {"manual": ("o", "-"), "sdpa": ("s", "--")}
    top = max(max(r.batch_bytes + r.seq_bytes) for r in results)
    unit, scale = pick_unit(top)
    for r in results:
        marker, line = styles.get(r.attn_impl, ("^", "-."))
        ax.plot(r.batch_sizes, np.array(r.batch_bytes) / scale, marker, color=color, label=f"{r.attn_impl}: measured")
        if len(r.batch_sizes) >= 2:
            slope, intercept, _ = r.batch_fit()
            xs = np.linspace(0, max(r.batch_sizes), 50)
            ax.plot(xs, (float(slope) * xs + float(intercept)) / scale, line, color=color, label=f"{r.attn_impl}: fit")
        bx.plot(r.seq_lens, np.array(r.seq_bytes) / scale, marker, color=color, label=f"{r.attn_impl}: measured")
        if len(r.seq_lens) >= 3:
            (c0, c1, c2), _ = r.seq_fit()
            xs = np.linspace(0, max(r.seq_lens), 80)
            fit = float(c0) + float(c1) * xs + float(c2) * xs * xs
            bx.plot(xs, fit / scale, line, color=color, label=f"{r.attn_impl}: fit a + b·s + c·s²")
            if c2 != 0:
                lin = float(c0) + float(c1) * xs
                bx.plot(xs, lin / scale, ":", color="#333", zorder=4, label=f"{r.attn_impl}: its linear part")
    r0 = results[0]
    ax.set_xlabel("batch size b")
    ax.set_ylabel(f"activation bytes saved ({unit})")
    ax.set_title(f"Linear in batch size (seq_len {r0.seq_len})")
    bx.set_xlabel("sequence length s (tokens)")
    bx.set_ylabel(f"activation bytes saved ({unit})")
    bx.set_title(f"Sequence length (batch {r0.batch_size})")
    for a in (ax, bx):
        a.set_xlim(left=0)
        a.set_ylim(bottom=0)
        a.legend(fontsize=8)
    cfg = ", ".join(f"{k} {v}" for k, v in r0.config.items() if k != "attn_impl")
    fig.suptitle(title or f"Forward activations, measured ({cfg})")
    return fig


def activation_scaling(
    batch_size: int = 4,
    seq_len: int = 128,
    n_layer: int = 2,
    d_model: int = 128,
    attn_impl: str = "manual",
    device=None,
):
    """Measure a ``n_layer`` x ``d_model`` model (4 heads) at 4 batch sizes up to ``batch_size`` and 4
    sequence lengths up to ``seq_len``; print the exact fits and plot them. The function behind
    notebook 01's slider panel. Returns the Figure.
    """
    res = measure_scaling(
        attn_impl,
        _even_points(batch_size),
        _even_points(seq_len),
        device=device,
        n_layer=n_layer,
        d_model=d_model,
        n_head=4,
    )
    print(res.summary())
    return plot_scaling([res])


# ---------------------------------------------------------------------------------------------
# Measured layer vs the formula, term by term
# ---------------------------------------------------------------------------------------------


def plot_formula_vs_measured(comparison: list[TermComparison], title: str | None = None):
    """Paired horizontal bars per term: the formula (grey), the measurement (activations colour).

    Returns the Figure.
    """
    terms = [c.term for c in comparison]
    unit, scale = pick_unit(max(max(c.formula, c.measured) for c in comparison))
    fig = CourseFigure(figsize=(9, 0.34 * len(terms) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    ys = np.arange(len(terms))
    f = np.array([c.formula for c in comparison]) / scale
    m = np.array([c.measured for c in comparison]) / scale
    ax.barh(ys - 0.2, f, height=0.4, color="#bbbbbb", label="formula (16-bit, 1-byte masks)")
    ax.barh(ys + 0.2, m, height=0.4, color=CATEGORY_COLORS["activations"], label="measured")
    for y, c in zip(ys, comparison):
        if c.difference:
            ax.text(
                max(c.formula, c.measured) / scale,
                y,
                f"  {c.difference / scale:+.3f}",
                va="center",
                fontsize=8,
            )
    ax.set_yticks(ys, terms)
    ax.invert_yaxis()
    ax.margins(x=0.15)
    ax.set_xlabel(f"bytes per layer ({unit})")
    ax.set_title(title or "One layer: Korthikanti et al. formula vs measured")
    ax.legend(loc="lower right", fontsize=8)
    return fig
