"""The step tracker: what is alive in memory, op by op, during training steps.

How it sees memory (all of it public torch machinery, removed again on exit):

* a ``TorchDispatchMode`` sees every op's output tensors. A storage seen for the
  first time is an allocation; a weak reference on it reports the free;
* ``saved_tensors_hooks`` see what autograd saves for backward (activations);
* ``register_post_accumulate_grad_hook`` sees each parameter's gradient land;
* optimizer step hooks (and a wrapped ``zero_grad``) mark the optimizer phase;
  its state is read from ``optimizer.state`` after every step;
* module forward hooks say which module is running; in backward, the module is
  the one that saved the tensor autograd has just unpacked.

Each allocation gets one category, decided by what the storage turned out to be
(a tensor saved for backward is an activation from the moment it was created).
Storages are counted once however many views point at them, so on CPU the
numbers are exact bytes and the same on every run.
"""

from __future__ import annotations

import math
import time
import weakref
from functools import partial

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .tensors import optimizer_state_tensors, returns_alias
from .trace import (
    ACTIVATIONS,
    BACKWARD,
    CATEGORIES,
    FORWARD,
    GRADIENTS,
    IDLE,
    INPUTS,
    NO_MODULE,
    OPT_STEP,
    OPT_ZERO_GRAD,
    OPTIMIZER,
    OPTIMIZER_STATE,
    PARAMETERS,
    PHASES,
    ROOT,
    TEMPORARIES,
    CudaMark,
    PhaseMark,
    SavedTensor,
    Timeline,
    Trace,
)
from .units import MiB

_graph_task_id = torch._C._current_graph_task_id  # -1 outside backward
_MISSING = object()














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


