"""Will a training step fit on a GPU, which phase runs out first, and the cheapest fix: all predicted on this
machine's CPU with dry runs (:mod:`anatomy_helpers.prediction.dryrun`: the tracked step on fake tensors, exact for every
category but kernel scratch), so it works for models far larger than the machine. Lesson 06 teaches it and the CLI's
``predict`` command prints it; the ranked fixes are in :mod:`anatomy_helpers.prediction.fixes`. A model deeper than
5 blocks is dry-run at depths 3, 4 and 5 and extended to its depth (:mod:`anatomy_helpers.prediction.periodic`: the
same bytes as the full-depth dry run), so a prediction's cost does not grow with depth; each report says which dry
run answered (:func:`dry_run_text`).

The devices, their memory as a process sees it (below the driver's figure) and the CUDA context's share, are in
:mod:`anatomy_helpers.prediction.devices`. The **caching allocator** rounds requests and keeps segments, so it reserves
more than the tensors need: we replay the dry run's allocation record through the allocator simulator
(:func:`anatomy_helpers.prediction.allocator.replay`), a simulation of the allocator's rules, not a measurement.

The dry run follows the CPU kernels' rules (what autograd saves, autocast's op lists). For a GPU with a known
compute capability the phase needs are corrected by CUDA's rules from torch's source
(:mod:`anatomy_helpers.prediction.cuda_rules`: dropout masks, cuBLAS workspaces, autocast's fp32 softmax, SDPA's
backend); each report says what a stored GPU run of that compute capability measured against it
(``cuda_rules.checked_text``: an H200 so far); a device given
only by its size keeps the CPU kernels' rules. Each report says which.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import functools
import os
from dataclasses import astuple, dataclass, field, replace

from ..core.checks import one_of
from ..core.model import ModelConfig, param_count
from ..tracking.trace import Trace
from ..training.step import AUTOCAST_CHOICES
from ..training.train import OPTIMIZER_NAMES
from .allocator import LimitReplay, replay, replay_with_limit
from .cuda_rules import (
    CPU_RULES,
    CUBLASLT_WORKSPACE,
    corrected_peak,
    correction_series,
    cublas_workspace_bytes,
    cuda_corrections,
    rules_text,
)
from .devices import DEFAULT_GPU, Device, get_device
from .dryrun import check_micro_batches, dry_run_config
from .fit_report import FitReport, PhaseNeed, assumed_bytes, size_text
from .periodic import DEPTHS, periodic_dry_run
from .sdpa_rules import sdpa_backend

#: Optimizer implementations and the (foreach, fused) flags that pick them.
IMPLEMENTATION_FLAGS = {"single": (False, None), "foreach": (True, None), "fused": (None, True)}

#: The phases a fit report looks at, in time order.
STEP_PHASES = tuple((s, p) for s in (1, 2) for p in ("forward", "backward", "optimizer"))


#: The rules line of a device given only by its size: no compute capability to pick CUDA's rules by.
SIZE_ONLY_RULES = f"{CPU_RULES}, not CUDA's: a device given only by its size has no compute capability to pick them by"


def phase_needs(trace: Trace, rep=None, series=None, series_in_rep: bool = False) -> tuple[PhaseNeed, ...]:
    """Step 1's and step 2's phases of a dry run: tensor peaks, and the simulated allocator's reserved bytes at them.

    A step of several micro-batches has each phase several times (forward and backward once per micro-batch): a
    phase's peak is the highest of them. ``rep``: the uncapped
    :func:`~anatomy_helpers.prediction.allocator.replay` of the trace's record, if already made. ``series``: CUDA rules'
    corrections per sample and category (:func:`~anatomy_helpers.prediction.cuda_rules.correction_series`); the peaks
    are then those of the corrected timeline, and the reserved bytes get the correction at that moment added, unless
    ``series_in_rep`` (``rep`` already replays the corrected record).
    """
    rep = replay(trace.allocation_record()) if rep is None else rep
    n0 = len(trace.baseline_ids)  # the record's first rows are the storages alive at the start
    out = []
    for step, phase in STEP_PHASES:
        pk = trace.peak(step=step, phase=phase)
        tensors, index, breakdown = pk.bytes, pk.index, dict(pk.breakdown)
        if series is not None:
            tensors, index, breakdown = corrected_peak(trace, series, step, phase)
        reserved = int(rep.reserved[n0 + index]) if len(rep.reserved) else 0
        if series is not None and not series_in_rep:
            reserved += int(series[index].sum())
        out.append(PhaseNeed(step, phase, tensors, reserved, breakdown))
    return tuple(out)


def describe(cfg: ModelConfig, batch_size: int, optimizer: str, implementation: str, autocast: str | None) -> str:
    """A short label of a configuration."""
    parts = [f"{cfg.block} {cfg.n_layer}x{cfg.d_model}", f"b={batch_size} s={cfg.seq_len}", cfg.dtype]
    if cfg.mlp_ratio != 4:
        parts.append(f"MLP {cfg.mlp_ratio}h")
    if not cfg.tie_embeddings:
        parts.append("untied head")
    if cfg.dropout:
        parts.append(f"dropout {cfg.dropout:g}")
    if autocast:
        parts.append(f"autocast {autocast}")
    parts.append(f"{optimizer} ({implementation})")
    if cfg.checkpoint != "none":
        every = f" {cfg.checkpoint_every}" if cfg.checkpoint == "every_k" else ""
        parts.append(f"checkpoint {cfg.checkpoint}{every}")
    if cfg.loss_chunk is not None:
        parts.append(f"loss in chunks of {cfg.loss_chunk} tokens")
    return ", ".join(parts)


#: A full-depth dry run (where the period of depths 3, 4 and 5 does not apply) replays every layer's ops (about
#: 0.1 s per layer and step at 7B's width on one core): beyond this, minutes.
MAX_LAYERS = 1024
#: Refuse configurations whose parameters and logits alone need more than this many times the device's memory:
#: no dry run is needed to say they cannot fit, and their sizes approach what int64 tensor sizes can hold.
MAX_OVER_DEVICE = 1024


def usable_device(device: str | int | Device) -> Device:
    """:func:`~anatomy_helpers.prediction.devices.get_device`, refused (ValueError) if the CUDA context leaves
    nothing."""
    dev = get_device(device)
    if dev.usable <= 0:
        raise ValueError(
            f"device {dev.name} has no memory left once the {dev.context_note()} takes {size_text(dev.context)}"
        )
    return dev


@dataclass(frozen=True)
class FitRequest:
    """One training configuration asked about: what :func:`will_it_fit` and
    :func:`~anatomy_helpers.prediction.fixes.cheapest_fix` take (their keyword options are these fields)."""

    cfg: ModelConfig = field(default_factory=ModelConfig)
    batch_size: int = 8  # the global batch, in sequences
    optimizer: str = "adamw"  # one of train.OPTIMIZER_NAMES
    implementation: str = "foreach"  # the optimizer's: "single", "foreach" (torch's CUDA default), "fused"
    autocast: str | None = None  # None, "bfloat16" or "float16"
    device: str | int | Device = DEFAULT_GPU  # a short name, "this GPU", a total in bytes, or a Device
    micro_batches: int = 1  # gradient accumulation: batch_size // micro_batches sequences per forward
    in_backward: bool = False  # the optimizer step fused into backward (step.OptimizerInBackward)

    def but(self, **changes) -> FitRequest:
        """The same request with ``changes`` (field name -> value)."""
        return replace(self, **changes)

    def label(self) -> str:
        """What the request runs, in words (the device aside)."""
        b = self.batch_size // self.micro_batches
        text = describe(self.cfg, b, self.optimizer, self.implementation, self.autocast)
        text += " stepped in backward" if self.in_backward else ""
        return text + (f" x {self.micro_batches} micro-batches" if self.micro_batches > 1 else "")

    def check(self) -> Device:
        """Check every field before any work; returns the Device. ValueError names the field and says why."""

        cfg, batch_size = self.cfg, self.batch_size
        dev = usable_device(self.device)
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        one_of("in_backward", self.in_backward, (True, False))
        check_micro_batches(batch_size, self.micro_batches, self.in_backward)
        one_of("optimizer", self.optimizer, OPTIMIZER_NAMES)
        one_of("implementation", self.implementation, IMPLEMENTATION_FLAGS)
        if self.optimizer in ("adamw_bf16", "adamw8bit") and self.implementation != "single":
            raise ValueError(f"optimizer {self.optimizer} has one implementation: implementation='single'")
        one_of("autocast", self.autocast, AUTOCAST_CHOICES)
        full_dry_run_asked()  # the environment's choice of dry run (FULL_DRY_RUN_ENV), checked before any work
        if cfg.n_layer > MAX_LAYERS:
            raise ValueError(
                f"n_layer must be at most {MAX_LAYERS} for a dry run (it replays every layer), got {cfg.n_layer}"
            )
        rows = batch_size // self.micro_batches  # one pass's: the logits of one micro-batch are alive at a time
        least = (param_count(cfg) + rows * cfg.seq_len * cfg.vocab_size) * cfg.torch_dtype.itemsize
        if least > MAX_OVER_DEVICE * dev.total:  # parameters + logits alone
            raise ValueError(
                f"{self.label()} needs at least "
                f"{size_text(least)} for its parameters and logits alone, over {MAX_OVER_DEVICE} times the "
                f"{size_text(dev.total)} of {dev.name}: it cannot fit, and no dry run is needed to say so"
            )
        return dev


def precision_note(dtype: str, autocast: str | None, device: Device) -> str:
    """A warning where the run asks for bfloat16 (``dtype``: the weights') on a GPU without native bf16 (compute
    capability < 8.0); also the reason a Hugging Face fine-tune's recipe changes there (recipes.device_recipe)."""
    if device.bf16_native is False and "bfloat16" in (autocast, dtype):
        major, minor = device.capability
        return (
            f"note: {device.name} (compute capability {major}.{minor}) has no native bfloat16 (from 8.0 on); "
            "use float16 autocast with a GradScaler there"
        )
    return ""


