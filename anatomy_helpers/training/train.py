"""One training step, the optimizers the course compares, and device choice."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable

import torch
import torch.nn as nn

from ..core.checks import one_of, optional_callable, positive_int, positive_number
from ..core.data import seed_everything
from ..core.model import GPT, ModelConfig
from ..tracking.trace import Trace
from ..tracking.tracker import StepTracker
from .step import OptimizerInBackward, StepPlan, run_step

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")  # the four lesson 03 compares
OPTIMIZER_NAMES = (*OPTIMIZERS, "adamw_bf16", "adamw8bit")  # every name make_optimizer takes (lesson 10's too)


class AdamWBF16State(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, Loshchilov & Hutter 2019) whose two moments are *stored* in bfloat16: 2 + 2
    bytes per parameter of state instead of torch's 4 + 4 for a float32 model.

    torch's own Adam(W) keeps its state in the parameter's dtype and has no option for a narrower one, so this is
    written out here, the update itself in float32: each moment is widened, updated with torch's formulas
    (``torch/optim/adamw.py``, single-tensor path) and rounded back to bf16 (round to nearest, no stochastic
    rounding). The cost: float32 temporaries of one parameter's size during its update, and the second moment's
    small increments ((1 - beta2) g^2 on a value with 8 bits of mantissa) partly lost to rounding, which changes
    the training dynamics a little: measure the loss beside float32 AdamW (tests/test_levers.py). The step count is a
    Python int (no tensor, no bytes), so a dry run can follow the bias correction without reading a value.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        positive_number("lr", lr)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AdamWBF16State takes no closure")
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()  # the gradient itself when it is float32 (no copy)
                m = state["exp_avg"].float().lerp_(g, 1 - b1)  # float32 temporaries, one parameter's size each
                v = state["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                state["exp_avg"].copy_(m)  # rounded back to bf16: the state that stays
                state["exp_avg_sq"].copy_(v)
                p.mul_(1 - lr * wd)
                denom = v.div_(1 - b2**t).sqrt_().add_(eps)  # in place on the float32 copy: one temporary fewer
                p.addcdiv_(m, denom, value=-lr / (1 - b1**t))
        return None


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


def adamw_8bit(params, lr: float = 1e-3) -> torch.optim.Optimizer:
    """bitsandbytes' ``AdamW8bit`` (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"), the same
    hyperparameters as ``adamw``: each moment stored as one uint8 per parameter plus a float32 scale per block of
    256 (and a 256-entry float32 code book per moment); tensors under 4,096 elements keep float32 state
    (bitsandbytes' ``min_8bit_size``). It runs on CPU (bitsandbytes' CPU backend, checked with 0.50.2) and on
    CUDA. A dry run cannot follow it: it reads tensor values (each block's absolute maximum), and a dry run has none.

    Needs the optional extra: ``pip install "anatomy_helpers[levers]"`` (or ``bitsandbytes``); ValueError if missing.
    """
    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")  # warns that an optional 4-bit matmul kernel (the
    level = quiet.level  # `kernels` package) is missing; nothing here uses 4-bit matmuls
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError(
            'optimizer "adamw8bit" needs bitsandbytes: pip install "anatomy_helpers[levers]" (or bitsandbytes)'
        ) from None
    finally:
        quiet.setLevel(level)
    return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=0.1)


def make_optimizer(
    model: nn.Module,
    name: str = "adamw",
    lr: float = 1e-3,
    foreach: bool | None = None,
    fused: bool | None = None,
    *,
    in_backward: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (sgd, momentum, adam, adamw, adamw_bf16) over the model's parameters.

    ``foreach=None`` keeps torch's default for the device: the single-tensor loop on
    CPU and the foreach (multi-tensor) implementation on CUDA. ``fused=True`` asks for
    the fused kernel (one kernel updates every parameter in place). ``adamw_bf16``:
    :class:`AdamWBF16State` (the same hyperparameters as ``adamw``, its state in bf16); ``adamw8bit``:
    bitsandbytes' 8-bit AdamW (:func:`adamw_8bit`, an optional dependency).
    ``in_backward=True``: the step fused into backward, one such optimizer per parameter
    (:class:`~anatomy_helpers.training.step.OptimizerInBackward`).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__} {model!r}")
    positive_number("lr", lr)
    one_of("in_backward", in_backward, (True, False))
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"optimizer must be one of {OPTIMIZER_NAMES}, got {name!r}")
    if name in ("adamw_bf16", "adamw8bit") and (foreach or fused):
        raise ValueError(f"{name} has one implementation: no foreach, no fused")
    if in_backward:
        return OptimizerInBackward(model.parameters(), lambda params: _optimizer(params, name, lr, foreach, fused))
    return _optimizer(model.parameters(), name, lr, foreach, fused)


def _optimizer(params, name: str, lr: float, foreach: bool | None, fused: bool | None) -> torch.optim.Optimizer:
    impl = {"foreach": foreach, "fused": fused}
    if name == "adamw_bf16":
        return AdamWBF16State(params, lr=lr, weight_decay=0.1)
    if name == "adamw8bit":
        return adamw_8bit(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **impl)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **impl)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **impl)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **impl)  # "adamw"


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training step on the batch ``(x, y)``, untracked: :func:`~anatomy_helpers.training.step.run_step` (forward,
    backward, optimizer step, zero_grad) with that batch. Returns the loss as a float."""
    return run_step(model, optimizer, StepPlan(batch_size=x.shape[0], batch=lambda _: (x, y)), 0)


def make_model(device: str | torch.device | None = None, seed: int = 0, **config) -> GPT:
    """A freshly initialised GPT on ``device`` (best available by default).

    ``config`` overrides ModelConfig fields, e.g. ``make_model(n_layer=2, attn_impl="sdpa")``.
    The same seed always gives the same weights.
    """
    cfg = ModelConfig(**config)  # a bad config fails here, before anything is built
    target = pick_device(device)
    seed_everything(seed)
    return GPT(cfg).to(target)


def track_steps(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    steps: int = 3,
    batch_size: int = 8,
    *,
    budget_bytes: int | None = None,
    progress: bool = False,
    after_step: Callable[[int], None] | None = None,
    tracker: StepTracker | None = None,
    **step,
) -> Trace:
    """Train ``steps`` steps on course batches inside a StepTracker and return its Trace.

    Each step is :func:`~anatomy_helpers.training.step.run_step` of ``StepPlan(batch_size=batch_size, **step)``: forward
    (``loss = model(x, y)[1]``), ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=...)``
    on batch ``get_batch(batch_size, model.cfg.seq_len, step=i - 1, seed=seed)``; then ``after_step(i)`` (i from 1).
    ``step`` takes any :class:`~anatomy_helpers.training.step.StepPlan` field: ``seed``, ``set_to_none``,
    ``optimizer_step=False`` (stop after backward: gradients kept, no optimizer phase), ``autocast="bfloat16"`` (or
    ``"float16"`` on CUDA, then with a ``torch.amp.GradScaler``): mixed precision the way most PyTorch users train
    (weights, gradients and optimizer state stay in the model's dtype; matmuls run, and save their inputs, in 16
    bits), ``micro_batches=k`` (gradient accumulation: ``batch_size`` is the global batch, the tracker counts the k
    forward/backward passes as micro-steps of one step), ``rank``/``world_size`` (data parallelism, see
    distributed/ranks.py: ``model`` may be a DDP wrapper whose ``.module`` is the course GPT), ``hooks`` (a lesson's
    :class:`~anatomy_helpers.training.step.StepHooks`). ``tracker``: a StepTracker (or subclass) of this model and
    optimizer
    to record with instead of a new one (made with ``accumulate=True`` when ``micro_batches > 1``).

    With ``budget_bytes`` a step that goes over it raises MemoryBudgetExceeded. Whatever the loop raises
    carries what was recorded up to that moment as its ``.trace``.
    """
    steps = positive_int("steps", steps)
    unknown = sorted(set(step) - {f.name for f in dataclasses.fields(StepPlan)} - {"batch_size"})
    if unknown:
        raise ValueError(
            f"track_steps has no option {', '.join(map(repr, unknown))}: it takes the fields of StepPlan "
            f"({', '.join(f.name for f in dataclasses.fields(StepPlan))})"
        )
    plan = StepPlan(batch_size=batch_size, **step)
    optional_callable("after_step", after_step)  # refused now, not after a whole training step
    device = next(model.parameters()).device
    scaler = plan.grad_scaler(device)
    if tracker is None:
        tracker = StepTracker(model, optimizer, budget_bytes=budget_bytes, accumulate=plan.micro_batches > 1)
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
    elif plan.micro_batches > 1 and not tracker.accumulate:
        # Without accumulate, the tracker starts a new step at every forward after a backward: each micro-batch
        # would be a step of its own (2k steps recorded for 2 of k micro-batches).
        raise ValueError(
            f"micro_batches={plan.micro_batches} needs a tracker made with StepTracker(..., accumulate=True), so "
            "that the micro-batches' forward and backward passes count as one step"
        )
    with tracker:
        for i in range(steps):
            loss = run_step(model, optimizer, plan, i, scaler=scaler)
            if progress:
                print(f"step {i + 1}/{steps}: loss {loss:.3f}", file=sys.stderr, flush=True)
            if after_step is not None:
                after_step(i + 1)
    return tracker.trace