class _OpWatcher(TorchDispatchMode):
    """Runs every op, then hands its outputs to the tracker."""

    def __init__(self, tracker: StepTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker._after_op(func, out)
        return out


class StepTracker:
    """Context manager that records memory through training steps of ``model``.

    Usage::

        with StepTracker(model, optimizer) as tracker:
            for step in range(3):
                train_step(model, optimizer, *get_batch(step=step))
        trace = tracker.trace

    Phases are found automatically: a step starts at the model's forward (or at
    the end of ``zero_grad``), backward starts at the first op autograd runs,
    the optimizer phase at ``optimizer.step()`` and runs through ``zero_grad``.
    Only storages on the model's device are counted.

    ``budget_bytes``: if set, raise :class:`MemoryBudgetExceeded` the moment live
    tracked bytes exceed it (a CPU stand-in for a GPU running out of memory).
    """

    _running: StepTracker | None = None  # the tracker inside its `with` block, if any

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, budget_bytes: int | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"StepTracker needs an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "StepTracker needs the optimizer that trains the model (got "
                f"{type(optimizer).__name__}): it marks the optimizer phase and reads its state"
            )
        model_params = {id(p) for p in model.parameters()}
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(id(p) in model_params for p in opt_params):
            raise ValueError("the optimizer holds none of the model's parameters: pass the optimizer of this model")
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool)
            or not isinstance(budget_bytes, (int, float))
            or not math.isfinite(budget_bytes)
            or budget_bytes <= 0
        ):
            raise ValueError(f"budget_bytes must be a positive, finite number of bytes, got {budget_bytes!r}")
        self.model, self.optimizer, self.budget_bytes = model, optimizer, budget_bytes
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._cuda_index = self.device.index if self._cuda else -1
        self._trace: Trace | None = None
        self._active = False
        self._undo: list = []  # what __enter__ installed, each as a function that removes it again

    # ---- entering and leaving -------------------------------------------------
    def __enter__(self) -> StepTracker:
        # Dispatch modes and saved-tensor hooks are global to the thread: a second tracker would see the
        # first one's ops (and vice versa) and mis-attribute categories and steps. One at a time.
        active = StepTracker._running
        if active is not None:
            which = "this model" if active.model is self.model else f"another model ({type(active.model).__name__})"
            raise RuntimeError(
                f"a StepTracker is already running on {which}: trackers cannot be nested or run side by side "
                "(the ops of both would land in both traces); finish the first `with` block before starting another"
            )
        self._reset_records()
        self._active = True
        try:
            self._install(self._claim, self._release)
            self._register_existing()
            self._n_baseline = len(self._events)
            if self.budget_bytes is not None and self._live_bytes > self.budget_bytes:  # the model itself does not fit
                raise MemoryBudgetExceeded(self.budget_bytes, self._live_bytes, 0, "idle", ROOT, self.live_breakdown())
            self._install_hooks()
            mode = _OpWatcher(self)
            self._install(mode.__enter__, lambda: mode.__exit__(None, None, None))
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._install(hooks.__enter__, lambda: hooks.__exit__(None, None, None))
        except BaseException as exc:
            self._teardown()
            if isinstance(exc, MemoryBudgetExceeded):
                exc.trace = self._trace
            raise
        self._mark_phase()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._teardown()
        if exc is not None:
            try:
                exc.trace = self._trace  # what happened up to the failure, for plotting
            except AttributeError:  # an exception type that takes no attributes
                pass
        return None

    def _install(self, do, undo) -> None:
        """Run ``do``; only if it succeeded, remember ``undo`` for the teardown (so nothing is undone twice)."""
        do()
        self._undo.append(undo)

    def _claim(self) -> None:
        StepTracker._running = self
        self.model._anatomy_tracker = self

    def _release(self) -> None:
        StepTracker._running = None
        if getattr(self.model, "_anatomy_tracker", None) is self:
            del self.model._anatomy_tracker

    def _teardown(self) -> None:
        """Undo exactly what was installed, newest first, whatever fails on the way; then build the trace."""
        errors = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as e:  # keep undoing the rest; report the first failure afterwards
                errors.append(e)
        if self._active:
            self._active = False
            self._end_ns = time.perf_counter_ns()
            if not hasattr(self, "_n_baseline"):  # failed while registering what was already alive
                self._n_baseline = len(self._events)
            self._trace = self._build_trace()
        self._refs.clear()  # dropping the weak refs also drops their callbacks
        self._live.clear()
        if errors:
            raise errors[0]

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
        if hasattr(self, "_n_baseline"):
            del self._n_baseline

    @property
    def trace(self) -> Trace:
        """The recorded :class:`Trace`; available once the ``with`` block has ended."""
        if self._trace is None:
            raise RuntimeError("the trace is ready when the `with StepTracker(...)` block has ended")
        return self._trace

    def _build_trace(self) -> Trace:
        """The Trace of what was recorded: the baseline storages first, then one sample per event."""
        n0, start = self._n_baseline, self._start_ns
        ev = np.array(self._events, dtype=np.int64).reshape(-1, 6)  # (ns, alloc id, delta, step, phase, module)
        base, ev = ev[:n0], ev[n0:]
        cats = np.array(self._a_cat, dtype=np.int64)
        deltas = np.zeros((len(ev), len(CATEGORIES)), dtype=np.int64)
        deltas[np.arange(len(ev)), cats[ev[:, 1]]] = ev[:, 2]
        baseline = np.zeros(len(CATEGORIES), dtype=np.int64)
        np.add.at(baseline, cats[base[:, 1]], base[:, 2])
        cuda = np.array(self._cuda_samples[n0:], dtype=np.int64).reshape(-1, 2) if self._cuda else None
        timeline = Timeline(
            time_s=(ev[:, 0] - start) / 1e9,
            step=ev[:, 3].copy(),
            phase=ev[:, 4].copy(),
            module=ev[:, 5].copy(),
            bytes=baseline + np.cumsum(deltas, axis=0),
            module_names=list(self._modules),
            cuda_allocated=None if cuda is None else cuda[:, 0],
            cuda_reserved=None if cuda is None else cuda[:, 1],
        )
        names, sizes = self._modules, self._a_bytes
        saved = [
            SavedTensor(step, names[m], shape, dtype, nbytes, aid, sizes[aid], CATEGORIES[self._a_cat[aid]])
            for step, m, shape, dtype, nbytes, aid in self._saved
        ]
        return Trace(
            timeline=timeline,
            alloc_category=cats,
            alloc_module=np.array(self._a_module, dtype=np.int64),
            alloc_ids=ev[:, 1].copy(),
            alloc_deltas=ev[:, 2].copy(),
            baseline_ids=base[:, 1].copy(),
            baseline_bytes=base[:, 2].copy(),
            phase_marks=[PhaseMark(i - n0, (t - start) / 1e9, s, PHASES[p]) for i, t, s, p in self._phase_marks],
            saved=saved,
            grad_param=dict(self._grad_param),
            device=str(self.device),
            duration_s=(self._end_ns - start) / 1e9,
            cuda_at_entry=CudaMark(-1, *self._cuda_at_entry) if self._cuda else None,
            cuda_marks=[CudaMark(i - n0, a, r, q) for i, a, r, q in self._cuda_marks],
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
            return self._new(st, self._module if module is None else module, category) if new else None
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
        self._events.append((time.perf_counter_ns(), aid, delta, self._step, self._phase, module))
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
        # optimizer phase, or when zero_grad closes the optimizer phase.
        if (self._phase == OPTIMIZER and phase in (IDLE, FORWARD)) or (self._phase == BACKWARD and phase == FORWARD):
            self._step += 1
        self._phase = phase
        self._mark_phase()

    def _install_hooks(self) -> None:
        root_code = self._code(ROOT)

        def hook(handle) -> None:  # a RemovableHandle, removed again at teardown
            self._undo.append(handle.remove)

        def root_pre(module, args):
            self._set_phase(FORWARD)
            self._mod_stack.clear()
            self._module = root_code
            for a in args:
                if isinstance(a, torch.Tensor):
                    self._mark(a, INPUTS)

        def root_post(module, args, output):
            self._module = root_code

        hook(self.model.register_forward_pre_hook(root_pre, prepend=True))
        hook(self.model.register_forward_hook(root_post))
        for name, sub in self.model.named_modules():
            if not name:
                continue
            code = self._code(name)

            def pre(module, args, code=code):
                self._mod_stack.append(self._module)
                self._module = code

            def post(module, args, output):
                if self._mod_stack:
                    self._module = self._mod_stack.pop()

            hook(sub.register_forward_pre_hook(pre))
            hook(sub.register_forward_hook(post))

        def grad_landed(p, name):
            aid = self._mark(p.grad, GRADIENTS)
            if aid is not None:
                self._grad_param[aid] = name

        for name, p in self.model.named_parameters():
            if p.requires_grad:
                hook(p.register_post_accumulate_grad_hook(lambda p, name=name: grad_landed(p, name)))

        def opt_pre(opt, args, kwargs):
            self._set_phase(OPTIMIZER)
            self._module = self._code(OPT_STEP)

        def opt_post(opt, args, kwargs):
            self._mark_optimizer_state()

        hook(self.optimizer.register_step_pre_hook(opt_pre))
        hook(self.optimizer.register_step_post_hook(opt_post))

        opt = self.optimizer
        original_zero_grad = opt.zero_grad  # the class's method, or the user's own attribute
        own = vars(opt).get("zero_grad", _MISSING)

        def zero_grad(*args, **kwargs):
            if self._phase == OPTIMIZER:
                self._module = self._code(OPT_ZERO_GRAD)
            original_zero_grad(*args, **kwargs)
            if self._phase == OPTIMIZER:
                self._set_phase(IDLE)
                self._module = self._code(NO_MODULE)

        def restore() -> None:
            if own is _MISSING:
                vars(opt).pop("zero_grad", None)  # back to the class's own method
            else:
                opt.zero_grad = own  # the user's own, as it was

        self._install(lambda: setattr(opt, "zero_grad", zero_grad), restore)

    # ---- callbacks from torch -------------------------------------------------------
    def _after_op(self, func, out) -> None:
        if self._phase != BACKWARD and _graph_task_id() != -1:
            self._set_phase(BACKWARD)
            self._module = self._code(ROOT)
        # Views, in-place and out= ops return memory that already existed: a storage first seen
        # there was allocated before tracking began (a slice of the dataset, say), not by this op.
        aliases = returns_alias(func)
        if isinstance(out, torch.Tensor):
            self._aid(out, new=not aliases)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._aid(o, new=not aliases)

    def _pack(self, t: torch.Tensor):
        aid = self._mark(t, ACTIVATIONS) if self._active else None
        if aid is not None:
            self._saved.append((self._step, self._module, tuple(t.shape), t.dtype, t.nbytes, aid))
        # Keep a detached alias, not t itself: when a node saves its own output, holding t (whose grad_fn
        # holds this pack) would make a reference cycle that outlives a graph nobody backpropagates.
        return t.detach(), self._module

    def _unpack(self, packed):
        t, module = packed
        if self._active:
            if self._phase != BACKWARD and _graph_task_id() != -1:
                self._set_phase(BACKWARD)
            self._module = module
        return t
