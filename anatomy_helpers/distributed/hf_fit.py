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
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..core.checks import one_of, positive_int
from ..prediction.devices import DEFAULT_GPU
from ..prediction.dryrun import DryRunError, check_ops
from ..prediction.fit import dry_run_text, precision_note, trace_fit_report
from ..prediction.fit_report import FitReport, size_text
from ..prediction.hf import hf_config
from ..prediction.hf_cuda_rules import hf_cuda_rules
from ..prediction.hf_fit import HF_RULES, MODEL_STATES, check_request, describe_hf, hf_assumptions
from ..prediction.hf_fixes import hf_step_flops, layers_of
from ..prediction.hf_periodic import hf_period, periodic_dry_run_hf
from ..prediction.hf_step import (
    FineTune,
    check_dry_runnable,
    check_positions,
    fake_run,
    hf_batch,
    hf_dry_run,
    hf_loss,
    hf_optimizer_spec,
    make_hf_model,
    twin_config,
    twin_fine_tune,
)
from ..prediction.levers import EFFECTS, Fix, Lever, Setup, fine_tune_levers, rank_key
from ..prediction.recipes import recipe_of
from ..tracking.trace import Trace
from .fake_world import FakeRun, check_rank_job, fake_rank
from .hf_rank_period import ddp_buckets, zero1_share
from .ranks import RankJob, Trainee, run_job

#: ``zero`` stage -> lesson 08's strategy (distributed/ranks.py STRATEGIES).
ZERO_STRATEGIES = {0: "ddp", 1: "zero1", 2: "fsdp2_zero2", 3: "fsdp2_zero3"}


def warmup_steps(zero: int) -> int:
    """Untracked steps before the two tracked ones under ZeRO stage ``zero``: after one, the optimizer state and
    FSDP2's all-gather buffers exist (a rank's tracker watches the buffers FSDP2 resizes in place only once they
    exist); DDP (stages 0 and 1) rebuilds its gradient buckets in its second step, holding the old and the new ones
    for a moment (a real gloo rank measured it: tests/test_hf_fit.py), so its ranks warm up for two, as lesson 08's."""
    return 1 if zero >= 2 else 2


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
        warmup=warmup_steps(zero),
        batch_size=world_size * ft.batch_size,
        micro_batches=ft.micro_batches,
    )
    cls, kwargs = hf_optimizer_spec(ft)
    return job, Trainee(hf_blocks, cls, kwargs, {"loss": hf_loss, "autocast": ft.autocast})


@dataclass(frozen=True)
class HFRankJob:
    """A Hugging Face fine-tune run by real ranks (``world.run_world``: gloo processes), each rank as its dry run
    (:func:`dry_run_hf_rank`) runs it: the same :func:`hf_job` and Trainee, a real model (``make_hf_model``, seeded)
    and real batches (``hf_batch``: random tokens). What tests/test_hf_fit.py compares byte for byte with the dry run.
    ``config``: a transformers config (small: every rank builds the real model)."""

    config: object
    ft: FineTune
    zero: int = 0
    world_size: int = 2

    @property
    def job(self) -> RankJob:
        return hf_job(self.ft, self.world_size, self.zero)[0]

    # what the runner reads of a job: its strategy (results are filed by it) and its rows (check_rows)
    strategy = property(lambda self: self.job.strategy)
    batch_size = property(lambda self: self.job.batch_size)
    micro_batches = property(lambda self: self.job.micro_batches)
    tp = 1

    def run_rank(self, rank: int, world_size: int, device):
        """This rank's part, inside the runner's process group: ``ranks.run_job`` with the real model and batches."""
        if world_size != self.world_size:
            raise ValueError(f"HFRankJob was made for {self.world_size} ranks, run on {world_size}")
        job, trainee = hf_job(self.ft, world_size, self.zero)
        whole = dataclasses.replace(self.ft, batch_size=job.batch_size)  # the global batch: each rank takes its rows

        def build() -> nn.Module:
            torch.manual_seed(0)  # every rank the same weights, as DDP's start-up broadcast would make them
            return make_hf_model(self.config, self.ft)

        plan = trainee.plan | {"batch": functools.partial(hf_batch, self.config.vocab_size, whole, fake=False)}
        real = dataclasses.replace(trainee, plan=plan, build=build)
        return run_job(job, rank, world_size, device, trainee=real)


