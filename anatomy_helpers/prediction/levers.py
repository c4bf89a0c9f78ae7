"""The one catalogue of levers, and the one way to verify and rank them: :func:`cheapest_fix` (lesson 06, the CLI's
``predict --fix``), :func:`verify_levers` (lesson 10) and the lesson's measured runs all take their levers from
:func:`levers`.

A lever is a change of the step (a model option, an optimizer, where the optimizer runs, how the batch is cut);
each lowers some categories of memory (``acts_on``) and costs something else: recomputed FLOPs (counted with
``FlopCounterMode``: :func:`~anatomy_helpers.prediction.flops.config_step_flops`) or a change of training
(:data:`EFFECTS`). Each candidate is verified by a dry run under the allocator simulator
(:func:`~anatomy_helpers.prediction.fit.fit_run`) and ranked by one key (:func:`rank_key`). The ranking rules:

* a step that already fits needs no change: :func:`cheapest_fix` ranks nothing (an empty list);
* a candidate that does not lower the step's peak of tensor bytes is dropped, whatever else it does;
* a recompute is counted in the extra FLOPs; a cost the count cannot see is not ranked as free: its extra FLOPs
  are unknown (None) and it ranks after every counted lever of the same effect. Two such: the element-wise ops
  that ``checkpoint=selective`` recomputes (``FlopCounterMode`` counts matrix multiplications and attention
  kernels only), and sdpa's attention on the CPU dry run (no formula for the CPU flash kernel);
* :func:`verify_levers`' dominant-category filter narrows only the levers that change training (numerics, the
  global batch, the optimizer): those are tried where they act on the category holding the peak. A lever that
  keeps the maths (effect "time only") costs nothing but time, so it is always tried, and kept where the dry run
  shows it lowers the peak (the step in backward and the fused optimizer on an optimizer-bound step, whose peak is
  the state's).

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..core.model import ModelConfig
from ..tracking.events import Peak
from ..tracking.trace import Trace
from .cuda_rules import CudaRuleError
from .devices import Device
from .fit import FitRequest, dry_run_and_replay, fit_run
from .fit_report import FitReport, PhaseNeed
from .flops import config_step_flops

#: What a lever changes, in the order the ranking prefers them: only the time a step takes (the same maths), the
#: numerics (16-bit matmuls, 16-bit state), the global batch (fewer sequences per optimizer step), the optimizer,
#: or which parameters train (a Hugging Face fine-tune made LoRA: distributed/hf_fit.py).
EFFECTS = ("time only", "numerics", "global batch", "optimizer", "trained parameters")
#: The step options a lever may set, besides ModelConfig fields (FitRequest's fields, and the optimizer's flags).
STEP_OPTIONS = ("optimizer", "fused", "foreach", "in_backward", "autocast", "micro_batches", "batch_size")
_ADAM = ("adam", "adamw")


@dataclass(frozen=True)
class Lever:
    """One change of the step and the categories it acts on.

    ``config``: ModelConfig fields it sets; ``step``: the step options it sets (:data:`STEP_OPTIONS`; lesson 10's
    own levers may set options of ``track_steps`` too, which only a real run takes). ``effect``: one of
    :data:`EFFECTS`. ``family``: levers of one family (2, 4, 8 micro-batches) are tried in order up to the first
    that fits, and only that one (or the last tried) is ranked. ``uncounted``: what it recomputes that
    ``FlopCounterMode`` cannot count ("" when everything is counted).
    """

    name: str
    acts_on: tuple[str, ...]  # the categories it shrinks
    effect: str
    note: str
    config: dict = field(default_factory=dict)
    step: dict = field(default_factory=dict)
    family: str = ""
    uncounted: str = ""

    def applies(self, cfg: ModelConfig, optimizer: str, step: dict) -> bool:
        """False where the configuration already does what the lever does (or the lever does not fit it).
        ``step``: the step's options (in_backward, fused, foreach, autocast, micro_batches)."""
        if any(getattr(cfg, k) == v for k, v in self.config.items()):
            return False
        if any(step.get(k) == v for k, v in self.step.items()):
            return False
        if ("optimizer" in self.step or "fused" in self.step) and optimizer not in _ADAM:
            return False  # the state levers replace Adam's two moments; torch fuses Adam(W) (and SGD: not offered)
        if "autocast" in self.step and (step.get("autocast") is not None or cfg.dtype != "float32"):
            return False  # mixed precision over fp32 master weights
        if "in_backward" in self.step and step.get("micro_batches", 1) > 1:
            return False  # the step in backward steps at every backward: no accumulation
        return not (self.step.get("fused") and step.get("in_backward"))

    def apply(self, request: FitRequest) -> FitRequest:
        """``request`` with this lever applied; ValueError naming an option only a real run takes."""
        changes = {"cfg": replace(request.cfg, **self.config)} if self.config else {}
        for key, value in self.step.items():
            if key == "fused":
                changes["implementation"] = "fused" if value else request.implementation
            elif key == "foreach":
                changes["implementation"] = "foreach" if value else "single"
            elif key in STEP_OPTIONS:
                changes[key] = value
            else:
                raise ValueError(f"lever {self.name!r}: a dry run has no option {key!r} (a real run's only)")
        if changes.get("optimizer") in ("adamw_bf16", "adamw8bit"):
            changes["implementation"] = "single"  # their one implementation
        return request.but(**changes)


