"""Notebook 08: beyond one step on one device: gradient accumulation, mixed precision, and per-rank memory under
DDP, ZeRO-1 and FSDP2 (the ranks themselves: :mod:`anatomy_helpers.distributed`; starting them and their tables:
:mod:`anatomy_helpers.distributed.world`). Bytes unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.tables import Col, format_table
from ..core.units import MiB, pick_unit
from ..distributed.fake_world import dry_run_rank
from ..distributed.ranks import STRATEGIES, Collective, RankJob, RankResult
from ..distributed.sync_model import collective_name
from ..distributed.world import format_rank_table, rank_rows, run_world
from ..prediction.formulas import zero_model_states
from ..tracking.trace import Trace
from ..tracking.tracker import StepTracker
from ..training.train import make_model, make_optimizer, track_steps
from ..ui.plots import CourseFigure, legend_of_all, phase_legend_entries, plot_timeline

# The lesson's model: small enough that five strategies on two ranks run in seconds on a laptop.
CONFIG = dict(n_layer=2, d_model=128, n_head=4, seq_len=64)
GLOBAL_BATCH = 8

# ---- section 1: gradient accumulation -----------------------------------------------------------------------


@dataclass(frozen=True)
class AccumulationRow:
    """Step 2 of a run at one global batch in ``micro_batches`` micro-batches (bytes at step 2's peak)."""

    micro_batches: int
    micro_batch: int  # rows per micro-batch
    peak: int
    activations: int  # the most activation bytes alive at any moment of step 2
    gradients: int  # at the peak
    optimizer_state: int  # at the peak
    peak_phase: str
    peak_micro_step: int  # which micro-batch's pass holds the peak (1-based)
    peak_module: str


def micro_step_of(trace: Trace, index: int) -> int:
    """Which micro-step (1-based) of its step timeline sample ``index`` belongs to: forwards of the step so far."""
    step = int(trace.timeline.step[index])
    return max(1, sum(1 for ph in trace.phases() if ph.step == step and ph.phase == "forward" and ph.start <= index))


def accumulation_sweep(
    micro_batches=(1, 2, 4, 8), batch_size: int = GLOBAL_BATCH, device=None, **config
) -> tuple[list[AccumulationRow], dict[int, Trace]]:
    """Two AdamW steps at global batch ``batch_size`` for each number of micro-batches: rows and traces."""
    config = {**CONFIG, **config}
    rows, traces = [], {}
    for k in micro_batches:
        model = make_model(device=device, **config)
        trace = track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=batch_size, micro_batches=k)
        pk = trace.peak(step=2)
        window = trace.window(step=2)
        rows.append(
            AccumulationRow(
                micro_batches=k,
                micro_batch=batch_size // k,
                peak=pk.bytes,
                activations=int(trace.timeline.category("activations")[window].max()),
                gradients=pk.breakdown["gradients"],
                optimizer_state=pk.breakdown["optimizer_state"],
                peak_phase=pk.phase,
                peak_micro_step=micro_step_of(trace, pk.index),
                peak_module=pk.module,
            )
        )
        traces[k] = trace
    return rows, traces


def format_accumulation(rows: list[AccumulationRow]) -> str:
    cols = [
        Col("k", 3, "d"),
        Col("rows", 4, "d"),
        Col("peak", 7, ".2f"),
        Col("activations", 11, ".2f"),
        Col("gradients", 9, ".2f"),
        Col("opt state", 9, ".2f"),
        Col("peak in", 30, align="<", gap="  "),
    ]
    out = [
        [
            r.micro_batches,
            r.micro_batch,
            r.peak / MiB,
            r.activations / MiB,
            r.gradients / MiB,
            r.optimizer_state / MiB,
            f"{r.peak_phase} {r.peak_micro_step}/{r.micro_batches}, {r.peak_module}",
        ]
        for r in rows
    ]
    return format_table(cols, out, note="(MiB, step 2; k micro-batches of `rows` rows)")


# ---- section 2: mixed precision -----------------------------------------------------------------------------

PRECISIONS = {
    "fp32": {},
    "fp32 + autocast bf16": {"autocast": "bfloat16"},
    "pure bf16": {"dtype": "bfloat16"},
}


