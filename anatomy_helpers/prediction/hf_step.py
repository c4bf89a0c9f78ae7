"""The fine-tuning step people run on a Hugging Face causal LM, tracked for real or dry-run.

One :class:`FineTune` says how the step runs: batch and sequence length, micro-batches, the weights' dtype or
autocast, the attention implementation, HF's own ``gradient_checkpointing_enable()``, the optimizer (AdamW,
Adam, SGD; single-tensor, foreach or fused) and what is trained: everything (``method="full"``), everything but
the parameters under the ``freeze`` prefixes (``"frozen"``: ``requires_grad_(False)``), or LoRA adapters through
``peft`` (``"lora"``: ``LoraConfig(r, lora_alpha, target_modules)``; the base frozen, in ``dtype``).

:func:`hf_plan` is the step itself, a :class:`~anatomy_helpers.training.step.StepPlan` run by the course's one
:func:`~anatomy_helpers.training.step.run_step` (the loop a training script writes: forward with ``labels`` so the model
computes its own shifted cross-entropy, :func:`hf_loss`, divided by the number of micro-batches; ``backward`` per
micro-batch, ``optimizer.step()``, ``zero_grad``); :func:`track_hf` runs it for real under the StepTracker on a
model with random weights, and :func:`dry_run_hf` runs the very same plan on fake tensors (dryrun.py) at any size,
checked op by op against the real kernels on a tiny twin of the configuration (hf.tiny_config): exact, or refused
with a DryRunError naming the op.

What a dry run assumes about values it does not have: :data:`HF_ASSUMPTIONS`. Mixture of experts: the router
picks experts from the data. transformers' ``grouped_mm`` experts (its default) sort the routed tokens by expert
and multiply them in one grouped matmul, so every shape is independent of the routing and the dry run needs no
assumption (kernel scratch inside the grouped matmul does depend on it, and a dry run never counts scratch);
torch's fake ``_grouped_mm`` accepts bfloat16 only, so a float32 model is refused naming it. ``batched_mm``
copies each routed token's expert weights (routing-independent too, and large). The ``eager`` experts loop over
the experts that received tokens (``nonzero``): refused, naming the op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor

from ..core.checks import one_of, positive_int, positive_number
from ..core.interrupts import DeferredInterrupt
from ..tracking.compiled import CompiledCodeError
from ..tracking.trace import Trace
from ..tracking.tracker import StepTracker
from ..training.step import AUTOCAST_CHOICES, StepPlan, run_step
from ..training.train import OPTIMIZERS, adamw_8bit  # the one list of optimizer names (lesson 03's four)
from .dryrun import DryRunError, build_fake_model, check_ops, refuse_compiled
from .fake_check import CheckedFakeTensorMode
from .hf import build_model, hf_config, max_positions, tiny_config
from .recipes import REFUSED

METHODS = ("full", "frozen", "lora")
#: The optimizers a fine-tune takes: lesson 03's four, and bitsandbytes' AdamW8bit (a real run's only: a dry run
#: refuses it by name, recipes.REFUSED).
FINE_TUNE_OPTIMIZERS = (*OPTIMIZERS, "adamw8bit")

#: What a dry run of a Hugging Face model assumes about the batch's values (it has none).
HF_ASSUMPTIONS = (
    "Each row of the batch is one sequence: no padding, no packed sequences. On real data transformers reads the "
    "position ids to find packed sequences (masking_utils.find_packed_sequence_indices) and, finding none, skips "
    "building an attention mask; the dry run runs the same ops and takes that answer. Where transformers would "
    "take its tracing path for fake tensors anywhere else (utils.is_tracing), the dry run is refused. A padded "
    "batch with an attention_mask is not modelled (transformers then builds a (batch, 1, s, s) mask). The key/value "
    "cache is off (use_cache=False, make_hf_model), as a training loop should have it. Every fit report lists "
    "these among its assumptions (hf_fit.hf_assumptions)."
)


@dataclass(frozen=True)
class FineTune:
    """How one fine-tuning step runs (see the module docstring). ``batch_size`` is the global batch, split into
    ``micro_batches`` equal micro-batches whose gradients accumulate before one optimizer step."""

    batch_size: int = 2
    seq_len: int = 16
    micro_batches: int = 1
    dtype: str = "float32"  # of the weights (LoRA: of the frozen base)
    autocast: str | None = None
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"
    foreach: bool | None = None
    fused: bool | None = None
    lr: float = 1e-4
    method: str = "full"
    freeze: tuple[str, ...] = ()  # "frozen": prefixes of the parameter names to freeze
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"  # peft's target_modules
    experts_implementation: str | None = None  # mixture of experts: see hf.build_model

    def __post_init__(self):
        positive_int("batch_size", self.batch_size)
        positive_int("seq_len", self.seq_len)
        positive_int("micro_batches", self.micro_batches)
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batches ({self.micro_batches})"
            )
        one_of("autocast", self.autocast, AUTOCAST_CHOICES)
        one_of("optimizer", self.optimizer, FINE_TUNE_OPTIMIZERS)
        if self.optimizer == "adamw8bit" and (self.foreach or self.fused):
            raise ValueError("optimizer adamw8bit has one implementation: no foreach, no fused")
        one_of("method", self.method, METHODS)
        positive_number("lr", self.lr)
        positive_int("lora_rank", self.lora_rank)
        positive_number("lora_alpha", self.lora_alpha)
        if self.method == "frozen" and not self.freeze:
            raise ValueError('method="frozen" needs freeze=(parameter-name prefixes, e.g. "model.layers.0.")')
        if self.method != "frozen" and self.freeze:
            raise ValueError(f'freeze is for method="frozen", not {self.method!r}')
        if isinstance(self.freeze, str):
            raise ValueError(f"freeze must be a tuple of parameter-name prefixes, got the string {self.freeze!r}")


def _freeze(model: nn.Module, prefixes: Sequence[str]) -> None:
    """``requires_grad_(False)`` on every parameter whose name starts with one of ``prefixes``."""
    names = [name for name, _ in model.named_parameters()]
    for prefix in prefixes:
        if not any(name.startswith(prefix) for name in names):
            tops = sorted({re.sub(r"\.(weight|bias)$", "", n).rsplit(".", 2)[0] for n in names})[:12]
            raise ValueError(f"no parameter name starts with {prefix!r}; names start e.g. with {', '.join(tops)}")
    for name, p in model.named_parameters():
        if name.startswith(tuple(prefixes)):
            p.requires_grad_(False)


def _not_the_bnb_kernel_note(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


@contextlib.contextmanager
def _bitsandbytes_quiet():
    """While peft runs: peft imports bitsandbytes where it is installed (peft 0.21 at its own import, 0.22 when
    ``get_peft_model`` first makes an adapter), which on a CPU with AVX-512 BF16 logs that its optional 4-bit kernel
    package (``kernels``) is missing, through a logger with no handler, so to stderr; and imports
    torch.utils.mkldnn, whose ``torch.jit.script_method`` warns that it is deprecated. Those messages alone are
    dropped (LoRA here quantizes nothing); every other message of that logger, and every other warning, passes."""
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    log.addFilter(_not_the_bnb_kernel_note)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
            yield
    finally:
        log.removeFilter(_not_the_bnb_kernel_note)


def _import_peft():
    """``peft``, or an ImportError saying how to install it (imported quietly: :func:`_bitsandbytes_quiet`)."""
    try:
        with _bitsandbytes_quiet():
            import peft
    except ImportError as e:
        raise ImportError('LoRA needs peft: pip install "anatomy_helpers[hf]"') from e
    return peft


def _lora(model: nn.Module, ft: FineTune) -> nn.Module:
    peft = _import_peft()
    targets = ft.lora_targets if isinstance(ft.lora_targets, str) else list(ft.lora_targets)
    # GPT-2's layers are Conv1D (weights stored transposed): peft needs to know, and warns if it has to guess
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    config = peft.LoraConfig(
        r=ft.lora_rank, lora_alpha=ft.lora_alpha, target_modules=targets, lora_dropout=0.0, fan_in_fan_out=conv1d
    )
    try:
        with _bitsandbytes_quiet(), warnings.catch_warnings():
            # Mixture of experts (transformers 5.x fuses w1 and w3 into gate_up_proj): peft maps the targets onto
            # the fused parameters itself and gives gate_up_proj twice the rank through rank_pattern/alpha_pattern,
            # which it does apply (tests/test_hf.py checks the adapter's rank), then warns that the patterns
            # matched no *module*. No other rank or alpha pattern is ever passed, so the warning is only that one.
            warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match", RuntimeWarning)
            return peft.get_peft_model(model, config)
    except ValueError as e:  # peft's own message names the targets it did not find
        raise ValueError(f"LoRA target modules {ft.lora_targets!r}: {e}") from None


def make_hf_model(cfg, ft: FineTune) -> nn.Module:
    """``cfg``'s model (hf.build_model) made ready for ``ft``: frozen parts, LoRA adapters, checkpointing."""
    model = build_model(
        cfg,
        attn_implementation=ft.attn_implementation,
        dtype=ft.dtype,
        experts_implementation=ft.experts_implementation,
    )
    model.config.use_cache = False  # training: no key/value cache (HF turns it off under checkpointing anyway)
    if ft.method == "frozen":
        _freeze(model, ft.freeze)
    if ft.gradient_checkpointing:  # before LoRA, as in peft's examples: the base model's own switch
        # gradient_checkpointing_enable() was renamed activation_checkpointing_enable() in transformers 5.x
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    if ft.method == "lora":
        with warnings.catch_warnings():  # peft asks for is_gradient_checkpointing, deprecated in transformers 5.x
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = _lora(model, ft)
    return model