def _mixed_precision(dev: Device | None) -> Lever:
    """Mixed precision for ``dev``: bf16 autocast from compute capability 8.0 on (or a device of unknown
    capability), fp16 autocast with a GradScaler below, as ``torch.cuda.is_bf16_supported`` draws the line."""
    if dev is None or dev.capability is None:  # a size alone: the CPU kernels' rules
        rules = "activations by CPU autocast's op lists (CUDA's runs softmax, log_softmax and layer_norm in fp32)"
    else:
        rules = "activations by CUDA autocast's op lists (softmax in fp32), from torch's source"
    if dev is not None and dev.mixed_precision == "float16":
        major, minor = dev.capability
        note = (
            f"no native bf16 on {dev.name} ({major}.{minor} < 8.0); fp32 master weights; {rules}; "
            "the scaler's state is a few scalars"
        )
        return Lever("fp16 autocast + GradScaler", ("activations",), "numerics", note, step={"autocast": "float16"})
    unsure = dev is None or dev.bf16_native is None
    unknown = " (bf16 needs compute capability >= 8.0; below: fp16 + GradScaler)" if unsure else ""
    note = f"fp32 master weights; {rules}{unknown}"
    return Lever("bf16 autocast", ("activations",), "numerics", note, step={"autocast": "bfloat16"})


