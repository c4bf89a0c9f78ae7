"""A memory budget on CPU: training steps that "run out of memory" when live tensor bytes pass a limit.

The tracker raises :class:`~anatomy_helpers.tracking.recorder.MemoryBudgetExceeded` the moment its live bytes go over
``budget_bytes``; :func:`run_under_budget` turns that into a :class:`BudgetRun` (which steps passed, where it
failed) and :class:`StorageWatch` checks that a failed step left nothing alive. Bytes everywhere.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.tensors import on_device, optimizer_state_tensors, returns_alias
from ..core.units import MiB
from ..tracking.recorder import MemoryBudgetExceeded
from ..tracking.trace import Trace
from .train import make_model, make_optimizer, track_steps


def budget_between(trace: Trace, step_a: int = 1, step_b: int = 2, round_to: int = MiB) -> int:
    """A budget halfway between the tracked peaks of ``step_a`` and ``step_b``, rounded down to a multiple
    of ``round_to`` bytes. Raises ValueError if no such multiple lies strictly between the two peaks."""
    a, b = trace.peak(step=step_a).bytes, trace.peak(step=step_b).bytes
    budget = (a + b) // 2 // round_to * round_to
    if not a < budget < b:
        raise ValueError(
            f"no budget between step {step_a}'s peak ({a:,} bytes) and step {step_b}'s ({b:,} bytes) "
            f"in multiples of {round_to:,} bytes"
        )
    return budget


def model_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a training run keeps on purpose between steps: parameters, buffers, gradients, optimizer state."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *model.buffers(), *grads, *optimizer_state_tensors(optimizer)]


class StorageWatch(TorchDispatchMode):
    """Keeps a weak reference to every storage that ops create inside it, to ask later which are still alive.

    Usage::

        with StorageWatch() as watch:
            ...  # run something, maybe fail
        watch.alive_bytes(exclude=model_state_tensors(model, optimizer))  # 0 if nothing leaked

    Outputs of view and in-place ops (which return memory that already existed) are not new storages
    and are ignored, as the step tracker does.
    """

    def __init__(self):
        super().__init__()
        self._refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not returns_alias(func):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta:
                    self._refs.append(weakref.ref(t.untyped_storage()))
        return out

    def alive(self, exclude: Iterable[torch.Tensor] = (), device=None) -> list[torch.UntypedStorage]:
        """Storages created inside the watch that are still alive, each once, minus those behind ``exclude``
        (and, with ``device``, only those on it)."""
        skip = {t.untyped_storage()._cdata for t in exclude}
        seen: dict[int, torch.UntypedStorage] = {}
        for ref in self._refs:
            st = ref()
            if st is None or st._cdata in skip or not on_device(st, device):
                continue
            seen.setdefault(st._cdata, st)
        return list(seen.values())

    def alive_bytes(self, exclude: Iterable[torch.Tensor] = (), device=None) -> int:
        """Bytes of :meth:`alive`."""
        return sum(st.nbytes() for st in self.alive(exclude, device))


@dataclass
class BudgetRun:
    """Tracked training steps under a budget of live tensor bytes (``track_steps(..., budget_bytes=)``)."""

    budget: int
    steps: int  # steps asked for
    completed: list[int]  # steps that finished
    trace: Trace  # what was recorded (up to the failure)
    failed_step: int | None = None
    phase: str | None = None
    module: str | None = None
    requested: int | None = None  # bytes of the allocation that went over
    breakdown: dict[str, int] | None = None  # live bytes per category at that moment
    message: str | None = None

    @property
    def passed(self) -> bool:
        return self.failed_step is None

    def step_peaks(self) -> dict[int, int]:
        """Peak tracked bytes of every step that started (the failed one up to its failure)."""
        return {s: self.trace.peak(step=s).bytes for s in self.trace.training_steps()}

    def summary(self) -> str:
        peaks = self.step_peaks()
        parts = []
        for s in range(1, self.steps + 1):
            if s in self.completed:
                parts.append(f"step {s} ok (peak {peaks[s] / MiB:.2f} MiB)")
            elif s == self.failed_step:
                parts.append(f"step {s} FAILED in {self.phase}, {self.module}")
                break
        if self.failed_step == 0:
            parts.append("the model does not fit before step 1 (parameters and state alone are over the budget)")
        return f"budget {self.budget / MiB:.2f} MiB: " + "; ".join(parts)


def run_under_budget(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    budget_bytes: int,
    steps: int = 3,
    batch_size: int = 8,
    seed: int = 0,
) -> BudgetRun:
    """Train ``steps`` tracked steps under ``budget_bytes`` of live tensor memory and report what happened.

    A :class:`~anatomy_helpers.tracking.recorder.MemoryBudgetExceeded` is caught and turned into plain fields; the
    exception itself is not kept (its traceback holds the failed step's tensors). After a failure, the
    half-made gradients are dropped with ``zero_grad`` and the garbage collector runs, as a training loop
    that survives an out-of-memory error must.
    """
    try:
        trace = track_steps(model, optimizer, steps=steps, batch_size=batch_size, seed=seed, budget_bytes=budget_bytes)
    except MemoryBudgetExceeded as err:
        run = BudgetRun(
            budget_bytes,
            steps,
            list(range(1, err.step)),
            err.trace,
            err.step,
            err.phase,
            err.module,
            err.requested,
            dict(err.breakdown),
            str(err),
        )
    else:
        return BudgetRun(budget_bytes, steps, list(range(1, steps + 1)), trace)
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    return run


def try_budget(
    budget_bytes: int,
    batch_size: int = 8,
    optimizer: str = "adamw",
    checkpoint: str = "none",
    steps: int = 3,
    device=None,
    **model_config,
) -> BudgetRun:
    """:func:`run_under_budget` on a fresh model (``checkpoint`` and ``model_config`` go to make_model)."""
    model = make_model(device=device, checkpoint=checkpoint, **model_config)
    return run_under_budget(model, make_optimizer(model, optimizer), budget_bytes, steps=steps, batch_size=batch_size)
