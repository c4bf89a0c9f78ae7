"""Will a Hugging Face fine-tune fit, per rank of a data-parallel job: one rank of the sharded step dry-run on
torch's fake process group, by the engine lesson 08's per-rank tables use for the course GPT.

:func:`dry_run_hf_rank` is :func:`~anatomy_helpers.distributed.fake_world.fake_rank` (what
:func:`~anatomy_helpers.distributed.fake_world.dry_run_rank` runs for the course GPT) with a Hugging Face model:
the same :func:`~anatomy_helpers.distributed.ranks.run_job` (the same wrappers: DDP, ZeRO-1's
ZeroRedundancyOptimizer, FSDP2's ``fully_shard`` of each decoder layer then the root; the same warm-up; the same
tracked :func:`~anatomy_helpers.training.step.run_step`, here of :func:`~anatomy_helpers.prediction.hf_step.hf_plan`'s
loss
and autocast), told what it trains by a :class:`~anatomy_helpers.distributed.ranks.Trainee`. So the optimizer's
temporaries, DDP's buckets, FSDP2's all-gathered layers and reduce-scatter outputs are those of one rank of the
sharded step, not the one-device step's with its model states divided by the ZeRO formulas.

ZeRO stages as lesson 08 maps them (:data:`ZERO_STRATEGIES`): 0 DDP, 1 DDP + ZeroRedundancyOptimizer, 2 FSDP2 with
``reshard_after_forward=False`` (parameters kept gathered from forward to backward: ZeRO-2-like, its gradients and
optimizer state sharded), 3 FSDP2 resharding after forward. ``FineTune.batch_size`` is the batch of each rank.
Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import dataclasses
import functools

import torch.nn as nn

from ..core.checks import one_of, positive_int
from ..prediction.devices import DEFAULT_GPU
from ..prediction.dryrun import check_ops
from ..prediction.fit import trace_fit_report
from ..prediction.fit_report import FitReport, size_text
from ..prediction.hf import hf_config
from ..prediction.hf_cuda_rules import hf_cuda_rules
from ..prediction.hf_fit import HF_RULES, MODEL_STATES, check_request, describe_hf, hf_assumptions
from ..prediction.hf_fixes import LORA_RANK, hf_step_flops
from ..prediction.hf_step import (
    FineTune,
    check_positions,
    dry_run_hf,
    hf_batch,
    hf_dry_run,
    hf_loss,
    hf_optimizer_spec,
    make_hf_model,
    twin_config,
    twin_fine_tune,
)
from ..prediction.levers import Fix, ranked
from ..tracking.trace import Trace
from .fake_world import FakeRun, check_rank_job, fake_rank
from .ranks import RankJob, Trainee

#: ``zero`` stage -> lesson 08's strategy (distributed/ranks.py STRATEGIES).
ZERO_STRATEGIES = {0: "ddp", 1: "zero1", 2: "fsdp2_zero2", 3: "fsdp2_zero3"}
#: Untracked steps before the two tracked ones: FSDP2's all-gather buffers and the optimizer state exist (a rank's
#: tracker watches the buffers FSDP2 resizes in place only once they exist).
WARMUP = 1


def hf_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face model (under peft's wrapper too): the modules of the classes its
    ``_no_split_modules`` names, which FSDP2 shards one by one (as transformers' and accelerate's FSDP plans do)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(base).__name__} names no decoder layer class (_no_split_modules) for FSDP2 to shard")
    return blocks


def hf_job(ft: FineTune, world_size: int, zero: int) -> tuple[RankJob, Trainee]:
    """The RankJob of ``ft`` at ``world_size`` ranks under ZeRO stage ``zero``, and the Trainee it trains."""
    one_of("zero", zero, tuple(ZERO_STRATEGIES))
    job = RankJob(
        ZERO_STRATEGIES[zero],
        steps=2,
        warmup=WARMUP,
        batch_size=world_size * ft.batch_size,
        micro_batches=ft.micro_batches,
    )
    cls, kwargs = hf_optimizer_spec(ft)
    return job, Trainee(hf_blocks, cls, kwargs, {"loss": hf_loss, "autocast": ft.autocast})


def _hf_rank(cfg, ft: FineTune, world_size: int, zero: int, rank: int) -> tuple[FakeRun, dict]:
    job, trainee = hf_job(ft, world_size, zero)
    check_rank_job(job, world_size, rank)
    whole = dataclasses.replace(ft, batch_size=job.batch_size)  # the global batch: each rank copies its rows
    batch = functools.partial(hf_batch, cfg.vocab_size, whole, fake=True)

    def run(mode, as_for_real):
        build = functools.partial(make_hf_model, cfg, ft)
        return fake_rank(job, world_size, rank, build, batch, trainee=trainee, mode=mode, around=as_for_real)

    return hf_dry_run(cfg, run)


def dry_run_hf_rank(model, ft: FineTune, world_size: int = 2, zero: int = 0, rank: int = 0) -> FakeRun:
    """Dry-run rank ``rank`` of ``world_size`` ranks fine-tuning ``model`` (anything hf.hf_config takes) as ``ft``
    says under ZeRO stage ``zero``: :data:`WARMUP` untracked steps, then two tracked ones. Exact or refused as every
    dry run: each op signature is checked against the real kernel, on the tiny twin (hf_step.twin_config) at the
    same world size where the call is too large to run here; DryRunError naming the op otherwise."""

    cfg = hf_config(model)
    positive_int("world_size", world_size)
    check_positions(cfg, ft)
    twin, small = twin_config(cfg, ft), twin_fine_tune(ft)  # first: a model with no twin is refused
    run, calls = _hf_rank(cfg, ft, world_size, zero, rank)
    what = f"rank {rank} of {world_size} ({ZERO_STRATEGIES[zero]}) of {cfg.model_type}"
    check_ops(calls, what, lambda: _hf_rank(twin, small, world_size, zero, rank)[1])
    return run


def rank_note(trace: Trace, world_size: int, zero: int) -> str:
    """What one rank holds before its last optimizer step, and how it was found."""
    last = trace.phase(trace.training_steps()[-1], "optimizer")
    before = trace.at(last.start - 1)
    parts = ", ".join(f"{c.replace('_', ' ')} {size_text(before[c])}" for c in MODEL_STATES)
    return (
        f"per rank of {world_size} under {ZERO_STRATEGIES[zero]} (ZeRO-{zero}): {parts} before the optimizer step; "
        f"a dry run of rank 0 of the sharded step on torch's fake process group, after "
        f"{WARMUP} untracked warm-up step"
    )


def _check_request(model, ft: FineTune, device, world_size: int, zero: int | None):
    """(the config, the Device) of a request; ValueError naming the argument that is wrong."""
    cfg, dev = check_request(model, ft, device)
    positive_int("world_size", world_size)
    one_of("zero", zero, (None, *ZERO_STRATEGIES))
    if zero is not None and world_size == 1:
        raise ValueError(f"zero={zero} shards across ranks: it needs world_size > 1")
    return cfg, dev


def will_it_fit_hf(
    model,
    fine_tune: FineTune | None = None,
    device=DEFAULT_GPU,
    *,
    world_size: int = 1,
    zero: int | None = None,
    trace: Trace | None = None,
) -> FitReport:
    """Will ``fine_tune`` (default ``FineTune()``) of ``model`` fit on ``device``, on one device or per rank:
    ``world_size > 1`` is data parallelism under ZeRO stage ``zero`` (0: DDP, the default; 1, 2, 3), each rank
    running ``fine_tune`` on its own batch; the report is rank 0's, from :func:`dry_run_hf_rank`. With
    ``world_size == 1``: prediction/hf_fit.py's one-device report. ``trace``: the dry run (of that rank), if made.
    """
    fine_tune = FineTune() if fine_tune is None else fine_tune
    cfg, dev = _check_request(model, fine_tune, device, world_size, zero)
    label = describe_hf(cfg, fine_tune, model if isinstance(model, str) else None)
    if world_size == 1:
        trace = dry_run_hf(cfg, fine_tune, steps=2) if trace is None else trace
        if dev.capability is None:  # a size alone: the CPU kernels' rules
            return trace_fit_report(trace, label, dev, rules=HF_RULES, assumptions=hf_assumptions(fine_tune))
        corrections, rules = hf_cuda_rules(trace, cfg, fine_tune, dev)  # CUDA's, applied or named
        return trace_fit_report(
            trace, label, dev, rules=rules, assumptions=hf_assumptions(fine_tune), corrections=corrections
        )
    stage = zero or 0
    trace = dry_run_hf_rank(cfg, fine_tune, world_size, stage).result.trace if trace is None else trace
    note = rank_note(trace, world_size, stage)
    return trace_fit_report(trace, label, dev, note, HF_RULES, hf_assumptions(fine_tune))


def cheapest_fix_hf(
    model, fine_tune: FineTune | None = None, device=DEFAULT_GPU, *, world_size: int = 1, zero: int | None = None
) -> list[Fix]:
    """Candidate changes of ``fine_tune`` on ``model``, each dry-run (per rank with ``world_size > 1``, as
    :func:`will_it_fit_hf`), ranked by the course's one key (prediction/levers.py: what fits first, then what
    they change, then extra FLOPs, prediction/hf_fixes.hf_step_flops), by its rules: nothing where the step fits
    as it is, and no candidate that does not lower the peak:

    * **micro-batches** (time only): 2, 4, ... dividing the batch, up to the first that fits;
    * **gradient checkpointing** (time only: recomputes the forward in backward);
    * **the fused optimizer** (time only), for Adam and AdamW;
    * **a higher ZeRO stage** (time only: more communication), with ``world_size > 1``;
    * **precision** (numerics): bf16 autocast over fp32 weights, and bf16 weights, for an fp32 fine-tune;
    * **LoRA** rank :data:`~anatomy_helpers.prediction.hf_fixes.LORA_RANK` on all linear layers, bf16 base (trains
      adapters, not the model), for a full or frozen fine-tune.
    """
    ft = FineTune() if fine_tune is None else fine_tune
    cfg, _ = _check_request(model, ft, device, world_size, zero)  # every argument, before any dry run
    base = will_it_fit_hf(model, ft, device, world_size=world_size, zero=zero)
    if base.fits:
        return []  # no change needed (the catalogue's ranking rules: prediction/levers.py)
    base_flops = hf_step_flops(cfg, ft)
    fixes: list[Fix] = []

    def add(name, effect, note, new_ft=ft, new_zero=zero, micro=1):
        report = will_it_fit_hf(model, new_ft, device, world_size=world_size, zero=new_zero)
        extra = hf_step_flops(cfg, new_ft) / base_flops - 1 if new_ft != ft else 0.0
        fixes.append(Fix(name, report, extra, effect, note, micro))

    k = 2 * ft.micro_batches
    while k <= ft.batch_size and not any(f.fits for f in fixes):
        if ft.batch_size % k == 0:
            note = "same global batch; the accumulated gradients are in the dry run"
            micro = dataclasses.replace(ft, micro_batches=k)
            add(f"micro-batch {ft.batch_size // k} x {k}", "time only", note, micro, micro=k)
        k *= 2
    if not ft.gradient_checkpointing:
        gc = dataclasses.replace(ft, gradient_checkpointing=True)
        add("gradient checkpointing", "time only", "recomputes each layer's forward in backward", gc)
    if ft.optimizer in ("adam", "adamw") and not ft.fused:
        fused = dataclasses.replace(ft, foreach=None, fused=True)
        add("fused optimizer", "time only", "no optimizer temporaries; same maths", fused)
    if world_size > 1:
        for stage in range((zero or 0) + 1, len(ZERO_STRATEGIES)):
            add(f"ZeRO-{stage}", "time only", f"{ZERO_STRATEGIES[stage]}: more communication", new_zero=stage)
    if ft.dtype == "float32" and ft.autocast is None:
        autocast = dataclasses.replace(ft, autocast="bfloat16")
        add("bf16 autocast", "numerics", "fp32 weights and state; 16-bit matmuls (CPU autocast's op lists)", autocast)
        add(
            "bf16 weights",
            "numerics",
            "weights, gradients and optimizer state in bf16",
            dataclasses.replace(ft, dtype="bfloat16"),
        )
    if ft.method != "lora":
        lora = dataclasses.replace(ft, method="lora", freeze=(), lora_rank=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                   dtype="bfloat16" if ft.dtype == "float32" else ft.dtype)  # fmt: skip
        note = "trains adapters on all linear layers, the base frozen in bf16: another fine-tune"
        add(f"LoRA r={LORA_RANK}", "trained parameters", note, lora)
    return ranked(fixes, base)
