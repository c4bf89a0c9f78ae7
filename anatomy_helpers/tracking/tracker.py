"""The step tracker: what is alive in memory, op by op, during training steps.

How it sees memory (all of it public torch machinery, removed again on exit):

* a ``TorchDispatchMode`` sees every op's output tensors. A storage seen for the
  first time is an allocation; a weak reference on it reports the free;
* ``saved_tensors_hooks`` see what autograd saves for backward (activations);
* ``register_post_accumulate_grad_hook`` sees each parameter's gradient land;
* optimizer step hooks (and a wrapped ``zero_grad``) mark the optimizer phase;
  its state is read from ``optimizer.state`` after every step (a step fused into
  backward, ``step.OptimizerInBackward``, is an optimizer phase inside backward);
* module forward hooks say which module is running; in backward, the module is
  the one that saved the tensor autograd has just unpacked. An op that runs with
  grad mode on *inside* backward is activation checkpointing recomputing forward
  code (autograd runs its own ops with grad mode off): what it allocates then is
  "recomputed";
* on CPU, a memory-only profiler session reports the allocator's own events, so
  memory a kernel allocates and frees inside one op counts too, as
  "kernel_scratch" (scratch.py).

Each allocation gets one category, decided by what the storage turned out to be
(a tensor saved for backward is an activation from the moment it was created).
Storages are counted once however many views point at them, so on CPU the
numbers are exact bytes and the same on every run.

What watching changes: under any dispatch mode, every op's outputs pass through
Python, and autograd then sums some gradients out of place where it would have
summed them in place (it adds in place only when it holds the last reference to
the running sum: ``can_accumulate_inplace`` in torch/csrc/autograd/input_buffer.cpp).
On the default model that is one extra 1 MiB ``add`` per residual connection per
step, a temporary freed at once; none of them falls on a peak in the profiler
sweep (tests/test_profiler_agreement.py). And it costs time: see
benchmarks/tracker_overhead.py.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core import checkpointing
from ..core.checks import positive_number
from ..core.interrupts import DeferredInterrupt
from ..core.tensors import ALLOCATES, IN_PLACE, VIEWS, op_outputs, optimizer_state_tensors
from .compiled import CompiledCodeError, compiled_function, refuse_compiled_code, refuse_untrackable
from .events import (
    ACTIVATIONS,
    BACKWARD,
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
    ROOT,
    OpWindow,
    SavedRow,
)
from .recorder import FIXED_MODULES, MemoryBudgetExceeded, Recorder
from .scratch import MemoryEvents
from .trace import Trace

_graph_task_id = torch._C._current_graph_task_id  # -1 outside backward
_time_ns = time.time_ns  # the clock the profiler's memory events are stamped with
_MISSING = object()
_OUTSIDE = FIXED_MODULES.index(NO_MODULE)  # module index: allocated while no module of the model was running


class _OpWatcher(TorchDispatchMode):
    """Runs every op, then hands its outputs to the tracker."""

    def __init__(self, tracker: StepTracker):
        super().__init__()
        self.tracker = tracker

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps every mode's __torch_dispatch__ in a "Dynamo, do not compile this" frame guard, a few
        # microseconds on each of the ~1,300 ops of a step. Dynamo only ever sees this frame inside code that
        # torch.compile wrapped (its mode stack is empty while the mode runs, so Dynamo would compile it), and the
        # tracker refuses such code before its first frame runs (compiled.py), so the guard buys nothing here.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker._after_op(out, self.tracker._op_kind(func))
        return out


class _TimedOpWatcher(_OpWatcher):
    """Also notes each op's time window, to match the allocator's own events to ops (kernel scratch)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tracker = self.tracker
        kind = tracker._op_kind(func)
        if kind == VIEWS:  # a view allocates nothing: no window, nothing to record (about a third of all ops)
            return func(*args, **(kwargs or {}))
        start = _time_ns()
        out = func(*args, **(kwargs or {}))
        end = _time_ns()
        tracker._after_op(out, kind)
        # where a scratch sample would go (after this op's output samples), and the op's context
        tracker._windows.append(
            OpWindow(start, end, len(tracker._events), tracker._step, tracker._phase, tracker._module)
        )
        return out


