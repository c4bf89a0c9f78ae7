"""What a :class:`~anatomy_helpers.tracker.StepTracker` recorded, and one way to ask it questions.

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

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .tables import Col, format_table
from .units import MiB, round_up

# Lower index wins when a storage qualifies twice: a weight saved for backward
# stays a parameter, the token ids saved by the embedding stay inputs.
CATEGORIES = ("parameters", "optimizer_state", "gradients", "inputs", "activations", "temporaries")
PARAMETERS, OPTIMIZER_STATE, GRADIENTS, INPUTS, ACTIVATIONS, TEMPORARIES = range(len(CATEGORIES))
PHASES = ("idle", "forward", "backward", "optimizer")
IDLE, FORWARD, BACKWARD, OPTIMIZER = range(len(PHASES))

# Module names used outside the model's own modules.
NO_MODULE, ROOT, OPT_STEP, OPT_ZERO_GRAD = "-", "model", "optimizer.step", "optimizer.zero_grad"

# The parts of the course GPT, in the order forward runs them.
EMBEDDINGS, HEAD = "embeddings", "head"
_EMBEDDING_MODULES = ("tok_emb", "pos_emb", "drop")
_HEAD_MODULES = ("ln_f", "lm_head", ROOT)  # the root's own ops: the loss


def model_part(module_name: str) -> str | None:
    """The part of the course GPT a module belongs to: ``"embeddings"``, ``"blocks.<i>"`` or ``"head"``.

    ``"blocks.2.mlp.fc"`` -> ``"blocks.2"``; ``"tok_emb"`` -> ``"embeddings"``; ``"ln_f"``, ``"lm_head"``
    and the root ``"model"`` (where the loss is computed) -> ``"head"``. Names outside the model
    (``"-"``, ``"optimizer.step"`` ...) give None.
    """
    parts = module_name.split(".")
    if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
        return f"blocks.{parts[1]}"
    if parts[0] in _EMBEDDING_MODULES:
        return EMBEDDINGS
    if parts[0] in _HEAD_MODULES:
        return HEAD
    return None


def model_parts(n_layer: int) -> list[str]:
    """The parts in forward order: embeddings, blocks.0 .. blocks.<n_layer-1>, head."""
    return [EMBEDDINGS, *(f"blocks.{i}" for i in range(n_layer)), HEAD]


def _check_phase(phase: str | None) -> None:
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


# ---- typed records --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseMark:
    """A phase change: from timeline sample ``index`` on, the tracker was in ``phase`` of ``step``."""

    index: int
    time_s: float  # seconds since tracking began
    step: int
    phase: str


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd saved for backward, as the tracker saw it being packed."""

    step: int
    module: str  # the module running when it was saved
    shape: tuple
    dtype: object  # torch.dtype
    bytes: int  # the saved view's own bytes
    storage: int  # allocation id: several saved views may share one storage
    storage_bytes: int  # the whole storage, what the tracker counts
    category: str  # what the storage turned out to be (a weight saved for backward stays a parameter)


@dataclass(frozen=True)
class CudaMark:
    """The CUDA caching allocator's own counters (bytes) just before timeline sample ``index``."""

    index: int  # -1: when tracking began
    allocated: int  # memory_allocated()
    reserved: int  # memory_reserved()
    requested: int  # what the tensors asked for, before rounding


@dataclass
class AllocationRecord:
    """Every allocation and free in order, one row each (numpy columns of equal length).

    ``sample`` is the timeline index (-1 for storages already alive when tracking began),
    ``bytes`` is positive for an allocation and negative for a free, ``category`` an index into
    CATEGORIES, ``step`` 0 for the rows alive at the start, ``phase`` an index into PHASES.
    """

    sample: np.ndarray
    time_s: np.ndarray
    alloc_id: np.ndarray
    bytes: np.ndarray
    category: np.ndarray
    step: np.ndarray
    phase: np.ndarray

    def __post_init__(self):
        lengths = {name: len(getattr(self, name)) for name in self.__dataclass_fields__}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"an allocation record's columns must have one length each, got {lengths}")

    def __len__(self) -> int:
        return len(self.bytes)

    def rows_through(self, step: int | None) -> int:
        """How many rows belong to steps up to ``step`` (all of them for None)."""
        return len(self) if step is None else int(np.searchsorted(self.step, step + 1))

    def head(self, rows: int) -> AllocationRecord:
        """The first ``rows`` rows."""
        return AllocationRecord(**{name: getattr(self, name)[:rows] for name in self.__dataclass_fields__})

    def where(
        self, *, step: int | None = None, phase: str | None = None, category: str | None = None, allocations=False
    ) -> np.ndarray:
        """Boolean mask of the rows recorded during tracking (not the baseline) that match every filter given.

        ``allocations``: only rows that allocate (positive bytes).
        """
        _check_phase(phase)
        mask = self.sample >= 0
        if step is not None:
            mask &= self.step == step
        if phase is not None:
            mask &= self.phase == PHASES.index(phase)
        if category is not None:
            mask &= self.category == CATEGORIES.index(category)
        if allocations:
            mask &= self.bytes > 0
        return mask


