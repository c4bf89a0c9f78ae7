"""The vocabulary of a trace: memory categories and which one wins, phases, the parts of the course model, the rows
the recorder appends while it watches (:class:`Event`, :class:`OpWindow`, :class:`SavedRow`) and the typed records
of a finished trace.

:mod:`anatomy_helpers.tracking.recorder` writes the rows, :mod:`anatomy_helpers.tracking.trace` builds on the
records; everything here is plain data (named tuples, numpy arrays, dataclasses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import numpy as np

from ..core.units import MiB

# What a storage is, in the order tables and figures show them. "recomputed": made again during backward by
# activation checkpointing. "kernel_scratch": memory a kernel allocates and frees inside one op (no op output shows
# it; see scratch.py). "communication": memory that exists only for a collective under data parallelism (DDP's
# gradient buckets, FSDP's all-gathered parameters and reduce-scatter buffers; see distributed/ranks.py); a
# single-device trace never holds it. Which one a storage keeps when it qualifies twice: CATEGORY_PRECEDENCE.
CATEGORIES = (
    "parameters",
    "optimizer_state",
    "gradients",
    "inputs",
    "activations",
    "recomputed",
    "temporaries",
    "kernel_scratch",
    "communication",
)
(
    PARAMETERS,
    OPTIMIZER_STATE,
    GRADIENTS,
    INPUTS,
    ACTIVATIONS,
    RECOMPUTED,
    TEMPORARIES,
    KERNEL_SCRATCH,
    COMMUNICATION,
) = range(len(CATEGORIES))

# Which category a storage keeps when it qualifies as two (earlier in this list wins), the one table the recorder
# and the per-rank tracker both use. The model states come first, whatever else touches them: a weight saved for
# backward stays "parameters", a gradient that is a view of DDP's bucket stays "gradients", Adam's moments stay
# "optimizer_state". Then "communication": an FSDP parameter all-gathered for forward and saved for backward is the
# all-gather's buffer, not an activation. Then what the step itself makes, in the order of CATEGORIES: the token ids
# saved by the embedding stay "inputs", a temporary saved for backward becomes "activations".
CATEGORY_PRECEDENCE = (
    "parameters",
    "optimizer_state",
    "gradients",
    "communication",
    "inputs",
    "activations",
    "recomputed",
    "temporaries",
    "kernel_scratch",
)
#: Per category index (CATEGORIES order): its place in CATEGORY_PRECEDENCE, 0 the strongest. The recorder's fast path.
PRECEDENCE_RANK = tuple(CATEGORY_PRECEDENCE.index(c) for c in CATEGORIES)


def winning_category(current: str, other: str) -> str:
    """The category a storage ends with when it is ``current`` and turns out to qualify as ``other`` too.

    ``winning_category("parameters", "activations")`` is ``"parameters"`` (a weight saved for backward);
    ``winning_category("temporaries", "activations")`` is ``"activations"`` (an op output saved for backward).
    """
    for name in (current, other):
        if name not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {name!r}")
    return min(current, other, key=CATEGORY_PRECEDENCE.index)


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


def check_phase(phase: str | None) -> None:
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


# ---- the rows the recorder appends while it watches ----------------------------------------------------------
# Named tuples: as cheap to make and to turn into a numpy array as plain tuples (thousands per step), read by name.


class Event(NamedTuple):
    """One change of one allocation: the recorder's event list holds one per allocation, free or resize, in order.

    The list becomes the trace's timeline (np.array of these rows, columns in this order; see Trace.from_events).
    """

    time_ns: int  # time.perf_counter_ns() when it was recorded
    alloc_id: int  # which allocation (the recorder's index of the storage)
    delta: int  # bytes: positive when allocated or grown, negative when freed or shrunk
    step: int  # the step it happened in (1, 2, ...)
    phase: int  # index into PHASES
    module: int  # index into the recorder's module names


class OpWindow(NamedTuple):
    """One op that may allocate, as the timed watcher saw it run: where its kernel scratch would go (scratch.py)."""

    start_ns: int  # time.time_ns() just before the op ran (the profiler's clock)
    end_ns: int  # time.time_ns() just after it returned
    event_index: int  # number of events recorded once its outputs were: a scratch pair is inserted there
    step: int  # the op's step, phase (index into PHASES) and module (index into the module names)
    phase: int
    module: int


class SavedRow(NamedTuple):
    """One tensor autograd packed for backward, as the recorder notes it (SavedTensor once the trace is built)."""

    step: int
    module: int  # index into the module names: the module running when it was saved
    shape: tuple
    dtype: object  # torch.dtype
    bytes: int  # the saved view's own bytes
    alloc_id: int  # the allocation behind it (several saved views may share one)


# ---- typed records of a finished trace -------------------------------------------------------------------------


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
        check_phase(phase)
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


class CategoryColumns:
    """A sampled table whose ``bytes`` (n_samples, n_categories) holds one column per name in ``category_names``."""

    category_names: ClassVar[tuple[str, ...]] = CATEGORIES

    def category(self, name: str) -> np.ndarray:
        """Bytes of one category over the samples."""
        if name not in self.category_names:
            raise ValueError(f"category must be one of {self.category_names}, got {name!r}")
        return self.bytes[:, self.category_names.index(name)]


@dataclass
class Timeline(CategoryColumns):
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