class StepTracker(Recorder):
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

    ``accumulate=True``: gradient accumulation, a step is several forward/backward
    passes (micro-batches) and ends only with the optimizer phase; a forward after a
    backward is the next micro-step of the same step, not a new step.

    ``torch.compile``d code is refused with :class:`~anatomy_helpers.tracking.compiled.CompiledCodeError` (the
    tracker would see its eager ops, not the compiled step): a compiled model or submodule when the tracker is made,
    a compiled function when the step calls it, before it runs (compiled.py).

    Extending it (the per-rank tracker in distributed/ranks.py does): override these, each documented below,
    and record through the Recorder's :meth:`~Recorder.mark`, :meth:`~Recorder.allocation_id` and
    :meth:`~Recorder.resize`:

    * :meth:`storage_tensor` -- which tensor's storage holds a tensor's bytes (every tensor);
    * :meth:`state_tensors` -- the optimizer state to count (on entering, after every optimizer step);
    * :meth:`on_baseline` -- mark more storages alive before tracking (once, on entering);
    * :meth:`on_optimizer_step` -- act as each ``optimizer.step()`` starts;
    * :meth:`inner_modes` -- dispatch modes that see each op before the tracker records its outputs.
    """

    _running: StepTracker | None = None  # the tracker inside its `with` block, if any

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        budget_bytes: int | None = None,
        kernel_scratch: bool = True,
        accumulate: bool = False,
    ):
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
        if budget_bytes is not None:
            positive_number("budget_bytes", budget_bytes)
        refuse_untrackable(model)  # compiled code, sparse gradients (compiled.py)
        first = next(iter(model.parameters()), None)
        super().__init__(
            first.device if first is not None else torch.device("cpu"), budget_bytes=budget_bytes, accumulate=accumulate
        )
        self.model = model  # the model whose step is tracked
        self.optimizer = optimizer  # its optimizer: marks the optimizer phase, its state is read after every step
        # Kernel scratch is measured through the CPU allocator's reports (scratch.py); on CUDA the allocator's
        # own counters cover it.
        self.kernel_scratch = kernel_scratch and not self._cuda
        self._trace: Trace | None = None  # what the last `with` block recorded
        self._undo: list = []  # what __enter__ installed, each as a function that removes it again
        self._interrupt = DeferredInterrupt()  # Ctrl-C waits for a safe point: a module, a gradient, the optimizer
        self._thread: int | None = None  # the thread the `with` block runs in
        self._op_kinds: dict[int, int] = {}  # id(op) -> what its outputs are (tensors.op_outputs), read once per op

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
        self.begin()
        self._thread = threading.get_ident()
        # Held from here until the teardown is complete: a Ctrl-C never splits the bookkeeping, a weak-reference
        # callback or the undo of what is installed. It is raised from the tracker's Python hooks (a module's
        # forward, a gradient landing, the optimizer step) or when the block ends, never from inside an op:
        # under a dry run, an exception raised in an op that torch's C++ called can abort the process.
        self._interrupt.start()
        try:
            self._install(self._claim, self._release)
            no_compiling = refuse_compiled_code()  # a compiled function called inside: refused (compiled.py)
            self._install(no_compiling.__enter__, lambda: no_compiling.__exit__(None, None, None))
            if self.kernel_scratch:
                memory = MemoryEvents()
                self._install(lambda: memory.start(), lambda: self._memory_events.append(memory.stop()))
            self._install(
                lambda: None, checkpointing.add_listener(lambda t: self.mark(t, ACTIVATIONS))
            )  # what a checkpointing policy keeps outside autograd's saved tensors is an activation
            self._register_existing()
            self.close_baseline()
            clear_cache = torch.clear_autocast_cache  # called by torch.autocast's __exit__ (amp/autocast_mode.py)

            def clear_in_order():  # see Recorder.frees_in_allocation_order
                with self.frees_in_allocation_order():
                    clear_cache()

            self._install(
                lambda: setattr(torch, "clear_autocast_cache", clear_in_order),
                lambda: setattr(torch, "clear_autocast_cache", clear_cache),
            )
            self._install_hooks()
            mode = _TimedOpWatcher(self) if self.kernel_scratch else _OpWatcher(self)
            self._install(mode.__enter__, lambda: mode.__exit__(None, None, None))
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._install(hooks.__enter__, lambda: hooks.__exit__(None, None, None))
            for inner in self.inner_modes():  # entered after the tracker's own mode: they see each op first
                self._install(inner.__enter__, lambda inner=inner: inner.__exit__(None, None, None))
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
            where = compiled_function(exc)
            if where is not None:  # Dynamo refused to compile a function the step called (refuse_compiled_code)
                raise CompiledCodeError(where) from exc
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
        """Undo exactly what was installed, newest first, whatever fails on the way; then build the trace.

        Everything here runs even if one undo fails (a KeyboardInterrupt included: it is re-raised afterwards),
        so a failed or interrupted block never leaves a hook, a mode or a profiler session behind.
        """
        errors: list[BaseException] = []
        try:
            while self._undo:
                try:
                    self._undo.pop()()
                except BaseException as e:  # keep undoing the rest; report the first failure afterwards
                    errors.append(e)
            if self._active:
                self._trace = self.end()
        finally:
            try:
                self._interrupt.stop()  # gives SIGINT back; raises a Ctrl-C that came in meanwhile
            except KeyboardInterrupt as e:
                errors.append(e)
        if errors:
            raise errors[0]

    @property
    def trace(self) -> Trace:
        """The recorded :class:`Trace`; available once the ``with`` block has ended."""
        if self._trace is None:
            raise RuntimeError("the trace is ready when the `with StepTracker(...)` block has ended")
        return self._trace

    # ---- extension points: override in a subclass (each called as its docstring says) -------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer-state tensors to count as "optimizer_state" (in the optimizer.step module).

        Called on entering (state that already exists) and after every ``optimizer.step()`` (state it made).
        Default: every tensor in ``self.optimizer.state``.
        """
        return optimizer_state_tensors(self.optimizer)

    def on_baseline(self) -> None:
        """Mark (with :meth:`mark`) storages alive before tracking that the model and optimizer do not hold.

        Called once on entering, after the parameters, buffers, gradients and :meth:`state_tensors` are
        registered and before the baseline closes (what is marked here counts as alive when tracking began).
        Default: nothing.
        """

    def on_optimizer_step(self) -> None:
        """Called as each ``optimizer.step()`` starts, once the tracker is in the optimizer phase (after the step
        pre-hooks registered before the tracker). Default: nothing."""

    def inner_modes(self) -> list[TorchDispatchMode]:
        """Dispatch modes to run inside the tracker's own, entered on entering and exited on leaving.

        Each sees every op first, with its arguments, before the tracker; when it has called the op, the tracker
        has recorded the op's outputs. Default: none.
        """
        return []

    # ---- what is alive before tracking, and the hooks --------------------------------------------------------
    def _register_existing(self) -> None:
        for name, p in self.model.named_parameters():
            self.mark(p, PARAMETERS, self._code(name.rpartition(".")[0] or ROOT))
        for name, b in self.model.named_buffers():
            self.mark(b, PARAMETERS, self._code(name.rpartition(".")[0] or ROOT))
        for p in self.model.parameters():
            if p.grad is not None:
                self.mark(p.grad, GRADIENTS)
        self._mark_optimizer_state()
        self.on_baseline()

    def _mark_optimizer_state(self) -> None:
        module = self._code(OPT_STEP)
        for t in self.state_tensors():
            self.mark(t, OPTIMIZER_STATE, module)

    def _install_hooks(self) -> None:
        root_code = self._code(ROOT)

        def hook(handle) -> None:  # a RemovableHandle, removed again at teardown
            self._undo.append(handle.remove)

        def root_pre(module, args):
            self._refuse_other_threads(module)
            self._interrupt.check()  # a Ctrl-C that came in meanwhile is raised at a module's start
            self._set_phase(FORWARD)
            self._mod_stack.clear()
            self._module = root_code
            for a in args:
                if isinstance(a, torch.Tensor):
                    self.mark(a, INPUTS)

        def root_post(module, args, output):
            self._module = root_code

        hook(self.model.register_forward_pre_hook(root_pre, prepend=True))
        hook(self.model.register_forward_hook(root_post))
        for name, sub in self.model.named_modules():
            if not name:
                continue
            code = self._code(name)

            def pre(module, args, code=code):
                self._refuse_other_threads(module)
                self._interrupt.check()
                self._mod_stack.append(self._module)
                self._module = code

            def post(module, args, output):
                if self._mod_stack:
                    self._module = self._mod_stack.pop()

            hook(sub.register_forward_pre_hook(pre))
            hook(sub.register_forward_hook(post))

        def grad_landed(p, name):
            self._interrupt.check()  # in backward: raised through autograd like any error of a hook
            alloc_id = self.mark(p.grad, GRADIENTS)
            if alloc_id is not None:
                self._grad_param[alloc_id] = name

        for name, p in self.model.named_parameters():
            if p.requires_grad:
                hook(p.register_post_accumulate_grad_hook(lambda p, name=name: grad_landed(p, name)))

        def opt_pre(opt, args, kwargs):
            self._interrupt.check()
            self._set_phase(OPTIMIZER)
            self._module = self._code(OPT_STEP)
            self.on_optimizer_step()

        def opt_post(opt, args, kwargs):
            self._interrupt.check()
            self._mark_optimizer_state()
            if _graph_task_id() != -1:  # a step fused into backward (step.OptimizerInBackward): backward goes on
                self._set_phase(BACKWARD)
                self._module = root_code

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

    def _refuse_other_threads(self, module: nn.Module) -> None:
        # The tracker's dispatch mode and saved-tensor hooks belong to its own thread, but module hooks fire in
        # every thread: a forward of the tracked model from another thread would add steps to this trace. Inside
        # backward, autograd may run a checkpoint's recomputation on its own worker thread (CUDA): that is ours.
        if threading.get_ident() != self._thread and _graph_task_id() == -1:
            raise RuntimeError(
                f"{type(module).__name__} is being tracked by a StepTracker in another thread: run it from that "
                "thread, or after its `with` block has ended (its forward would be merged into that trace)"
            )

    # ---- callbacks from torch -------------------------------------------------------
    def _op_kind(self, func) -> int:
        """What ``func``'s outputs are (tensors.op_outputs), read from its schema once per op."""
        kind = self._op_kinds.get(id(func))  # keyed by id: an OpOverload hashes in Python, slowly
        if kind is None:
            kind = self._op_kinds[id(func)] = op_outputs(func)
        return kind

    def _after_op(self, out, kind: int) -> None:
        # inside backward, every op is backward's, but an optimizer step fused into it (its step hooks say when)
        if self._phase != BACKWARD and self._phase != OPTIMIZER and _graph_task_id() != -1:
            self._set_phase(BACKWARD)
            self._module = self._code(ROOT)
        if kind == VIEWS or kind == IN_PLACE:  # nothing allocated, nothing resized
            return
        # out= ops and resize_ return memory that already existed (maybe resized): a storage first seen there
        # was allocated before tracking began (a slice of the dataset, say), not by this op.
        new = kind == ALLOCATES
        if isinstance(out, torch.Tensor):
            self.allocation_id(out, new=new)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self.allocation_id(o, new=new)

    def _pack(self, t: torch.Tensor):
        alloc_id = self.allocation_id(t) if self._active else None
        if alloc_id is not None:
            # Data made outside any module before the forward (targets handed straight to a loss, say) and only
            # read by it is an input, not an activation the model produced.
            self.mark(t, INPUTS if self._alloc_module[alloc_id] == _OUTSIDE else ACTIVATIONS)
            self._saved.append(SavedRow(self._step, self._module, tuple(t.shape), t.dtype, t.nbytes, alloc_id))
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