@dataclass
class Peak:
    """The largest total of tracked bytes in a window, and what made it up."""

    bytes: int
    index: int  # sample index in the trace's timeline
    step: int
    phase: str
    module: str
    breakdown: dict[str, int]  # bytes per category at the peak

    def __str__(self) -> str:
        return f"{self.bytes / MiB:.2f} MiB at step {self.step}, {self.phase}, in {self.module}"


@dataclass
class Timeline:
    """One sample per allocation or free: a columnar table of numpy arrays.

    ``bytes[i, c]`` is the number of live bytes of category ``CATEGORIES[c]``
    after sample ``i``; ``total`` is their sum.
    """

    time_s: np.ndarray  # seconds since tracking began
    step: np.ndarray
    phase: np.ndarray  # index into PHASES
    module: np.ndarray  # index into module_names
    bytes: np.ndarray  # (n_samples, n_categories)
    module_names: list[str]
    cuda_allocated: np.ndarray | None = None  # torch.cuda.memory_allocated() per sample
    cuda_reserved: np.ndarray | None = None  # torch.cuda.memory_reserved() per sample
    total: np.ndarray = field(init=False)  # (n_samples,) computed once

    def __post_init__(self):
        self.total = self.bytes.sum(axis=1)

    def __len__(self) -> int:
        return len(self.step)

    def category(self, name: str) -> np.ndarray:
        """Bytes of one category over the samples."""
        if name not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {name!r}")
        return self.bytes[:, CATEGORIES.index(name)]


@dataclass
class PhaseSummary:
    step: int
    phase: str
    start: int  # first sample index of the phase
    end: int  # last sample index of the phase
    peak: Peak
    at_end: dict[str, int]  # bytes per category after the phase's last sample
    dominant: str  # the category holding the most bytes at the phase's peak


@dataclass
class OptimizerPhase:
    """What one step's optimizer phase (``optimizer.step()`` through ``zero_grad()``) did to memory (bytes)."""

    step: int
    start: int  # first sample index of the phase
    end: int  # last sample index of the phase
    state_before: int  # optimizer state just before the phase
    state_after: int  # optimizer state at the end of the phase (after zero_grad)
    temporaries: int  # temporaries at the phase peak, minus those alive just before the phase
    extra_peak: int  # the phase's peak total minus the total just before the phase
    peak: dict[str, int]  # bytes per category at the phase peak
    peak_index: int  # sample of the phase peak (start - 1: the moment just before the phase)


@dataclass(frozen=True)
class LiveAllocation:
    """One storage alive at a moment: its bytes, the module that allocated it, its category."""

    bytes: int
    module: str
    category: str
    alloc_id: int


# ---- the trace ----------------------------------------------------------------------------------------------


class Trace:
    """What a :class:`~anatomy_helpers.tracker.StepTracker` recorded. Bytes everywhere, exact on CPU.

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
        base = np.zeros(len(CATEGORIES), dtype=np.int64)
        np.add.at(base, alloc_category[baseline_ids], baseline_bytes)
        self.baseline: dict[str, int] = {c: int(b) for c, b in zip(CATEGORIES, base)}  # bytes when tracking began

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
        _check_phase(phase)
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
        """The highest total in the given step and/or phase (the whole trace by default)."""
        idx = self.window(step, phase)
        if len(idx) == 0:
            raise ValueError(f"no samples for step={step!r}, phase={phase!r}; steps recorded: {self.steps}")
        return self._peak_at(int(idx[np.argmax(self.timeline.total[idx])]))

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
            peak = self._peak_at(s + int(np.argmax(tl.total[s : e + 1])))
            dominant = max(peak.breakdown, key=peak.breakdown.get)
            out.append(PhaseSummary(peak.step, peak.phase, s, e, peak, self.at(e), dominant))
        return out

    def phases(self) -> list[PhaseSummary]:
        """One summary per (step, phase) run of samples, in time order."""
        return list(self._phases)

    def phase(self, step: int, phase: str) -> PhaseSummary:
        """The summary of ``phase`` in ``step`` (the first run of it, if the phase was entered twice)."""
        _check_phase(phase)
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
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive integer, got {depth!r}")
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

    # ---- printing -------------------------------------------------------------------------------------------
    def table(self) -> str:
        """Phase x category table in MiB; each row is the moment of that phase's peak."""
        cols = [Col("step", 4), Col("phase", 9, align="<")]
        cols += [Col(c.replace("_", " "), 15 if c == "optimizer_state" else 11, ".2f") for c in CATEGORIES]
        cols += [Col("total", 9, ".2f"), Col("peak in", 20, align="<", gap="  ")]
        rows = [
            (ph.step, ph.phase, *(ph.peak.breakdown[c] / MiB for c in CATEGORIES), ph.peak.bytes / MiB, ph.peak.module)
            for ph in self._phases
            if ph.phase != "idle"
        ]
        return format_table(cols, rows, note="(MiB, at each phase's peak)", footer=[f"peak: {self.peak()}"])
