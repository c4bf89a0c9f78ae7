"""Lesson 07, profiling a training step with PyTorch's own tools, next to the course's tracker.

What only this lesson uses: the profiled loop packaged for the exercise (:func:`profile_steps`), the ops of each
phase (:func:`phase_ops`, :func:`top_ops`), the per-step wall-time table, the tracker-vs-profiler tables, the
split of the profiler's unknown bytes, the memory-viz page shown inside the notebook, and the committed GPU
reference snapshot. Reading the profiler's memory timeline into the course's types is core
(:mod:`anatomy_helpers.tracking.profiler`).

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import html
import json
import pickle
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule
from torch.profiler._memory_profiler import Action, TensorKey

from ..core.tables import Col, format_table
from ..core.units import MiB
from ..prediction.snapshot import GPU_REFERENCE
from ..tracking.events import CATEGORIES, PHASES
from ..tracking.profiler import (
    COURSE_CATEGORY,
    STEP_PHASES,
    PhaseSpan,
    ProfilerTimeline,
    load_memory_timeline,
    phase_spans,
    profiler_trace,
    quiet_profiler,
    sample_phases,
)
from ..tracking.trace import Trace
from ..training.step import StepHooks, StepPlan, run_step

# The course's categories that hold what the profiler calls TEMPORARY, AUTOGRAD_DETAIL or unknown.
SCRATCH_CATEGORIES = tuple(c for c in ("temporaries", "kernel_scratch") if c in CATEGORIES)
PROFILER_SCRATCH = ("TEMPORARY", "AUTOGRAD_DETAIL", "UNKNOWN")


# ---- the profiled loop, for the exercise -----------------------------------------------------------------------


@dataclass
class ProfiledRun:
    """A profiled run of training steps: the profiler, its phase spans, its memory timeline and that timeline as
    a Trace (:func:`~anatomy_helpers.tracking.profiler.profiler_trace`)."""

    prof: object  # torch.profiler.profile, finished
    spans: list[PhaseSpan]
    timeline: ProfilerTimeline
    trace: Trace


class RecordPhases(StepHooks):
    """Each phase of the step inside a ``torch.profiler.record_function`` range of its name, so the profile can be
    cut into steps and phases (:func:`~anatomy_helpers.tracking.profiler.phase_spans`)."""

    def phase(self, name: str):

        return record_function(name)


def profile_steps(model, optimizer, steps: int = 2, batch_size: int = 8, *, seed: int = 0) -> ProfiledRun:
    """Profile ``steps`` training steps as notebook 07 does (schedule, record_function phases, memory), and read
    the memory timeline back. Each step is the course's :func:`~anatomy_helpers.training.step.run_step` on the batches
    of
    ``track_steps`` (same ``seed``), so a tracked run of a model built the same way runs the same step on the same
    data; the loss is not read, as notebook 07's loop does not read it."""

    plan = StepPlan(batch_size, seed=seed, read_loss=False, hooks=RecordPhases())
    device = next(model.parameters()).device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with (
        quiet_profiler(),
        profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
            profile_memory=True,
            record_shapes=True,
            with_stack=True,
        ) as prof,
    ):
        prof.step()  # the profiler's own warm-up, with no training in it: training step 1 is recorded
        for i in range(steps):
            run_step(model, optimizer, plan, i)
            prof.step()
    spans = phase_spans(prof)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of CUDA memory snapshots
        path = f"{tmp}/memory_timeline.json"
        prof.export_memory_timeline(path, device=_device_str(device))
        timeline = load_memory_timeline(path)
    return ProfiledRun(prof, spans, timeline, profiler_trace(timeline, spans, device=_device_str(device)))


def _device_str(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"


# ---- ops per phase ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpRow:
    """One op name in one phase of one step (``step`` 0: summed over steps)."""

    step: int
    phase: str
    name: str
    calls: int
    self_bytes: int  # allocated minus freed by the op itself (not its children), as the profiler counts
    self_time_us: float


def op_averages(prof, group_by_input_shape: bool = False):
    """``prof.key_averages(group_by_input_shape=...)`` without the Python-function rows ``with_stack=True`` adds
    (``file.py(line): name``, ``<built-in ...>``): in a notebook they include the kernel's own background threads (a
    ``select`` waiting on its sockets, a ``sleep``), which would top a table sorted by time without being part of
    the step. Returns an ``EventList``: its ``.table(sort_by=..., row_limit=...)`` prints as ``key_averages()``'
    does (the same list, with its settings, cut down in place)."""
    averages = prof.key_averages(group_by_input_shape=group_by_input_shape)
    averages[:] = [e for e in averages if ".py(" not in e.key and not e.key.startswith("<built-in")]
    return averages


def phase_ops(prof, spans: Sequence[PhaseSpan]) -> list[OpRow]:
    """Every ``aten::`` op of a finished profile, counted per (step, phase, name) of the span it starts in.

    Self memory is the profiler's own figure: what the op allocated minus what it freed, children excluded.
    """

    origin_us = prof.profiler.kineto_results.trace_start_ns() / 1e3
    events = [e for e in prof.events() if e.name.startswith("aten::") and e.device_type == DeviceType.CPU]
    starts = np.array([origin_us + e.time_range.start for e in events])
    step, phase = sample_phases(starts, spans) if events else (np.zeros(0), np.zeros(0))
    sums: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])
    for e, s, p in zip(events, step.tolist(), phase.tolist()):
        if PHASES[p] == "idle":
            continue
        acc = sums[(s, PHASES[p], e.name)]
        acc[0] += 1
        acc[1] += e.self_cpu_memory_usage + getattr(e, "self_device_memory_usage", 0)
        acc[2] += e.self_cpu_time_total
    return [OpRow(s, p, n, c, b, t) for (s, p, n), (c, b, t) in sums.items()]


