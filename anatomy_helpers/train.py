"""One training step, the optimizers the course compares, and device choice."""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from .data import get_batch, seed_everything
from .model import GPT, ModelConfig
from .tracker import StepTracker, Trace

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


def pick_device(preferred: str | None = None) -> torch.device:
    """CUDA when available (or ``preferred`` if given), else CPU."""
    if preferred is not None:
        device = torch.device(preferred)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {preferred!r} was asked for, but CUDA is not available here")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_optimizer(
    model: nn.Module, name: str = "adamw", lr: float = 1e-3, foreach: bool | None = None, fused: bool | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (sgd, momentum, adam, adamw) over the model's parameters.

    ``foreach=None`` keeps torch's default for the device: the single-tensor loop on
    CPU and the foreach (multi-tensor) implementation on CUDA. ``fused=True`` asks for
    the fused kernel (one kernel updates every parameter in place).
    """
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
    """Forward, backward, optimizer step, zero_grad. Returns the loss as a float."""
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
    seed_everything(seed)
    return GPT(ModelConfig(**config)).to(pick_device(device) if device is None else torch.device(device))


def track_steps(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    steps: int = 3,
    batch_size: int = 8,
    *,
    seed: int = 0,
    budget_bytes: int | None = None,
    progress: bool = False,
) -> Trace:
    """Train ``steps`` steps on course batches inside a StepTracker and return its Trace.

    Batch ``i`` is ``get_batch(batch_size, model.cfg.seq_len, step=i, seed=seed)``.
    With ``budget_bytes`` a step that goes over it raises MemoryBudgetExceeded,
    whose ``.trace`` holds what was recorded up to that moment.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    device = next(model.parameters()).device
    with StepTracker(model, optimizer, budget_bytes=budget_bytes) as tracker:
        for i in range(steps):
            x, y = get_batch(batch_size, model.cfg.seq_len, step=i, seed=seed, device=device)
            loss = train_step(model, optimizer, x, y)
            del x, y  # the next batch should not overlap with this one
            if progress:
                print(f"step {i + 1}/{steps}: loss {loss:.3f}", file=sys.stderr, flush=True)
    return tracker.trace