def will_it_fit(cfg: ModelConfig | None = None, batch_size: int = 8, **options) -> FitReport:
    """Dry-run two steps of ``cfg``; say whether they fit on ``device`` and, if not, which phase runs out first.

    ``options``: the other fields of :class:`FitRequest` (``optimizer``, ``implementation``, ``autocast``,
    ``device``, ``micro_batches``), by keyword.

    ``device``: a short name (:data:`~anatomy_helpers.prediction.devices.DEVICES`: "t4", "l4", "a100-40", "a100-80",
    "h100", "h200"), "this GPU" (CUDA only), a total in bytes, or a :class:`~anatomy_helpers.prediction.devices.Device`.
    ``implementation`` is the optimizer's ("single", "foreach": torch's CUDA default, "fused"). Usable memory is the
    device's minus the CUDA context's share; the verdict replays the dry run's allocations through the caching-allocator
    simulator capped at it (see :class:`FitReport`). For a GPU named with its compute capability the phase needs follow
    CUDA's rules (:mod:`anatomy_helpers.prediction.cuda_rules`: cuBLAS workspaces added, dropout masks and autocast's
    softmax corrected; :class:`~anatomy_helpers.prediction.cuda_rules.CudaRuleError` where no rule is stated); a device
    given as a size keeps the CPU kernels'. Kernel scratch (attention kernels' scratch) is in neither: keep a margin.

    ``micro_batches=k`` (gradient accumulation, ``batch_size`` the global batch): the dry run runs the k
    micro-batches one by one, as ``track_steps(..., micro_batches=k)`` does (exact, see :func:`fit_run`).
    """
    request = FitRequest(cfg if cfg is not None else ModelConfig(), batch_size, **options)
    dev = request.check()
    return fit_run(request, dev, precision_note(request.cfg.dtype, request.autocast, dev))


