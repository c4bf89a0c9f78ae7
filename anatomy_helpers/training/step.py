"""One training step, written once: what it does (:class:`StepPlan`), where a lesson may change it
(:class:`StepHooks`), and :func:`run_step`, which runs it.

Every loop of the course runs its steps through :func:`run_step`: ``train.track_steps`` (inside a StepTracker),
the dry run (``prediction/dryrun.py``, on fake tensors), each data-parallel rank (its untracked warm-up and its
tracked steps, ``distributed/ranks.py``) and the profiled loop of lesson 07. So a dry run allocates what a real run
allocates because it *is* the same code, not a copy kept in step. Also here: :class:`OptimizerInBackward` (the
optimizer step fused into backward, which :func:`run_step` runs inside ``loss.backward()``) and :func:`step_flops`,
the FLOPs of one forward and backward as torch's ``FlopCounterMode`` counts them.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from ..core.checks import int_in, one_of, optional_callable, positive_int, positive_number, rank_of_world
from ..core.data import SEED_LIMIT, get_batch

AUTOCAST_CHOICES = (None, "bfloat16", "float16")


def gpt_loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """The course GPT's loss: ``model(x, y)`` returns ``(logits, loss)``; the logits are dropped at once, so only
    what autograd saved stays."""
    return model(*batch)[1]


class StepHooks:
    """Where a lesson changes a step without copying it: each method does what the plain step does, and a lesson
    overrides the one its lesson is about (lesson 02 keeps graphs alive, lesson 07 marks phases for the profiler).

    ``phase(name)`` is a context around each phase ("forward", "backward", "optimizer"); ``backward(loss)``
    backpropagates one (micro-)batch's loss (already scaled under a GradScaler); ``after_backward(loss)`` sees the
    unscaled loss after its backward; ``before_step(model, plan, step)`` runs before the step fetches its batch.
    """

    def before_step(self, model: nn.Module, plan: StepPlan, step: int) -> None:
        pass

    def phase(self, name: str):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def after_backward(self, loss: torch.Tensor) -> None:
        pass


NO_HOOKS = StepHooks()


class OptimizerInBackward(torch.optim.Optimizer):
    """The optimizer step fused into backward: one optimizer per parameter, each stepped by a hook the moment that
    parameter's gradient is complete, which then frees that gradient (PyTorch's tutorial "How to save memory by
    fusing the optimizer step into the backward pass"). So the gradients are never all alive at once: at most the
    ones backward is still summing, where the plain step holds every gradient when the optimizer starts.

    ``make([p])`` builds the optimizer of one parameter (any ``torch.optim`` optimizer whose update of a parameter
    reads only that parameter's gradient: SGD, momentum, Adam(W)). It keeps torch's optimizer contract: its
    ``state`` and ``param_groups`` *are* the per-parameter optimizers' (one shared state dict, one group per
    parameter), so the tracker counts the state as optimizer state, a learning rate set in ``param_groups`` (by hand
    or by an ``lr_scheduler``) is the one each parameter steps with, and ``state_dict``/``load_state_dict`` round
    trip. Every parameter given gets an optimizer, frozen or not: a parameter unfrozen later trains from then on.

    The hooks live only while :func:`run_step` runs backward (:meth:`in_backward`), on the parameters that require
    a gradient then. What it cannot do, by construction, raises a ValueError: clipping the gradients by their norm
    over all parameters (no moment holds them all), accumulating micro-batches or a second backward in one step
    (each would step again), a GradScaler (it unscales and checks every gradient before any step), data
    parallelism (DDP averages the gradients after they land) and ``add_param_group``.
    """

    def __init__(self, params, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        params = list(params)
        if not any(p.requires_grad for p in params):
            raise ValueError("OptimizerInBackward needs at least one parameter that requires a gradient")
        super().__init__(params, {})
        self.optimizers = {p: make([p]) for p in params}  # a tensor hashes by identity: one entry per parameter
        for opt in self.optimizers.values():
            if not isinstance(opt, torch.optim.Optimizer):
                raise ValueError(f"make([p]) must return a torch.optim.Optimizer, got {type(opt).__name__}")
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers.values()]
        self._share()
        self._ready: torch.Tensor | None = None  # the parameter whose gradient has just landed
        self._stepped: set[torch.Tensor] = set()  # the parameters stepped inside the current in_backward()
        self._set_to_none = True

    def _share(self) -> None:
        """Point every per-parameter optimizer at this one's state dict and at its own group here: one dict keyed by
        parameter for all (counted once, read like any optimizer's), one group each (lr and schedulers reach it)."""
        for group in self.param_groups:
            opt = self.optimizers[group["params"][0]]
            opt.state, opt.param_groups = self.state, [group]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``Optimizer.load_state_dict``, then the per-parameter optimizers pointed at the loaded state and
        groups (torch replaces both dicts: left alone, each would go on from its old state, Adam from its old step)."""
        super().load_state_dict(state_dict)
        self._share()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "optimizers"):  # torch's __init__ adds the first group itself
            raise ValueError(
                "OptimizerInBackward builds one optimizer per parameter when it is made: make a new one with "
                "every parameter instead of adding a group"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """Step the one parameter whose gradient has just landed, then free (or zero) that gradient. Called by the
        hook inside backward (through ``Optimizer.step``'s own hooks, so a tracker sees an optimizer phase)."""
        p = self._ready
        if p is None or closure is not None:
            raise ValueError(
                "OptimizerInBackward steps each parameter inside loss.backward(): run the step with run_step "
                "(or under `with optimizer.in_backward():`), not optimizer.step()"
            )
        self.optimizers[p].step()
        if self._set_to_none:
            p.grad = None  # this gradient dies now, before backward computes the next one
        else:
            p.grad.zero_()

    @contextlib.contextmanager
    def in_backward(self, set_to_none: bool = True):
        """While inside: each parameter that requires a gradient is stepped as its gradient lands
        (``register_post_accumulate_grad_hook``), once; the hooks are removed on leaving, whatever happened."""

        def hook(p: torch.Tensor) -> None:
            if p in self._stepped:
                raise ValueError(
                    "a second backward inside one in_backward() would step this parameter twice in one training "
                    "step: run one backward per step (to accumulate gradients, use a plain optimizer)"
                )
            self._stepped.add(p)
            self._ready = p
            try:
                self.step()
            finally:
                self._ready = None

        self._set_to_none = set_to_none
        self._stepped = set()
        handles = []
        try:
            for p in self.optimizers:
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(hook))
            yield self
        finally:
            for h in handles:
                h.remove()
            self._stepped = set()


@dataclass(frozen=True)
class StepPlan:
    """What one training step does; checked once, when the plan is made (ValueError naming the field).

    Step ``i`` (from 0) trains on batch ``first_batch + i``: ``get_batch(batch_size, seq_len, step=first_batch + i,
    seed=seed)`` of the course text, or ``batch(first_batch + i)`` (a sequence of tensors, e.g. fake ones for a dry
    run). ``world_size > 1``: data parallelism, this process is rank ``rank`` and trains rows ``rank * b`` to
    ``(rank + 1) * b - 1`` of each global batch (``b = rows // world_size``), copied out as a data loader would hand
    them over. ``micro_batches=k`` accumulates gradients: the rows are split into k micro-batches (views), each
    runs forward and backward with its loss divided by k (the gradients are the global batch's mean), then one
    optimizer step. ``autocast`` ("bfloat16", or "float16" on CUDA) runs forward and loss under ``torch.autocast``.
    ``optimizer_step=False`` stops after backward (gradients kept, no optimizer phase). ``read_loss``: read the
    loss value (``.item()``, which allocates nothing); a dry run cannot, its tensors hold no values.
    ``clip_grad_norm``: scale the gradients so that their norm over all parameters is at most this, before the
    step (``torch.nn.utils.clip_grad_norm_``). An :class:`OptimizerInBackward` steps inside backward instead of
    after it: :func:`run_step` refuses it with clipping, micro-batches, a GradScaler or data parallelism.
    """

    batch_size: int = 8  # rows of the global batch (all ranks, all micro-batches) of the course batches
    micro_batches: int = 1
    autocast: str | None = None
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    first_batch: int = 0
    set_to_none: bool = True
    optimizer_step: bool = True
    read_loss: bool = True
    clip_grad_norm: float | None = None
    batch: Callable[[int], Sequence[torch.Tensor]] | None = None  # None: the course batches (get_batch)
    loss: Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor] = gpt_loss
    hooks: StepHooks = NO_HOOKS

    def __post_init__(self):
        positive_int("batch_size", self.batch_size)
        positive_int("micro_batches", self.micro_batches)
        one_of("autocast", self.autocast, AUTOCAST_CHOICES)
        rank_of_world(self.rank, self.world_size)
        int_in("seed", self.seed, 0, SEED_LIMIT, "2**32")
        int_in("first_batch", self.first_batch, 0, SEED_LIMIT, "2**32")
        for name in ("set_to_none", "optimizer_step", "read_loss"):
            one_of(name, getattr(self, name), (True, False))
        optional_callable("batch", self.batch)
        if self.clip_grad_norm is not None:
            positive_number("clip_grad_norm", self.clip_grad_norm)
        if not callable(self.loss):
            raise ValueError(f"loss must be a function (model, batch) -> loss, got {self.loss!r}")
        if not isinstance(self.hooks, StepHooks):
            raise ValueError(f"hooks must be a StepHooks, got {type(self.hooks).__name__}")
        if self.batch is None and self.batch_size % (self.micro_batches * self.world_size):
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batches x world_size "
                f"({self.micro_batches} x {self.world_size})"
            )

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        """The GradScaler fp16 needs on CUDA (its narrow exponent range loses small gradients: the loss is scaled
        up, the gradients unscaled before the step); None otherwise (bf16 has fp32's range)."""
        return torch.amp.GradScaler(device.type) if self.autocast == "float16" and device.type == "cuda" else None


