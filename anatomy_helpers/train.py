"""One training step, the optimizers the course compares, and device choice."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import torch
import torch.nn as nn

from .checks import optional_callable, positive_int, positive_number
from .data import get_batch, seed_everything
from .model import GPT, ModelConfig
from .tracking.tracker import StepTracker, Trace

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


def pick_device(preferred: str | torch.device | None = None) -> torch.device:
    """``preferred`` if given and usable, else the GPU when there is one, else the CPU.

    A GPU comes back with its index (``cuda:0``, not ``cuda``), so comparisons with tensors' devices work.
    Raises ValueError for a device that cannot be used here (a typo, CUDA on a CPU-only machine, a GPU index
    that does not exist).
    """
    if preferred is None:
        preferred = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(preferred)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {preferred!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {preferred!r} was asked for, but CUDA is not available here")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {preferred!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"the course runs on 'cpu' or 'cuda', got {preferred!r}")
    return device


def make_optimizer(
    model: nn.Module, name: str = "adamw", lr: float = 1e-3, foreach: bool | None = None, fused: bool | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (sgd, momentum, adam, adamw) over the model's parameters.

    ``foreach=None`` keeps torch's default for the device: the single-tensor loop on
    CPU and the foreach (multi-tensor) implementation on CUDA. ``fused=True`` asks for
    the fused kernel (one kernel updates every parameter in place).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__} {model!r}")
    positive_number("lr", lr)
    params = model.parameters()
    impl = {"foreach": foreach, "fused": fused}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **impl)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **impl)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **impl)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **impl)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward, backward, optimizer step, zero_grad (the step :func:`track_steps` runs, untracked).

    Returns the loss as a float."""
    loss = model(x, y)[1]  # the logits are dropped at once: only what autograd saved stays
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def make_model(device: str | torch.device | None = None, seed: int = 0, **config) -> GPT:
    """A freshly initialised GPT on ``device`` (best available by default).

    ``config`` overrides ModelConfig fields, e.g. ``make_model(n_layer=2, attn_impl="sdpa")``.
    The same seed always gives the same weights.
    """
    cfg = ModelConfig(**config)  # a bad config fails here, before anything is built
    target = pick_device(device)
    seed_everything(seed)
    return GPT(cfg).to(target)


KEEP_CHOICES = ("item", "loss", "val_loss")


def _loss_value(loss) -> float:
    """A step's loss as a float: a loss tensor's item, or the sum of its micro-batches' losses (floats or tensors)."""
    if isinstance(loss, list):
        return sum(p if isinstance(p, float) else p.item() for p in loss)
    return loss.item()