def hf_optimizer_spec(ft: FineTune) -> tuple[type[torch.optim.Optimizer], dict]:
    """``ft.optimizer`` as (its class, its keyword arguments): what ZeRO-1's ZeroRedundancyOptimizer takes."""
    impl = {"lr": ft.lr, "foreach": ft.foreach, "fused": ft.fused}
    if ft.optimizer == "sgd":
        return torch.optim.SGD, impl
    if ft.optimizer == "momentum":
        return torch.optim.SGD, impl | {"momentum": 0.9}
    if ft.optimizer == "adam":
        return torch.optim.Adam, impl
    return torch.optim.AdamW, impl | {"weight_decay": 0.0}


def make_hf_optimizer(model: nn.Module, ft: FineTune) -> torch.optim.Optimizer:
    """``ft.optimizer`` over the parameters that train (the others get no gradient and no state)."""
    if ft.optimizer == "adamw8bit":
        return adamw_8bit([p for p in model.parameters() if p.requires_grad], lr=ft.lr)
    cls, kwargs = hf_optimizer_spec(ft)
    return cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def hf_batch(vocab_size: int, ft: FineTune, step: int, fake: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, each (batch, seq_len) int64, the labels a copy of the inputs (the model shifts
    them itself). Real: random tokens from a generator seeded with ``step``; fake: the same two allocations."""
    shape = (ft.batch_size, ft.seq_len)
    if fake:
        return torch.empty(shape, dtype=torch.long), torch.empty(shape, dtype=torch.long)
    ids = torch.randint(vocab_size, shape, generator=torch.Generator().manual_seed(step))
    return ids, ids.clone()


def hf_loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """A Hugging Face causal LM's loss: forward with ``labels``, so the model computes its own shifted
    cross-entropy (``model(input_ids=..., labels=...).loss``); the output's logits die with it at once."""
    input_ids, labels = batch
    return model(input_ids=input_ids, labels=labels).loss


def hf_plan(vocab_size: int, ft: FineTune, *, fake: bool = False, **fields) -> StepPlan:
    """The fine-tuning step as a :class:`~anatomy_helpers.training.step.StepPlan`, run by the course's one
    :func:`~anatomy_helpers.training.step.run_step`: step ``i``'s batch is ``hf_batch(vocab_size, ft, i, fake)``, split
    into
    ``ft.micro_batches``
    micro-batches (views), each forward under ``ft.autocast`` with :func:`hf_loss` divided by the number of
    micro-batches, and backward; then the optimizer step and ``zero_grad(set_to_none=True)``. A ``fake`` step
    reads no loss (a fake tensor has no value). ``fields``: more StepPlan fields (``optimizer_step``, ``rank``,
    ``world_size``, ...)."""
    return StepPlan(
        batch_size=ft.batch_size,
        micro_batches=ft.micro_batches,
        autocast=ft.autocast,
        read_loss=not fake,
        batch=functools.partial(hf_batch, vocab_size, ft, fake=fake),
        loss=hf_loss,
        **fields,
    )


def _steps(model, optimizer, vocab_size: int, ft: FineTune, steps: int, *, fake: bool, kernel_scratch: bool) -> Trace:
    """``steps`` tracked steps of :func:`hf_plan`: the batch made inside the step, as a data loader hands it over."""
    plan = hf_plan(vocab_size, ft, fake=fake)
    with StepTracker(model, optimizer, kernel_scratch=kernel_scratch, accumulate=ft.micro_batches > 1) as tracker:
        for i in range(steps):
            run_step(model, optimizer, plan, i)
    return tracker.trace


def check_positions(cfg, ft: FineTune) -> None:
    """ValueError if ``ft``'s sequences are longer than ``cfg``'s model takes. A real step would fail (GPT-2's
    learned position table has 1,024 rows: index out of range) or run past what the model was made for; a dry run
    reads no token ids, so without this it would return a number for a step that cannot run as configured."""
    limit = max_positions(cfg)
    if limit is not None and ft.seq_len > limit:
        raise ValueError(
            f"seq_len {ft.seq_len} is longer than {type(cfg).__name__} ({cfg.model_type}) takes: "
            f"{limit} positions; use seq_len <= {limit}, or a config.json whose model takes longer sequences"
        )


def track_hf(cfg, ft: FineTune, steps: int = 2, *, seed: int = 0, kernel_scratch: bool = True) -> Trace:
    """``steps`` real tracked steps of ``cfg``'s model (random weights, seeded) on CPU. Compare with a dry run
    using ``kernel_scratch=False``: kernel scratch is the one category a dry run cannot see."""
    cfg = hf_config(cfg)
    positive_int("steps", steps)
    check_positions(cfg, ft)
    torch.manual_seed(seed)
    model = make_hf_model(cfg, ft)
    optimizer = make_hf_optimizer(model, ft)
    return _steps(model, optimizer, cfg.vocab_size, ft, steps, fake=False, kernel_scratch=kernel_scratch)


def _one_sequence_per_row(position_ids: torch.Tensor):
    """transformers.masking_utils.find_packed_sequence_indices (5.x) for fake tensors: the same ops, and the
    answer it gives for rows that hold one sequence each (None: not packed). Its check reads values, so for fake
    tensors transformers would assume packing and build a full attention mask the real step never builds."""
    first_dummy_value = position_ids[:, :1] - 1
    position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
    packed_sequence_mask = (position_diff != 1).cumsum(-1)
    (packed_sequence_mask[:, -1] == 0).all()  # the real check's ops; its answer (True: not packed) assumed
    return None


def _no_padding_warning(self, input_ids, attention_mask):
    """PreTrainedModel.warn_if_padding_and_no_attention_mask for fake tensors: the same ops (``pad_token_id in
    input_ids[:, [-1, 0]]``), answered "no padding" (nothing to warn about)."""
    if attention_mask is None and self.config.pad_token_id is not None:
        (input_ids[:, [-1, 0]] == self.config.pad_token_id).any()


@contextlib.contextmanager
def as_real_run(tracing_calls: list[str]):
    """transformers made to run a fake step as a real one (HF_ASSUMPTIONS); every other call of its
    ``is_tracing`` with a fake tensor is noted in ``tracing_calls`` (file:line), so the dry run can refuse."""
    import transformers.masking_utils as masking  # optional extra [hf]
    from transformers.modeling_utils import PreTrainedModel  # optional extra [hf]
    from transformers.utils import import_utils  # optional extra [hf]

    original = import_utils.is_tracing

    def watched(tensor=None):
        if isinstance(tensor, FakeTensor):
            caller = sys._getframe(1)
            tracing_calls.append(f"{caller.f_code.co_filename}:{caller.f_lineno} ({caller.f_code.co_name})")
        return original(tensor)

    # Modules bind is_tracing by name: swap it where it is bound (vars(), so that no lazy module is imported).
    users = [m for name, m in list(sys.modules.items()) if name.startswith("transformers") and m is not None]
    users = [m for m in users if vars(m).get("is_tracing") is original]
    saved = (masking.find_packed_sequence_indices, PreTrainedModel.warn_if_padding_and_no_attention_mask)
    try:
        for m in users:
            m.is_tracing = watched
        masking.find_packed_sequence_indices = _one_sequence_per_row
        PreTrainedModel.warn_if_padding_and_no_attention_mask = _no_padding_warning
        yield
    finally:
        for m in users:
            m.is_tracing = original
        masking.find_packed_sequence_indices, PreTrainedModel.warn_if_padding_and_no_attention_mask = saved


class _NamingMode(CheckedFakeTensorMode):
    """The checked fake mode, remembering the op it runs last: a fake kernel that raises is named by it."""

    func = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.func = func
        return super().__torch_dispatch__(func, types, args, kwargs)


def check_dry_runnable(ft: FineTune) -> None:
    """DryRunError naming what ``ft`` runs that a dry run cannot follow (recipes.REFUSED): AdamW8bit."""
    if ft.optimizer == "adamw8bit":
        raise DryRunError(f"the 8-bit AdamW recipe is refused: {REFUSED['adamw-8bit']}")


def fake_run(cfg, ft: FineTune, steps: int):
    """The dry run: (its Trace, the op calls to check)."""
    check_dry_runnable(ft)

    def run(mode, as_for_real):
        model = build_fake_model(lambda: make_hf_model(cfg, ft), mode)
        mode.calls.clear()  # making the fake model is the dry run's doing, not the step's
        with mode, as_for_real:
            optimizer = make_hf_optimizer(model, ft)
            return _steps(model, optimizer, cfg.vocab_size, ft, steps, fake=True, kernel_scratch=False), mode.calls

    return hf_dry_run(cfg, run)


def hf_dry_run(cfg, run):
    """``run(mode, as_for_real)`` as every dry run of ``cfg``'s model runs: in the checked fake ``mode`` (made
    here), with ``as_for_real`` (a context: transformers made to take its real path, :data:`HF_ASSUMPTIONS`)
    around the step, a Ctrl-C held to a safe point; returns what ``run`` returns. A fake kernel that refuses, a
    shape made from values or transformers' tracing path seen on a fake tensor raise DryRunError naming it."""
    interrupt = DeferredInterrupt()  # see dryrun._run_fake: a Ctrl-C inside the fake mode would abort the process
    interrupt.start()
    quiet = logging.getLogger("torch._subclasses.fake_tensor").disabled  # it logs a refusing fake kernel's traceback
    logging.getLogger("torch._subclasses.fake_tensor").disabled = True
    mode = _NamingMode()
    tracing_calls: list[str] = []
    try:
        out = run(mode, as_real_run(tracing_calls))
    except CompiledCodeError as e:  # a compiled function the step called (the tracker refused it before it ran)
        raise refuse_compiled(e.where) from e
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        op = getattr(e, "func", e)
        raise DryRunError(
            f"{type(cfg).__name__} ({cfg.model_type}) makes a shape from tensor values during the step ({op}): a "
            "dry run has shapes but no values"
            + (
                ". This is the mixture-of-experts router's choice of tokens per expert; pass "
                'experts_implementation="grouped_mm" (routed tokens sorted by expert: every shape is independent '
                'of the routing) or "batched_mm"'
                if getattr(cfg, "num_local_experts", None)
                else ""
            )
        ) from e
    except RuntimeError as e:
        if mode.func is None:
            raise
        raise DryRunError(
            f"the fake kernel of {mode.func} refused what the step gives it ({str(e).splitlines()[0]}), so a dry run "
            f"of {type(cfg).__name__} with these settings is refused"
            + (
                ' (torch\'s fake grouped_mm takes bfloat16 only: use dtype="bfloat16", or '
                'experts_implementation="batched_mm")'
                if "grouped_mm" in str(mode.func)
                else ""
            )
        ) from e
    finally:
        interrupt.stop()
        logging.getLogger("torch._subclasses.fake_tensor").disabled = quiet
    if tracing_calls:
        raise DryRunError(
            f"transformers takes another path for fake tensors than for real ones in {type(cfg).__name__} "
            f"(is_tracing, at {'; '.join(sorted(set(tracing_calls)))}): the dry run would not be the real step, so "
            "it is refused"
        )
    return out


def twin_config(cfg, ft: FineTune):
    """The tiny twin whose real kernels check the ops of a dry run of ``cfg`` under ``ft``: ``tiny_config(cfg)``,
    whose sliding window (if any) is shrunk so that the twin's 16 tokens cross it (a mask: SDPA's math path);
    when ``ft``'s sequence fits in the real window, the step has no mask and takes SDPA's fused kernel, so the
    twin's window then holds its whole sequence too."""
    twin = tiny_config(cfg)
    window = getattr(cfg, "sliding_window", None)
    if window is not None and ft.seq_len <= window:
        twin.sliding_window = max_positions(twin)
    return twin


def twin_fine_tune(ft: FineTune) -> FineTune:
    """``ft`` at the twin's size: at most 16 tokens, and two rows per micro-batch where ``ft`` has two or more
    (with one, a size-1 batch dimension makes views contiguous that are not at batch 2+, and contiguity enters
    each op's signature: the twin would not run the ops the real step runs)."""
    rows = min(ft.batch_size // ft.micro_batches, 2)
    return dataclasses.replace(ft, batch_size=rows * ft.micro_batches, seq_len=min(ft.seq_len, 16))


def dry_run_hf(cfg, ft: FineTune = FineTune(), steps: int = 2, *, check_on=None) -> Trace:
    """Dry-run ``steps`` fine-tuning steps of ``cfg``'s model (hf.hf_config takes a shipped name, a config.json
    or a config): the Trace :func:`track_hf` records with ``kernel_scratch=False``, byte for byte, at any size.

    Every op signature is checked against the real kernel (dryrun.py); those seen only at calls too large to run
    here are checked on ``check_on`` (default: ``tiny_config(cfg)``, the same code paths at a size that runs
    in milliseconds). Refused with DryRunError when a fake kernel differs or a shape depends on values.
    """
    cfg = hf_config(cfg)
    positive_int("steps", steps)
    check_positions(cfg, ft)
    twin = check_on if check_on is not None else twin_config(cfg, ft)  # first: a model with no twin is refused
    trace, calls = fake_run(cfg, ft, steps)
    small = twin_fine_tune(ft)
    check_ops(calls, f"{cfg.model_type} ({type(cfg).__name__})", lambda: fake_run(twin, small, 2)[1])
    return trace