#: How many dry runs (with their uncapped allocator replays) are kept for reuse. A dry run is deterministic (shapes
#: only), and the same one is asked for again and again: lesson 06's panel moved one notch and put back, the fix list
#: of a second device (every candidate but mixed precision is the same dry run), ``cheapest_fix`` after
#: ``will_it_fit``, ``combined`` after ``try_levers``. Bounded: GPT-2 small's two steps keep
#: about a MiB of records.
DRY_RUNS_KEPT = 32


#: Set to 1, every course-GPT prediction dry-runs the whole depth instead of extending depths 3, 4 and 5
#: (:func:`~anatomy_helpers.prediction.periodic.periodic_dry_run`): the baseline benchmarks/predict_time.py times
#: each case against, and the tests' full path. Unset (or 0): the periodic dry run where it applies.
FULL_DRY_RUN_ENV = "ANATOMY_FULL_DRY_RUN"


def full_dry_run_asked() -> bool:
    """Whether :data:`FULL_DRY_RUN_ENV` asks for the full-depth dry run; ValueError for a value other than 0 or 1."""
    value = os.environ.get(FULL_DRY_RUN_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{FULL_DRY_RUN_ENV} must be 0 or 1 (or unset), got {value!r}")
    return value == "1"


@functools.lru_cache(maxsize=DRY_RUNS_KEPT)
def _dry_run(
    fields: tuple,
    batch_size: int,
    optimizer: str,
    implementation: str,
    autocast: str | None,
    in_backward: bool,
    micro_batches: int,
    full: bool,
):
    foreach, fused = IMPLEMENTATION_FLAGS[implementation]
    cfg = ModelConfig(*fields)
    run = dict(
        optimizer=optimizer,
        foreach=foreach,
        fused=fused,
        batch_size=batch_size,
        autocast=autocast,
        in_backward=in_backward,
        micro_batches=micro_batches,
    )
    if full:
        trace, why = dry_run_config(cfg, **run), f"full dry run: {FULL_DRY_RUN_ENV}=1 asks for it"
    else:
        trace, why = periodic_dry_run(cfg, **run)
    return trace, replay(trace.allocation_record()), why


def dry_run_and_replay(
    cfg: ModelConfig,
    batch_size: int,
    optimizer: str,
    implementation: str,
    autocast: str | None,
    in_backward: bool = False,
    micro_batches: int = 1,
):
    """(the Trace of ``dry_run_config``, its uncapped allocator replay, why it ran at full depth: None where
    depths 3, 4 and 5 were extended) for two steps of ``cfg`` (``batch_size`` the global batch, in
    ``micro_batches`` micro-batches): the last :data:`DRY_RUNS_KEPT` are kept and given again (read them, do not
    change them).

    The Trace is :func:`~anatomy_helpers.prediction.periodic.periodic_dry_run`'s: deeper than 5 blocks, built from
    dry runs at depths 3, 4 and 5, the same bytes as the full-depth dry run (tests/test_periodic.py), and wall times
    spread evenly, not measured (nothing here reads them); where the step does not repeat block by block, or
    :data:`FULL_DRY_RUN_ENV` is 1, the full dry run's."""
    full = full_dry_run_asked()
    return _dry_run(astuple(cfg), batch_size, optimizer, implementation, autocast, in_backward, micro_batches, full)


def dry_run_text(n_layer: int, why: str | None) -> str:
    """Which dry run answered, in words: ``why`` is :func:`~anatomy_helpers.prediction.periodic.periodic_dry_run`'s
    (None: depths 3, 4 and 5 extended to ``n_layer`` blocks; else why it ran at full depth)."""
    if why is None:
        depths = ", ".join(map(str, DEPTHS))
        return f"depths {depths}, extended to {n_layer} blocks (exact: the same bytes as a full dry run)"
    return f"full depth ({why.removeprefix('full dry run: ')})"


def capped_replay(record, rep, limit: int) -> LimitReplay | None:
    """Where the caching-allocator simulator capped at ``limit`` bytes runs out replaying ``record`` (its
    :class:`~anatomy_helpers.prediction.allocator.LimitReplay`; step 0, phase "idle" when nothing is left for the
    step), or None if it passes. ``rep``: the uncapped replay of the same record."""
    if limit <= 0:
        return LimitReplay(limit, False, 0, 0, "idle", None, 0, 0, 0)
    if len(rep.reserved) and rep.reserved.max() <= limit:
        # The uncapped replay never reserves more than the cap, so the capped one never flushes its cache: the
        # same replay, which passes. (Replaying it again would give the same answer, at a cost.)
        return None
    capped = replay_with_limit(record, limit)
    return None if capped.passed else capped


def allocator_answer(record, rep, limit: int, allowance: int) -> tuple[LimitReplay | None, bool]:
    """(:func:`capped_replay` under ``limit``, whether its answer turns with ``allowance`` bytes more memory (a
    replay that runs out) or less (one that passes): too close to call)."""
    oom = capped_replay(record, rep, limit)
    if not allowance:
        return oom, False
    other = capped_replay(record, rep, limit + allowance if oom else limit - allowance)
    return oom, (other is None) != (oom is None)


def unapplied_workspaces(dev: Device) -> int:
    """The cuBLAS and cuBLASLt workspaces a step may hold where CUDA's rules are not applied (bytes, an upper bound):
    two of each, the forward's thread's and autograd's backward thread's (cuda_rules.cublas_workspaces,
    cublaslt_workspaces), cuBLAS's at Hopper's size where the capability is unknown (the largest)."""
    return 2 * (cublas_workspace_bytes(dev.capability or (9, 0)) + CUBLASLT_WORKSPACE)


def course_assumptions(cfg: ModelConfig, optimizer: str, autocast: str | None) -> tuple[str, ...]:
    """A course GPT step's assumptions, for its report: sequences, checkpointing, precision."""
    every = f" every {cfg.checkpoint_every}" if cfg.checkpoint == "every_k" else ""
    return (
        f"sequences: every row {cfg.seq_len} tokens, full length (the course GPT takes no padding or attention mask)",
        f"activation checkpointing: {cfg.checkpoint}{every}",
        f"precision: {cfg.dtype} weights and gradients, {f'{autocast} autocast' if autocast else 'no autocast'}, "
        f"{optimizer} state",
    )


def fit_run(request: FitRequest, dev: Device, note: str = "") -> FitReport:
    """The :class:`FitReport` of ``request`` on ``dev`` (its checked device), from its dry run
    (:func:`dry_run_and_replay`).

    Its ``dry_run`` says which dry run answered (:func:`dry_run_text`).

    ``micro_batches=k``: the dry run runs the global batch's k micro-batches one by one (forward and backward each,
    the gradients accumulated, then one optimizer step), as ``track_steps(..., micro_batches=k)`` does: exact, byte
    for byte (tests/test_prediction.py checks it against the real run); a phase's need is the highest of its k
    passes.
    """
    cfg, autocast = request.cfg, request.autocast
    trace, rep, why = dry_run_and_replay(
        cfg, request.batch_size, request.optimizer, request.implementation, autocast, request.in_backward,
        request.micro_batches,
    )  # fmt: skip
    label = request.label()
    limit = dev.usable
    corrections, series, sdpa = None, None, None
    if dev.capability is not None:  # a GPU we know: CUDA's rules (CudaRuleError where one cannot be stated)
        corrections = cuda_corrections(trace, cfg, autocast, dev)
        series = correction_series(trace, corrections)
        sdpa = sdpa_backend(cfg, autocast, dev.capability) if cfg.attn_impl == "sdpa" else None
        limit -= max(0, int(series.sum(axis=1).max()))  # the replay has no CUDA-only storages: keep them out
    workspace = 0 if corrections is not None else unapplied_workspaces(dev)
    allowance = assumed_bytes(dev.context, dev.context_measured, workspace)
    oom, close = allocator_answer(trace.allocation_record(), rep, limit, allowance)
    needs = phase_needs(trace, rep, series)
    rules = rules_text(corrections, sdpa, dev.capability) if corrections is not None else SIZE_ONLY_RULES
    return FitReport(
        label, dev.name, dev.total, dev.usable, needs, _where(oom), note, dev.context_note(), rules,
        course_assumptions(cfg, request.optimizer, autocast), workspace, oom, close, dev.total_note(),
        dry_run_text(cfg.n_layer, why),
    )  # fmt: skip


def _where(oom: LimitReplay | None) -> tuple[int, str] | None:
    return None if oom is None else (oom.step, oom.phase)


def trace_fit_report(
    trace: Trace,
    label: str,
    dev: Device,
    note: str = "",
    rules: str = CPU_RULES,
    assumptions: tuple[str, ...] = (),
    corrections: list | None = None,
) -> FitReport:
    """``trace`` (two steps: a dry run of one device's step, or of one rank's) replayed through the allocator
    simulator under ``dev``'s usable memory, as a :class:`FitReport` labelled ``label``, its phase needs following
    ``rules``, ``assumptions`` the step's. ``corrections`` (``cuda_rules.Correction``: a Hugging Face model's on
    one GPU, from ``hf_cuda_rules.hf_cuda_rules``) are added as :func:`fit_run` adds the course GPT's; without them
    (a rank's step, a device given by its size) the cuBLAS workspaces are not counted, and the margin says so."""
    record = trace.allocation_record()
    rep = replay(record)
    series = correction_series(trace, corrections) if corrections else None
    limit = dev.usable - (max(0, int(series.sum(axis=1).max())) if series is not None else 0)
    workspace = 0 if corrections else unapplied_workspaces(dev)
    allowance = assumed_bytes(dev.context, dev.context_measured, workspace)
    oom, close = allocator_answer(record, rep, limit, allowance)
    needs = phase_needs(trace, rep, series)
    return FitReport(
        label, dev.name, dev.total, dev.usable, needs, _where(oom), note, dev.context_note(), rules, assumptions,
        workspace, oom, close, dev.total_note(),
    )  # fmt: skip
