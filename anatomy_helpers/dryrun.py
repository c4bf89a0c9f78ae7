"""Dry runs: the course's tracked training step on tensors that hold no data.

Under torch's ``FakeTensorMode`` every op computes the shape, dtype, strides and storage size of its outputs
and nothing else: no kernel runs, no byte of data is allocated. The :class:`~anatomy_helpers.tracker.StepTracker`
runs on top of it unchanged (its dispatch mode sees the fake outputs, its saved-tensor hooks see what autograd
saves, its weak references see the fake storages die), so a dry run returns the same :class:`Trace` a real run
does, and every table and plot of the course works on it, for models far larger than the machine.

How the model is made without memory: the model factory runs under ``torch.device("meta")`` (parameters with a
shape and no storage), then :func:`fake_module` swaps every parameter and buffer for a fake tensor on the target
device, keeping shared (tied) tensors shared.

What a dry run cannot see is :data:`KERNEL_SCRATCH_RULE`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from .interrupts import DeferredInterrupt
from .model import GPT, ModelConfig
from .trace import Trace
from .tracker import StepTracker
from .train import make_optimizer

#: The rule for the one category a dry run cannot measure.
KERNEL_SCRATCH_RULE = (
    "A dry run sees every storage an op returns, autograd saves or a policy keeps, so it is exact for every "
    "category but kernel scratch: memory a kernel allocates and frees inside one op. Fake tensors run no kernels, "
    "so the trace says kernel_scratch_recorded=False and that category reads 0 because it is unknown. It is "
    "compared with a real run measured with StepTracker(..., kernel_scratch=False); on CPU kernel scratch is "
    "measured only by real runs (the tracker's default), on CUDA only by the allocator's own counters."
)

AUTOCAST_CHOICES = (None, "bfloat16", "float16")


class DryRunError(ValueError):
    """A model, batch or loss a dry run cannot handle; the message says why and what to do."""


def fake_module(model: nn.Module, mode: FakeTensorMode, device: str | torch.device = "cpu") -> nn.Module:
    """Replace every parameter and buffer of ``model`` (in place) by a fake tensor on ``device``; returns it.

    Same shape, strides, dtype and ``requires_grad``; a tensor shared by two modules (tied weights) stays shared.
    """
    new: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in new:
            with mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            new[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        return new[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    table[name] = fake(t)
    return model


def build_fake_model(
    model_factory: Callable[[], nn.Module], mode: FakeTensorMode, device: str | torch.device = "cpu"
) -> nn.Module:
    """``model_factory()`` built on the meta device (no memory), then made fake on ``device``."""
    with torch.device("meta"):
        model = model_factory()
    if not isinstance(model, nn.Module):
        raise DryRunError(f"the model factory must return an nn.Module, got {type(model).__name__}")
    if next(iter(model.parameters()), None) is None:
        raise DryRunError(f"{type(model).__name__} has no parameters: there is no training step to dry-run")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type != "meta":
            raise DryRunError(
                f"{name} was created on {t.device}, not on the meta device: the model factory must create its "
                "tensors on the default device (no explicit device=...), so the dry run can build it without memory"
            )
    return fake_module(model, mode, device)


def course_batch(batch_size: int, seq_len: int, device: str | torch.device = "cpu"):
    """A batch shaped like ``data.get_batch``'s, making the same allocations in the same order, without data.

    get_batch draws ``batch_size`` start offsets (one int64 each), stacks the inputs and the targets
    (each (B, T) int64) and frees the offsets when it returns.
    """
    starts = torch.empty(batch_size, dtype=torch.long, device=device)  # (B,)
    x = torch.empty(batch_size, seq_len, dtype=torch.long, device=device)  # (B, T)
    y = torch.empty(batch_size, seq_len, dtype=torch.long, device=device)  # (B, T)
    del starts
    return x, y


def gpt_loss(model: nn.Module, batch) -> torch.Tensor:
    """The course GPT's step: ``model(x, y)`` returns ``(logits, loss)``; the logits are dropped at once."""
    return model(*batch)[1]