def _rows(plan: StepPlan, model: nn.Module, step: int, device: torch.device) -> list[torch.Tensor]:
    """Step ``step``'s batch, this rank's rows only, in a list that :func:`run_step` empties to free it."""
    index = plan.first_batch + step
    if plan.batch is not None:
        batch = list(plan.batch(index))
    else:
        seq_len = getattr(model, "module", model).cfg.seq_len  # a DDP wrapper holds the GPT as .module
        batch = list(get_batch(plan.batch_size, seq_len, step=index, seed=plan.seed, device=device))
    split = plan.micro_batches * plan.world_size
    if split > 1 and batch[0].shape[0] % split:
        raise ValueError(
            f"the batch has {batch[0].shape[0]} rows, not a multiple of micro_batches x world_size "
            f"({plan.micro_batches} x {plan.world_size})"
        )
    if plan.world_size > 1:
        local = batch[0].shape[0] // plan.world_size
        mine = [t[plan.rank * local : (plan.rank + 1) * local].clone() for t in batch]
        for j in range(len(batch)):  # the global batch freed first to last once this rank's copies exist
            batch[j] = mine[j]
        del mine
    return batch


def run_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    plan: StepPlan,
    step: int,
    *,
    scaler: torch.amp.GradScaler | None = None,
) -> float | None:
    """Run training step ``step`` (from 0) of ``plan``; returns the loss (None unless ``plan.read_loss``).

    The course's one step: ``hooks.before_step``; the batch; for each micro-batch ``loss = plan.loss(model,
    batch)`` (under autocast if planned), ``hooks.backward(loss)`` (``loss.backward()``, scaled by ``scaler`` if
    given); then ``optimizer.step()`` (``scaler.step`` and ``scaler.update``) and
    ``optimizer.zero_grad(set_to_none=...)``. With one micro-batch the loss lives until after the optimizer step;
    with several, each micro-batch's loss dies after its backward. The batch is freed last, first tensor first.
    ``model`` may be a wrapper (DDP) whose ``.module`` is the course GPT. With an :class:`OptimizerInBackward`
    each parameter is stepped inside backward as its gradient lands, and no optimizer step follows.
    """
    hooks, k = plan.hooks, plan.micro_batches
    if optimizer is None and plan.optimizer_step:
        raise ValueError("run_step needs an optimizer unless the plan stops after backward (optimizer_step=False)")
    device = next(model.parameters()).device
    fused = isinstance(optimizer, OptimizerInBackward)
    if fused:
        _check_in_backward(plan, scaler)
    hooks.before_step(model, plan, step)
    batch = _rows(plan, model, step, device)
    rows = batch[0].shape[0] // k if k > 1 else None
    parts: list[float | None] = []  # each micro-batch's loss, read at once so the tensor can die
    for j in range(k):
        part = batch if k == 1 else [t[j * rows : (j + 1) * rows] for t in batch]  # views: no copy
        mixed = torch.autocast(device.type, dtype=getattr(torch, plan.autocast)) if plan.autocast else None
        with _gradient_sync(model, last=j == k - 1):
            with hooks.phase("forward"), mixed or contextlib.nullcontext():
                loss = plan.loss(model, part) if k == 1 else plan.loss(model, part) / k
            del part
            in_backward = optimizer.in_backward(plan.set_to_none) if fused else contextlib.nullcontext()
            with hooks.phase("backward"), in_backward:
                hooks.backward(loss if scaler is None else scaler.scale(loss))
        hooks.after_backward(loss)
        if k > 1:
            parts.append(loss.item() if plan.read_loss else None)
            del loss
    if plan.optimizer_step and not fused:
        with hooks.phase("optimizer"):
            if plan.clip_grad_norm is not None:  # over all parameters: every gradient must be there
                if scaler is not None:  # torch's AMP recipe: clip the true gradients, not the scaled ones
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), plan.clip_grad_norm)
            if scaler is None:
                optimizer.step()
            else:  # skips the step if a gradient overflowed, then adapts the scale
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad(set_to_none=plan.set_to_none)
    value = None
    if plan.read_loss:
        value = sum(parts) if k > 1 else loss.item()
    if k == 1:
        del loss
    for j in range(len(batch)):  # freed first to last; the next batch should not overlap with this one
        batch[j] = None
    return value


