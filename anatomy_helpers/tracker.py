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

import time
import weakref
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

# Lower index wins when a storage qualifies twice: a weight saved for backward
# stays a parameter, the token ids saved by the embedding stay inputs.
CATEGORIES = ("parameters", "optimizer_state", "gradients", "inputs", "activations", "temporaries")
PARAMETERS, OPTIMIZER_STATE, GRADIENTS, INPUTS, ACTIVATIONS, TEMPORARIES = range(len(CATEGORIES))
PHASES = ("idle", "forward", "backward", "optimizer")
IDLE, FORWARD, BACKWARD, OPTIMIZER = range(len(PHASES))
MiB = 2**20

# Module names used outside the model's own modules.
NO_MODULE, ROOT, OPT_STEP, OPT_ZERO_GRAD = "-", "model", "optimizer.step", "optimizer.zero_grad"

_graph_task_id = torch._C._current_graph_task_id  # -1 outside backward


def _round_up(nbytes: np.ndarray, multiple: int) -> np.ndarray:
    return -(-nbytes // multiple) * multiple


def storage_bytes(tensors, device: torch.device | str | None = None) -> int:
    """Bytes held by the distinct storages behind ``tensors`` (views counted once).

    With ``device``, only storages on that device count. This is what the tracker's
    per-category totals should equal, computed straight from the tensors.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if device is not None and t.device != torch.device(device):
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (exp_avg, exp_avg_sq, step, momentum_buffer ...)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class MemoryBudgetExceeded(RuntimeError):
    """Live tracked bytes went over the tracker's ``budget_bytes``: a simulated out-of-memory."""

    def __init__(self, budget, requested, step, phase, module, breakdown):
        self.budget, self.requested = budget, requested
        self.step, self.phase, self.module, self.breakdown = step, phase, module, breakdown
        parts = ", ".join(f"{k} {v / MiB:.2f}" for k, v in breakdown.items() if v)
        super().__init__(
            f"out of memory (simulated budget {budget / MiB:.2f} MiB): step {step}, {phase} phase, "
            f"in {module}, tried to allocate {requested / MiB:.2f} MiB with "
            f"{sum(breakdown.values()) / MiB:.2f} MiB live [{parts}] (MiB)"
        )


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
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.model, self.optimizer, self.budget_bytes = model, optimizer, budget_bytes
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._trace: Trace | None = None
        self._active = False

    # ---- entering and leaving -------------------------------------------------
    def __enter__(self) -> StepTracker:
        if getattr(self.model, "_anatomy_tracker", None) is not None:
            raise RuntimeError("this model is already being tracked: trackers on one model cannot be nested")
        self.model._anatomy_tracker = self
        self._handles = []
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
        self._aliasing: dict = {}  # op -> whether its outputs alias its inputs
        self._grad_param: dict[int, str] = {}  # allocation id of a gradient -> its parameter's name
        self._saved: list[tuple[int, int, tuple, torch.dtype, int, int]] = []
        self._start_ns = time.perf_counter_ns()
        self._cuda_marks: list[tuple[int, int, int, int]] = []  # (sample, allocated, reserved, requested)
        self._cuda_at_entry = self._cuda_counters() if self._cuda else (0, 0, 0)
        self._active = True
        try:
            self._register_existing()
            self._n_baseline = len(self._events)
            self._install_hooks()
            self._mode = _OpWatcher(self)
            self._mode.__enter__()
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        except BaseException:
            self._teardown()
            raise
        self._mark_phase()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._teardown()
        if isinstance(exc, MemoryBudgetExceeded):
            exc.trace = self._trace  # what happened up to the failure, for plotting
        return None

    def _teardown(self) -> None:
        if hasattr(self, "_saved_hooks"):
            self._saved_hooks.__exit__(None, None, None)
            del self._saved_hooks
        if hasattr(self, "_mode"):
            self._mode.__exit__(None, None, None)
            del self._mode
        for h in self._handles:
            h.remove()
        self._handles = []
        if "zero_grad" in vars(self.optimizer):
            del self.optimizer.zero_grad  # back to the class's own method
        if getattr(self.model, "_anatomy_tracker", None) is self:
            del self.model._anatomy_tracker
        if self._active:
            self._active = False
            self._end_ns = time.perf_counter_ns()
            self._trace = Trace._from_tracker(self)
        self._refs.clear()  # dropping the weak refs also drops their callbacks
        self._live.clear()

    @property
    def trace(self) -> Trace:
        """The recorded :class:`Trace`; available once the ``with`` block has ended."""
        if self._trace is None:
            raise RuntimeError("the trace is ready when the `with StepTracker(...)` block has ended")
        return self._trace

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

    def _aid(self, t: torch.Tensor, module: int | None = None, new: bool = True) -> int | None:
        """Allocation id of t's storage, registering it if unknown and ``new``.

        None if the storage is not on the tracked device (or unknown and not ``new``).
        """
        if t.is_cuda is not self._cuda or t.is_meta or t.layout is not torch.strided:
            return None
        st = t.untyped_storage()
        aid = self._live.get(st._cdata)
        if aid is None:
            return self._new(st, self._module if module is None else module) if new else None
        nbytes = st.nbytes()
        if nbytes != self._a_bytes[aid]:  # resized in place (out= ops, resize_)
            self._record(aid, nbytes - self._a_bytes[aid], self._module)
            self._a_bytes[aid] = nbytes
        return aid

    def _new(self, st: torch.UntypedStorage, module: int) -> int:
        nbytes = st.nbytes()
        aid = len(self._a_bytes)
        self._a_bytes.append(nbytes)
        self._a_cat.append(TEMPORARIES)
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
        aid = self._aid(t, module)
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
        h = self._handles

        def root_pre(module, args):
            self._set_phase(FORWARD)
            self._mod_stack.clear()
            self._module = root_code
            for a in args:
                if isinstance(a, torch.Tensor):
                    self._mark(a, INPUTS)

        def root_post(module, args, output):
            self._module = root_code

        h.append(self.model.register_forward_pre_hook(root_pre, prepend=True))
        h.append(self.model.register_forward_hook(root_post))
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

            h.append(sub.register_forward_pre_hook(pre))
            h.append(sub.register_forward_hook(post))

        def grad_landed(p, name):
            aid = self._mark(p.grad, GRADIENTS)
            if aid is not None:
                self._grad_param[aid] = name

        for name, p in self.model.named_parameters():
            if p.requires_grad:
                h.append(p.register_post_accumulate_grad_hook(lambda p, name=name: grad_landed(p, name)))

        def opt_pre(opt, args, kwargs):
            self._set_phase(OPTIMIZER)
            self._module = self._code(OPT_STEP)

        def opt_post(opt, args, kwargs):
            self._mark_optimizer_state()

        h.append(self.optimizer.register_step_pre_hook(opt_pre))
        h.append(self.optimizer.register_step_post_hook(opt_post))

        original_zero_grad = self.optimizer.zero_grad  # bound method of the class

        def zero_grad(*args, **kwargs):
            if self._phase == OPTIMIZER:
                self._module = self._code(OPT_ZERO_GRAD)
            original_zero_grad(*args, **kwargs)
            if self._phase == OPTIMIZER:
                self._set_phase(IDLE)
                self._module = self._code(NO_MODULE)

        self.optimizer.zero_grad = zero_grad

    # ---- callbacks from torch -------------------------------------------------------
    def _after_op(self, func, out) -> None:
        if self._phase != BACKWARD and _graph_task_id() != -1:
            self._set_phase(BACKWARD)
            self._module = self._code(ROOT)
        # Views, in-place and out= ops return memory that already existed: a storage first seen
        # there was allocated before tracking began (a slice of the dataset, say), not by this op.
        aliases = self._aliasing.get(func)
        if aliases is None:
            aliases = self._aliasing[func] = any(r.alias_info is not None for r in func._schema.returns)
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

    def __len__(self) -> int:
        return len(self.step)

    @property
    def total(self) -> np.ndarray:
        return self.bytes.sum(axis=1)

    def category(self, name: str) -> np.ndarray:
        """Bytes of one category over the samples."""
        return self.bytes[:, CATEGORIES.index(name)]

    def records(self) -> list[dict]:
        """The table as a list of dicts (one per sample), for printing or pandas."""
        return [
            {
                "time_s": float(self.time_s[i]),
                "step": int(self.step[i]),
                "phase": PHASES[self.phase[i]],
                "module": self.module_names[self.module[i]],
                **{c: int(self.bytes[i, j]) for j, c in enumerate(CATEGORIES)},
            }
            for i in range(len(self))
        ]


@dataclass
class PhaseSummary:
    step: int
    phase: str
    start: int  # first sample index of the phase
    end: int  # last sample index of the phase
    peak: Peak
    at_end: dict[str, int]  # bytes per category after the phase's last sample
    dominant: str  # the category holding the most bytes at the phase's peak


class Trace:
    """What a :class:`StepTracker` recorded. Bytes everywhere, exact on CPU."""

    def __init__(self, timeline, baseline, alloc_category, alloc_module, alloc_events, phase_marks, saved, meta):
        self.timeline: Timeline = timeline
        self.baseline: dict[str, int] = baseline  # bytes per category when tracking began
        self.alloc_category = alloc_category  # category index per allocation id
        self.alloc_module = alloc_module  # module index per allocation id
        self.alloc_events = alloc_events  # (n_samples, ) allocation id of each sample
        self.phase_marks = phase_marks
        self.saved = saved
        self.meta = meta

    @classmethod
    def _from_tracker(cls, tr: StepTracker) -> Trace:
        n0 = tr._n_baseline
        ev = np.array(tr._events, dtype=np.int64).reshape(-1, 6)
        cats = np.array(tr._a_cat, dtype=np.int64)
        base = np.zeros(len(CATEGORIES), dtype=np.int64)
        np.add.at(base, cats[ev[:n0, 1]], ev[:n0, 2])
        baseline_deltas = (ev[:n0, 1].copy(), ev[:n0, 2].copy())
        ev = ev[n0:]
        deltas = np.zeros((len(ev), len(CATEGORIES)), dtype=np.int64)
        deltas[np.arange(len(ev)), cats[ev[:, 1]]] = ev[:, 2]
        cuda = np.array(tr._cuda_samples[n0:], dtype=np.int64).reshape(-1, 2) if tr._cuda else None
        timeline = Timeline(
            time_s=(ev[:, 0] - tr._start_ns) / 1e9,
            step=ev[:, 3].copy(),
            phase=ev[:, 4].copy(),
            module=ev[:, 5].copy(),
            bytes=base + np.cumsum(deltas, axis=0),
            module_names=list(tr._modules),
            cuda_allocated=None if cuda is None else cuda[:, 0],
            cuda_reserved=None if cuda is None else cuda[:, 1],
        )
        marks = [(i - n0, (t - tr._start_ns) / 1e9, s, p) for i, t, s, p in tr._phase_marks]
        saved = [
            {
                "step": s,
                "module": tr._modules[m],
                "shape": shape,
                "dtype": dtype,
                "bytes": nbytes,  # the saved view's own bytes
                "storage": aid,  # allocation id: several saved views may share one storage
                "storage_bytes": tr._a_bytes[aid],  # the whole storage, what the tracker counts
                "category": CATEGORIES[tr._a_cat[aid]],
            }
            for s, m, shape, dtype, nbytes, aid in tr._saved
        ]
        meta = {
            "device": str(tr.device),
            "duration_s": (tr._end_ns - tr._start_ns) / 1e9,
            # CUDA only: allocator counters when tracking began and at every phase change
            # (rows: sample index the change happened before, allocated, reserved, requested bytes).
            "cuda_at_entry": tr._cuda_at_entry,
            "cuda_at_phase_marks": np.array([(i - n0, a, r, q) for i, a, r, q in tr._cuda_marks], dtype=np.int64),
            "alloc_deltas": ev[:, 2].copy(),
            "baseline_deltas": baseline_deltas,
            "grad_param": dict(tr._grad_param),  # gradient allocation id -> parameter name
        }
        return cls(
            timeline,
            {c: int(b) for c, b in zip(CATEGORIES, base)},
            cats,
            np.array(tr._a_module, dtype=np.int64),
            ev[:, 1].copy(),
            marks,
            saved,
            meta,
        )

    # ---- windows ------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        """Every step number that has samples (a trailing idle step included)."""
        return sorted(set(self.timeline.step.tolist()))

    def training_steps(self) -> list[int]:
        """Steps that ran a forward pass."""
        return sorted({s for _, _, s, p in self.phase_marks if p == FORWARD})

    def _window(self, step: int | None, phase: str | None) -> np.ndarray:
        mask = np.ones(len(self.timeline), dtype=bool)
        if step is not None:
            mask &= self.timeline.step == step
        if phase is not None:
            if phase not in PHASES:
                raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
            mask &= self.timeline.phase == PHASES.index(phase)
        return np.flatnonzero(mask)

    def _breakdown(self, i: int) -> dict[str, int]:
        if i < 0:
            return dict(self.baseline)
        return {c: int(b) for c, b in zip(CATEGORIES, self.timeline.bytes[i])}

    def at(self, index: int) -> dict[str, int]:
        """Bytes per category after sample ``index`` (-1: when tracking began)."""
        return self._breakdown(index)

    def peak(self, step: int | None = None, phase: str | None = None) -> Peak:
        """The highest total in the given step and/or phase (the whole trace by default)."""
        idx = self._window(step, phase)
        if len(idx) == 0:
            raise ValueError(f"no samples for step={step!r}, phase={phase!r}; steps recorded: {self.steps}")
        i = int(idx[np.argmax(self.timeline.total[idx])])
        tl = self.timeline
        return Peak(
            int(tl.total[i]), i, int(tl.step[i]), PHASES[tl.phase[i]], tl.module_names[tl.module[i]], self._breakdown(i)
        )

    def phases(self) -> list[PhaseSummary]:
        """One summary per (step, phase) run of samples, in time order."""
        tl = self.timeline
        if len(tl) == 0:
            return []
        key = tl.step * len(PHASES) + tl.phase
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        ends = np.r_[starts[1:] - 1, len(tl) - 1]
        out = []
        for s, e in zip(starts.tolist(), ends.tolist()):
            i = s + int(np.argmax(tl.total[s : e + 1]))
            peak = Peak(
                int(tl.total[i]),
                i,
                int(tl.step[i]),
                PHASES[tl.phase[i]],
                tl.module_names[tl.module[i]],
                self._breakdown(i),
            )
            dominant = max(peak.breakdown, key=peak.breakdown.get)
            out.append(PhaseSummary(peak.step, peak.phase, s, e, peak, self._breakdown(e), dominant))
        return out

    def step_times_s(self) -> dict[int, float]:
        """Wall time of each step in seconds, from its first phase change to the next step's."""
        starts: dict[int, float] = {}
        for _, t, s, _ in self.phase_marks:
            starts.setdefault(s, t)
        steps = sorted(starts)
        ends = [starts[s] for s in steps[1:]] + [self.meta["duration_s"]]
        ran = set(self.training_steps())
        return {s: e - starts[s] for s, e in zip(steps, ends) if s in ran}

    def live_by_module(self, index: int, depth: int = 2) -> dict[str, dict[str, int]]:
        """Bytes alive after sample ``index``, by the module that allocated them and category.

        Module names are cut to ``depth`` parts (``blocks.0.attn.qkv`` -> ``blocks.0``).
        Parameters count under the module that owns them.
        """
        alive = np.zeros(len(self.alloc_category), dtype=np.int64)
        n0_deltas = self.meta["baseline_deltas"]
        np.add.at(alive, n0_deltas[0], n0_deltas[1])
        np.add.at(alive, self.alloc_events[: index + 1], self.meta["alloc_deltas"][: index + 1])
        out: dict[str, dict[str, int]] = {}
        names = self.timeline.module_names
        for aid in np.flatnonzero(alive):
            name = ".".join(names[self.alloc_module[aid]].split(".")[:depth])
            row = out.setdefault(name, dict.fromkeys(CATEGORIES, 0))
            row[CATEGORIES[self.alloc_category[aid]]] += int(alive[aid])
        return out

    def allocation_record(self) -> dict[str, np.ndarray]:
        """Every allocation and free in order, for replaying (e.g. through an allocator model).

        Columns (numpy arrays of one row per memory event): ``sample`` (timeline index,
        -1 for storages already alive when tracking began), ``time_s``, ``alloc_id``,
        ``bytes`` (positive for an allocation, negative for a free), ``category``
        (index into CATEGORIES), ``step`` and ``phase`` (index into PHASES).
        """
        base_ids, base_bytes = self.meta["baseline_deltas"]
        tl = self.timeline
        n0 = len(base_ids)
        return {
            "sample": np.r_[np.full(n0, -1), np.arange(len(tl))],
            "time_s": np.r_[np.zeros(n0), tl.time_s],
            "alloc_id": np.r_[base_ids, self.alloc_events],
            "bytes": np.r_[base_bytes, self.meta["alloc_deltas"]],
            "category": self.alloc_category[np.r_[base_ids, self.alloc_events]],
            "step": np.r_[np.zeros(n0, dtype=np.int64), tl.step],
            "phase": np.r_[np.zeros(n0, dtype=np.int64), tl.phase],
        }

    def replay_baseline(self, round_to: int = 1) -> int:
        """Bytes alive when tracking began, each allocation rounded up to ``round_to`` bytes."""
        return int(_round_up(self.meta["baseline_deltas"][1], round_to).sum())

    def replay_totals(self, round_to: int = 1) -> np.ndarray:
        """Total live bytes after each sample, each allocation rounded up to ``round_to`` bytes.

        ``round_to=512`` mimics the CUDA caching allocator's block sizes, so the
        result can be compared with ``torch.cuda.memory_allocated()``.
        """
        d = self.meta["alloc_deltas"]
        return self.replay_baseline(round_to) + np.cumsum(np.sign(d) * _round_up(np.abs(d), round_to))

    # ---- printing -------------------------------------------------------------------
    def table(self) -> str:
        """Phase x category table in MiB, each row at that phase's peak."""
        head = f"{'step':>4} {'phase':<9}" + "".join(f"{c[:11]:>12}" for c in CATEGORIES) + f"{'total':>10}  peak in"
        lines = [head, "-" * len(head)]
        for ph in self.phases():
            if ph.phase == "idle":
                continue
            cells = "".join(f"{ph.peak.breakdown[c] / MiB:12.2f}" for c in CATEGORIES)
            lines.append(f"{ph.step:>4} {ph.phase:<9}{cells}{ph.peak.bytes / MiB:10.2f}  {ph.peak.module}")
        lines.append(f"peak: {self.peak()}")
        return "\n".join(lines)