def _hf_rank(cfg, ft: FineTune, world_size: int, zero: int, rank: int) -> tuple[FakeRun, dict]:
    check_dry_runnable(ft)
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
    says under ZeRO stage ``zero``: :func:`warmup_steps` untracked steps, then two tracked ones. Exact or refused as
    every dry run: each op signature is checked against the real kernel, on the tiny twin (hf_step.twin_config) at the
    same world size where the call is too large to run here; DryRunError naming the op otherwise."""

    cfg = hf_config(model)
    positive_int("world_size", world_size)
    check_positions(cfg, ft)
    twin, small = twin_config(cfg, ft), twin_fine_tune(ft)  # first: a model with no twin is refused
    run, calls = _hf_rank(cfg, ft, world_size, zero, rank)
    what = f"rank {rank} of {world_size} ({ZERO_STRATEGIES[zero]}) of {cfg.model_type}"
    check_ops(calls, what, lambda: _hf_rank(twin, small, world_size, zero, rank)[1])
    return run


def periodic_dry_run_hf_rank(
    model, ft: FineTune, world_size: int = 2, zero: int = 0, rank: int = 0
) -> tuple[Trace, str | None]:
    """:func:`dry_run_hf_rank`'s Trace, built from the same rank's dry runs at 3, 4 and 5 layers
    (prediction/hf_periodic.hf_period: its refusals by name, ``ANATOMY_FULL_DRY_RUN=1``, the period's checks), and
    None; or the full dry run's, and why (fit.dry_run_text says either). What a rank adds is checked too
    (distributed/hf_rank_period.py): ZeRO-1's partition and DDP's buckets must repeat layer by layer."""
    cfg = hf_config(model)
    positive_int("world_size", world_size)
    check_rank_job(hf_job(ft, world_size, zero)[0], world_size, rank)  # bad input refused before any dry run

    def check(path: str, traces: list[Trace] | None) -> str | None:
        if traces is None:
            return zero1_share(cfg, ft, world_size, rank, path) if zero == 1 else None
        return ddp_buckets(traces) if zero < 2 else None

    run_at = lambda d: dry_run_hf_rank(layers_of(cfg, d), ft, world_size, zero, rank).result.trace  # noqa: E731
    trace, why = hf_period(cfg, ft, run_at, check)
    return (trace, None) if why is None else (dry_run_hf_rank(cfg, ft, world_size, zero, rank).result.trace, why)


def rank_note(trace: Trace, world_size: int, zero: int) -> str:
    """What one rank holds before its last optimizer step, and how it was found."""
    before = trace.before_last_optimizer_step()
    parts = ", ".join(f"{c.replace('_', ' ')} {size_text(before[c])}" for c in MODEL_STATES)
    return (
        f"per rank of {world_size} under {ZERO_STRATEGIES[zero]} (ZeRO-{zero}): {parts} before the optimizer step; "
        f"a dry run of rank 0 of the sharded step on torch's fake process group, after "
        f"{warmup_steps(zero)} untracked warm-up step{'s' if warmup_steps(zero) > 1 else ''}"
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
    why: str = "",
) -> FitReport:
    """Will ``fine_tune`` (default ``FineTune()``) of ``model`` fit on ``device``, on one device or per rank:
    ``world_size > 1`` is data parallelism under ZeRO stage ``zero`` (0: DDP, the default; 1, 2, 3), each rank
    running ``fine_tune`` on its own batch; the report is rank 0's, from :func:`dry_run_hf_rank`, built from 3, 4
    and 5 layers where the rank's step repeats (:func:`periodic_dry_run_hf_rank`). With ``world_size == 1``:
    prediction/hf_fit.py's one-device report, its dry run built from 3, 4 and 5 layers where the layers repeat
    (prediction/hf_periodic.py). Either way the report's ``dry_run`` says which. ``trace``: the dry run (of that
    rank), if made.
    The report's note names the precision recipe and its bytes per parameter (prediction/recipes.py), ``why`` it
    was chosen (recipes.device_recipe's reason), and warns of bf16 asked for on a GPU without native bf16.
    """
    fine_tune = FineTune() if fine_tune is None else fine_tune
    cfg, dev = _check_request(model, fine_tune, device, world_size, zero)
    label = describe_hf(cfg, fine_tune, model if isinstance(model, str) else None)
    notes = [recipe_of(fine_tune).text(), why, precision_note(fine_tune.dtype, fine_tune.autocast, dev)]
    if world_size == 1:
        which = ""  # which dry run answered (FitReport.dry_run): said where it is made here
        if trace is None:  # built from 3, 4 and 5 layers where the layers repeat (the same bytes)
            trace, full_why = periodic_dry_run_hf(cfg, fine_tune, steps=2)
            which = dry_run_text(cfg.num_hidden_layers, full_why)
        note = "\n".join(filter(None, notes))
        if dev.capability is None:  # a size alone: the CPU kernels' rules
            report = trace_fit_report(trace, label, dev, note, HF_RULES, hf_assumptions(fine_tune))
        else:
            corrections, rules = hf_cuda_rules(trace, cfg, fine_tune, dev)  # CUDA's, applied or named
            report = trace_fit_report(trace, label, dev, note, rules, hf_assumptions(fine_tune), corrections)
        return dataclasses.replace(report, dry_run=which)
    stage, which = zero or 0, ""
    if trace is None:  # rank 0's, built from 3, 4 and 5 layers where its step repeats (the same bytes)
        trace, full_why = periodic_dry_run_hf_rank(cfg, fine_tune, world_size, stage)
        which = dry_run_text(cfg.num_hidden_layers, full_why)
    notes.append(rank_note(trace, world_size, stage))
    report = trace_fit_report(trace, label, dev, "\n".join(filter(None, notes)), HF_RULES, hf_assumptions(fine_tune))
    return dataclasses.replace(report, dry_run=which)


#: What a change may do and still train the fine-tune as asked (the same data, the same trained parameters).
KEEPS_TRAINING = ("time only", "numerics")
#: World sizes the search tries when no one device fits the fine-tune as it trains (same global batch).
MULTI_GPU = (2, 4, 8)


@dataclass(frozen=True)
class FixSearch:
    """What :func:`search_fix_hf` found: ``fixes``, the combinations that fit (or, where none does, the closest
    one tried), each confirmed by a full dry run, ranked by :func:`~anatomy_helpers.prediction.levers.rank_key`;
    ``refused``, the catalogue's levers a fine-tune's dry run cannot take (each with its reason); ``more_gpus``,
    the smallest data-parallel setup (world size, ZeRO stage) that fits the fine-tune as it trains, where one
    device does not without changing what it trains; ``dry_runs``, the screening and confirming dry runs made."""

    fixes: list[Fix]
    refused: list[Lever]
    more_gpus: Fix | None
    one_device: bool
    dry_runs: int
    world_sizes: tuple[int, ...] = ()  # the world sizes tried for ``more_gpus`` (those that split the batch evenly)

    def text(self, device_name: str) -> str:
        """What the table of fixes does not say: the refused levers, and the multi-GPU answer."""
        lines = [f"refused by name: {lv.name}: {lv.not_for_fine_tune}" for lv in self.refused]
        if not self.one_device:
            lines.append(f"no single {device_name} fits this fine-tune as it trains (the same data and trained "
                         "parameters)")  # fmt: skip
        if self.more_gpus is not None:
            peak = size_text(self.more_gpus.report.peak.tensors)
            lines.append(f"{self.more_gpus.name} does: {peak} of tensors at rank 0's peak (a dry run of that rank)")
        elif not self.one_device:
            tried = " or ".join(map(str, self.world_sizes)) or "no"
            lines.append(
                f"nor do {tried} GPUs under ZeRO-1/2/3 (the world sizes of {', '.join(map(str, MULTI_GPU))} that "
                "split the batch evenly), with the levers that keep its training"
            )
        lines.append(f"({self.dry_runs} dry runs: pairs of one- and two-layer screens, and full confirmations)")
        return "\n".join(lines)


class _Search:
    """Screens setups of one fine-tune: each setup's peak of tensor bytes extrapolated from dry runs of its
    model cut to one and two decoder layers (``P1 + (L - 1) (P2 - P1)``: the layers are identical), cached; a
    candidate that screens as fitting is then confirmed by the full dry run (:func:`will_it_fit_hf`)."""

    def __init__(self, model, cfg, dev):
        self.model, self.cfg, self.dev = model, cfg, dev
        self.screens: dict[Setup, int | None] = {}
        self.reports: dict[Setup, FitReport] = {}

    def screen(self, setup: Setup) -> int | None:
        if setup not in self.screens:
            peaks = []
            for n in (1, 2):
                small = layers_of(self.cfg, n)
                try:
                    if setup.world_size == 1:
                        trace = fake_run(small, setup.fine_tune, 2)[0]
                    else:
                        run = _hf_rank(small, setup.fine_tune, setup.world_size, setup.zero or 0, 0)[0]
                        trace = run.result.trace
                except (DryRunError, ValueError):
                    peaks = None
                    break
                peaks.append(trace.peak().bytes)
            layers = self.cfg.num_hidden_layers
            self.screens[setup] = None if peaks is None else peaks[0] + (layers - 1) * (peaks[1] - peaks[0])
        return self.screens[setup]

    def fits(self, setup: Setup) -> bool:
        peak = self.screen(setup)
        return peak is not None and peak <= self.dev.usable

    def report(self, setup: Setup) -> FitReport:
        if setup not in self.reports:
            ft, ws = setup.fine_tune, setup.world_size
            self.reports[setup] = will_it_fit_hf(self.model, ft, self.dev, world_size=ws, zero=setup.zero)
        return self.reports[setup]


def _apply(start: Setup, chosen: list[Lever]) -> Setup | None:
    setup = start
    for lever in chosen:
        setup = setup.but(lever)
        if setup is None:
            return None
    return setup


def _greedy(search: _Search, start: Setup, catalogue: list[Lever]) -> tuple[list[Lever], Setup | None]:
    """Levers added one at a time in the catalogue's order (by what they change, then cost), each kept only where
    it lowers the screened peak (a lever of a family replaces its family's), until the setup screens as fitting
    and its full dry run confirms it; then each kept lever, the costliest first, dropped if the rest still
    screens as fitting, and a family's lever lowered to the smallest of its family that still does (kept only if
    the full dry run confirms). Returns (the levers, their setup), or (the levers, None) if nothing fits."""
    chosen: list[Lever] = []
    best = search.screen(start)
    if search.fits(start) and search.report(start).fits:  # e.g. more ranks that need no other change
        return chosen, start
    for lever in catalogue:
        trial = [lv for lv in chosen if not (lever.family and lv.family == lever.family)] + [lever]
        setup = _apply(start, trial)
        peak = None if setup is None else search.screen(setup)
        if peak is None or best is None or peak >= best:
            continue  # saves nothing: dropped
        chosen, best = trial, peak
        if peak <= search.dev.usable and search.report(setup).fits:  # screened, then confirmed by the full run
            break
    if not chosen or not search.fits(_apply(start, chosen)) or not search.report(_apply(start, chosen)).fits:
        return chosen, None  # (a full dry run only for what screens as fitting)
    confirmed = chosen
    for lever in reversed(list(chosen)):
        rest = [lv for lv in chosen if lv is not lever]
        setup = _apply(start, rest)
        if setup is not None and search.fits(setup):
            chosen = rest
    for lever in list(chosen):
        smaller = [lv for lv in catalogue if lever.family and lv.family == lever.family]
        for other in smaller[: smaller.index(lever)] if smaller else ():
            trial = [other if lv is lever else lv for lv in chosen]
            setup = _apply(start, trial)
            if setup is not None and search.fits(setup):
                chosen = trial
                break
    if not search.report(_apply(start, chosen)).fits:  # the allocator's rounding, which the screen does not see
        chosen = confirmed
    return chosen, _apply(start, chosen)


def _as_fix(search: _Search, start: Setup, chosen: list[Lever], setup: Setup, prefix: str = "") -> Fix:
    """The confirmed Fix of ``setup`` (``chosen`` applied to ``start``): its full dry run's report, the largest
    effect of its levers, its extra FLOPs per token (prediction/hf_fixes.hf_step_flops)."""
    cfg, old, new = search.cfg, start.fine_tune, setup.fine_tune
    per_token = lambda ft: hf_step_flops(cfg, ft) / (ft.batch_size * ft.seq_len)  # noqa: E731
    extra = per_token(new) / per_token(old) - 1 if new != old else 0.0
    effect = max((lv.effect for lv in chosen), key=EFFECTS.index, default="time only")
    name = " + ".join([prefix, *(lv.name for lv in chosen)] if prefix else [lv.name for lv in chosen])
    note = "; ".join(lv.note for lv in chosen if lv.note)
    return Fix(name, search.report(setup), extra, effect, note, new.micro_batches, setup=setup)


def search_fix_hf(
    model,
    fine_tune: FineTune | None = None,
    device=DEFAULT_GPU,
    *,
    world_size: int = 1,
    zero: int | None = None,
    base: FitReport | None = None,
) -> FixSearch:
    """The cheapest combination of the one catalogue's levers (prediction/levers.fine_tune_levers) that makes
    ``fine_tune`` of ``model`` fit on ``device`` (per rank with ``world_size > 1``, as :func:`will_it_fit_hf`).

    A greedy search (:func:`_greedy`): levers taken in the ranking's order (what they change, :data:`EFFECTS`,
    then cost), each kept only where it lowers the peak, until the step fits; then what saves nothing is dropped.
    Candidates are screened by dry runs of the model cut to one and two decoder layers (a tensor peak
    extrapolated to every layer: tens of small dry runs, not full ones); the combination found is confirmed by the
    full dry run, whose exact peak and allocator verdict the :class:`Fix` carries. Where the combination that
    fits changes the training (a smaller batch, shorter sequences, LoRA) or nothing fits, the smallest
    data-parallel setup (:data:`MULTI_GPU` ranks, the same global batch, the lowest ZeRO stage) that fits the
    fine-tune with the levers that keep its training is searched too. A step that fits as it is needs nothing.
    ``base``: the request's own report (:func:`will_it_fit_hf`), if made."""
    ft = FineTune() if fine_tune is None else fine_tune
    cfg, dev = _check_request(model, ft, device, world_size, zero)  # every argument, before any dry run
    base = will_it_fit_hf(model, ft, dev, world_size=world_size, zero=zero) if base is None else base
    if base.fits:
        return FixSearch([], [], None, True, 1)
    catalogue = fine_tune_levers(ft, dev, world_size, zero)
    refused = [lv for lv in catalogue if lv.not_for_fine_tune]
    usable = [lv for lv in catalogue if not lv.not_for_fine_tune]
    search, start = _Search(model, cfg, dev), Setup(ft, world_size, zero)
    search.reports[start] = base
    chosen, setup = _greedy(search, start, usable)
    fixes = []
    if setup is not None and search.report(setup).fits:
        fixes.append(_as_fix(search, start, chosen, setup))
    keeps = [lv for lv in usable if lv.effect in KEEPS_TRAINING]
    one_device = any(f.effect in KEEPS_TRAINING for f in fixes)
    more = None
    if not one_device and world_size == 1:
        more = _more_gpus(search, ft, keeps)
    n = sum(1 for v in search.screens.values() if v is not None) * 2 + len(search.reports) + 1
    sizes = tuple(k for k in MULTI_GPU if ft.batch_size % k == 0) if more is None and world_size == 1 else ()
    return FixSearch(sorted(fixes, key=rank_key), refused, more, one_device, n, sizes)