def _gradient_sync(model: nn.Module, last: bool):
    """DDP's ``no_sync()`` on every micro-batch but the last (nanoGPT's and accelerate's accumulation loop): the
    gradients are summed locally and all-reduced once, at the last micro-batch's backward, instead of at each.
    Any other model (one device, FSDP2, which reduce-scatters each micro-batch to keep its gradients sharded): no
    change. DDP must see ``no_sync`` from the forward on, so the context spans forward and backward."""
    if last or not isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def _check_in_backward(plan: StepPlan, scaler) -> None:
    """ValueError for what an :class:`OptimizerInBackward` cannot do, saying why."""
    why = {
        "clip_grad_norm": "clipping by the norm over all parameters needs every gradient at once, and this optimizer "
        "steps each parameter (and frees its gradient) as soon as its gradient lands",
        "micro_batches": "accumulating gradients needs them kept across micro-batches, and this optimizer would step "
        "at every micro-batch's backward",
        "scaler": "a GradScaler unscales and checks every gradient for inf/NaN before any parameter is stepped",
        "world_size": "data parallelism averages each gradient across ranks after it lands, and this optimizer steps "
        "before that",
        "optimizer_step": "it steps inside backward: there is no step to leave out",
    }
    asked = {
        "clip_grad_norm": plan.clip_grad_norm is not None,
        "micro_batches": plan.micro_batches > 1,
        "scaler": scaler is not None,
        "world_size": plan.world_size > 1,
        "optimizer_step": not plan.optimizer_step,
    }
    for name, on in asked.items():
        if on:
            raise ValueError(
                f"the optimizer step fused into backward (OptimizerInBackward) cannot take {name}: {why[name]}"
            )


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)  # torch's formula for the CUDA kernels