def top_ops(
    rows: Sequence[OpRow], phase: str, *, step: int | None = None, by: str = "self_bytes", n: int = 3
) -> list[OpRow]:
    """The ``n`` ops of ``phase`` (in ``step``, or summed over every step) with the largest ``by``
    ("self_bytes" or "self_time_us"); ties go by name."""
    if by not in ("self_bytes", "self_time_us"):
        raise ValueError(f"by must be 'self_bytes' or 'self_time_us', got {by!r}")
    sums: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
    for r in rows:
        if r.phase == phase and (step is None or r.step == step):
            acc = sums[r.name]
            acc[0] += r.calls
            acc[1] += r.self_bytes
            acc[2] += r.self_time_us
    out = [OpRow(step or 0, phase, name, c, b, t) for name, (c, b, t) in sums.items()]
    return sorted(out, key=lambda r: (-getattr(r, by), r.name))[:n]


def format_top_ops(rows: Sequence[OpRow], *, time: bool = False) -> str:
    """A table of ops: phase, name, calls, self memory (MiB) and, with ``time``, self CPU time (ms)."""
    cols = [Col("phase", 9, align="<"), Col("op", 34, align="<", gap="  "), Col("calls", 6), Col("self MiB", 9, "+.2f")]
    if time:
        cols.append(Col("self ms", 9, ".1f"))
    lines = [(r.phase, r.name, r.calls, r.self_bytes / MiB, *((r.self_time_us / 1e3,) if time else ())) for r in rows]
    return format_table(cols, lines)


def op_count_changes(rows: Sequence[OpRow], phase: str, first: int, later: int) -> dict[str, tuple[int, int]]:
    """Ops whose call count in ``phase`` differs between step ``first`` and step ``later``: name -> (counts)."""
    counts = {s: {r.name: r.calls for r in rows if r.step == s and r.phase == phase} for s in (first, later)}
    names = sorted(set(counts[first]) | set(counts[later]))
    return {
        n: (counts[first].get(n, 0), counts[later].get(n, 0))
        for n in names
        if counts[first].get(n, 0) != counts[later].get(n, 0)
    }


def step_time_table(spans: Sequence[PhaseSpan]) -> str:
    """Wall time (ms) of each phase of each step, as the profiler measured its record_function ranges."""
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for s in spans:
        by_step[s.step][s.phase] = by_step[s.step].get(s.phase, 0.0) + s.duration_ms
    cols = [Col("step", 4)] + [Col(p, 10, ".0f") for p in STEP_PHASES] + [Col("total", 9, ".0f")]
    rows = [(s, *(ph.get(p) for p in STEP_PHASES), sum(ph.values())) for s, ph in sorted(by_step.items())]
    return format_table(cols, rows, note="(ms of wall time, with the profiler's overhead)")


# ---- the profiler next to the tracker --------------------------------------------------------------------------


@dataclass(frozen=True)
class PeakPair:
    """One step's peak as the tracker and as the profiler measured it (bytes)."""

    step: int
    tracker: int
    tracker_phase: str
    profiler: int
    profiler_phase: str

    @property
    def difference(self) -> int:
        return self.profiler - self.tracker


def step_peaks(tracker: Trace, profiled: Trace) -> list[PeakPair]:
    """Each training step's peak, tracker and profiler (a :func:`profiler_trace`), side by side."""
    rows = []
    for s in tracker.training_steps():
        a, b = tracker.peak(step=s), profiled.peak(step=s)
        rows.append(PeakPair(s, a.bytes, a.phase, b.bytes, b.phase))
    return rows


