"""What the cheapest fix for a Hugging Face fine-tune (:func:`anatomy_helpers.distributed.hf_fit.cheapest_fix_hf`,
fixes.py's ranking for the models of :mod:`anatomy_helpers.prediction.hf`) weighs: each candidate's extra FLOPs,
counted by torch's ``FlopCounterMode`` on the fake model (:func:`hf_step_flops`), and the LoRA rank it offers.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import copy

from torch._subclasses.fake_tensor import FakeTensorMode

from ..training.step import flop_counter, run_step
from .dryrun import build_fake_model
from .hf import hf_config
from .hf_step import FineTune, as_real_run, hf_plan, make_hf_model, make_hf_optimizer

#: The LoRA rank offered to a full or frozen fine-tune (a common choice; the candidate says which).
LORA_RANK = 16


def layers_of(cfg, n: int):
    """``cfg`` with ``n`` decoder layers (its per-layer lists cut to them)."""
    out = copy.deepcopy(cfg)
    out.num_hidden_layers = n  # GPT-2's n_layer too, through its attribute_map
    if getattr(out, "layer_types", None):
        out.layer_types = out.layer_types[:n]
    return out


def _flops_of(cfg, ft: FineTune) -> int:
    """FLOPs of one step's forwards and backwards of ``ft`` on ``cfg``'s fake model: :func:`hf_plan` run by
    :func:`~anatomy_helpers.training.step.run_step`, stopped after backward (no optimizer step), under
    FlopCounterMode."""
    mode = FakeTensorMode()
    model = build_fake_model(lambda: make_hf_model(cfg, ft), mode)
    plan = hf_plan(cfg.vocab_size, ft, fake=True, optimizer_step=False)
    with mode, as_real_run([]), flop_counter() as counter:
        run_step(model, make_hf_optimizer(model, ft), plan, 0)
    return int(counter.get_total_flops())


def hf_step_flops(model, ft: FineTune) -> int:
    """FLOPs of one step's forwards and backwards (all micro-batches) of ``ft`` on ``model``, as
    ``FlopCounterMode`` counts them (matmuls and attention kernels; checkpointing's recomputation included; not
    the optimizer). The decoder layers are identical, so the count is ``F(1) + (L - 1) * (F(2) - F(1))`` from
    models of one and two layers, like fixes.config_step_flops."""
    cfg = hf_config(model)
    f1, f2 = (_flops_of(layers_of(cfg, n), ft) for n in (1, 2))
    return f1 + (cfg.num_hidden_layers - 1) * (f2 - f1)
