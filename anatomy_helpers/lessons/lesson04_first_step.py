"""Lesson 04, the first step is different: optimizer state appears, the caching allocator warms up, and a
run can pass step 1 and fail step 2.

What only this lesson uses: the step-by-step peak table, optimizer-state births, the replay summary and
the allocator plots (segments over time, the segment map), and the notebook's two slider panels. The
allocator simulator and its limits (:mod:`anatomy_helpers.prediction.allocator`), snapshots
(:mod:`anatomy_helpers.prediction.snapshot`), budget runs (:mod:`anatomy_helpers.training.budget`) and the real GPU
helpers (:mod:`anatomy_helpers.prediction.cuda`) are core: later lessons use them too.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from matplotlib.patches import Patch

from ..core.tables import Col, format_table
from ..core.units import MiB, pick_unit
from ..prediction.allocator import CachingAllocatorSim, Replay, replay, summarize_replay
from ..tracking.events import CATEGORIES, PHASES
from ..tracking.trace import Trace
from ..training.budget import try_budget
from ..training.train import make_model, make_optimizer, track_steps
from ..ui.plots import CATEGORY_COLORS, CATEGORY_LABELS, FIGURE_WIDTH_IN, CourseFigure, plot_budget_run

# The Ultra-Scale Playbook's measured profile of a ~1.24 B-parameter Llama, fp32, first four steps
# (its memory-profile figure; docs/references.md lists the source).
PLAYBOOK_GB = {
    "parameters": 4.60,
    "optimizer_state": 9.21,
    "activations": 45.6,
    "step1_peak": 50.3,
    "later_peak": 59.5,
    "reserved_max": 64.0,
    "step1_time_s": 2.4,
    "later_time_s": 1.6,
}


# ---- section 1: four steps side by side --------------------------------------------------------


def step_peak_table(trace: Trace) -> str:
    """One line per training step: its peak (MiB), where it happened, and the categories at that moment."""
    cats = ("parameters", "optimizer_state", "gradients", "activations", "temporaries", "inputs")
    cols = [Col("step", 4), Col("peak", 8, ".2f"), Col("where", 28, align="<", gap="  ")]
    cols += [Col(c.replace("_", " "), 15 if c == "optimizer_state" else 11, ".2f") for c in cats]
    rows = []
    for s in trace.training_steps():
        pk = trace.peak(step=s)
        rows.append((s, pk.bytes / MiB, f"{pk.phase}, {pk.module}", *(pk.breakdown[c] / MiB for c in cats)))
    return format_table(cols, rows, note="(MiB)")


def optimizer_state_births(trace: Trace, step: int = 1) -> tuple[int, int]:
    """(count, bytes) of optimizer-state storages allocated during ``step``'s optimizer phase."""
    rec = trace.allocation_record()
    mask = rec.where(step=step, phase="optimizer", category="optimizer_state", allocations=True)
    return int(mask.sum()), int(rec.bytes[mask].sum())


# ---- section 2: the caching allocator, simulated ------------------------------------------------


def format_replay_summary(result: Replay) -> str:
    """Per step of a replay: segments created, reserved at the end and at the peak, allocated peak,
    and the gap between reserved and allocated at the step's allocated peak (cached but unused), in MiB."""
    cols = [Col("step", 9), Col("new segments", 13), Col("reserved end", 13, ".2f"), Col("peak alloc.", 12, ".2f")]
    cols += [Col("peak reserved", 14, ".2f"), Col("gap at peak", 12, ".2f")]
    rows = [
        (
            "0 (start)" if r.step == 0 else str(r.step),
            r.segments_created,
            r.reserved_end / MiB,
            r.peak_allocated / MiB,
            r.peak_reserved / MiB,
            r.gap_at_peak / MiB,
        )
        for r in summarize_replay(result)
    ]
    return format_table(cols, rows, note="(MiB)")