def _cpu_flash_attention_backward_flops(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)  # scores recomputed: 5 bmm


#: torch's own SDPA formulas (``flop_counter.py``'s ``sdpa_flop_count``, ``sdpa_backward_flop_count``) for the CPU
#: flash-attention kernel, which ``FlopCounterMode`` registers none for: the same matmuls as the CUDA kernels.
CPU_SDPA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_flops,
}


def flop_counter() -> FlopCounterMode:
    """torch's ``FlopCounterMode`` (not displayed) with :data:`CPU_SDPA_FLOPS`, so ``attn_impl="sdpa"`` on a CPU
    counts its attention like the CUDA kernels do (causal masking not discounted, as torch counts it). The one
    counter of the package."""
    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS)


def step_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, early_stop: bool = True) -> int:
    """FLOPs of one forward + backward of ``model`` on ``(x, y)``, as torch's ``FlopCounterMode`` counts them.

    The counter (:func:`flop_counter`) counts matrix multiplications and attention kernels (the ops that dominate a
    large model's compute; CPU flash attention too), not element-wise ops, and reads shapes only, so fake tensors
    count the same as real ones. Checkpointing's recomputation is counted; the optimizer is not.
    ``early_stop=False`` makes a checkpoint recompute its whole segment instead of stopping once it has remade every
    tensor backward needs (``torch.utils.checkpoint.set_checkpoint_early_stop``; True is torch's default). The
    gradients are dropped again.
    """
    plan = StepPlan(batch_size=x.shape[0], batch=lambda _: (x, y), optimizer_step=False, read_loss=False)
    with set_checkpoint_early_stop(early_stop), flop_counter() as counter:
        run_step(model, None, plan, 0)  # the one step, stopped after backward: no optimizer needed
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())