def track_steps(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    steps: int = 3,
    batch_size: int = 8,
    *,
    seed: int = 0,
    budget_bytes: int | None = None,
    progress: bool = False,
    set_to_none: bool = True,
    retain_graph: bool = False,
    keep: str = "item",
    optimizer_step: bool = True,
    autocast: str | None = None,
    micro_batches: int = 1,
    after_step: Callable[[int], None] | None = None,
    rank: int = 0,
    world_size: int = 1,
    tracker: StepTracker | None = None,
) -> Trace:
    """Train ``steps`` steps on course batches inside a StepTracker and return its Trace.

    The course's one training loop. Step ``i`` (from 1) is ``loss = model(x, y)[1]``,
    ``loss.backward(retain_graph=retain_graph)``, ``optimizer.step()``,
    ``optimizer.zero_grad(set_to_none=set_to_none)`` on batch
    ``get_batch(batch_size, model.cfg.seq_len, step=i - 1, seed=seed)``; then ``after_step(i)``.
    ``optimizer_step=False`` stops each step after backward (gradients kept, no optimizer phase).
    ``autocast="bfloat16"`` (or ``"float16"`` on CUDA) runs the forward and the loss under ``torch.autocast``:
    mixed precision the way most PyTorch users train (weights, gradients and optimizer state stay in the model's
    dtype; matmuls run, and save their inputs, in 16 bits). ``"float16"`` on CUDA also uses a
    ``torch.amp.GradScaler`` (loss scaled before backward, gradients unscaled and checked in ``scaler.step``).
    ``micro_batches=k`` accumulates gradients: each step splits its batch of ``batch_size`` (the global batch,
    a multiple of k) into k micro-batches of ``batch_size // k`` rows, runs forward and backward of each (loss
    divided by k, so the gradients are the global batch's mean), then one optimizer step. The tracker counts
    the k forward/backward passes as micro-steps of one step.
    ``world_size > 1``: data parallelism (see distributed/ranks.py). This process is rank ``rank``: it trains rows
    ``rank * b`` to ``(rank + 1) * b - 1`` of each global batch (``b = batch_size // world_size``), copied out as
    a data loader would hand them over, in micro-batches of ``b // micro_batches``. ``model`` may be a wrapper
    (DDP) whose ``.module`` is the course GPT. ``tracker``: a StepTracker (or subclass) of this model and
    optimizer to record with instead of a new one (made with ``accumulate=True`` when ``micro_batches > 1``).

    ``keep`` is what the loop keeps of each step for logging, in a list that lives through all steps:
    ``"item"``: ``loss.item()``, a Python float (the right way); ``"loss"``: the loss tensor itself, after
    its backward; ``"val_loss"``: a validation loss computed at the start of each step on another batch
    *without* ``torch.no_grad()`` and never backpropagated (its whole graph stays alive).

    With ``budget_bytes`` a step that goes over it raises MemoryBudgetExceeded. Whatever the loop raises
    carries what was recorded up to that moment as its ``.trace``.
    """
    steps, batch_size = positive_int("steps", steps), positive_int("batch_size", batch_size)
    if keep not in KEEP_CHOICES:
        raise ValueError(f"keep must be one of {KEEP_CHOICES}, got {keep!r}")
    if autocast not in (None, "bfloat16", "float16"):
        raise ValueError(f"autocast must be None, 'bfloat16' or 'float16', got {autocast!r}")
    micro_batches, world_size = positive_int("micro_batches", micro_batches), positive_int("world_size", world_size)
    optional_callable("after_step", after_step)  # refused now, not after a whole training step
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank {rank!r} of world_size {world_size!r}")
    if batch_size % (micro_batches * world_size):
        raise ValueError(
            f"batch_size ({batch_size}) must be a multiple of micro_batches x world_size "
            f"({micro_batches} x {world_size})"
        )
    local = batch_size // world_size  # rows this rank trains on
    micro = local // micro_batches
    device = next(model.parameters()).device
    seq_len = getattr(model, "module", model).cfg.seq_len
    kept: list = []
    mixed_precision = (
        torch.autocast(device.type, dtype=getattr(torch, autocast))
        if autocast is not None
        else contextlib.nullcontext()
    )
    # fp16's narrow exponent range loses small gradients: scale the loss up, unscale before the step (CUDA only;
    # bf16 has fp32's range and needs none)
    scaler = torch.amp.GradScaler(device.type) if autocast == "float16" and device.type == "cuda" else None
    if tracker is None:
        tracker = StepTracker(model, optimizer, budget_bytes=budget_bytes, accumulate=micro_batches > 1)
    elif (
        not isinstance(tracker, StepTracker)
        or tracker.model not in (model, getattr(model, "module", None))  # a DDP wrapper tracks its .module
        or tracker.optimizer is not optimizer
    ):
        # A tracker hooks its own model's modules and optimizer: with another model's, this loop's forward would
        # go unseen (no forward phase) and its steps would merge.
        raise ValueError(
            "tracker must be a StepTracker made for this model and optimizer: StepTracker(model, optimizer, ...)"
            f", got {type(tracker).__name__}"
            + (" of another model or optimizer" if isinstance(tracker, StepTracker) else "")
        )
    elif micro_batches > 1 and not tracker.accumulate:
        # Without accumulate, the tracker starts a new step at every forward after a backward: each micro-batch
        # would be a step of its own (2k steps recorded for 2 of k micro-batches).
        raise ValueError(
            f"micro_batches={micro_batches} needs a tracker made with StepTracker(..., accumulate=True), so that "
            "the micro-batches' forward and backward passes count as one step"
        )
    with tracker:
        for i in range(steps):
            if keep == "val_loss":
                vx, vy = get_batch(batch_size, seq_len, step=10_000 + i, seed=seed, device=device)
                kept.append(model(vx, vy)[1])  # grad mode is on: its whole graph stays alive
                del vx, vy
            x, y = get_batch(batch_size, seq_len, step=i, seed=seed, device=device)
            if world_size > 1:  # this rank's rows only
                x, y = (t[rank * local : (rank + 1) * local].clone() for t in (x, y))
            if micro_batches == 1:
                with mixed_precision:
                    loss = model(x, y)[1]  # the logits are dropped at once: only what autograd saved stays
                (loss if scaler is None else scaler.scale(loss)).backward(retain_graph=retain_graph)
            else:  # row slices of the global batch: views of its storage, no copy
                parts: list = []  # each micro-batch's loss: a float, or the tensor itself with keep="loss"
                for j in range(0, local, micro):
                    with mixed_precision:
                        part = model(x[j : j + micro], y[j : j + micro])[1] / micro_batches
                    (part if scaler is None else scaler.scale(part)).backward(retain_graph=retain_graph)
                    parts.append(part if keep == "loss" else part.item())
                    del part
                loss = parts
            if optimizer_step:
                if scaler is None:
                    optimizer.step()
                else:  # skips the step if a gradient overflowed, then adapts the scale
                    scaler.step(optimizer)
                    scaler.update()
                optimizer.zero_grad(set_to_none=set_to_none)
            kept.append(loss if keep == "loss" else _loss_value(loss) if keep == "item" else None)
            if progress:
                print(f"step {i + 1}/{steps}: loss {_loss_value(loss):.3f}", file=sys.stderr, flush=True)
            del loss
            del x, y  # the next batch should not overlap with this one
            if after_step is not None:
                after_step(i + 1)
    return tracker.trace