@dataclass(frozen=True)
class PrecisionRow:
    """Bytes per parameter of each model state (just before step 2's optimizer), and the activation peak."""

    setup: str
    parameters: float  # bytes per parameter
    gradients: float
    optimizer_state: float
    activations: int  # the most activation bytes alive in step 2
    weight_copies: int  # step 2's saved tensors that are casts of a parameter (autocast's cached copies), distinct
    saved_16bit: float  # fraction of the saved activation bytes that are 16-bit


class _ParameterCasts(TorchDispatchMode):
    """Notes the output of every ``aten._to_copy`` whose input lives in a parameter's storage (entered inside the
    tracker's own mode, so it sees the op first and the tracker has registered the copy when it returns)."""

    def __init__(self, tracker: CastTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tracker = self.tracker
        if func is torch.ops.aten._to_copy.default and tracker.recording:
            source = args[0]  # a view or transpose of a weight shares the weight's storage
            if source.untyped_storage()._cdata in tracker._param_storages:
                alloc_id = tracker.allocation_id(out, new=False)
                if alloc_id is not None:
                    tracker.parameter_casts.add(alloc_id)
        return out


class CastTracker(StepTracker):
    """A StepTracker that also knows which storages are casts of a parameter (by provenance: made by
    ``aten._to_copy`` from a parameter's storage, as autocast's weight cache does), in :attr:`parameter_casts`
    (allocation ids, as in ``Trace.saved``). Views and transposes of a cast share its storage, so they count too."""

    def __init__(self, model, optimizer, **kwargs):
        super().__init__(model, optimizer, **kwargs)
        self.parameter_casts: set[int] = set()
        self._param_storages = {p.untyped_storage()._cdata for p in model.parameters()}

    def inner_modes(self) -> list[TorchDispatchMode]:
        return [_ParameterCasts(self)]


def precision_table(batch_size: int = GLOBAL_BATCH, device=None, **config) -> list[PrecisionRow]:
    """fp32, fp32 under ``torch.autocast(bfloat16)``, and a pure-bf16 model (bf16 AdamW state), two steps each."""
    config = {**CONFIG, **config}
    rows = []
    for name, setup in PRECISIONS.items():
        model = make_model(device=device, **config, **({"dtype": setup["dtype"]} if "dtype" in setup else {}))
        n = sum(p.numel() for p in model.parameters())
        optimizer = make_optimizer(model, "adamw")
        tracker = CastTracker(model, optimizer)
        trace = track_steps(
            model, optimizer, steps=2, batch_size=batch_size, autocast=setup.get("autocast"), tracker=tracker
        )
        before = trace.at(trace.phase(2, "optimizer").start - 1)
        saved = [s for s in trace.saved if s.step == 2 and s.category == "activations"]
        distinct = {s.storage: s for s in saved}
        total = sum(s.storage_bytes for s in distinct.values())
        low = sum(s.storage_bytes for s in distinct.values() if s.dtype in (torch.bfloat16, torch.float16))
        copies = sum(s.storage_bytes for aid, s in distinct.items() if aid in tracker.parameter_casts)
        rows.append(
            PrecisionRow(
                setup=name,
                parameters=(before["parameters"] - _buffers(model)) / n,
                gradients=before["gradients"] / n,
                optimizer_state=before["optimizer_state"] / n,
                activations=int(trace.timeline.category("activations")[trace.window(step=2)].max()),
                weight_copies=copies,
                saved_16bit=low / total if total else 0.0,
            )
        )
    return rows


def _buffers(model) -> int:
    return sum(b.untyped_storage().nbytes() for b in model.buffers())


def format_precision(rows: list[PrecisionRow]) -> str:
    cols = [
        Col("setup", 21, align="<"),
        Col("params", 6, ".2f"),
        Col("grads", 5, ".2f"),
        Col("state", 5, ".2f"),
        Col("activations MiB", 15, ".2f"),
        Col("bf16 weight copies MiB", 22, ".2f"),
        Col("saved 16-bit", 12, ".0%"),
    ]
    out = [
        [
            r.setup,
            r.parameters,
            r.gradients,
            r.optimizer_state,
            r.activations / MiB,
            r.weight_copies / MiB,
            r.saved_16bit,
        ]
        for r in rows
    ]
    return format_table(cols, out, note="(bytes per parameter; step 2)")


# ---- section 3: data parallelism ----------------------------------------------------------------------------


def measure_world(
    world_size: int = 2, micro_batches: int = 1, strategies: tuple = tuple(STRATEGIES), backend: str = "gloo"
) -> dict[str, list[RankResult]]:
    """Every strategy in ``strategies`` on one world of ``world_size`` ranks, run once per kernel for each set of
    arguments (the panel re-reads the lesson's worlds): ``measure_world(2)`` and ``measure_world(2, 1)`` are one."""
    return _measured_world(world_size, micro_batches, tuple(strategies), backend)


@lru_cache(maxsize=8)  # keyed on all four arguments, in order (lru_cache tells positional from keyword)
def _measured_world(
    world_size: int, micro_batches: int, strategies: tuple, backend: str
) -> dict[str, list[RankResult]]:
    jobs = [
        RankJob(s, steps=1, batch_size=GLOBAL_BATCH, micro_batches=micro_batches, model=dict(CONFIG))
        for s in strategies
    ]
    return run_world(jobs, world_size, backend=backend, timeout_s=300)


#: How each collective is marked on a rank's timeline: (marker, filled), by the kind of op.
COLLECTIVE_MARKERS = {"all-gather": ("v", True), "broadcast": ("x", True), "reduce": ("o", False)}


def collective_kind(op: str) -> str:
    """The marker kind of a c10d op ("_allgather_base_" -> "all-gather"; all-reduce and reduce-scatter: "reduce")."""
    return "all-gather" if "allgather" in op else "broadcast" if "broadcast" in op else "reduce"


#: Rank panels per row: with more ranks, a strategy's ranks wrap onto further rows (4 ranks: 2 x 2).
RANK_COLUMNS = 2


def plot_rank_timelines(results: dict[str, list[RankResult]], strategies=None, *, x: str = "event", title=None):
    """One timeline per (strategy, rank): strategies down, ranks across (wrapping after :data:`RANK_COLUMNS`), one
    y scale; collectives as ticks on top (filled triangle: all-gather, hollow circle: reduce-scatter or all-reduce,
    cross: broadcast). One legend names every category, marker and phase shading drawn. Returns the Figure."""
    from matplotlib.lines import Line2D  # drawn on first use: rank processes never draw

    strategies = list(strategies or results)
    ranks = len(results[strategies[0]])
    one_each = ranks == 1 and len(strategies) > 1  # one rank of each strategy: the strategies side by side
    columns = min(len(strategies) if one_each else ranks, RANK_COLUMNS)
    rows_each = -(-ranks // columns)
    panel_rows = -(-len(strategies) // columns) if one_each else rows_each * len(strategies)
    # 4 in a panel and the legend below them: two panels fit a 1280 px window's notebook column (844 px) unshrunk
    fig = CourseFigure(figsize=(4 * columns, 2.1 * panel_rows + 1.4), layout="constrained")
    axes = fig.subplots(panel_rows, columns, squeeze=False)
    top = max(r.trace.timeline.total.max() for s in strategies for r in results[s])
    unit, scale = pick_unit(top)
    marked: dict[str, set[str]] = {}  # marker kind -> the ops it marked
    for i, s in enumerate(strategies):
        for j, r in enumerate(results[s]):
            k = i if one_each else i * rows_each * columns + j  # the panel's place, row by row
            ax = axes[k // columns, k % columns]
            plot_timeline(r.trace, ax=ax, x=x, title=f"{s}, rank {r.rank}", annotate_peak=False)
            ax.set_ylim(0, top / scale * 1.25)
            for text in list(ax.texts):
                text.remove()  # phase and step labels would crowd the small panels: the legend names the shading
            xs = np.arange(len(r.trace.timeline)) if x == "event" else r.trace.timeline.time_s * 1e3
            for c in r.collectives:
                xi = xs[min(max(c.index, 0), len(xs) - 1)]
                kind = collective_kind(c.op)
                marker, filled = COLLECTIVE_MARKERS[kind]
                marked.setdefault(kind, set()).add(collective_name(c.op))
                ax.plot(
                    [xi],
                    [top / scale * 1.18],
                    marker=marker,
                    color="black",
                    markersize=4,
                    fillstyle="full" if filled else "none",
                    linestyle="none",
                )
            ax.set_xlabel("memory event" if x == "event" else "time (ms)", fontsize=8)
    for ax in axes.flat[sum(len(results[s]) for s in strategies) :]:
        ax.set_visible(False)  # a world that does not fill its last row
    markers = [
        (
            Line2D([], [], marker=COLLECTIVE_MARKERS[k][0], color="black", markersize=4, linestyle="none",
                   fillstyle="full" if COLLECTIVE_MARKERS[k][1] else "none"),
            f"{' / '.join(sorted(marked[k]))} issued",
        )
        for k in COLLECTIVE_MARKERS
        if k in marked
    ]  # fmt: skip
    legend_of_all(axes.flat, fig, extra=markers + phase_legend_entries(), columns=4)
    fig.suptitle(title or "Per-rank memory: same model, same global batch")
    return fig


def phase_seconds(trace: Trace, step: int, phase: str) -> float:
    """Wall time of ``step``'s first ``phase`` run, from its phase mark to the next one (s)."""
    marks = trace.phase_marks
    for a, b in zip(marks, marks[1:] + [None]):
        if a.step == step and a.phase == phase:
            return (b.time_s if b is not None else trace.duration_s) - a.time_s
    raise ValueError(f"step {step} has no {phase!r} phase")


def straggler_run(delay_s: float = 0.3, strategy: str = "ddp", world_size: int = 2) -> list[RankResult]:
    """One tracked step in which the last rank sleeps ``delay_s`` at the end of its forward (a slow GPU)."""
    job = RankJob(strategy, steps=1, batch_size=GLOBAL_BATCH, model=dict(CONFIG), straggler_s=delay_s)
    return run_world(job, world_size, timeout_s=300)[strategy]


def scaling_panel(strategy: str = "fsdp2_zero3", world_size: int = 2, micro_batches: int = 1):
    """Per-rank timelines of one strategy (one world per (world size, micro-batches), all strategies, cached),
    with its rows of the measured-vs-formula table printed above. Returns the Figure."""
    results = measure_world(world_size, micro_batches)
    print(format_rank_table([row for row in rank_rows(results) if row.strategy == strategy]))
    return plot_rank_timelines(
        {strategy: results[strategy]},
        title=f"{STRATEGIES[strategy]}: {world_size} ranks, {micro_batches} micro-batch(es) per rank",
    )


@dataclass(frozen=True)
class FormulaGap:
    """Why one rank's measured model states differ from the ZeRO formulas (bytes, measured minus formula).

    ``parameters == buffers + split + padding + at_rest`` and ``optimizer_state == step_counts + moments`` hold to
    the byte (:func:`formula_gaps` checks it)."""

    strategy: str
    rank: int
    parameters: int  # measured minus formula
    buffers: int  # tensors the model registers besides parameters (the causal mask), counted with parameters
    split: int  # this rank's shard minus an even 1/N share: FSDP cuts each parameter's dim 0 in whole rows
    padding: int  # FSDP pads each parameter's dim 0 to a multiple of N: the last rank's short shard is padded
    at_rest: int  # ZeRO-2's formula keeps whole parameters; FSDP2's ZeRO-2-like mode keeps only its shard at rest
    optimizer_state: int  # measured minus formula
    optimizer_formula: int  # the formula's optimizer state for this rank (for the relative gap)
    step_counts: int  # AdamW's "step" (a scalar tensor per parameter) on every rank holding state for it
    moments: int  # this rank's exp_avg + exp_avg_sq minus the formula's share (how the parameters were split)
    communication_peak: int  # the most bucket / all-gather / reduce-scatter memory alive at once (no formula term)

    @property
    def optimizer_relative(self) -> float:
        return self.optimizer_state / self.optimizer_formula


def formula_gaps(results: dict[str, list[RankResult]], buffers: int) -> list[FormulaGap]:
    """Each rank's :class:`FormulaGap`; ``buffers`` is the model's buffer bytes (measured from the model)."""
    out = []
    for ranks in results.values():
        for r in ranks:
            formula = {k: int(v) for k, v in zero_model_states(r.strategy, r.n_params, r.world_size).items()}
            sharded = r.torch_param_numel_bytes < 4 * r.n_params  # FSDP2 in either mode
            share = int(zero_model_states("fsdp2_zero3", r.n_params, r.world_size)["parameters"])
            steps = r.torch_state_by_key.get("step", 0)
            gap = FormulaGap(
                strategy=r.strategy,
                rank=r.rank,
                parameters=r.model_states["parameters"] - formula["parameters"],
                buffers=buffers,
                split=r.torch_param_numel_bytes - share if sharded else 0,
                padding=r.torch_param_bytes - r.torch_param_numel_bytes,
                at_rest=share - formula["parameters"] if sharded else 0,
                optimizer_state=r.model_states["optimizer_state"] - formula["optimizer_state"],
                optimizer_formula=formula["optimizer_state"],
                step_counts=steps,
                moments=r.torch_state_bytes - steps - formula["optimizer_state"],
                communication_peak=int(r.trace.timeline.category("communication").max()),
            )
            if gap.parameters != gap.buffers + gap.split + gap.padding + gap.at_rest or (
                gap.optimizer_state != gap.step_counts + gap.moments
            ):
                raise AssertionError(f"the terms do not add up to the measured gap: {gap}")
            out.append(gap)
    return out


def format_formula_gaps(gaps: list[FormulaGap]) -> str:
    cols = [
        Col("strategy", 15, align="<"),
        Col("rank", 4, "d"),
        Col("params", 10, "+,d"),
        Col("=buffers", 8, ",d"),
        Col("+split", 6, "+,d"),
        Col("+padding", 8, ",d"),
        Col("+at rest", 10, "+,d"),
        Col("opt state", 9, "+,d"),
        Col("(%)", 7, "+.2%"),
        Col("=steps", 6, ",d"),
        Col("+moments", 8, "+,d"),
        Col("comm peak", 10, ",d"),
    ]
    rows = [
        [
            g.strategy,
            g.rank,
            g.parameters,
            g.buffers,
            g.split,
            g.padding,
            g.at_rest,
            g.optimizer_state,
            g.optimizer_relative,
            g.step_counts,
            g.moments,
            g.communication_peak,
        ]
        for g in gaps
    ]
    return format_table(cols, rows, note="(bytes: measured minus formula, and the terms that make it up)")


def communication_at_peak(result: RankResult) -> tuple[int, list[int], Collective]:
    """(timeline index of the rank's communication peak, the communication storages alive there largest first,
    the last collective issued before it)."""
    timeline = result.trace.timeline.category("communication")
    index = int(np.argmax(timeline))
    alive = sorted((a.bytes for a in result.trace.live_allocations(index, "communication")), reverse=True)
    last = [c for c in result.collectives if c.index <= index][-1]
    return index, alive, last


@dataclass(frozen=True)
class SyncRow:
    """One DDP rank's step at ``micro_batches`` micro-batches: what it all-reduced and its peak (bytes)."""

    micro_batches: int
    all_reduces: int  # gradient all-reduces issued in the tracked step
    all_reduced: int  # bytes they carried
    peak: int
    peak_phase: str


def accumulation_sync(micro_batches=(1, 2, 4), world_size: int = 2) -> list[SyncRow]:
    """Rank 0 of a ``world_size``-rank DDP job at the lesson's global batch, dry-run on torch's fake process group
    for each micro-batch count: ``run_step`` runs all but the last micro-batch under DDP's ``no_sync()``, so the
    gradients are all-reduced once per step, whatever k."""

    rows = []
    for k in micro_batches:
        job = RankJob("ddp", steps=1, batch_size=GLOBAL_BATCH, micro_batches=k, model=dict(CONFIG))
        result = dry_run_rank(job, world_size).result
        reduces = [c for c in result.collectives if c.op.startswith("allreduce")]
        peak = result.peak
        rows.append(SyncRow(k, len(reduces), sum(c.bytes for c in reduces), peak.bytes, peak.phase))
    return rows


def format_accumulation_sync(rows: list[SyncRow]) -> str:
    """The :func:`accumulation_sync` rows as a table (MiB)."""
    cols = [
        Col("micro-batches", 13),
        Col("all-reduces", 11, ",d"),
        Col("all-reduced", 11, ".2f"),
        Col("rank peak", 9, ".2f"),
        Col("peak phase", 11, "", "<", "  "),
    ]
    table = [(r.micro_batches, r.all_reduces, r.all_reduced / MiB, r.peak / MiB, r.peak_phase) for r in rows]
    return format_table(cols, table, note="(MiB)")