def _step_starts(steps: np.ndarray) -> list[tuple[int, int]]:
    """(index, step) where each run of equal step numbers begins."""
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    return [(int(i), int(steps[i])) for i in starts]


def _mark_steps(ax, xs, steps, top, phases=None) -> None:
    """Dashed lines where each step begins (steps without a forward phase, e.g. a trailing idle one, skipped)."""
    for i, s in _step_starts(steps):
        if s == 0 or (phases is not None and not np.any(phases[steps == s] == PHASES.index("forward"))):
            continue
        ax.axvline(xs[i], color="#333", linestyle="--", linewidth=0.8)
        ax.text(xs[i], top * 0.97, f" step {s}", ha="left", va="top", fontsize=9)


ALLOCATED_WIDTH, TRACKED_WIDTH = 2.4, 0.8  # plot_allocator's two nearly equal lines: a wide band, a thin line


def plot_allocator(result: Replay, trace: Trace | None = None, *, title: str | None = None):
    """Simulated ``memory_allocated`` and ``memory_reserved`` over the memory events of a :func:`replay`.

    The gap between them (cached in segments but holding no tensor) is shaded. With ``trace``, its exact
    tracked total is drawn too, and when the trace was recorded on CUDA a second panel shows the real
    allocator's counters, sample by sample, measured from the start of tracking. Returns the Figure.
    """
    on = result.sample >= 0
    xs = result.sample[on]
    steps = result.step[on]
    alloc, res = result.allocated[on], result.reserved[on]
    cuda = trace is not None and trace.timeline.cuda_reserved is not None
    panels = 2 if cuda else 1
    unit, scale = pick_unit(max(int(res.max()), 1))
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 3.6 * panels + 0.4), layout="constrained")
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    ax.fill_between(
        xs, alloc / scale, res / scale, step="post", color="#dddddd", label="cached, unused (reserved - allocated)"
    )
    ax.step(xs, res / scale, where="post", color="#333333", linewidth=1.4, label="reserved (segments)")
    # allocated is the tracked bytes rounded up to whole blocks, a few MiB apart at most: a wide pale band under a
    # thin line, so that both stay visible where they nearly coincide
    ax.step(
        xs,
        alloc / scale,
        where="post",
        color=CATEGORY_COLORS["parameters"],
        linewidth=ALLOCATED_WIDTH,
        alpha=0.45,
        label="allocated (blocks: the tensors rounded up)",
    )
    if trace is not None:
        ax.step(
            np.arange(len(trace.timeline)),
            trace.timeline.total / scale,
            where="post",
            color=CATEGORY_COLORS["activations"],
            linewidth=TRACKED_WIDTH,
            label="tracked tensor bytes (exact)",
        )
    top = res.max() / scale * 1.15
    ax.set_ylim(0, top)
    _mark_steps(ax, xs, steps, top, result.phase[on])
    ax.set_ylabel(f"simulated allocator ({unit})")
    # a figure title, centred over axes and legend: an axes title this long was clipped at the figure's left edge
    fig.suptitle(title or "The caching allocator, simulated from the tracker's allocations and frees")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if cuda:
        ax2 = axes[1]
        tl = trace.timeline
        entry_alloc, entry_res = trace.cuda_at_entry.allocated, trace.cuda_at_entry.reserved
        r = (tl.cuda_reserved - entry_res) / scale
        a = (tl.cuda_allocated - entry_alloc) / scale
        x2 = np.arange(len(tl))
        ax2.fill_between(x2, a, r, step="post", color="#dddddd", label="cached, unused")
        ax2.step(x2, r, where="post", color="#333333", linewidth=1.4, label="memory_reserved()")
        ax2.step(x2, a, where="post", color=CATEGORY_COLORS["parameters"], linewidth=1.0, label="memory_allocated()")
        top2 = max(float(r.max()), 1e-9) * 1.15
        ax2.set_ylim(min(0.0, float(a.min())), top2)
        _mark_steps(ax2, x2, tl.step, top2, tl.phase)
        ax2.set_ylabel(f"real, since tracking began ({unit})")
        ax2.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes[-1].set_xlabel("memory event (allocation or free)")
    axes[-1].set_xlim(xs[0], xs[-1])
    return fig


