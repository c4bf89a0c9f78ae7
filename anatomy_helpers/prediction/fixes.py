"""The cheapest fix for a training step that does not fit: candidate changes, each verified by a dry run under the
same capped allocator simulator as :func:`anatomy_helpers.prediction.fit.will_it_fit`, and ranked by whether they fit,
what they change in training (:data:`EFFECTS`) and their extra FLOPs. Lesson 06 and the CLI's ``predict --fix``.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, replace

from torch._subclasses.fake_tensor import FakeTensorMode

from ..checks import one_of
from ..model import GPT, ModelConfig
from ..step import AUTOCAST_CHOICES, step_flops
from ..tables import Col, format_table
from ..units import pick_unit
from .cuda_rules import CudaRuleError
from .devices import Device
from .dryrun import build_fake_model, course_batch
from .fit import FitReport, FitRequest, fit_run


@functools.lru_cache(maxsize=64)  # bounded: one entry per configuration counted, a few bytes each
def _flops_of(fields: tuple, batch_size: int) -> int:
    cfg = ModelConfig(*fields)
    mode = FakeTensorMode()
    model = build_fake_model(lambda: GPT(cfg), mode)
    with mode:
        return step_flops(model, *course_batch(batch_size, cfg.seq_len))


def config_step_flops(cfg: ModelConfig, batch_size: int, autocast: str | None = None) -> int:
    """FLOPs of one forward + backward of ``cfg`` at ``batch_size``: :func:`~anatomy_helpers.step.step_flops` of
    the model built on fake tensors (no memory, any size): checkpointing's recomputation is counted, the optimizer
    (element-wise, a few FLOPs per parameter) is not; nor are element-wise ops (what "selective" recomputes).

    ``autocast`` changes no count: autocast casts the inputs of the same ops, and every formula in torch's
    ``flop_counter.py`` reads shapes only (tests/test_prediction.py checks it). So it is not counted again.
    Nor is every layer: the blocks are identical (same shapes, same policy per block), so the count is
    ``F(1) + (L - 1) * (F(2) - F(1))``, from models of one and two blocks; exact (tested against the full count).
    ``every_k`` checkpointing groups blocks into segments, so it is counted whole.
    """
    one_of("autocast", autocast, AUTOCAST_CHOICES)
    if cfg.n_layer <= 2 or cfg.checkpoint == "every_k":
        return _flops_of(dataclasses.astuple(cfg), batch_size)
    one, two = (_flops_of(dataclasses.astuple(replace(cfg, n_layer=n)), batch_size) for n in (1, 2))
    return one + (cfg.n_layer - 1) * (two - one)


#: What a fix changes, in the order the ranking prefers them: only the time a step takes (the same maths), the
#: numerics (16-bit matmuls), the global batch (fewer sequences per optimizer step), the optimizer, or which
#: parameters train (a Hugging Face fine-tune made LoRA: hf_fixes.py).
EFFECTS = ("time only", "numerics", "global batch", "optimizer", "trained parameters")


@dataclass(frozen=True)
class Fix:
    """One candidate change, verified by a dry run, and what it costs."""

    name: str
    report: FitReport
    extra_flops: float  # matmul FLOPs per sequence trained relative to the original, minus 1 (0.33 = a third more)
    effect: str  # one of EFFECTS: what the change does to training besides its memory
    note: str
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step

    @property
    def fits(self) -> bool:
        return self.report.fits

    @property
    def changes_training(self) -> bool:
        """True when the training itself changes (numerics, global batch, optimizer), not only its cost."""
        return self.effect != "time only"


def _fix_sort_key(fix: Fix):
    # what fits first; then what keeps training as it was, at any FLOP cost (a numerics change is not free); then
    # the extra FLOPs; fewer micro-batches at equal FLOPs (small matrix multiplications use a GPU less well)
    flops = round(fix.extra_flops, 3)
    return (not fix.fits, EFFECTS.index(fix.effect), flops, fix.micro_batches, fix.report.peak.tensors)


def cheapest_fix(cfg: ModelConfig | None = None, batch_size: int = 8, **options) -> list[Fix]:
    """Candidate changes that lower the peak, each checked by another dry run, ranked: the ones that fit first,
    then by what they change (:data:`EFFECTS`: time only, then numerics, global batch, optimizer), then by extra
    FLOPs (measured with ``FlopCounterMode``). ``options``: the other fields of
    :class:`~anatomy_helpers.prediction.fit.FitRequest`, by keyword, as for ``will_it_fit``.

    * **Micro-batches with gradient accumulation** (time only: the global batch is kept; 2, 4, 8, ... dividing
      the batch, up to the first that fits): ``dry_run_config`` has no micro-batches, so we dry-run the smaller
      batch and add the whole gradient bytes to its forward and backward, and the rest of the global batch's
      inputs (``track_steps`` slices micro-batches out of it) to every phase: an upper bound (from the second
      micro-batch on, the accumulated gradients are alive throughout; tests/test_prediction.py checks it against
      ``track_steps(micro_batches=k)``); the same FLOPs per global batch (smaller matrix multiplications run less
      efficiently: a time cost FLOPs do not show);
    * **A smaller global batch** (the same dry run as the micro-batch's, without accumulation: changes the
      global batch);
    * **Activation checkpointing** (time only): "attention" (only where the ``s^2`` scores are kept),
      "selective", "full";
    * **The fused optimizer** (time only: no temporaries, the same maths) and **SGD with momentum** (half of
      Adam's state: another optimizer);
    * **Lesson 10's levers**: the optimizer step fused into backward (time only), the chunked loss (time only,
      its recomputed head matmul counted), bf16 optimizer state (numerics), see :func:`_add_lesson10_levers`;
    * **Mixed precision** (numerics): bf16 autocast where the device has native bf16 (compute capability 8.0 and
      up); on a T4 (7.5) fp16 autocast with a GradScaler instead, as ``torch.cuda.is_bf16_supported`` draws the
      line. The fp32 parameters stay the master weights. Pure 16-bit parameters with a separate fp32 master copy
      need a custom optimizer, which ``dry_run_config`` cannot build: not offered.

    With ``micro_batches=m`` the configuration already accumulates: every candidate keeps it, and the
    accumulation candidates try 2m, 4m, ... micro-batches. A candidate whose memory on ``device`` no CUDA rule
    states (:class:`~anatomy_helpers.prediction.cuda_rules.CudaRuleError`) is left out, not guessed.
    """
    request = FitRequest(cfg if cfg is not None else ModelConfig(), batch_size, **options)
    dev = request.check()
    cfg, m = request.cfg, request.micro_batches
    optimizer, implementation, autocast = request.optimizer, request.implementation, request.autocast
    base_flops = config_step_flops(cfg, batch_size)
    fixes = []

    def candidate(name, effect, note, new_cfg=cfg, b=batch_size, micro=m, flops=None, **over):
        report = fit_run(request.but(cfg=new_cfg, batch_size=b, micro_batches=micro, **over), dev)
        flops = config_step_flops(new_cfg, b) * batch_size // b if flops is None else flops  # per global batch
        return Fix(name, report, flops / base_flops - 1, effect, note, micro)

    def add(*args, **kwargs):
        try:
            fixes.append(candidate(*args, **kwargs))
        except CudaRuleError:  # no CUDA rule states this candidate's memory on dev: not offered rather than guessed
            pass

    # Micro-batches and smaller batches: FLOPs per sequence do not change (every FLOP formula is linear in the
    # batch), so they are not counted again.
    k, tried = 2 * m, []
    while k <= batch_size and not request.in_backward and not any(f.fits for f in fixes):  # the fewest that fit
        if batch_size % k == 0:
            tried.append(k)
            note = "accumulated gradients and the whole batch's inputs added (upper bound); same global batch"
            add(f"micro-batch {batch_size // k} x {k} (accumulate)", "time only", note, micro=k, flops=base_flops)
        k *= 2
    smaller = None  # one smaller global batch, in m micro-batches: the largest that fits, from the same dry runs
    for k in tried:
        b = batch_size * m // k
        note = f"{k // m}x fewer sequences per step; the learning rate may need retuning"
        smaller = candidate(f"batch {b} (smaller global batch)", "global batch", note, b=b, flops=base_flops)
        if smaller.fits:
            break
    if smaller is not None:
        fixes.append(smaller)
    scores_kept = cfg.attn_impl == "manual" or cfg.dropout > 0  # sdpa without dropout keeps no s^2 scores
    for policy in ("attention", "selective", "full") if scores_kept else ("selective", "full"):
        if cfg.checkpoint != policy:
            note = "recomputes in backward" + (
                " (element-wise ops: not in the FLOP count)" if policy == "selective" else ""
            )
            add(f"checkpoint={policy}", "time only", note, new_cfg=replace(cfg, checkpoint=policy))
    if implementation != "fused" and optimizer in ("adam", "adamw"):
        note = "no optimizer temporaries; same maths"
        add("fused optimizer", "time only", note, implementation="fused", flops=base_flops)
    if optimizer in ("adam", "adamw"):
        note = "one state buffer instead of two: another optimizer"
        add("SGD with momentum", "optimizer", note, optimizer="momentum", flops=base_flops)
    _add_lesson10_levers(add, cfg, request, base_flops)
    if autocast is None and cfg.dtype == "float32":
        add(*_mixed_precision(dev), autocast=dev.mixed_precision, flops=base_flops)
    return sorted(fixes, key=_fix_sort_key)


def _add_lesson10_levers(add, cfg: ModelConfig, request: FitRequest, base_flops: int) -> None:
    """Lesson 10's levers as candidates: the optimizer step in backward (time only: each gradient freed once its
    parameter is stepped; not with accumulation), the chunked loss (time only: the head's matmul recomputed,
    counted in its FLOPs) and bf16 optimizer state (numerics: Adam's moments rounded to bf16)."""
    if not request.in_backward and request.micro_batches == 1:
        note = "each gradient freed once stepped; no global-norm clipping, no accumulation"
        add("optimizer step in backward", "time only", note, in_backward=True, flops=base_flops)
    if cfg.loss_chunk is None:
        chunk = max(1, cfg.seq_len // 4)
        note = "LM head + loss per chunk, recomputed in backward: one chunk's logits alive"
        add(f"chunked loss ({chunk} tokens)", "time only", note, new_cfg=replace(cfg, loss_chunk=chunk))
    if request.optimizer in ("adam", "adamw"):
        note = "Adam's moments stored in bf16 (4 instead of 8 B/param); loop implementation"
        add("bf16 optimizer state", "numerics", note, optimizer="adamw_bf16", implementation="single", flops=base_flops)


def _mixed_precision(dev: Device) -> tuple[str, str, str]:
    """The mixed-precision candidate for ``dev``: its name, effect and note."""
    if dev.capability is None:  # a size alone: the CPU kernels' rules
        rules = "activations by CPU autocast's op lists (CUDA's runs softmax, log_softmax and layer_norm in fp32)"
    else:
        rules = "activations by CUDA autocast's op lists (softmax in fp32), from torch's source"
    if dev.mixed_precision == "float16":
        major, minor = dev.capability
        return (
            "fp16 autocast + GradScaler",
            "numerics",
            f"no native bf16 on {dev.name} ({major}.{minor} < 8.0); fp32 master weights; {rules}; "
            "the scaler's state is a few scalars",
        )
    unknown = " (bf16 needs compute capability >= 8.0; below: fp16 + GradScaler)" if dev.bf16_native is None else ""
    return "bf16 autocast", "numerics", f"fp32 master weights; {rules}{unknown}"


def fixes_table(fixes: list[Fix]) -> str:
    """The candidates, ranked as :func:`cheapest_fix` ranks them."""
    unit, scale = pick_unit(max(f.report.peak.tensors for f in fixes))
    cols = [
        Col("rank", 4),
        Col("change", 34, align="<", gap="  "),
        Col("peak", 8, ".2f"),
        Col("fits", 5),
        Col("extra FLOPs", 11, "+.0%"),
        Col("changes", max(map(len, EFFECTS)), align="<", gap="  "),  # "trained parameters": LoRA (hf_fixes.py)
        Col("note", 60, align="<", gap="  "),
    ]
    rows = [
        (i, f.name, f.report.peak.tensors / scale, "yes" if f.fits else "no", f.extra_flops, f.effect, f.note)
        for i, f in enumerate(fixes, 1)
    ]
    note = f"({unit} of tensors at the peak; fits: simulated allocator under the cap; extra FLOPs per sequence)"
    return format_table(cols, rows, note=note)