def format_step_peaks(rows: Sequence[PeakPair]) -> str:
    cols = [
        Col("step", 4),
        Col("tracker", 9, ".2f"),
        Col("in", 9, align="<"),
        Col("profiler", 9, ".2f"),
        Col("in", 9, align="<"),
        Col("profiler - tracker (bytes)", 27, "+,d"),
    ]
    lines = [(r.step, r.tracker / MiB, r.tracker_phase, r.profiler / MiB, r.profiler_phase, r.difference) for r in rows]
    return format_table(cols, lines, note="(MiB)")


def category_table(tracker: Trace, profiled: Trace, timeline: ProfilerTimeline, step: int) -> str:
    """Bytes per category at ``step``'s peak: the tracker's, the profiler's own categories and what they count
    as in the course's, and the difference per course category (categories neither tool has are left out)."""
    at_t = tracker.peak(step=step).breakdown
    at_p = timeline.at(profiled.peak(step=step).index)
    mapped = dict.fromkeys(CATEGORIES, 0)
    for name, b in at_p.items():
        mapped[COURSE_CATEGORY[name]] += b
    cols = [
        Col("course category", 16, align="<"),
        Col("tracker", 12, ",d"),
        Col("profiler", 12, ",d"),
        Col("difference", 11, "+,d"),
        Col("the profiler's categories", 40, align="<", gap="   "),
    ]
    rows = []
    for c in CATEGORIES:
        if not (at_t[c] or mapped[c]):
            continue  # neither tool has any: leave the row out
        theirs = ", ".join(f"{n} {b:,}" for n, b in at_p.items() if COURSE_CATEGORY[n] == c and b)
        rows.append((c.replace("_", " "), at_t[c], mapped[c], mapped[c] - at_t[c], theirs or "-"))
    total = (sum(at_t.values()), sum(mapped.values()))
    footer = [f"total: tracker {total[0]:,}, profiler {total[1]:,}"]
    return format_table(cols, rows, note=f"(bytes, at step {step}'s peak)", footer=footer)


@dataclass(frozen=True)
class ScratchRow:
    """What each tool counts as "the rest" at one phase's peak (bytes): the tracker's temporaries (and kernel
    scratch where it has that category), the profiler's TEMPORARY + AUTOGRAD_DETAIL + unknown."""

    step: int
    phase: str
    tracker: int
    profiler: int
    profiler_by_category: dict  # the three profiler categories at its peak


def scratch_rows(tracker: Trace, profiled: Trace, timeline: ProfilerTimeline) -> list[ScratchRow]:
    rows = []
    for ph in tracker.phases():
        if ph.phase == "idle":
            continue
        theirs = timeline.at(profiled.phase(ph.step, ph.phase).peak.index)
        by = {c: theirs[c] for c in PROFILER_SCRATCH}
        ours = sum(ph.peak.breakdown[c] for c in SCRATCH_CATEGORIES)
        rows.append(ScratchRow(ph.step, ph.phase, ours, sum(by.values()), by))
    return rows


def format_scratch_rows(rows: Sequence[ScratchRow]) -> str:
    cols = [Col("step", 4), Col("phase", 9, align="<"), Col("tracker", 9, ".2f"), Col("profiler", 9, ".2f")]
    cols += [Col(c, len(c), ".2f") for c in PROFILER_SCRATCH]
    lines = [
        (
            r.step,
            r.phase,
            r.tracker / MiB,
            r.profiler / MiB,
            *(r.profiler_by_category[c] / MiB for c in PROFILER_SCRATCH),
        )
        for r in rows
    ]
    return format_table(cols, lines, note="(MiB at each phase's peak)")


@dataclass(frozen=True)
class UnknownPeak:
    """The profiler's unknown bytes in one (step, phase), split by what they are (peak of each, bytes)."""

    step: int
    phase: str
    tensors: int  # tensors whose category the profiler could not infer
    no_tensor: int  # allocations that never became a tensor: memory a kernel takes for itself


def unknown_split(prof, spans: Sequence[PhaseSpan], device: str = "cpu") -> list[UnknownPeak]:
    """Split the profiler's UNKNOWN column into its two kinds, replaying its memory profile as
    ``export_memory_timeline`` does (reads torch's private ``_memory_profile``; recomputes it, a few seconds)."""

    mem = prof._memory_profile()
    dev = torch.device(device)
    live = np.zeros(2, dtype=np.int64)  # [unknown tensors, no tensor]
    times, states = [], []

    def add(key, version, delta):
        if not isinstance(key, TensorKey):
            live[1] += delta
        elif mem._categories.get(key, version) is None:
            live[0] += delta

    for t, action, (key, version), nbytes in mem.timeline:
        if key.device != dev:
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            add(key, version, nbytes)
        elif action == Action.INCREMENT_VERSION:
            add(key, version, -nbytes)
            add(key, version + 1, nbytes)
        elif action == Action.DESTROY:
            add(key, version, -nbytes)
        times.append(t / 1e3)
        states.append(live.copy())
    peaks: dict[tuple[int, str], np.ndarray] = {}
    if times:
        step, phase = sample_phases(np.array(times), spans)
        for s, p, state in zip(step.tolist(), phase.tolist(), states):
            key = (s, PHASES[p])
            peaks[key] = np.maximum(peaks.get(key, state), state)
    return [UnknownPeak(s, p, int(v[0]), int(v[1])) for (s, p), v in peaks.items() if p != "idle"]


