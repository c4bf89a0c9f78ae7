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
  are unknown (None) and it ranks after every counted lever of the same effect. One such: the element-wise ops
  that ``checkpoint=selective`` recomputes (``FlopCounterMode`` counts matrix multiplications and attention
  kernels only; sdpa's is counted, the CPU flash kernel included: ``training.step.flop_counter``);
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
from .hf_fixes import LORA_RANK
from .recipes import REFUSED, device_recipe

#: What a lever changes, in the order the ranking prefers them: only the time a step takes (the same update, up to
#: floating-point rounding), the numerics (16-bit matmuls, 16-bit state), the global batch (fewer sequences per
#: optimizer step), the optimizer,
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
    fine_tune: dict = field(default_factory=dict)  # on a Hugging Face fine-tune: FineTune fields, world_size, zero
    not_for_fine_tune: str = ""  # why a fine-tune's dry run cannot take it ("": it takes ``fine_tune``)

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


def _accumulation(batch_size: int | None, micro_batches: int) -> list[Lever]:
    """Gradient accumulation (2m, 4m, ... micro-batches dividing ``batch_size``: the same global batch), then a
    smaller global batch (the same micro-batch sizes, not accumulated): the course GPT's and a fine-tune's (both
    dry runs run the micro-batches one by one)."""
    out = []
    k = 2 * micro_batches
    while batch_size is not None and k <= batch_size:
        if batch_size % k == 0:
            note = "micro-batches dry-run one by one; same global batch"
            name = f"micro-batch {batch_size // k} x {k} (accumulate)"
            out.append(Lever(name, ("activations", "temporaries"), "time only", note, step={"micro_batches": k},
                             family="micro-batches", fine_tune={"micro_batches": k}))  # fmt: skip
        k *= 2
    k = 2 * micro_batches
    while batch_size is not None and k <= batch_size:
        if batch_size % k == 0:
            b = batch_size * micro_batches // k
            note = f"{k // micro_batches}x fewer sequences per step; the learning rate may need retuning"
            ft = {"batch_size": b} if b % micro_batches == 0 else {}
            why = "" if ft else f"{micro_batches} micro-batches do not divide {b}"
            out.append(Lever(f"batch {b} (smaller global batch)", ("activations", "temporaries"), "global batch",
                             note, step={"batch_size": b}, family="smaller batch", fine_tune=ft,
                             not_for_fine_tune=why))  # fmt: skip
        k *= 2
    return out


#: Blocks (a fine-tune's decoder layers: transformers' gradient_checkpointing_enable) recomputed in backward.
CHECKPOINT_FULL = Lever("checkpoint=full", ("activations",), "time only", "blocks recomputed in backward",
                        {"checkpoint": "full"}, fine_tune={"gradient_checkpointing": True})  # fmt: skip
FUSED = Lever("fused optimizer", ("temporaries",), "time only", "no optimizer temporaries; same update up to rounding",
              step={"fused": True}, fine_tune={"fused": True, "foreach": None})  # fmt: skip
MOMENTUM = Lever("SGD with momentum", ("optimizer_state",), "optimizer", "one state buffer instead of two: another "
                 "optimizer", step={"optimizer": "momentum"}, fine_tune={"optimizer": "momentum"})  # fmt: skip


def _chunked_loss(chunk: int) -> Lever:
    return Lever(f"chunked loss ({chunk} tokens)", ("activations", "temporaries"), "time only",
                 "the LM head and the loss per chunk, recomputed in backward: logits of one chunk alive",
                 config={"loss_chunk": chunk}, not_for_fine_tune="transformers' causal-LM loss takes the whole "
                 "logits (its forward makes them before the loss): no chunked loss to switch on")  # fmt: skip


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
        return Lever("fp16 autocast + GradScaler", ("activations",), "numerics", note, step={"autocast": "float16"},
                     fine_tune={"autocast": "float16"})  # fmt: skip
    unsure = dev is None or dev.bf16_native is None
    unknown = " (bf16 needs compute capability >= 8.0; below: fp16 + GradScaler)" if unsure else ""
    note = f"fp32 master weights; {rules}{unknown}"
    return Lever("bf16 autocast", ("activations",), "numerics", note, step={"autocast": "bfloat16"},
                 fine_tune={"autocast": "bfloat16"})  # fmt: skip


def levers(
    cfg: ModelConfig, *, batch_size: int | None = None, micro_batches: int = 1, device: Device | None = None
) -> list[Lever]:
    """Every lever for ``cfg``, the one catalogue. With ``batch_size`` (the global batch, in ``micro_batches``
    micro-batches) also gradient accumulation (2m, 4m, ... micro-batches dividing it: the same global batch) and
    a smaller global batch (the same micro-batch sizes, not accumulated). ``device`` picks the mixed precision
    (bf16, or fp16 + GradScaler below compute capability 8.0). The chunked loss's chunk: a quarter of a sequence."""
    out = [Lever("sdpa attention", ("activations",), "time only", "no s x s scores kept (backward recomputes them)",
                 {"attn_impl": "sdpa"})]  # fmt: skip
    out += _accumulation(batch_size, micro_batches)
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
        CHECKPOINT_FULL,
        FUSED,
        Lever(
            "optimizer step in backward",
            ("gradients",),
            "time only",
            "each gradient freed once its parameter is stepped; no global-norm clipping, no accumulation",
            step={"in_backward": True},
        ),
        _chunked_loss(max(1, cfg.seq_len // 4)),
        Lever(
            "bf16 optimizer state",
            ("optimizer_state",),
            "numerics",
            "Adam's moments stored in bf16: 4 instead of 8 bytes per parameter; loop implementation",
            step={"optimizer": "adamw_bf16"},
        ),
        MOMENTUM,
        _mixed_precision(device),
    ]
    return out


@dataclass(frozen=True)
class Setup:
    """A Hugging Face fine-tune as the fix search changes it: its ``FineTune`` (prediction/hf_step.py), the
    data-parallel world size and ZeRO stage (None: plain DDP, or one device)."""

    fine_tune: object
    world_size: int = 1
    zero: int | None = None

    def but(self, lever: Lever) -> Setup | None:
        """This setup with ``lever``'s fine-tune changes, or None where the lever cannot apply or changes nothing
        (it is not for fine-tunes, fused needs Adam(W), autocast needs fp32 weights without autocast, the
        micro-batches must divide the batch, or the FineTune refuses the combination)."""
        if lever.not_for_fine_tune or not lever.fine_tune:
            return None
        ft = self.fine_tune
        ranks = {k: v for k, v in lever.fine_tune.items() if k in ("world_size", "zero")}
        fields = {k: v for k, v in lever.fine_tune.items() if k not in ranks}
        if all(getattr(ft, k) == v for k, v in fields.items()) and all(getattr(self, k) == v for k, v in ranks.items()):
            return None
        if "fused" in fields and ft.optimizer not in _ADAM:
            return None
        if "autocast" in fields and "dtype" not in fields and (ft.autocast is not None or ft.dtype != "float32"):
            return None  # mixed precision over fp32 master weights
        try:
            return replace(self, fine_tune=replace(ft, **fields), **ranks)
        except ValueError:  # e.g. micro-batches that do not divide the batch
            return None


def fine_tune_levers(ft, device: Device, world_size: int = 1, zero: int | None = None) -> list[Lever]:
    """Every lever for a Hugging Face fine-tune ``ft`` (prediction/hf_step.FineTune) on ``device``, from the one
    catalogue: the levers it shares with the course GPT (:func:`levers`: accumulation, a smaller batch, checkpointing,
    the fused optimizer, the chunked loss (refused: ``not_for_fine_tune``), mixed precision, SGD with momentum) and
    a fine-tune's own (16-bit weights or base as the device runs them, 8-bit AdamW and QLoRA (refused by name),
    shorter sequences, LoRA or a smaller LoRA, a higher ZeRO stage with ``world_size > 1``), sorted by
    :data:`EFFECTS` (stable: within an effect, the catalogue's order, no-FLOP levers before recomputation)."""
    states = ("parameters", "gradients", "optimizer_state")
    accumulation = _accumulation(ft.batch_size, ft.micro_batches)
    out = [lv for lv in accumulation if lv.family == "micro-batches"]
    out += [FUSED, CHECKPOINT_FULL]
    for stage in range((zero or 0) + 1, 4) if world_size > 1 else ():
        note = "shards more of the model states across the ranks: more communication"
        out.append(Lever(f"ZeRO-{stage}", states, "time only", note, fine_tune={"zero": stage}))
    out += [_chunked_loss(max(1, ft.seq_len // 4)), _mixed_precision(device)]
    lora_dtype, lora_autocast, _ = device_recipe("lora", device)
    if ft.method == "lora":
        name = "bf16 frozen base" if lora_dtype == "bfloat16" else "fp16 frozen base + fp16 autocast"
        out.append(Lever(name, ("parameters",), "numerics", "the frozen base in 16 bits (2 B per parameter); "
                         "fp32 adapters", fine_tune={"dtype": lora_dtype, "autocast": lora_autocast}))  # fmt: skip
    elif device.mixed_precision == "bfloat16":
        pure = {"dtype": "bfloat16", "autocast": None}
        out.append(Lever("pure bf16 weights", states, "numerics", "weights, gradients and AdamW state in bf16: 8 "
                         "instead of 16 B per parameter", fine_tune=pure))  # fmt: skip
    else:
        out.append(Lever("pure fp16 weights", states, "numerics", "", not_for_fine_tune="a GradScaler refuses fp16 "
                         "gradients: fp16 training keeps fp32 master weights"))  # fmt: skip
    eight = {"optimizer": "adamw8bit", "foreach": None, "fused": None}
    out += [
        Lever(
            "8-bit AdamW",
            ("optimizer_state",),
            "numerics",
            "",
            fine_tune=eight,
            not_for_fine_tune=REFUSED["adamw-8bit"],
        ),  # fmt: skip
        Lever("QLoRA (4-bit base)", ("parameters",), "numerics", "", not_for_fine_tune=REFUSED["qlora"]),
        MOMENTUM,
    ]
    out += [lv for lv in accumulation if lv.family == "smaller batch"]
    for k in (2, 4):
        if ft.seq_len // k >= 1:
            out.append(Lever(f"sequences of {ft.seq_len // k} tokens", ("activations", "temporaries"), "global batch",
                             f"{k}x fewer tokens per sequence: the data cut shorter", family="shorter sequences",
                             fine_tune={"seq_len": ft.seq_len // k}))  # fmt: skip
    if ft.method != "lora":
        lora = {"method": "lora", "freeze": (), "lora_rank": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
                "lora_targets": "all-linear", "dtype": lora_dtype, "autocast": lora_autocast}  # fmt: skip
        note = "trains adapters on all linear layers, the base frozen in 16 bits: another fine-tune"
        out.append(Lever(f"LoRA r={LORA_RANK}", states, "trained parameters", note, fine_tune=lora))
    else:
        for k in (2, 4):
            if ft.lora_rank // k >= 1:
                out.append(Lever(f"LoRA r={ft.lora_rank // k}", states, "trained parameters", "smaller adapters",
                                 family="LoRA rank", fine_tune={"lora_rank": ft.lora_rank // k,
                                                                "lora_alpha": ft.lora_alpha // k or 1}))  # fmt: skip
        qv = ("q_proj", "v_proj")
        if ft.lora_targets != qv:
            out.append(Lever("LoRA on q_proj, v_proj", states, "trained parameters", "adapters on two projections",
                             fine_tune={"lora_targets": qv}))  # fmt: skip
    return sorted(out, key=lambda lv: EFFECTS.index(lv.effect))


@dataclass(frozen=True)
class Fix:
    """One candidate change, verified by a dry run, and what it costs."""

    name: str
    report: FitReport
    extra_flops: float | None  # FLOPs per sequence trained relative to the original, minus 1; None: not counted
    effect: str  # one of EFFECTS: what the change does to training besides its memory
    note: str
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step
    lever: Lever | None = None  # the catalogue's lever (None for a combination of levers)
    setup: Setup | None = None  # a Hugging Face fine-tune's: the setup the change makes (distributed/hf_fit.py)

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


def combined(request: FitRequest, dev: Device, candidates: list[Lever]) -> Fix | None:
    """A combination of ``candidates`` that fits where no one lever does: levers taken in :data:`EFFECTS` order
    (stable: the catalogue's order within an effect), each kept only where its dry run lowers the peak (a lever of
    a family replaces its family's), until the step fits; then each kept lever, the last first, dropped if the rest
    still fits. Every candidate is a dry run (:func:`~anatomy_helpers.prediction.fit.fit_run`, kept for reuse).
    None if even every lever together does not fit."""

    def run(chosen: list[Lever]):
        new = request
        for lever in chosen:
            if not lever.applies(new.cfg, new.optimizer, _options(new)):
                return None
            new = lever.apply(new)
        try:
            return new, fit_run(new, dev)
        except CudaRuleError:  # no CUDA rule states its memory on dev: not offered rather than guessed
            return None

    chosen: list[Lever] = []
    best = fit_run(request, dev)
    for lever in sorted(candidates, key=lambda lv: EFFECTS.index(lv.effect)):
        trial = [lv for lv in chosen if not (lever.family and lv.family == lever.family)] + [lever]
        out = run(trial)
        if out is None or out[1].peak.tensors >= best.peak.tensors:
            continue  # saves nothing: dropped
        chosen, best = trial, out[1]
        if best.fits:
            break
    if not best.fits:
        return None
    for lever in reversed(list(chosen)):
        out = run([lv for lv in chosen if lv is not lever])
        if out is not None and out[1].fits:
            chosen = [lv for lv in chosen if lv is not lever]
    new, report = run(chosen)
    uncounted = any(lv.uncounted for lv in chosen)
    base_flops = config_step_flops(request.cfg, request.batch_size)
    extra = None if uncounted else config_step_flops(new.cfg, request.batch_size) / base_flops - 1
    effect = max((lv.effect for lv in chosen), key=EFFECTS.index)
    note = "; ".join(lv.note for lv in chosen)
    return Fix(" + ".join(lv.name for lv in chosen), report, extra, effect, note, new.micro_batches)


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
    cfg: ModelConfig,
    batch_size: int = 8,
    optimizer: str = "adamw",
    *,
    only_dominant: bool = True,
    device: str | Device | int | None = None,
    **step,
) -> tuple[Trace, str, list[Verified]]:
    """Dry-run ``cfg`` as given, then each lever of the catalogue (:func:`levers`, with ``batch_size``: micro-batches
    and a smaller batch too); returns (the trace, the dominant category at its peak, the verified levers that lower
    the peak, ranked by :func:`rank_key`, as :func:`cheapest_fix` ranks).

    ``only_dominant``: a lever that changes training is tried only where it acts on the dominant category; a lever
    that keeps the maths is always tried (see the module's ranking rules); ``False`` tries every lever.
    ``device``: a GPU's short name, a :class:`~anatomy_helpers.prediction.devices.Device` or a size in bytes: each
    lever is judged on it (its CUDA rules, its usable memory), so what fits ranks first and a step that already fits
    there ranks nothing, as :func:`cheapest_fix`; None (the default) is a size no lesson's step reaches, on CPU
    kernels' rules, so every lever that lowers the peak is listed by its cost.
    ``step``: ``in_backward``, ``fused``, ``foreach``, ``autocast`` of the original (the optimizer: torch's default
    on a CPU, single-tensor, unless ``fused`` or ``foreach``).
    """
    impl = "fused" if step.pop("fused", None) else "foreach" if step.pop("foreach", None) else "single"
    capped = device is not None
    request = FitRequest(
        cfg, batch_size, optimizer=optimizer, implementation=impl, device=device if capped else UNBOUNDED, **step
    )
    dev = request.check()
    trace, _, _ = dry_run_and_replay(
        cfg, batch_size, optimizer, impl, request.autocast, request.in_backward, request.micro_batches
    )
    _, category = dominant(trace)
    base = fit_run(request, dev)
    if capped and base.fits:
        return trace, category, []  # it already fits on ``device``: nothing to rank

    def keep(lever: Lever) -> bool:
        return not only_dominant or lever.effect == "time only" or category in lever.acts_on

    catalogue = levers(cfg, batch_size=batch_size, micro_batches=request.micro_batches, device=dev if capped else None)
    fixes = ranked(try_levers(request, dev, catalogue, keep), base)
    return trace, category, [Verified(f.lever, base.peak, f) for f in fixes]
