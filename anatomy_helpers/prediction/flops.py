"""The FLOPs of one forward + backward of the course GPT, counted by torch's ``FlopCounterMode`` on a model built on
fake tensors (no memory, any size): what each lever of :mod:`anatomy_helpers.prediction.levers` costs in compute.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import replace

from torch._subclasses.fake_tensor import FakeTensorMode

from ..core.checks import one_of
from ..core.model import GPT, ModelConfig
from ..training.step import AUTOCAST_CHOICES, step_flops
from .dryrun import build_fake_model, course_batch


@functools.lru_cache(maxsize=64)  # bounded: one entry per configuration counted, a few bytes each
def _flops_of(fields: tuple, batch_size: int) -> int:
    cfg = ModelConfig(*fields)
    mode = FakeTensorMode()
    model = build_fake_model(lambda: GPT(cfg), mode)
    with mode:
        return step_flops(model, *course_batch(batch_size, cfg.seq_len))


def config_step_flops(cfg: ModelConfig, batch_size: int, autocast: str | None = None) -> int:
    """FLOPs of one forward + backward of ``cfg`` at ``batch_size``: :func:`~anatomy_helpers.training.step.step_flops`
    of
    the model built on fake tensors (no memory, any size): checkpointing's recomputation is counted, the optimizer
    (element-wise, a few FLOPs per parameter) is not; nor are element-wise ops (what "selective" recomputes: see
    :data:`~anatomy_helpers.prediction.levers.UNCOUNTED`).

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