@dataclass(frozen=True)
class InOneOpRow:
    """Memory that lives and dies inside one op, per (step, phase): the most of it alive at once (bytes), as the
    profiler (TEMPORARY; unknown allocations that never became a tensor) and the tracker (kernel scratch; None
    for a tracker without that category) saw it."""

    step: int
    phase: str
    profiler_temporary: int
    profiler_no_tensor: int
    tracker_kernel_scratch: int | None


def in_one_op_rows(
    tracker: Trace, profiled: Trace, timeline: ProfilerTimeline, unknown: Sequence[UnknownPeak]
) -> list[InOneOpRow]:
    no_tensor = {(u.step, u.phase): u.no_tensor for u in unknown}
    has_scratch = "kernel_scratch" in CATEGORIES
    rows = []
    for ph in tracker.phases():
        if ph.phase == "idle":
            continue
        theirs = timeline.category("TEMPORARY")[profiled.window(ph.step, ph.phase)]
        ours = tracker.timeline.category("kernel_scratch")[tracker.window(ph.step, ph.phase)] if has_scratch else None
        rows.append(
            InOneOpRow(
                ph.step,
                ph.phase,
                int(theirs.max()) if len(theirs) else 0,
                no_tensor.get((ph.step, ph.phase), 0),
                None if ours is None else int(ours.max()),
            )
        )
    return rows


def format_in_one_op_rows(rows: Sequence[InOneOpRow]) -> str:
    cols = [
        Col("step", 4),
        Col("phase", 9, align="<"),
        Col("profiler TEMPORARY", 18, ",d"),
        Col("unknown, no tensor", 18, ",d"),
        Col("tracker kernel scratch", 22, ",d"),
    ]
    lines = [(r.step, r.phase, r.profiler_temporary, r.profiler_no_tensor, r.tracker_kernel_scratch) for r in rows]
    return format_table(cols, lines, note="(bytes, the most alive at once in each phase)")


def event_counts(prof, spans: Sequence[PhaseSpan], name: str) -> dict[int, int]:
    """How many events called ``name`` (an op, or a runtime call such as ``cudaMalloc``) start in each step."""
    origin_us = prof.profiler.kineto_results.trace_start_ns() / 1e3
    starts = np.array([origin_us + e.time_range.start for e in prof.events() if e.name == name])
    counts = dict.fromkeys(sorted({s.step for s in spans}), 0)
    if len(starts):
        for s in sample_phases(starts, spans)[0].tolist():
            counts[s] += 1
    return counts


def check_answer(name: str, answer: str | None, measured: str) -> bool | None:
    """Print whether ``answer`` is ``measured`` (without revealing it while there is no answer yet)."""
    if answer is None:
        print(
            f"{name}: no answer yet. Put yours in the variable above and re-run this cell; the measured one is "
            "revealed when you do."
        )
        return None
    ok = answer == measured
    print(f"{name}: you said {answer!r}, measured {measured!r} -> " + ("right." if ok else "look again."))
    return ok


# ---- snapshots -------------------------------------------------------------------------------------------------


def memory_viz_html(snapshot: dict, label: str, height: int = 460):
    """PyTorch's memory viewer (``torch.cuda._memory_viz.trace_plot``) for ``snapshot``, shown inside the notebook
    under ``label`` (an iframe; the viewer loads its script from the web, so it needs a connection)."""
    from IPython.display import HTML  # a notebook's display: not on import
    from torch.cuda import _memory_viz  # loaded when a snapshot is drawn

    page = _memory_viz.trace_plot(snapshot)
    return HTML(
        f"<p><b>{html.escape(label)}</b></p>"
        f'<iframe srcdoc="{html.escape(page, quote=True)}" style="width:100%;height:{height}px;border:1px solid #ccc">'
        "</iframe>"
    )


def load_gpu_reference(path: Path = GPU_REFERENCE) -> tuple[dict, dict] | None:
    """(snapshot, what was recorded) of the real GPU snapshot ``scripts/record_gpu_reference.py`` wrote: the
    pickle and the JSON beside it (package data). None when none is committed."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    meta = path.with_suffix(".json")
    return snapshot, (json.loads(meta.read_text()) if meta.exists() else {})


def snapshot_summary(snapshot: dict) -> tuple[int, int, int]:
    """(segments, reserved bytes, allocated bytes) of a snapshot's final state."""
    segs = snapshot["segments"]
    allocated = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
    return len(segs), sum(s["total_size"] for s in segs), allocated