def plot_segment_map(sim: CachingAllocatorSim, categories: Iterable[int] | None = None, *, title: str | None = None):
    """Every segment of a simulated allocator as a bar, its blocks coloured by the category of the tensor
    in them (``categories[alloc_id]``, indices into CATEGORIES); free (cached) blocks are left white.

    Small-pool segments (2 MiB) come first, then the large pool. Returns the Figure.
    """
    cats = None if categories is None else np.asarray(categories)
    segs = sorted(sim.segments(), key=lambda s: (s.pool != "small", s.id))
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 0.17 * len(segs) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    used: set[str] = set()
    for y, seg in enumerate(segs):
        ax.barh(y, seg.size / MiB, left=0, color="white", edgecolor="#999999", linewidth=0.6, height=0.8)
        for b in seg.blocks:
            if b.free:
                continue
            cat = "temporaries" if cats is None else CATEGORIES[int(cats[b.key])]
            used.add(cat)
            ax.barh(
                y,
                b.size / MiB,
                left=b.offset / MiB,
                color=CATEGORY_COLORS[cat],
                edgecolor="white",
                linewidth=0.3,
                height=0.8,
            )
    handles = [Patch(color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c]) for c in CATEGORIES if c in used]
    ax.set_yticks(range(len(segs)), [f"{s.pool} #{s.id}" for s in segs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("offset in the segment (MiB); white = cached, free")
    reserved, allocated = sim.reserved, sim.allocated
    ax.set_title(
        title or f"Segments: {len(segs)} held, {reserved / MiB:.0f} MiB reserved, {allocated / MiB:.1f} MiB allocated"
    )
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="cached, free"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="block", title_fontsize=8)
    return fig


# ---- slider panels ----------------------------------------------------------------------------------


def allocator_panel(batch_size: int = 8, steps: int = 3, device=None, **model_config):
    """Track ``steps`` steps of a fresh default model with AdamW, replay them through the allocator
    simulator, print the tracked and simulated peaks, and plot reserved vs allocated. Returns the Figure."""
    model = make_model(device=device, **model_config)
    trace = track_steps(model, make_optimizer(model, "adamw"), steps=steps, batch_size=batch_size)
    result = replay(trace.allocation_record())
    rows = summarize_replay(result)
    tracked = trace.peak().bytes
    peak_res = max(r.peak_reserved for r in rows)
    peak_alloc = max(r.peak_allocated for r in rows)
    print(
        f"batch {batch_size}: tracked peak {tracked / MiB:.2f} MiB, "
        f"simulated allocated peak {peak_alloc / MiB:.2f} MiB, "
        f"reserved peak {peak_res / MiB:.0f} MiB ({peak_res / tracked:.2f}x the tracked peak)"
    )
    print("segments created per step: " + ", ".join(f"{r.step}: {r.segments_created}" for r in rows if r.step))
    return plot_allocator(result, trace, title=f"batch {batch_size}: simulated reserved vs allocated")


def budget_panel(
    budget_mib: int = 100,
    batch_size: int = 8,
    optimizer: str = "adamw",
    checkpoint: str = "none",
    steps: int = 3,
    device=None,
    **model_config,
):
    """Train a fresh model for ``steps`` tracked steps under ``budget_mib`` MiB of live tensor memory;
    print which steps passed and where it failed; plot the timeline with the budget. Returns the Figure."""
    run = try_budget(budget_mib * MiB, batch_size, optimizer, checkpoint, steps, device, **model_config)
    print(run.summary())
    title = f"{optimizer}, batch {batch_size}, checkpoint {checkpoint}: " + (
        "every step fits" if run.passed else f"out of budget in step {run.failed_step}"
    )
    return plot_budget_run(run.trace, run.budget, title=title)