def _more_gpus(search: _Search, ft: FineTune, keeps: list[Lever]) -> Fix | None:
    """The smallest world size of :data:`MULTI_GPU`, then the lowest ZeRO stage, at which ``ft`` (the same global
    batch, split over the ranks) fits with the levers that keep its training (:func:`_greedy` over ``keeps``):
    stages screened from 3 down while they fit, then the lowest confirmed by a full dry run of rank 0."""
    keeps = [lv for lv in keeps if "zero" not in lv.fine_tune]
    for n in MULTI_GPU:
        if ft.batch_size % n:
            continue
        rows = ft.batch_size // n
        per_rank = dataclasses.replace(ft, batch_size=rows, micro_batches=math.gcd(rows, ft.micro_batches))
        found = []
        for stage in (3, 2, 1):
            start = Setup(per_rank, n, stage)
            chosen, setup = _greedy(search, start, keeps)
            if setup is None:
                break
            found.append((start, chosen, setup))
        for start, chosen, setup in reversed(found):
            if search.report(setup).fits:
                return _as_fix(search, start, chosen, setup, f"{n} GPUs, ZeRO-{start.zero}")
    return None


def cheapest_fix_hf(
    model, fine_tune: FineTune | None = None, device=DEFAULT_GPU, *, world_size: int = 1, zero: int | None = None
) -> list[Fix]:
    """The fitting combinations :func:`search_fix_hf` finds (its ``fixes``; empty where the step fits as it is)."""
    return search_fix_hf(model, fine_tune, device, world_size=world_size, zero=zero).fixes
