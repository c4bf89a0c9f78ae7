"""Dry runs: the course's tracked training step on tensors that hold no data.

Under torch's ``FakeTensorMode`` every op computes the shape, dtype, strides and storage size of its outputs
and nothing else: no kernel runs, no byte of data is allocated. The
:class:`~anatomy_helpers.tracking.tracker.StepTracker` runs on top of it unchanged (its dispatch mode sees the fake
outputs, its saved-tensor hooks see what autograd saves, its weak references see the fake storages die), so a dry run
returns the same :class:`Trace` a real run does, and every table and plot of the course works on it, for models far
larger than the machine.

How the model is made without memory: the model factory runs under ``torch.device("meta")`` (parameters with a
shape and no storage), then :func:`fake_module` swaps every parameter and buffer for a fake tensor on the target
device, keeping shared (tied) tensors and shared storages shared.

Exact or refused. The sizes come from each op's fake kernel, a shape function written apart from the real kernel,
and the two can differ (oneDNN's LSTM layer saves a workspace its fake kernel leaves empty). So every dry run
records its ops, and each op signature not yet seen in this process is run once for real at the smallest shape
the run used (a large ``dry_run_config`` configuration: on a small twin) and compared output by output
(fake_check.py says how and what that cannot see). An op whose fake kernel differs gets a :class:`DryRunError`
naming it and the module it ran in; no correction is guessed. What a dry run that returns still cannot see is
:data:`KERNEL_SCRATCH_RULE`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from ..core.checks import one_of, positive_int
from ..core.interrupts import DeferredInterrupt
from ..core.model import GPT, ModelConfig
from ..core.tensors import SPARSE_GRADIENT_REASON, sparse_gradient_modules
from ..tracking.compiled import CompiledCodeError, compiled_modules
from ..tracking.trace import Trace
from ..tracking.tracker import StepTracker
from ..training.step import AUTOCAST_CHOICES, StepPlan, gpt_loss, run_step
from ..training.train import make_optimizer
from . import fake_check
from .fake_check import CheckedFakeTensorMode, check_calls, op_checked

#: What a dry run guarantees, and the one category it cannot measure.
KERNEL_SCRATCH_RULE = (
    "A dry run sees every storage an op returns, autograd saves or a policy keeps. Each op's sizes come from its "
    "fake kernel, checked once against the real kernel of this machine (run at a small shape; a CPU op's result "
    "is kept on disk per machine and torch build, other ops' per session); an op whose fake kernel differs is "
    "refused with a DryRunError naming it. So a dry run that returns is exact for "
    "every category but kernel scratch: memory a kernel allocates and frees inside one op. Fake tensors run no "
    "kernels, so the trace says kernel_scratch_recorded=False and that category reads 0 because it is unknown. It "
    "is compared with a real run measured with StepTracker(..., kernel_scratch=False); on CPU kernel scratch is "
    "measured only by real runs (the tracker's default), on CUDA only by the allocator's own counters."
)


class DryRunError(ValueError):
    """A model, batch or loss a dry run cannot handle; the message says why and what to do."""


#: Why a dry run refuses torch.compile'd code (a module found before anything runs, a function when it is called).
COMPILED_REASON = (
    "a dry run's fake tensors follow the eager kernels, one op at a time, not the fused kernels inductor makes (a "
    "compiled step holds other tensors: no dry run can give its memory, and running compiled code on fake tensors "
    "can crash the process). Dry-run the model uncompiled (that predicts its eager step), or measure the compiled "
    "step with torch.profiler's memory timeline (lesson 10's compile_memory)"
)


def refuse_compiled(where: str) -> DryRunError:
    """The DryRunError for ``where``, a compiled module or function (:class:`CompiledCodeError`'s ``where``)."""
    return DryRunError(f"{where} is compiled by torch.compile, so a dry run is refused: {COMPILED_REASON}")


def fake_module(model: nn.Module, mode: FakeTensorMode, device: str | torch.device = "cpu") -> nn.Module:
    """Replace every parameter and buffer of ``model`` (in place) by a fake tensor on ``device``; returns it.

    Same shape, strides, storage offset, dtype and ``requires_grad``, and a storage of the same bytes: a tensor
    shared by two modules (tied weights) stays one tensor, and tensors that share a storage (a buffer that is a
    view of another) still share one. Modules that keep their own references to their parameters or buffers
    (``nn.LSTM``'s ``_flat_weights`` list, weak references) get the fake tensors there too. A tensor a module
    keeps outside its parameters and buffers that is *derived* from them (``self.w_t = self.weight.t()``) cannot
    be rebuilt: :class:`DryRunError`.
    """
    storages: dict[int, torch.UntypedStorage] = {}  # the original storage's id -> its fake stand-in
    new: dict[int, torch.Tensor] = {}  # id of an original tensor -> its fake stand-in
    old: list[torch.Tensor] = []  # the originals, alive until the end so that no id is reused

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in new:
            key = t.untyped_storage()._cdata
            with mode:
                if key in storages:  # a view of a storage already made
                    f = torch.empty(0, dtype=t.dtype, device=device)
                    f.set_(storages[key], t.storage_offset(), t.shape, t.stride())
                else:
                    f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                    if t.storage_offset() or f.untyped_storage().nbytes() != t.untyped_storage().nbytes():
                        st = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device=device)
                        f = torch.empty(0, dtype=t.dtype, device=device)
                        f.set_(st.untyped_storage(), t.storage_offset(), t.shape, t.stride())
                    storages[key] = f.untyped_storage()
            new[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
            old.append(t)
        return new[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    table[name] = fake(t)
    for name, module in model.named_modules():
        for attr, value in list(vars(module).items()):
            if attr not in ("_parameters", "_buffers", "_modules"):
                swapped = _swap_cached(value, new, f"{name or type(model).__name__}.{attr}")
                if swapped is not value:
                    module.__dict__[attr] = swapped
    return model


def _swap_cached(value, new: dict[int, torch.Tensor], where: str, depth: int = 0):
    """``value`` (a module attribute) with every reference to a replaced tensor swapped for its fake stand-in:
    tensors, weak references to them, and lists, tuples and dicts of those (two levels deep)."""
    if isinstance(value, torch.Tensor):
        if id(value) in new:
            return new[id(value)]
        if value.device.type == "meta":
            raise DryRunError(
                f"{where} is a tensor the module keeps outside its parameters and buffers, made on the meta "
                "device (from them, it seems): a dry run cannot rebuild it. Register it as a buffer, or compute it "
                "in forward"
            )
        return value
    if isinstance(value, weakref.ref) and not isinstance(value, weakref.WeakMethod):
        target = value()
        return weakref.ref(new[id(target)]) if target is not None and id(target) in new else value
    if depth < 2 and type(value) in (list, tuple):
        swapped = [_swap_cached(v, new, where, depth + 1) for v in value]
        return value if all(a is b for a, b in zip(swapped, value)) else type(value)(swapped)
    if depth < 2 and type(value) is dict:
        swapped = {k: _swap_cached(v, new, where, depth + 1) for k, v in value.items()}
        return value if all(swapped[k] is v for k, v in value.items()) else swapped
    return value


def build_fake_model(
    model_factory: Callable[[], nn.Module], mode: FakeTensorMode, device: str | torch.device = "cpu"
) -> nn.Module:
    """``model_factory()`` built on the meta device (no memory), then made fake on ``device``.

    Refused (:class:`DryRunError`, before anything runs): a model that is or holds a ``torch.compile``d module
    (:data:`COMPILED_REASON`), or a module whose weight gets a sparse gradient (``nn.Embedding(sparse=True)``)."""
    with torch.device("meta"):
        model = model_factory()
    if not isinstance(model, nn.Module):
        raise DryRunError(f"the model factory must return an nn.Module, got {type(model).__name__}")
    compiled = compiled_modules(model)
    if compiled:  # before anything runs: see COMPILED_REASON
        raise refuse_compiled(", ".join(compiled))
    sparse = sparse_gradient_modules(model)
    if sparse:
        raise DryRunError(
            f"{', '.join(sparse)} gets a sparse gradient, so a dry run is refused: {SPARSE_GRADIENT_REASON}"
        )
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
    micro_batches: int = 1,
) -> Trace:
    """``steps`` tracked training steps of any module: ``train.track_steps``' step
    (:func:`~anatomy_helpers.training.step.run_step`), with ``batch = batch_fn(i)`` and ``loss = loss_fn(model, batch)``
    for step ``i`` (from 0). A real run reads ``loss.item()`` as track_steps does; a ``fake`` one cannot (there is
    no value) and skips it, which allocates nothing either way. ``micro_batches=k``: gradient accumulation as
    track_steps runs it (``batch_fn(i)`` is the global batch, split into k micro-batches by the
    :class:`~anatomy_helpers.training.step.StepPlan`; the tracker made with ``accumulate=True``).
    """
    plan = StepPlan(
        autocast=autocast,
        set_to_none=set_to_none,
        read_loss=not fake,
        batch=batch_fn,
        loss=loss_fn,
        micro_batches=micro_batches,
    )
    with StepTracker(model, optimizer, kernel_scratch=kernel_scratch, accumulate=micro_batches > 1) as tracker:
        for i in range(steps):
            run_step(model, optimizer, plan, i)
    return tracker.trace


def _check_steps(steps, autocast) -> None:
    positive_int("steps", steps)
    one_of("autocast", autocast, AUTOCAST_CHOICES)


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
    the scalar loss; ``optimizer_factory(model)`` the optimizer (AdamW by default).

    Exact or refused (:data:`KERNEL_SCRATCH_RULE`): every op signature of the run is checked once against the
    real kernel (fake_check.py) and an op whose fake kernel differs gets a :class:`DryRunError` naming it. Also
    refused: a model that reads its tensors' values (``.item()``, data-dependent shapes), tensors made outside
    the model and the batch factory, and ops seen only at calls too large to check here (dry-run a smaller
    instance of the model first: what was checked is remembered for the session).
    """
    _check_steps(steps, autocast)
    args = (model_factory, batch_factory, loss_fn, optimizer_factory, steps, autocast, set_to_none, device)
    trace, calls = _run_fake(*args)
    check_ops(calls, _model_name(model_factory))
    return trace


def _model_name(model_factory) -> str:
    return getattr(model_factory, "__name__", type(model_factory).__name__)


def _run_fake(*args):
    """The dry run itself: (its Trace, the op calls to check, see fake_check.CheckedFakeTensorMode).

    ``args``: those of :func:`_fake_steps`.
    """
    # A Ctrl-C raised inside FakeTensorMode's Python code, which torch's C++ dispatcher called, aborts the whole
    # process (torch 2.13): hold it for the whole dry run; the tracker raises it between two ops.
    interrupt = DeferredInterrupt()
    interrupt.start()
    try:
        return _fake_steps(*args)
    finally:
        interrupt.stop()


def _fake_steps(
    model_factory, batch_factory, loss_fn, optimizer_factory, steps, autocast, set_to_none, device, micro_batches=1
):
    mode = CheckedFakeTensorMode()  # notes the op calls to check
    model = build_fake_model(model_factory, mode, device)
    mode.calls.clear()  # making the fake model is the dry run's own doing, not the step's
    optimizer = None
    try:
        with mode:
            optimizer = optimizer_factory(model)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise DryRunError(f"the optimizer factory must return a torch.optim.Optimizer, got {optimizer!r}")
            trace = run_steps(
                model,
                optimizer,
                batch_factory,
                loss_fn,
                steps,
                autocast=autocast,
                set_to_none=set_to_none,
                kernel_scratch=False,
                fake=True,
                micro_batches=micro_batches,
            )
    except CompiledCodeError as e:  # a compiled function the step called (the tracker refused it before it ran)
        raise refuse_compiled(e.where) from e
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        named = f" ({type(optimizer).__name__})" if optimizer is not None else ""
        who = f"{type(model).__name__} or its optimizer{named}"
        raise DryRunError(
            f"{who} reads tensor values during the step ({e.func if hasattr(e, 'func') else e}): "
            "a dry run has shapes but no values, so it cannot run code that branches on data or whose output "
            "shape depends on it (.item(), .tolist(), nonzero, boolean masks)"
        ) from e
    except NotImplementedError as e:
        if "Cannot access storage of" not in str(e):
            raise
        raise DryRunError(
            f"the step makes a tensor that has no storage ({e}: a sparse or other non-strided layout), whose bytes "
            "a dry run cannot see; every tensor of a dry-run step must be strided (no sparse gradients or ops)"
        ) from e
    except (RuntimeError, AssertionError) as e:
        if "FakeTensor" in str(e):
            raise DryRunError(
                f"the dry run met a real tensor: {e}. Every tensor the step uses must come from the model (its "
                "parameters and buffers) or from the batch factory"
            ) from e
        raise
    return trace, mode.calls


def check_ops(calls: dict, what: str, small_twin: Callable[[], dict] | None = None) -> None:
    """Refuse the dry run (DryRunError) unless every op signature in ``calls`` matches its real kernel.

    ``small_twin()``: the calls of a dry run of a smaller model with the same code paths, run only when some
    signature was seen only at calls too large to run for real here.
    """
    problems, unchecked = check_calls(calls)
    if unchecked and not problems and small_twin is not None:
        twin_problems, _ = check_calls(small_twin())
        problems = {key: p for key, p in twin_problems.items() if key in unchecked}
        unchecked = [key for key in unchecked if not op_checked(key)]
    if problems:
        hint = ""
        if any("mkldnn" in str(key[0]) for key in problems):
            hint = (
                " (mkldnn ops are oneDNN kernels: under `with torch.backends.mkldnn.flags(enabled=False):`, around "
                "the dry run and the real run alike, torch uses its own kernels)"
            )
        raise DryRunError(
            f"a dry run of {what} would not be exact, so it is refused: the fake kernel of "
            + "; the fake kernel of ".join(problems.values())
            + hint
        )
    if unchecked:
        ops = sorted({str(key[0]) for key in unchecked})
        raise DryRunError(
            f"a dry run of {what} uses {', '.join(ops)} only at calls over {fake_check.MAX_CHECK_BYTES / 2**20:g} MiB "
            f"({fake_check.MAX_CHECK_BYTES_16BIT_CPU / 2**20:g} MiB in 16-bit floats on the CPU; or on a device this "
            "machine lacks), too large to check against the real kernel here: dry-run a "
            "smaller instance of the same model first (ops that passed are remembered for the session)"
        )


def check_micro_batches(batch_size: int, micro_batches: int, in_backward: bool = False) -> None:
    """ValueError naming what is wrong with gradient accumulation's ``micro_batches`` for a global batch of
    ``batch_size`` rows (``in_backward``: the optimizer step fused into backward, which cannot accumulate)."""
    positive_int("batch_size", batch_size)
    positive_int("micro_batches", micro_batches)
    if batch_size % micro_batches:
        raise ValueError(
            f"batch_size ({batch_size}) must be a multiple of micro_batches ({micro_batches}): the global batch is "
            "split into micro-batches of equal rows"
        )
    if in_backward and micro_batches > 1:
        raise ValueError(
            f"in_backward cannot accumulate micro-batches (micro_batches={micro_batches}): the optimizer step fused "
            "into backward steps at every micro-batch's backward, and accumulating keeps the gradients until the last"
        )


def twin_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the same code paths at a size whose every op runs for real in milliseconds: head width 8,
    at most 16 positions, 64 tokens, and the layers a checkpointing policy needs."""
    layers = cfg.checkpoint_every + 1 if cfg.checkpoint == "every_k" else 2
    return dataclasses.replace(
        cfg,
        n_layer=min(cfg.n_layer, layers),
        d_model=cfg.n_head * 8,
        seq_len=min(cfg.seq_len, 16),
        vocab_size=min(cfg.vocab_size, 64),
    )


def dry_run_config(
    cfg: ModelConfig | None = None,
    *,
    optimizer: str = "adamw",
    foreach: bool | None = None,
    fused: bool | None = None,
    batch_size: int = 8,
    steps: int = 2,
    autocast: str | None = None,
    in_backward: bool = False,
    set_to_none: bool = True,
    micro_batches: int = 1,
    **config,
) -> Trace:
    """Dry-run ``track_steps`` on the course GPT: ``cfg`` (or ModelConfig fields as keywords), on CPU.

    The same loop as ``track_steps(make_model(**config), make_optimizer(model, optimizer, foreach=..,
    fused=.., in_backward=..), steps, batch_size, autocast=..., set_to_none=..., micro_batches=...)``, with the same
    batches' allocations (:func:`course_batch`). ``micro_batches=k``: gradient accumulation, ``batch_size`` the
    global batch, split into k micro-batches as the step splits it, each run forward and backward, then one
    optimizer step (the tracker made with ``accumulate=True``, as track_steps makes it); ``check_micro_batches``
    refuses k that does not divide the batch, or with ``in_backward``.
    Byte for byte the real trace with ``kernel_scratch=False``; any size (nothing is allocated). The ops of a
    large configuration are checked against the real kernels on a small twin (:func:`twin_config`, at most two
    rows per micro-batch, as many micro-batches; once per session for each set of code paths), see :func:`dry_run`.
    """
    if cfg is not None and config:
        raise ValueError("pass either a ModelConfig or its fields as keywords, not both")
    cfg = cfg if cfg is not None else ModelConfig(**config)
    _check_steps(steps, autocast)
    one_of("set_to_none", set_to_none, (True, False))
    one_of("in_backward", in_backward, (True, False))
    check_micro_batches(batch_size, micro_batches, in_backward)

    def run(cfg: ModelConfig, batch_size: int):
        return _run_fake(
            lambda: GPT(cfg),
            lambda step: course_batch(batch_size, cfg.seq_len),
            gpt_loss,
            lambda model: make_optimizer(model, optimizer, foreach=foreach, fused=fused, in_backward=in_backward),
            steps,
            autocast,
            set_to_none,
            "cpu",
            micro_batches,
        )

    trace, calls = run(cfg, batch_size)
    # the twin keeps the micro-batches (the same code paths: a loss divided by k, gradients accumulated), each of
    # at most 2 rows (1 where the real one has 1), so its batch stays a multiple of k
    twin_batch = micro_batches * min(batch_size // micro_batches, 2)
    check_ops(calls, "the course GPT", lambda: run(twin_config(cfg), twin_batch)[1])
    return trace
