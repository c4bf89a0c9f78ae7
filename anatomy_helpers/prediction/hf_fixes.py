"""The cheapest fix for a Hugging Face fine-tune that does not fit: :func:`cheapest_fix_hf`, fixes.py's ranking
for the models of :mod:`anatomy_helpers.prediction.hf`. Each candidate is another fine-tune, dry-run and replayed
as :func:`~anatomy_helpers.prediction.hf_fit.will_it_fit_hf` does (micro-batches are dry-run as they run, so no
bound is added); the extra FLOPs are counted by torch's ``FlopCounterMode`` on the fake model.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import copy
import dataclasses

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ..step import run_step
from .dryrun import build_fake_model
from .fixes import Fix, _fix_sort_key
from .hf import hf_config
from .hf_fit import ZERO_STRATEGIES, check_request, will_it_fit_hf
from .hf_step import FineTune, _as_for_real, dry_run_hf, hf_plan, make_hf_model, make_hf_optimizer

#: The LoRA rank offered to a full or frozen fine-tune (a common choice; the candidate says which).
LORA_RANK = 16


def _layers(cfg, n: int):
    """``cfg`` with ``n`` decoder layers (its per-layer lists cut to them)."""
    out = copy.deepcopy(cfg)
    out.num_hidden_layers = n  # GPT-2's n_layer too, through its attribute_map
    if getattr(out, "layer_types", None):
        out.layer_types = out.layer_types[:n]
    return out


def _flops_of(cfg, ft: FineTune) -> int:
    """FLOPs of one step's forwards and backwards of ``ft`` on ``cfg``'s fake model: :func:`hf_plan` run by
    :func:`~anatomy_helpers.step.run_step`, stopped after backward (no optimizer step), under FlopCounterMode."""
    mode = FakeTensorMode()
    model = build_fake_model(lambda: make_hf_model(cfg, ft), mode)
    plan = hf_plan(cfg.vocab_size, ft, fake=True, optimizer_step=False)
    with mode, _as_for_real([]), FlopCounterMode(display=False) as counter:
        run_step(model, make_hf_optimizer(model, ft), plan, 0)
    return int(counter.get_total_flops())


def hf_step_flops(model, ft: FineTune) -> int:
    """FLOPs of one step's forwards and backwards (all micro-batches) of ``ft`` on ``model``, as
    ``FlopCounterMode`` counts them (matmuls and attention kernels; checkpointing's recomputation included; not
    the optimizer). The decoder layers are identical, so the count is ``F(1) + (L - 1) * (F(2) - F(1))`` from
    models of one and two layers, like fixes.config_step_flops."""
    cfg = hf_config(model)
    f1, f2 = (_flops_of(_layers(cfg, n), ft) for n in (1, 2))
    return f1 + (cfg.num_hidden_layers - 1) * (f2 - f1)


def cheapest_fix_hf(
    model, fine_tune: FineTune | None = None, device="a100-80", *, world_size: int = 1, zero: int | None = None
) -> list[Fix]:
    """Candidate changes of ``fine_tune`` on ``model``, each dry-run, ranked as fixes.cheapest_fix ranks them
    (what fits first, then what they change, then extra FLOPs):

    * **micro-batches** (time only): 2, 4, ... dividing the batch, up to the first that fits;
    * **gradient checkpointing** (time only: recomputes the forward in backward);
    * **the fused optimizer** (time only), for Adam and AdamW;
    * **a higher ZeRO stage** (time only: more communication), with ``world_size > 1``;
    * **precision** (numerics): bf16 autocast over fp32 weights, and bf16 weights, for an fp32 fine-tune;
    * **LoRA** rank :data:`LORA_RANK` on all linear layers, bf16 base (trains adapters, not the model), for a
      full or frozen fine-tune.
    """
    ft = FineTune() if fine_tune is None else fine_tune
    cfg, _ = check_request(model, ft, device, world_size, zero)  # every argument, before any dry run
    base_flops = hf_step_flops(cfg, ft)
    fixes: list[Fix] = []
    traces = {}  # fine-tune -> its dry run: the ZeRO candidates share the request's

    def add(name, effect, note, new_ft=ft, new_zero=zero, micro=1):
        if new_ft not in traces:
            traces[new_ft] = dry_run_hf(cfg, new_ft, steps=2)
        report = will_it_fit_hf(model, new_ft, device, world_size=world_size, zero=new_zero, trace=traces[new_ft])
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
    return sorted(fixes, key=_fix_sort_key)
