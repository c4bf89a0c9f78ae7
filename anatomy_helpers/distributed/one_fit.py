"""The one will-it-fit: any model the course predicts (its GPT, or a Hugging Face model), on one device or per rank
of a data-parallel job, each through the one dry-run engine that runs it.

* the course GPT on one device: :func:`anatomy_helpers.prediction.fit.will_it_fit` (its options, CUDA's rules for a
  named GPU);
* the course GPT per rank: one rank of the sharded step dry-run on torch's fake process group
  (:func:`~anatomy_helpers.distributed.fake_world.dry_run_rank`, lesson 08's and 11's engine), AdamW as those
  lessons' ranks run it, replayed through the allocator simulator under the device's memory;
* a Hugging Face fine-tune, one device or per rank: :func:`anatomy_helpers.distributed.hf_fit.will_it_fit_hf`.

What one path cannot take is refused by name (ValueError), never dropped. Bytes everywhere.
"""

from __future__ import annotations

import dataclasses

from ..core.model import ModelConfig
from ..prediction import fit
from ..prediction.cuda_rules import CPU_RULES
from ..prediction.devices import DEFAULT_GPU
from ..prediction.fit import course_assumptions, trace_fit_report, usable_device
from ..prediction.fit_report import FitReport
from ..prediction.hf_step import FineTune
from .fake_world import dry_run_rank
from .hf_fit import ZERO_STRATEGIES, rank_note, warmup_steps, will_it_fit_hf
from .ranks import RankJob

#: The rules a course GPT's rank follows: its dry run is on CPU kernels; cuda_rules.py's corrections are stated for
#: one device's step.
RANK_RULES = f"{CPU_RULES}, not CUDA's: the course states CUDA's memory rules for one device's step, not per rank"


def will_it_fit(
    model: ModelConfig | str | object | None = None,
    batch_size: int | None = None,
    *,
    device=DEFAULT_GPU,
    world_size: int = 1,
    zero: int | None = None,
    fine_tune: FineTune | None = None,
    **options,
) -> FitReport:
    """Will two training steps of ``model`` fit on ``device``, on one device or per rank.

    ``model``: the course GPT (a :class:`~anatomy_helpers.core.model.ModelConfig`, None for the default) or a
    Hugging Face model (a shipped name, a config.json path or a transformers config: prediction/hf.py).
    ``batch_size``: per device, rows of each step (the course GPT's default 8; a fine-tune's, ``fine_tune``'s).
    ``world_size > 1``: data parallelism under ZeRO stage ``zero`` (0 DDP, the default; 1 ZeRO-1; 2 and 3 FSDP2),
    the report rank 0's. ``options``: the course GPT's other fields of
    :class:`~anatomy_helpers.prediction.fit.FitRequest` (one device; per rank only ``micro_batches``);
    ``fine_tune``: a Hugging Face model's :class:`~anatomy_helpers.prediction.hf_step.FineTune`.
    """
    if model is None or isinstance(model, ModelConfig):
        if fine_tune is not None:
            raise ValueError("fine_tune is a Hugging Face fine-tune's; the course GPT takes FitRequest's fields")
        cfg, rows = model if model is not None else ModelConfig(), 8 if batch_size is None else batch_size
        if world_size == 1 and zero is None:
            return fit.will_it_fit(cfg, rows, device=device, **options)
        return _course_rank_fit(cfg, rows, device, world_size, zero, **options)
    if options:
        raise ValueError(
            f"a Hugging Face model takes its options as fine_tune=FineTune(...), got {', '.join(sorted(options))}"
        )
    ft = FineTune() if fine_tune is None else fine_tune
    if batch_size is not None:
        ft = dataclasses.replace(ft, batch_size=batch_size)
    return will_it_fit_hf(model, ft, device, world_size=world_size, zero=zero)


def _course_rank_fit(
    cfg: ModelConfig, rows: int, device, world_size: int, zero: int | None, *, micro_batches: int = 1, **options
) -> FitReport:
    """Rank 0 of ``world_size`` ranks of the course GPT, each training ``rows`` rows, under ZeRO stage ``zero``."""
    if options:
        raise ValueError(
            f"per rank the course GPT trains as lessons 08 and 11's ranks do (AdamW, fp32, torch's CPU default "
            f"implementation): {', '.join(sorted(options))} is not modelled per rank; ask for one device instead"
        )
    if zero is not None and zero not in ZERO_STRATEGIES:
        raise ValueError(f"zero must be None or one of {tuple(ZERO_STRATEGIES)}, got {zero!r}")
    if zero is not None and world_size == 1:
        raise ValueError(f"zero={zero} shards across ranks: it needs world_size > 1")
    dev = usable_device(device)
    stage = zero or 0
    job = RankJob(
        ZERO_STRATEGIES[stage],
        batch_size=rows * world_size,  # the global batch
        micro_batches=micro_batches,
        warmup=warmup_steps(stage),
        model=dataclasses.asdict(cfg),
    )
    trace = dry_run_rank(job, world_size).result.trace
    label = f"course GPT ({cfg.n_layer} layers, d_model {cfg.d_model}), b={rows} per rank, adamw"
    note = rank_note(trace, world_size, stage)
    return trace_fit_report(trace, label, dev, note, RANK_RULES, course_assumptions(cfg, "adamw", None))
