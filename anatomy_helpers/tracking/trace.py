"""What a :class:`~anatomy_helpers.tracking.tracker.StepTracker` recorded, and one way to ask it questions.

A :class:`Trace` holds one *sample* per allocation or free, in order. Every question the
lessons ask goes through its query methods, so no lesson re-implements them:

* windows: :meth:`Trace.window` (sample indices of a step and/or phase), :meth:`Trace.phases`,
  :meth:`Trace.phase`, :meth:`Trace.peak`, :meth:`Trace.optimizer_phase`;
* moments: :meth:`Trace.at` (bytes per category), :meth:`Trace.alive_at` (bytes per allocation),
  :meth:`Trace.live_allocations`, :meth:`Trace.live_by_module`;
* allocations: :meth:`Trace.allocation_record` (every alloc/free in order, for replay),
  :meth:`Trace.largest_allocation`.

Bytes everywhere; exact on CPU.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import numpy as np

from ..core.checks import positive_int
from ..core.tables import Col, format_table
from ..core.units import MiB, round_up
from .events import (
    CATEGORIES,
    PHASES,
    AllocationRecord,
    CudaMark,
    Event,
    LiveAllocation,
    OptimizerPhase,
    Peak,
    PhaseMark,
    PhaseSummary,
    SavedTensor,
    Timeline,
    check_phase,
)

# ---- the trace ----------------------------------------------------------------------------------------------


class Trace:
    """What a :class:`~anatomy_helpers.tracking.tracker.StepTracker` recorded. Bytes everywhere, exact on CPU.

    Per allocation id ``a``: ``alloc_category[a]`` (index into CATEGORIES) and ``alloc_module[a]`` (index into
    ``timeline.module_names``). Per timeline sample ``i``: ``alloc_ids[i]`` (which allocation changed) and
    ``alloc_deltas[i]`` (by how many bytes). ``baseline_ids`` / ``baseline_bytes``: the storages alive when
    tracking began.
    """

    def __init__(
        self,
        *,
        timeline: Timeline,
        alloc_category: np.ndarray,
        alloc_module: np.ndarray,
        alloc_ids: np.ndarray,
        alloc_deltas: np.ndarray,
        baseline_ids: np.ndarray,
        baseline_bytes: np.ndarray,
        phase_marks: list[PhaseMark],
        saved: list[SavedTensor],
        grad_param: dict[int, str],
        device: str,
        duration_s: float,
        cuda_at_entry: CudaMark | None = None,
        cuda_marks: list[CudaMark] | None = None,
        kernel_scratch_recorded: bool = False,
    ):
        self.timeline = timeline
        self.alloc_category = alloc_category
        self.alloc_module = alloc_module
        self.alloc_ids = alloc_ids
        self.alloc_deltas = alloc_deltas
        self.baseline_ids = baseline_ids
        self.baseline_bytes = baseline_bytes
        self.phase_marks = phase_marks
        self.saved = saved
        self.grad_param = grad_param  # gradient allocation id -> its parameter's name
        self.device = device
        self.duration_s = duration_s
        self.cuda_at_entry = cuda_at_entry  # CUDA only: the allocator's counters when tracking began
        self.cuda_marks = cuda_marks or []  # CUDA only: ... and at every phase change
        # Whether kernel scratch was measured (CPU, no other profiler running): if not, that category is 0
        # because it is unknown, not because there was none.
        self.kernel_scratch_recorded = kernel_scratch_recorded
        base = np.zeros(len(CATEGORIES), dtype=np.int64)
        np.add.at(base, alloc_category[baseline_ids], baseline_bytes)
        self.baseline: dict[str, int] = {c: int(b) for c, b in zip(CATEGORIES, base)}  # bytes when tracking began

    @classmethod
    def from_samples(cls, timeline: Timeline, phase_marks: list[PhaseMark], *, device: str) -> Trace:
        """A Trace of memory samples alone, without the per-allocation record (e.g. one read from torch.profiler):
        no allocation ids, no saved tensors, no baseline; its duration is the timeline's last time."""
        empty = np.zeros(0, dtype=np.int64)
        allocations = ("alloc_category", "alloc_module", "alloc_ids", "alloc_deltas", "baseline_ids", "baseline_bytes")
        duration_s = float(timeline.time_s[-1]) if len(timeline) else 0.0
        return cls(
            timeline=timeline, phase_marks=phase_marks, saved=[], grad_param={}, device=device, duration_s=duration_s,
            **dict.fromkeys(allocations, empty),
        )  # fmt: skip

    @classmethod
    def from_events(
        cls,
        *,
        events: np.ndarray,
        n_baseline: int,
        start_ns: int,
        alloc_category: np.ndarray,
        module_names: list[str],
        phase_marks: list[PhaseMark],
        cuda_samples: np.ndarray | None = None,
        cuda_marks: list[CudaMark] | None = None,
        **fields,
    ) -> Trace:
        """A Trace from a recorder's event list.

        ``events``: (n, 6) int64, one :class:`~anatomy_helpers.tracking.events.Event` per row (its fields are the
        columns, in order), the first ``n_baseline`` of them the storages alive when recording began.
        ``phase_marks`` and ``cuda_marks`` index those rows (they are re-indexed to timeline samples here);
        ``cuda_samples``: (n, 2) memory_allocated / memory_reserved per row, on CUDA. The other keyword arguments
        are the Trace's own.
        """
        base = dict(zip(Event._fields, events[:n_baseline].T))  # column name -> the baseline rows' values
        ev = dict(zip(Event._fields, events[n_baseline:].T))  # ... and the timeline's
        n = len(events) - n_baseline
        deltas = np.zeros((n, len(CATEGORIES)), dtype=np.int64)
        deltas[np.arange(n), alloc_category[ev["alloc_id"]]] = ev["delta"]
        baseline = np.zeros(len(CATEGORIES), dtype=np.int64)
        np.add.at(baseline, alloc_category[base["alloc_id"]], base["delta"])
        cuda = None if cuda_samples is None else cuda_samples[n_baseline:]
        timeline = Timeline(
            time_s=(ev["time_ns"] - start_ns) / 1e9,
            step=ev["step"].copy(),
            phase=ev["phase"].copy(),
            module=ev["module"].copy(),
            bytes=baseline + np.cumsum(deltas, axis=0),
            module_names=module_names,
            cuda_allocated=None if cuda is None else cuda[:, 0],
            cuda_reserved=None if cuda is None else cuda[:, 1],
        )
        return cls(
            timeline=timeline,
            alloc_category=alloc_category,
            alloc_ids=ev["alloc_id"].copy(),
            alloc_deltas=ev["delta"].copy(),
            baseline_ids=base["alloc_id"].copy(),
            baseline_bytes=base["delta"].copy(),
            phase_marks=[dataclasses.replace(m, index=m.index - n_baseline) for m in phase_marks],
            cuda_marks=[dataclasses.replace(m, index=m.index - n_baseline) for m in cuda_marks or []],
            **fields,
        )

    # ---- windows ------------------------------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        """Every step number that has samples (a trailing idle step included)."""
        return np.unique(self.timeline.step).tolist()

    def training_steps(self) -> list[int]:
        """Steps that ran a forward pass."""
        return sorted({m.step for m in self.phase_marks if m.phase == "forward"})

    def window(self, step: int | None = None, phase: str | None = None) -> np.ndarray:
        """Timeline sample indices of ``step`` and/or ``phase`` (every sample by default)."""
        check_phase(phase)
        mask = np.ones(len(self.timeline), dtype=bool)
        if step is not None:
            mask &= self.timeline.step == step
        if phase is not None:
            mask &= self.timeline.phase == PHASES.index(phase)
        return np.flatnonzero(mask)

    def _check_index(self, index: int) -> None:
        if not isinstance(index, (int, np.integer)) or not -1 <= index < len(self.timeline):
            raise ValueError(
                f"index must be a sample index from -1 (when tracking began) to {len(self.timeline) - 1}, got {index!r}"
            )

    def at(self, index: int) -> dict[str, int]:
        """Bytes per category after sample ``index`` (-1: when tracking began)."""
        self._check_index(index)
        if index < 0:
            return dict(self.baseline)
        return {c: int(b) for c, b in zip(CATEGORIES, self.timeline.bytes[index])}

    def _peak_at(self, i: int) -> Peak:
        tl = self.timeline
        module = tl.module_names[tl.module[i]]
        return Peak(int(tl.total[i]), i, int(tl.step[i]), PHASES[tl.phase[i]], module, self.at(i))

    def peak(self, step: int | None = None, phase: str | None = None) -> Peak:
        """The highest total in the given step and/or phase (the whole trace by default).

        A phase's peak counts the memory it starts with (what the previous phase left alive) as its own: an
        optimizer that allocates nothing, say, peaks at its first moment, before it frees anything.
        """
        if phase is not None:
            runs = [ph.peak for ph in self._phases if ph.phase == phase and (step is None or ph.step == step)]
            if runs:
                return max(runs, key=lambda pk: pk.bytes)
        idx = self.window(step, phase)
        if len(idx) == 0:
            raise ValueError(f"no samples for step={step!r}, phase={phase!r}; steps recorded: {self.steps}")
        return self._peak_at(int(idx[np.argmax(self.timeline.total[idx])]))

    def _phase_peak(self, start: int, end: int) -> Peak:
        """The peak of the run of samples ``start..end``, counting the moment just before it."""
        tl = self.timeline
        first = max(start - 1, 0)
        i = first + int(np.argmax(tl.total[first : end + 1]))
        if i >= start:
            return self._peak_at(i)
        # the phase's first moment holds what the last phase left: named after the phase's first module
        module = tl.module_names[tl.module[start]]
        return Peak(int(tl.total[i]), i, int(tl.step[start]), PHASES[tl.phase[start]], module, self.at(i))

    @cached_property
    def _phases(self) -> list[PhaseSummary]:
        tl = self.timeline
        if len(tl) == 0:
            return []
        key = tl.step * len(PHASES) + tl.phase
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        ends = np.r_[starts[1:] - 1, len(tl) - 1]
        out = []
        for s, e in zip(starts.tolist(), ends.tolist()):
            peak = self._phase_peak(s, e)
            dominant = max(peak.breakdown, key=peak.breakdown.get)
            out.append(PhaseSummary(peak.step, peak.phase, s, e, peak, self.at(e), dominant))
        return out

    def phases(self) -> list[PhaseSummary]:
        """One summary per (step, phase) run of samples, in time order."""
        return list(self._phases)

    def before_last_optimizer_step(self) -> dict[str, int]:
        """Bytes per category just before the last training step's optimizer phase (what a rank holds as its
        model states: parameters, gradients, optimizer state)."""
        return self.at(self.phase(self.training_steps()[-1], "optimizer").start - 1)

    def phase(self, step: int, phase: str) -> PhaseSummary:
        """The summary of ``phase`` in ``step`` (the first run of it, if the phase was entered twice)."""
        check_phase(phase)
        for ph in self._phases:
            if ph.step == step and ph.phase == phase:
                return ph
        raise ValueError(f"step {step} has no {phase!r} phase; training steps recorded: {self.training_steps()}")

    def optimizer_phase(self, step: int) -> OptimizerPhase:
        """Summarise ``step``'s optimizer phase (``optimizer.step()`` through ``zero_grad()``).

        The peak is taken over the phase and the moment just before it, when every gradient is alive:
        an optimizer that allocates nothing (plain SGD, fused Adam in later steps) peaks right there.
        """
        ph = self.phase(step, "optimizer")
        before = self.at(ph.start - 1)
        totals = self.timeline.total[ph.start : ph.end + 1]
        i = ph.start + int(np.argmax(totals))
        peak_index, peak = (i, self.at(i)) if totals.max() > sum(before.values()) else (ph.start - 1, before)
        return OptimizerPhase(
            step=step,
            start=ph.start,
            end=ph.end,
            state_before=before["optimizer_state"],
            state_after=ph.at_end["optimizer_state"],
            temporaries=peak["temporaries"] - before["temporaries"],
            extra_peak=sum(peak.values()) - sum(before.values()),
            peak=peak,
            peak_index=peak_index,
        )

    def step_times_s(self) -> dict[int, float]:
        """Wall time of each step in seconds, from its first phase change to the next step's."""
        starts: dict[int, float] = {}
        for m in self.phase_marks:
            starts.setdefault(m.step, m.time_s)
        steps = sorted(starts)
        ends = [starts[s] for s in steps[1:]] + [self.duration_s]
        ran = set(self.training_steps())
        return {s: e - starts[s] for s, e in zip(steps, ends) if s in ran}

    # ---- moments --------------------------------------------------------------------------------------------
    def alive_at(self, index: int) -> np.ndarray:
        """Bytes alive per allocation id after sample ``index`` (-1: when tracking began)."""
        self._check_index(index)
        alive = np.zeros(len(self.alloc_category), dtype=np.int64)
        np.add.at(alive, self.baseline_ids, self.baseline_bytes)
        np.add.at(alive, self.alloc_ids[: index + 1], self.alloc_deltas[: index + 1])
        return alive

    def live_allocations(self, index: int, category: str | None = None) -> list[LiveAllocation]:
        """Each storage alive after sample ``index`` (of ``category``, or all), largest first."""
        if category is not None and category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        alive = self.alive_at(index)
        names = self.timeline.module_names
        rows = [
            LiveAllocation(int(alive[a]), names[self.alloc_module[a]], CATEGORIES[self.alloc_category[a]], int(a))
            for a in np.flatnonzero(alive)
        ]
        rows = [r for r in rows if category is None or r.category == category]
        return sorted(rows, key=lambda r: (-r.bytes, r.alloc_id))

    def live_by_module(self, index: int, depth: int = 2) -> dict[str, dict[str, int]]:
        """Bytes alive after sample ``index``, by the module that allocated them and category.

        Module names are cut to ``depth`` parts (``blocks.0.attn.qkv`` -> ``blocks.0``).
        Parameters count under the module that owns them.
        """
        positive_int("depth", depth)
        out: dict[str, dict[str, int]] = {}
        for r in self.live_allocations(index):
            name = ".".join(r.module.split(".")[:depth])
            out.setdefault(name, dict.fromkeys(CATEGORIES, 0))[r.category] += r.bytes
        return out

    # ---- allocations ----------------------------------------------------------------------------------------
    def allocation_record(self) -> AllocationRecord:
        """Every allocation and free in order, the baseline storages first (for replaying them through an
        allocator model)."""
        tl = self.timeline
        n0 = len(self.baseline_ids)
        ids = np.r_[self.baseline_ids, self.alloc_ids].astype(np.int64)
        return AllocationRecord(
            sample=np.r_[np.full(n0, -1), np.arange(len(tl))].astype(np.int64),
            time_s=np.r_[np.zeros(n0), tl.time_s],
            alloc_id=ids,
            bytes=np.r_[self.baseline_bytes, self.alloc_deltas].astype(np.int64),
            category=self.alloc_category[ids],
            step=np.r_[np.zeros(n0, dtype=np.int64), tl.step],
            phase=np.r_[np.zeros(n0, dtype=np.int64), tl.phase],
        )

    def largest_allocation(self, category: str, step: int | None = None, phase: str | None = None) -> int:
        """The largest single allocation (bytes) of ``category`` made during ``phase`` of ``step`` (0 if none)."""
        rec = self.allocation_record()
        mask = rec.where(step=step, phase=phase, category=category, allocations=True)
        return int(rec.bytes[mask].max()) if mask.any() else 0

    def replay_baseline(self, round_to: int = 1) -> int:
        """Bytes alive when tracking began, each allocation rounded up to ``round_to`` bytes."""
        return int(round_up(self.baseline_bytes, round_to).sum())

    def replay_totals(self, round_to: int = 1) -> np.ndarray:
        """Total live bytes after each sample, each allocation rounded up to ``round_to`` bytes.

        ``round_to=512`` mimics the CUDA caching allocator's block sizes, so the
        result can be compared with ``torch.cuda.memory_allocated()``.
        """
        d = self.alloc_deltas
        return self.replay_baseline(round_to) + np.cumsum(np.sign(d) * round_up(np.abs(d), round_to))

    def categories_present(self) -> list[str]:
        """The categories that hold bytes at some moment of the trace (the rest are left out of tables)."""
        held = self.timeline.bytes.max(axis=0) if len(self.timeline) else np.zeros(len(CATEGORIES))
        return [c for c, b, base in zip(CATEGORIES, held, self.baseline.values()) if b or base]

    def table_categories(self) -> list[str]:
        """The columns of :meth:`table`: categories that reach 0.005 MiB at some phase's peak (the rest would
        read 0.00 in every row)."""
        peaks = [ph.peak for ph in self._phases if ph.phase != "idle"]
        return [c for c in self.categories_present() if any(pk.breakdown[c] >= MiB / 200 for pk in peaks)]

    # ---- printing -------------------------------------------------------------------------------------------
    def table(self) -> str:
        """Phase x category table in MiB; each row is the moment of that phase's peak."""
        shown = self.table_categories()
        cols = [Col("step", 4), Col("phase", 9, align="<")]
        cols += [Col(c.replace("_", " "), max(11, len(c)), ".2f") for c in shown]
        cols += [Col("total", 9, ".2f"), Col("peak in", 20, align="<", gap="  ")]
        rows = [
            (ph.step, ph.phase, *(ph.peak.breakdown[c] / MiB for c in shown), ph.peak.bytes / MiB, ph.peak.module)
            for ph in self._phases
            if ph.phase != "idle"
        ]
        return format_table(cols, rows, note="(MiB, at each phase's peak)", footer=[f"peak: {self.peak()}"])