def levers(
    cfg: ModelConfig, *, batch_size: int | None = None, micro_batches: int = 1, device: Device | None = None
) -> list[Lever]:
    """Every lever for ``cfg``, the one catalogue. With ``batch_size`` (the global batch, in ``micro_batches``
    micro-batches) also gradient accumulation (2m, 4m, ... micro-batches dividing it: the same global batch) and
    a smaller global batch (the same micro-batch sizes, not accumulated). ``device`` picks the mixed precision
    (bf16, or fp16 + GradScaler below compute capability 8.0). The chunked loss's chunk: a quarter of a sequence."""
    sdpa = "the CPU flash-attention kernel: FlopCounterMode has no formula for it"
    out = [Lever("sdpa attention", ("activations",), "time only", f"no s x s scores kept (FLOPs: {sdpa})",
                 {"attn_impl": "sdpa"}, uncounted=sdpa)]  # fmt: skip
    k = 2 * micro_batches
    while batch_size is not None and k <= batch_size:
        if batch_size % k == 0:
            note = "accumulated gradients and the whole batch's inputs added (upper bound); same global batch"
            name = f"micro-batch {batch_size // k} x {k} (accumulate)"
            out.append(Lever(name, ("activations", "temporaries"), "time only", note, step={"micro_batches": k},
                             family="micro-batches"))  # fmt: skip
        k *= 2
    k = 2 * micro_batches
    while batch_size is not None and k <= batch_size:
        if batch_size % k == 0:
            b = batch_size * micro_batches // k
            note = f"{k // micro_batches}x fewer sequences per step; the learning rate may need retuning"
            out.append(Lever(f"batch {b} (smaller global batch)", ("activations", "temporaries"), "global batch",
                             note, step={"batch_size": b}, family="smaller batch"))  # fmt: skip
        k *= 2
    scores_kept = cfg.attn_impl == "manual" or cfg.dropout > 0  # sdpa without dropout keeps no s^2 scores
    if scores_kept:
        out.append(Lever("checkpoint=attention", ("activations",), "time only", "the attention core recomputed in "
                         "backward", {"checkpoint": "attention"}))  # fmt: skip
    uncounted = "element-wise ops: FlopCounterMode counts none"
    out += [
        Lever(
            "checkpoint=selective",
            ("activations",),
            "time only",
            f"element-wise ops recomputed in backward ({uncounted})",
            {"checkpoint": "selective"},
            uncounted=uncounted,
        ),  # fmt: skip
        Lever(
            "checkpoint=full", ("activations",), "time only", "blocks recomputed in backward", {"checkpoint": "full"}
        ),
        Lever(
            "fused optimizer",
            ("temporaries",),
            "time only",
            "no optimizer temporaries; same maths",
            step={"fused": True},
        ),
        Lever(
            "optimizer step in backward",
            ("gradients",),
            "time only",
            "each gradient freed once its parameter is stepped; no global-norm clipping, no accumulation",
            step={"in_backward": True},
        ),
        Lever(
            f"chunked loss ({max(1, cfg.seq_len // 4)} tokens)",
            ("activations", "temporaries"),
            "time only",
            "the LM head and the loss per chunk, recomputed in backward: logits of one chunk alive",
            config={"loss_chunk": max(1, cfg.seq_len // 4)},
        ),
        Lever(
            "bf16 optimizer state",
            ("optimizer_state",),
            "numerics",
            "Adam's moments stored in bf16: 4 instead of 8 bytes per parameter; loop implementation",
            step={"optimizer": "adamw_bf16"},
        ),
        Lever(
            "SGD with momentum",
            ("optimizer_state",),
            "optimizer",
            "one state buffer instead of two: another optimizer",
            step={"optimizer": "momentum"},
        ),  # fmt: skip
        _mixed_precision(device),
    ]
    return out


@dataclass(frozen=True)
class Fix:
    """One candidate change, verified by a dry run, and what it costs."""

    name: str
    report: FitReport
    extra_flops: float | None  # FLOPs per sequence trained relative to the original, minus 1; None: not counted
    effect: str  # one of EFFECTS: what the change does to training besides its memory
    note: str
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step
    lever: Lever | None = None  # the catalogue's lever (None for a Hugging Face fine-tune's own candidates)

    @property
    def fits(self) -> bool:
        return self.report.fits

    @property
    def changes_training(self) -> bool:
        """True when the training itself changes (numerics, global batch, optimizer), not only its cost."""
        return self.effect != "time only"


def rank_key(fix: Fix) -> tuple:
    """The one sort key of every ranking: what fits first; then what keeps training as it was, at any FLOP cost (a
    numerics change is not free); then the extra FLOPs (a recompute the count cannot see after every counted one);
    fewer micro-batches at equal FLOPs (small matrix multiplications use a GPU less well); then the peak left."""
    flops = math.inf if fix.extra_flops is None else round(fix.extra_flops, 3)
    return (not fix.fits, EFFECTS.index(fix.effect), flops, fix.micro_batches, fix.report.peak.tensors)


def ranked(fixes: list[Fix], base: FitReport) -> list[Fix]:
    """``fixes`` that lower ``base``'s peak of tensor bytes, sorted by :func:`rank_key` (those that save nothing
    are dropped, whatever else they do)."""
    return sorted((f for f in fixes if f.report.peak.tensors < base.peak.tensors), key=rank_key)


def _options(request: FitRequest) -> dict:
    impl = request.implementation
    return dict(in_backward=request.in_backward, fused=impl == "fused" or None, foreach=impl == "foreach",
                autocast=request.autocast, micro_batches=request.micro_batches)  # fmt: skip


def try_levers(request: FitRequest, dev: Device, candidates: list[Lever], keep=lambda lever: True) -> list[Fix]:
    """Each lever of ``candidates`` that applies to ``request`` (and that ``keep`` keeps) dry-run on ``dev``, in
    order; of a family, those up to the first that fits, and only the last tried is returned. A lever whose memory
    on ``dev`` no CUDA rule states (:class:`~anatomy_helpers.prediction.cuda_rules.CudaRuleError`) is left out,
    not guessed."""
    cfg, options = request.cfg, _options(request)
    base_flops = config_step_flops(cfg, request.batch_size)
    out, family = [], {}
    for lever in candidates:
        if not lever.applies(cfg, request.optimizer, options) or not keep(lever):
            continue
        if lever.family and family.get(lever.family) is not None and family[lever.family].fits:
            continue
        new = lever.apply(request)
        try:
            report = fit_run(new, dev)
        except CudaRuleError:  # no CUDA rule states this candidate's memory on dev: not offered rather than guessed
            continue
        extra = None if lever.uncounted else config_step_flops(new.cfg, request.batch_size) / base_flops - 1
        fix = Fix(lever.name, report, extra, lever.effect, lever.note, new.micro_batches, lever)
        if lever.family:
            if lever.family in family:
                out.remove(family[lever.family])
            family[lever.family] = fix
        out.append(fix)
    return out


def dominant(trace: Trace) -> tuple[Peak, str]:
    """The trace's peak (its phase: ``peak.phase``) and the category holding the most bytes there."""
    peak = trace.peak()
    return peak, max(peak.breakdown, key=peak.breakdown.get)


@dataclass(frozen=True)
class Verified:
    """A lever dry-run (its :class:`Fix`): the peak before and after (tensor bytes, the phase holding it), and what
    it costs."""

    lever: Lever
    before: PhaseNeed
    fix: Fix

    @property
    def after(self) -> PhaseNeed:
        return self.fix.report.peak

    @property
    def extra_flops(self) -> float | None:
        return self.fix.extra_flops

    @property
    def saved(self) -> int:
        return self.before.tensors - self.after.tensors


#: verify_levers' device: a size no step of a lesson reaches (so "fits" is "lowers the peak"; CPU kernels' rules).
UNBOUNDED = 2**50


def verify_levers(
    cfg: ModelConfig, batch_size: int = 8, optimizer: str = "adamw", *, only_dominant: bool = True, **step
) -> tuple[Trace, str, list[Verified]]:
    """Dry-run ``cfg`` as given, then each lever of the catalogue (:func:`levers`, with ``batch_size``: micro-batches
    and a smaller batch too); returns (the trace, the dominant category at its peak, the verified levers that lower
    the peak, ranked by :func:`rank_key`, as :func:`cheapest_fix` ranks).

    ``only_dominant``: a lever that changes training is tried only where it acts on the dominant category; a lever
    that keeps the maths is always tried (see the module's ranking rules); ``False`` tries every lever.
    ``step``: ``in_backward``, ``fused``, ``foreach``, ``autocast`` of the original (the optimizer: torch's default
    on a CPU, single-tensor, unless ``fused`` or ``foreach``).
    """
    impl = "fused" if step.pop("fused", None) else "foreach" if step.pop("foreach", None) else "single"
    request = FitRequest(cfg, batch_size, optimizer=optimizer, implementation=impl, device=UNBOUNDED, **step)
    dev = request.check()
    trace, _ = dry_run_and_replay(cfg, batch_size, optimizer, impl, request.autocast, request.in_backward)
    _, category = dominant(trace)
    base = fit_run(request, dev)

    def keep(lever: Lever) -> bool:
        return not only_dominant or lever.effect == "time only" or category in lever.acts_on

    fixes = ranked(try_levers(request, dev, levers(cfg, batch_size=batch_size), keep), base)
    return trace, category, [Verified(f.lever, base.peak, f) for f in fixes]