def run_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_fn: Callable[[int], Sequence[torch.Tensor]],
    loss_fn: Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor],
    steps: int = 2,
    *,
    autocast: str | None = None,
    set_to_none: bool = True,
    kernel_scratch: bool = True,
    fake: bool = False,
) -> Trace:
    """``steps`` tracked training steps of any module: the loop of ``train.track_steps``, for any model.

    Step ``i`` (from 0): ``batch = batch_fn(i)``; ``loss = loss_fn(model, batch)`` (under autocast if asked;
    it runs the model and drops what the loss does not need); ``loss.backward()``; ``optimizer.step()``;
    ``optimizer.zero_grad(set_to_none=...)``. A real run reads ``loss.item()`` as track_steps does; a ``fake``
    one cannot (there is no value) and skips it, which allocates nothing either way.
    """
    device = next(model.parameters()).device
    mixed = torch.autocast(device.type, dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext()
    with StepTracker(model, optimizer, kernel_scratch=kernel_scratch) as tracker:
        for i in range(steps):
            batch = list(batch_fn(i))
            with mixed:
                loss = loss_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            if not fake:
                loss.item()
            del loss
            for j in range(len(batch)):  # freed first to last, as track_steps' `del x, y`
                batch[j] = None
            del batch
    return tracker.trace


def _check_steps(steps, autocast) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if autocast not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast must be one of {AUTOCAST_CHOICES}, got {autocast!r}")


def dry_run(
    model_factory: Callable[[], nn.Module],
    batch_factory: Callable[[int], Sequence[torch.Tensor]],
    loss_fn: Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor],
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] = make_optimizer,
    steps: int = 2,
    *,
    autocast: str | None = None,
    set_to_none: bool = True,
    device: str = "cpu",
) -> Trace:
    """Dry-run ``steps`` training steps of any ``nn.Module``; returns the Trace a real run would record.

    ``model_factory()`` builds the model (it runs on the meta device: create tensors without ``device=``);
    ``batch_factory(step)`` returns the batch, a sequence of tensors (it runs under the fake mode, so
    ``torch.empty``/``torch.zeros`` make fake tensors); ``loss_fn(model, batch)`` runs the model and returns
    the scalar loss;
    ``optimizer_factory(model)`` the optimizer (AdamW by default). Exact but for kernel scratch
    (:data:`KERNEL_SCRATCH_RULE`). Raises :class:`DryRunError` for what it cannot run: a model that reads its
    tensors' values (``.item()``, data-dependent shapes), tensors made outside the model and the batch factory.
    """
    _check_steps(steps, autocast)
    # A Ctrl-C raised inside FakeTensorMode's Python code, which torch's C++ dispatcher called, aborts the whole
    # process (torch 2.13): hold it for the whole dry run; the tracker raises it between two ops.
    interrupt = DeferredInterrupt()
    interrupt.start()
    try:
        return _dry_run(model_factory, batch_factory, loss_fn, optimizer_factory, steps, autocast, set_to_none, device)
    finally:
        interrupt.stop()


def _dry_run(model_factory, batch_factory, loss_fn, optimizer_factory, steps, autocast, set_to_none, device) -> Trace:
    mode = FakeTensorMode()
    model = build_fake_model(model_factory, mode, device)
    try:
        with mode:
            optimizer = optimizer_factory(model)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise DryRunError(f"the optimizer factory must return a torch.optim.Optimizer, got {optimizer!r}")
            return run_steps(
                model,
                optimizer,
                batch_factory,
                loss_fn,
                steps,
                autocast=autocast,
                set_to_none=set_to_none,
                kernel_scratch=False,
                fake=True,
            )
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise DryRunError(
            f"{type(model).__name__} reads tensor values during the step ({e.func if hasattr(e, 'func') else e}): "
            "a dry run has shapes but no values, so it cannot run code that branches on data or whose output "
            "shape depends on it (.item(), .tolist(), nonzero, boolean masks)"
        ) from e
    except (RuntimeError, AssertionError) as e:
        if "FakeTensor" in str(e):
            raise DryRunError(
                f"the dry run met a real tensor: {e}. Every tensor the step uses must come from the model (its "
                "parameters and buffers) or from the batch factory"
            ) from e
        raise


def dry_run_config(
    cfg: ModelConfig | None = None,
    *,
    optimizer: str = "adamw",
    foreach: bool | None = None,
    fused: bool | None = None,
    batch_size: int = 8,
    steps: int = 2,
    autocast: str | None = None,
    **config,
) -> Trace:
    """Dry-run ``track_steps`` on the course GPT: ``cfg`` (or ModelConfig fields as keywords), on CPU.

    The same loop as ``track_steps(make_model(**config), make_optimizer(model, optimizer, foreach=..,
    fused=..), steps, batch_size, autocast=...)``, with the same batches' allocations (:func:`course_batch`).
    Byte for byte the real trace with ``kernel_scratch=False``; any size (nothing is allocated).
    """
    if cfg is not None and config:
        raise ValueError("pass either a ModelConfig or its fields as keywords, not both")
    cfg = cfg if cfg is not None else ModelConfig(**config)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return dry_run(
        lambda: GPT(cfg),
        lambda step: course_batch(batch_size, cfg.seq_len),
        gpt_loss,
        lambda model: make_optimizer(model, optimizer, foreach=foreach, fused=fused),
        steps,
        autocast=autocast,
    )
