"""The step tracker's bookkeeping: every storage it has seen, its category and module, and the event list.

:class:`Recorder` knows nothing of hooks; :class:`~anatomy_helpers.tracking.tracker.StepTracker` (its subclass) feeds it
from torch's callbacks and turns what it recorded into a :class:`~anatomy_helpers.tracking.trace.Trace`.

A recording's life: :meth:`Recorder.begin` (everything reset), the storages alive before tracking registered with
:meth:`~Recorder.mark`, :meth:`~Recorder.close_baseline`, then every allocation, free and resize as it happens
(:meth:`~Recorder.allocation_id`, :meth:`~Recorder.resize`, the weak references' callbacks), and
:meth:`~Recorder.end`, which returns the Trace. Every field is declared in ``__init__`` (what it records for) and
:meth:`~Recorder.reset` (what one recording holds); nothing else creates one.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from functools import partial

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..core.units import MiB
from .events import (
    BACKWARD,
    CATEGORIES,
    FORWARD,
    IDLE,
    KERNEL_SCRATCH,
    NO_MODULE,
    OPT_STEP,
    OPT_ZERO_GRAD,
    OPTIMIZER,
    PHASES,
    PRECEDENCE_RANK,
    RECOMPUTED,
    ROOT,
    TEMPORARIES,
    CudaMark,
    Event,
    OpWindow,
    PhaseMark,
    SavedRow,
    SavedTensor,
)
from .scratch import splice_scratch
from .trace import Trace

_now = time.perf_counter_ns
_graph_task_id = torch._C._current_graph_task_id  # -1 outside backward

#: Module names every recording knows from the start, at these indices (the model's own modules follow).
FIXED_MODULES = (NO_MODULE, ROOT, OPT_STEP, OPT_ZERO_GRAD)


class MemoryBudgetExceeded(RuntimeError):
    """Live tracked bytes went over the tracker's ``budget_bytes``: a simulated out-of-memory.

    ``step`` 0 means before training: what was already alive when tracking began (parameters, buffers,
    gradients, optimizer state) does not fit, as a model too big for a GPU fails when it is moved there.
    """

    def __init__(self, budget, requested, step, phase, module, breakdown):
        self.budget, self.requested = budget, requested
        self.step, self.phase, self.module, self.breakdown = step, phase, module, breakdown
        live = sum(breakdown.values())
        parts = ", ".join(f"{k} {v / MiB:.2f}" for k, v in breakdown.items() if v)
        if step == 0:
            where = f"before training starts, what is already alive needs {live / MiB:.2f} MiB [{parts}] (MiB)"
        else:
            where = (
                f"step {step}, {phase} phase, in {module}, tried to allocate {requested / MiB:.2f} MiB with "
                f"{live / MiB:.2f} MiB live [{parts}] (MiB)"
            )
        super().__init__(f"out of memory (simulated budget {budget / MiB:.2f} MiB): {where}")


class Recorder:
    """Allocation ids, categories, modules, phases and the event list of one tracked run (see StepTracker).

    ``device``: only storages on it are counted. ``budget_bytes``: raise :class:`MemoryBudgetExceeded` when live
    bytes pass it (None: no limit). ``accumulate``: a forward after a backward is the next micro-batch of the same
    step (gradient accumulation), not a new step.

    For subclasses: :meth:`storage_tensor` is the hook that says which tensor's storage a tensor's bytes live in;
    :meth:`mark`, :meth:`allocation_id` and :meth:`resize` record; :attr:`recording`, :attr:`step`, :attr:`phase`,
    :attr:`samples` and :meth:`elapsed_s` say where the recording is.
    """

    def __init__(self, device: torch.device | str, *, budget_bytes: int | None = None, accumulate: bool = False):
        self.device = torch.device(device)  # the device whose storages count
        self.budget_bytes = budget_bytes  # live bytes above this raise MemoryBudgetExceeded; None: no limit
        self.accumulate = bool(accumulate)  # True: only the optimizer phase ends a step (micro-batches)
        self._cuda = self.device.type == "cuda"  # a GPU: its allocator's counters are sampled with every event
        self._cuda_index = self.device.index if self._cuda else -1  # which GPU (-1 on CPU)
        self.reset()

    def reset(self) -> None:
        """Forget every recording: the state of a recorder that has not begun (the same fields ``__init__`` made)."""
        # -- whether it records, and since when
        self._active = False  # between begin() and end(); a free reported outside that is ignored
        self._start_ns = 0  # perf_counter_ns at begin(): times in the trace are seconds since then
        self._end_ns = 0  # perf_counter_ns at end()
        self._n_baseline: int | None = None  # events that registered what was alive at begin(); None until closed
        # -- where the step is
        self._step = 1  # the step now running (1, 2, ...)
        self._phase = IDLE  # index into PHASES
        self._modules = list(FIXED_MODULES)  # module names; an event's module is an index into this list
        self._module_code = {name: i for i, name in enumerate(self._modules)}  # module name -> its index
        self._module = self._module_code[NO_MODULE]  # index of the module now running
        self._mod_stack: list[int] = []  # indices of the modules whose forward the running one is inside
        # -- allocations, one entry per allocation id (ids count up from 0 in the order storages are first seen)
        self._alloc_bytes: list[int] = []  # bytes it holds now (its last size, once freed)
        self._alloc_category: list[int] = []  # index into CATEGORIES: what the storage turned out to be
        self._alloc_module: list[int] = []  # index of the module that allocated it (that owns it: parameters)
        self._live: dict[int, int] = {}  # storage address (_cdata) of each live storage -> its allocation id
        self._refs: dict[int, weakref.ref] = {}  # allocation id -> the weak reference whose callback reports the free
        self._live_bytes = 0  # bytes of every live allocation together
        self._held_frees: list[tuple[int, int]] | None = None  # inside frees_in_allocation_order: (id, address)
        self._grad_param: dict[int, str] = {}  # allocation id of a gradient -> the name of its parameter
        # -- what happened, in order
        self._events: list[Event] = []  # one per allocation, free or resize (the baseline's come first)
        self._phase_marks: list[PhaseMark] = []  # one per phase change; index: the number of events before it
        self._saved: list[SavedRow] = []  # one per tensor autograd packed for backward
        self._windows: list[OpWindow] = []  # one per op that may allocate (kernel scratch measured only)
        self._memory_events: list[np.ndarray | None] = []  # the allocator's (ns, +/- bytes) events, once stopped
        self._scratch_recorded = False  # whether kernel scratch was measured (the memory session survived)
        # -- CUDA only (empty or None on CPU)
        self._cuda_samples: list[tuple[int, int]] = []  # (memory_allocated, memory_reserved) bytes per event
        self._cuda_at_entry: CudaMark | None = None  # the allocator's counters at begin()
        self._cuda_marks: list[CudaMark] = []  # the allocator's counters at each phase change

    # ---- a recording's life ---------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a new recording: everything reset, the clock (and on CUDA the allocator's counters) read."""
        self.reset()
        self._start_ns = _now()
        if self._cuda:
            self._cuda_at_entry = CudaMark(-1, *self._cuda_counters())
        self._active = True

    def close_baseline(self) -> None:
        """What was alive before tracking is registered: the events from here on are the timeline.

        Raises :class:`MemoryBudgetExceeded` (step 0) if that alone is over the budget.
        """
        self._n_baseline = len(self._events)
        if self.budget_bytes is not None and self._live_bytes > self.budget_bytes:  # the model itself does not fit
            raise MemoryBudgetExceeded(self.budget_bytes, self._live_bytes, 0, "idle", ROOT, self.live_breakdown())

    def end(self) -> Trace:
        """Stop recording and return the :class:`Trace` (kernel scratch spliced in if the allocator's events came)."""
        try:
            self._active = False
            self._end_ns = _now()
            if self._n_baseline is None:  # failed while registering what was already alive
                self._n_baseline = len(self._events)
            memory_events = self._memory_events[0] if self._memory_events else None
            self._scratch_recorded = memory_events is not None
            if memory_events is not None:
                self._splice_scratch(memory_events)
            return self._build_trace()
        finally:
            self._refs.clear()  # dropping the weak refs also drops their callbacks
            self._live.clear()

    # ---- where the recording is (for subclasses) ----------------------------------------------------------------
    @property
    def recording(self) -> bool:
        """Whether a recording is under way (between :meth:`begin` and :meth:`end`)."""
        return self._active

    @property
    def step(self) -> int:
        """The step now running (1, 2, ...)."""
        return self._step

    @property
    def phase(self) -> str:
        """The phase now running, one of PHASES."""
        return PHASES[self._phase]

    @property
    def module(self) -> str:
        """The name of the module now running ("-" outside any module)."""
        return self._modules[self._module]

    @property
    def samples(self) -> int:
        """Timeline samples recorded so far (the baseline not counted): the next one gets this index."""
        return len(self._events) - (self._n_baseline or 0)

    def elapsed_s(self) -> float:
        """Seconds since the recording began."""
        return (_now() - self._start_ns) / 1e9

    # ---- the hook --------------------------------------------------------------------------------------------
    def storage_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor whose storage holds ``t``'s bytes: ``t`` itself here.

        Called on every tensor before its storage is looked up (each op output, each saved tensor, each mark), so
        keep it cheap. A subclass returns another tensor for wrappers that own no storage of their own (the
        per-rank tracker: a DTensor's local shard).
        """
        return t

    # ---- registering storages ---------------------------------------------------------------------------------
    def _code(self, name: str) -> int:
        """The index of module ``name``, registering it if new."""
        code = self._module_code.get(name)
        if code is None:
            code = self._module_code[name] = len(self._modules)
            self._modules.append(name)
        return code

    def allocation_id(
        self, t: torch.Tensor, module: int | None = None, new: bool = True, category: int = TEMPORARIES
    ) -> int | None:
        """Allocation id of ``t``'s storage, registering it (as ``category``, in ``module``) if unknown and ``new``.

        None if the storage is not on the recorded device (or unknown and not ``new``). A known storage whose size
        changed (out= ops, ``resize_``) is recorded as resized.
        """
        t = self.storage_tensor(t)
        # A fake tensor's device read from the tensor itself: ``t.device`` (and is_cuda, is_meta) would ask it
        # through every dispatch mode of a dry run, as an op.
        device = t.fake_device if type(t) is FakeTensor else t.device
        if (device.type == "cuda") is not self._cuda or device.type == "meta" or t.layout is not torch.strided:
            return None
        if self._cuda and device.index != self._cuda_index:  # another GPU's memory is not this model's
            return None
        st = t.untyped_storage()
        alloc_id = self._live.get(st._cdata)
        if alloc_id is None:
            if not new:
                return None
            if category == TEMPORARIES and _graph_task_id() != -1 and torch.is_grad_enabled():
                # Forward code running again inside backward (autograd's own ops run with grad mode off):
                # activation checkpointing recomputing it. Read per op, not from module hooks, since a
                # recomputation stops early (its modules' forward hooks never run) and the "attention"
                # policy recomputes a function, not a module.
                category = RECOMPUTED
            return self._new(st, self._module if module is None else module, category)
        nbytes = st.nbytes()
        if nbytes != self._alloc_bytes[alloc_id]:
            self.resize(alloc_id, nbytes)
        return alloc_id

    def resize(self, alloc_id: int, nbytes: int) -> None:
        """Record that allocation ``alloc_id`` now holds ``nbytes`` (resized in place); nothing if it already did.

        :meth:`allocation_id` calls it for the storages ops return; a subclass calls it for storages resized
        without an op (FSDP's all-gathered parameters).
        """
        old = self._alloc_bytes[alloc_id]
        if nbytes != old:
            self._record(alloc_id, nbytes - old, self._module)
            self._alloc_bytes[alloc_id] = nbytes

    def mark(self, t: torch.Tensor, category: int, module: int | None = None) -> int | None:
        """Count ``t``'s storage as ``category`` (an index into CATEGORIES) if that wins over what it is now.

        Registers the storage first if it is new (allocated now, in ``module``, default the running one).
        Which category wins is events.CATEGORY_PRECEDENCE. Returns its allocation id (None: not on the device).
        """
        alloc_id = self.allocation_id(t, module, category=category)
        if alloc_id is not None and PRECEDENCE_RANK[category] < PRECEDENCE_RANK[self._alloc_category[alloc_id]]:
            self._alloc_category[alloc_id] = category
        return alloc_id

    def _new(self, st: torch.UntypedStorage, module: int, category: int) -> int:
        nbytes = st.nbytes()
        alloc_id = len(self._alloc_bytes)
        self._alloc_bytes.append(nbytes)
        self._alloc_category.append(category)
        self._alloc_module.append(module)
        cdata = st._cdata
        self._live[cdata] = alloc_id
        self._refs[alloc_id] = weakref.ref(st, partial(self._on_free, alloc_id, cdata))
        self._record(alloc_id, nbytes, module)
        return alloc_id

    def _record(self, alloc_id: int, delta: int, module: int) -> None:
        self._live_bytes += delta
        self._events.append(Event(_now(), alloc_id, delta, self._step, self._phase, module))
        if self._cuda:
            self._cuda_samples.append(
                (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
            )
        if self.budget_bytes is not None and delta > 0 and self._live_bytes > self.budget_bytes:
            if self._n_baseline is None:
                return  # still registering what was alive before tracking: checked as a whole by close_baseline
            raise MemoryBudgetExceeded(
                self.budget_bytes, delta, self._step, PHASES[self._phase], self._modules[module], self.live_breakdown()
            )

    def _on_free(self, alloc_id: int, cdata: int, _ref) -> None:
        if not self._active or self._refs.pop(alloc_id, None) is None:
            return
        if self._held_frees is not None:
            self._held_frees.append((alloc_id, cdata))
            return
        self._free(alloc_id, cdata)

    @contextlib.contextmanager
    def frees_in_allocation_order(self):
        """Frees reported inside the block are recorded when it ends, the oldest allocation first.

        For frees that happen at one moment (no op runs between them) in an order that depends on addresses:
        leaving ``torch.autocast`` drops its cache of weight casts, a hash map keyed by the source tensor's
        address (``cached_casts`` in aten/src/ATen/autocast_mode.cpp), so the casts no backward holds (a
        linear layer's bias) die in hash order, which differs from run to run and between real and fake tensors.
        """
        self._held_frees = []
        try:
            yield
        finally:
            held, self._held_frees = self._held_frees, None
            for alloc_id, cdata in sorted(held):
                self._free(alloc_id, cdata)

    def _free(self, alloc_id: int, cdata: int) -> None:
        if self._live.get(cdata) == alloc_id:
            del self._live[cdata]
        self._record(alloc_id, -self._alloc_bytes[alloc_id], self._module)

    def live_breakdown(self) -> dict[str, int]:
        """Bytes alive right now per category, as the categories are known at this moment."""
        out = dict.fromkeys(CATEGORIES, 0)
        for alloc_id in self._live.values():
            out[CATEGORIES[self._alloc_category[alloc_id]]] += self._alloc_bytes[alloc_id]
        return out

    # ---- phases and modules -------------------------------------------------------
    def _mark_phase(self) -> None:
        at = len(self._events)
        self._phase_marks.append(PhaseMark(at, (_now() - self._start_ns) / 1e9, self._step, PHASES[self._phase]))
        if self._cuda:
            self._cuda_marks.append(CudaMark(at, *self._cuda_counters()))

    def _cuda_counters(self) -> tuple[int, int, int]:
        """(memory_allocated, memory_reserved, requested bytes): the allocator's own counts."""
        stats = torch.cuda.memory_stats(self.device)
        return (
            stats.get("allocated_bytes.all.current", 0),
            stats.get("reserved_bytes.all.current", 0),
            stats.get("requested_bytes.all.current", 0),
        )

    def _set_phase(self, phase: int) -> None:
        if phase == self._phase:
            return
        # A new step starts when the model runs forward again after a backward or an
        # optimizer phase, or when zero_grad closes the optimizer phase. Accumulating gradients, a forward
        # after a backward is the next micro-batch of the same step: only the optimizer ends a step.
        after_backward = self._phase == BACKWARD and phase == FORWARD and not self.accumulate
        if (self._phase == OPTIMIZER and phase in (IDLE, FORWARD)) or after_backward:
            self._step += 1
        self._phase = phase
        self._mark_phase()

    # ---- the trace ---------------------------------------------------------------------------------------------
    def _splice_scratch(self, memory_events: np.ndarray) -> None:
        """Add each op's kernel scratch (scratch.py) as an allocation right after the op's outputs, freed at once."""

        def new_scratch(nbytes: int, module: int) -> int:
            self._alloc_bytes.append(nbytes)
            self._alloc_category.append(KERNEL_SCRATCH)
            self._alloc_module.append(module)
            return len(self._alloc_bytes) - 1

        self._events, self._phase_marks = splice_scratch(
            self._events, self._windows, memory_events, self._phase_marks, new_scratch
        )

    def _build_trace(self) -> Trace:
        """The Trace of what was recorded: the baseline storages first, then one sample per event."""
        names, sizes, categories = self._modules, self._alloc_bytes, self._alloc_category
        saved = [
            SavedTensor(
                step=row.step,
                module=names[row.module],
                shape=row.shape,
                dtype=row.dtype,
                bytes=row.bytes,
                storage=row.alloc_id,
                storage_bytes=sizes[row.alloc_id],
                category=CATEGORIES[categories[row.alloc_id]],
            )
            for row in self._saved
        ]
        return Trace.from_events(
            events=np.array(self._events, dtype=np.int64).reshape(-1, len(Event._fields)),
            n_baseline=self._n_baseline,
            start_ns=self._start_ns,
            alloc_category=np.array(categories, dtype=np.int64),
            alloc_module=np.array(self._alloc_module, dtype=np.int64),
            module_names=list(names),
            phase_marks=list(self._phase_marks),
            saved=saved,
            grad_param=dict(self._grad_param),
            device=str(self.device),
            duration_s=(self._end_ns - self._start_ns) / 1e9,
            cuda_samples=np.array(self._cuda_samples, dtype=np.int64).reshape(-1, 2) if self._cuda else None,
            cuda_at_entry=self._cuda_at_entry,
            cuda_marks=list(self._cuda_marks),
            kernel_scratch_recorded=self._scratch_recorded,
        )
