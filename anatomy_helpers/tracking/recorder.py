"""The step tracker's bookkeeping: every storage it has seen, its category and module, and the event list.

:class:`Recorder` knows nothing of hooks; :class:`~anatomy_helpers.tracking.tracker.StepTracker` (its subclass) feeds it
from torch's callbacks and turns what it recorded into a :class:`~anatomy_helpers.tracking.trace.Trace`.
"""

from __future__ import annotations

import time
import weakref
from functools import partial

import numpy as np
import torch

from ..tensors import optimizer_state_tensors
from ..units import MiB
from .events import (
    BACKWARD,
    CATEGORIES,
    FORWARD,
    GRADIENTS,
    IDLE,
    KERNEL_SCRATCH,
    NO_MODULE,
    OPT_STEP,
    OPT_ZERO_GRAD,
    OPTIMIZER,
    OPTIMIZER_STATE,
    PARAMETERS,
    PHASES,
    RECOMPUTED,
    ROOT,
    TEMPORARIES,
    CudaMark,
    PhaseMark,
    SavedTensor,
)
from .scratch import splice_scratch
from .trace import Trace

_now = time.perf_counter_ns
_graph_task_id = torch._C._current_graph_task_id  # -1 outside backward


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
    """Allocation ids, categories, modules, phases and the event list of one tracked run (see StepTracker)."""

    def _reset_records(self) -> None:
        self._modules = [NO_MODULE, ROOT, OPT_STEP, OPT_ZERO_GRAD]
        self._module_code = {name: i for i, name in enumerate(self._modules)}
        self._mod_stack: list[int] = []
        self._module = self._module_code[NO_MODULE]
        self._phase, self._step = IDLE, 1
        self._phase_marks: list[tuple[int, int, int, int]] = []  # (event index, time ns, step, phase)
        self._events: list[tuple[int, int, int, int, int, int]] = []  # (ns, alloc id, delta, step, phase, module)
        self._cuda_samples: list[tuple[int, int]] = []  # (memory_allocated, memory_reserved) per event
        self._a_bytes: list[int] = []  # current bytes per allocation id
        self._a_cat: list[int] = []
        self._a_module: list[int] = []
        self._live: dict[int, int] = {}  # storage address (_cdata) -> allocation id
        self._refs: dict[int, weakref.ref] = {}  # allocation id -> weak ref that reports the free
        self._live_bytes = 0
        self._grad_param: dict[int, str] = {}  # allocation id of a gradient -> its parameter's name
        self._saved: list[tuple[int, int, tuple, torch.dtype, int, int]] = []
        self._start_ns = time.perf_counter_ns()
        self._cuda_marks: list[tuple[int, int, int, int]] = []  # (sample, allocated, reserved, requested)
        self._cuda_at_entry = self._cuda_counters() if self._cuda else (0, 0, 0)
        self._op_kinds: dict[int, int] = {}  # id(op) -> what its outputs are (tensors.op_outputs)
        self._windows: list[tuple[int, int, int, int, int, int]] = []  # per op: start, end ns, event index, context
        self._memory_events: list = []  # the allocator's events, once the memory session has stopped
        self._scratch_recorded = False
        if hasattr(self, "_n_baseline"):
            del self._n_baseline

    def _splice_scratch(self, memory_events: np.ndarray) -> None:
        """Add each op's kernel scratch (scratch.py) as an allocation right after the op's outputs, freed at once."""

        def new_scratch(nbytes: int, module: int) -> int:
            self._a_bytes.append(nbytes)
            self._a_cat.append(KERNEL_SCRATCH)
            self._a_module.append(module)
            return len(self._a_bytes) - 1

        self._events, self._phase_marks = splice_scratch(
            self._events, self._windows, memory_events, self._phase_marks, new_scratch
        )

    def _build_trace(self) -> Trace:
        """The Trace of what was recorded: the baseline storages first, then one sample per event."""
        names, sizes = self._modules, self._a_bytes
        saved = [
            SavedTensor(step, names[m], shape, dtype, nbytes, aid, sizes[aid], CATEGORIES[self._a_cat[aid]])
            for step, m, shape, dtype, nbytes, aid in self._saved
        ]
        start = self._start_ns
        return Trace.from_events(
            events=np.array(self._events, dtype=np.int64).reshape(-1, 6),
            n_baseline=self._n_baseline,
            start_ns=start,
            alloc_category=np.array(self._a_cat, dtype=np.int64),
            alloc_module=np.array(self._a_module, dtype=np.int64),
            module_names=list(names),
            phase_marks=[PhaseMark(i, (t - start) / 1e9, s, PHASES[p]) for i, t, s, p in self._phase_marks],
            saved=saved,
            grad_param=dict(self._grad_param),
            device=str(self.device),
            duration_s=(self._end_ns - start) / 1e9,
            cuda_samples=np.array(self._cuda_samples, dtype=np.int64).reshape(-1, 2) if self._cuda else None,
            cuda_at_entry=CudaMark(-1, *self._cuda_at_entry) if self._cuda else None,
            cuda_marks=[CudaMark(i, a, r, q) for i, a, r, q in self._cuda_marks],
            kernel_scratch_recorded=self._scratch_recorded,
        )

    # ---- registering storages ---------------------------------------------------
    def _register_existing(self) -> None:
        for name, p in self.model.named_parameters():
            self._mark(p, PARAMETERS, self._code(name.rpartition(".")[0] or ROOT))
        for name, b in self.model.named_buffers():
            self._mark(b, PARAMETERS, self._code(name.rpartition(".")[0] or ROOT))
        for p in self.model.parameters():
            if p.grad is not None:
                self._mark(p.grad, GRADIENTS)
        self._mark_optimizer_state()

    def _code(self, name: str) -> int:
        code = self._module_code.get(name)
        if code is None:
            code = self._module_code[name] = len(self._modules)
            self._modules.append(name)
        return code

    def _aid(
        self, t: torch.Tensor, module: int | None = None, new: bool = True, category: int = TEMPORARIES
    ) -> int | None:
        """Allocation id of t's storage, registering it (as ``category``) if unknown and ``new``.

        None if the storage is not on the tracked device (or unknown and not ``new``).
        """
        if t.is_cuda is not self._cuda or t.is_meta or t.layout is not torch.strided:
            return None
        if self._cuda and t.get_device() != self._cuda_index:  # another GPU's memory is not this model's
            return None
        st = t.untyped_storage()
        aid = self._live.get(st._cdata)
        if aid is None:
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
        if nbytes != self._a_bytes[aid]:  # resized in place (out= ops, resize_)
            self._record(aid, nbytes - self._a_bytes[aid], self._module)
            self._a_bytes[aid] = nbytes
        return aid

    def _new(self, st: torch.UntypedStorage, module: int, category: int) -> int:
        nbytes = st.nbytes()
        aid = len(self._a_bytes)
        self._a_bytes.append(nbytes)
        self._a_cat.append(category)
        self._a_module.append(module)
        cdata = st._cdata
        self._live[cdata] = aid
        self._refs[aid] = weakref.ref(st, partial(self._on_free, aid, cdata))
        self._record(aid, nbytes, module)
        return aid

    def _record(self, aid: int, delta: int, module: int) -> None:
        self._live_bytes += delta
        self._events.append((_now(), aid, delta, self._step, self._phase, module))
        if self._cuda:
            self._cuda_samples.append(
                (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
            )
        if self.budget_bytes is not None and delta > 0 and self._live_bytes > self.budget_bytes:
            if not hasattr(self, "_n_baseline"):
                return  # still registering what was alive before tracking: checked as a whole afterwards
            raise MemoryBudgetExceeded(
                self.budget_bytes, delta, self._step, PHASES[self._phase], self._modules[module], self.live_breakdown()
            )

    def _on_free(self, aid: int, cdata: int, _ref) -> None:
        if not self._active or self._refs.pop(aid, None) is None:
            return
        if self._live.get(cdata) == aid:
            del self._live[cdata]
        self._record(aid, -self._a_bytes[aid], self._module)

    def _mark(self, t: torch.Tensor, category: int, module: int | None = None) -> int | None:
        aid = self._aid(t, module, category=category)
        if aid is not None and category < self._a_cat[aid]:
            self._a_cat[aid] = category
        return aid

    def _mark_optimizer_state(self) -> None:
        for t in optimizer_state_tensors(self.optimizer):
            self._mark(t, OPTIMIZER_STATE, self._code(OPT_STEP))

    def live_breakdown(self) -> dict[str, int]:
        """Bytes alive right now per category, as the categories are known at this moment."""
        out = dict.fromkeys(CATEGORIES, 0)
        for aid in self._live.values():
            out[CATEGORIES[self._a_cat[aid]]] += self._a_bytes[aid]
        return out

    # ---- phases and modules -------------------------------------------------------
    def _mark_phase(self) -> None:
        self._phase_marks.append((len(self._events), time.perf_counter_ns(), self._step, self._phase))
        if self._cuda:
            self._cuda_marks.append((len(self._events), *self._cuda_counters()))

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
