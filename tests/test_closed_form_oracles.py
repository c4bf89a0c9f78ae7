"""Closed-form terms worked out by hand from the tensors' sizes (numel x element size), fast: no model is run.

Each expectation is written from what torch does (named in the test), not from estimate.py's own expressions.
"""

import pytest
import torch

from anatomy_helpers.core.model import GPT, ModelConfig
from anatomy_helpers.prediction.estimate import backward_moments, optimizer_temporaries
from anatomy_helpers.prediction.formulas import zero_model_states

from .conftest import SMALL


def meta_numels(cfg: ModelConfig) -> list[int]:
    """numel of each parameter tensor, in the optimizer's order, from the model itself (built on meta: no data)."""
    with torch.device("meta"):
        return [p.numel() for p in GPT(cfg).parameters()]


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_backward_moment_by_hand(tied):
    """At the embedding's backward every other gradient is alive. Tied: the LM head's gradient of the shared weight
    (V x h) and the embedding's own (V x h) are summed by autograd into a third (InputBuffer::add): three V x h
    at once, one of which is counted among all gradients. Untied: the embedding output's gradient (N x h) beside."""
    cfg = ModelConfig(**{**SMALL, "vocab_size": 8000, "tie_embeddings": tied})
    b, V, h, N = 1, 8000, SMALL["d_model"], SMALL["seq_len"]
    all_grads = 4 * sum(meta_numels(cfg))
    expected = all_grads + (2 * V * h * 4 if tied else N * h * 4)
    assert backward_moments(cfg, b)["embedding"] == expected


def test_adam_temporaries_by_hand():
    """torch's _single_tensor_adam: ``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` makes two tensors the size of
    parameter i while the previous parameter's ``denom`` is still bound; foreach makes one per parameter at once;
    fused kernels and SGD's in-place updates make none. fp32: 4 bytes per element."""
    cfg = ModelConfig(**SMALL)
    n = meta_numels(cfg)
    peaks = [2 * n[0]] + [n[i - 1] + 2 * n[i] for i in range(1, len(n))]
    assert optimizer_temporaries(cfg, "adamw", "single") == 4 * max(peaks)
    assert max(peaks) != 2 * max(n)  # the previous denom matters for this model (else the test could not tell)
    assert optimizer_temporaries(cfg, "adam", "foreach") == 4 * sum(n)
    assert optimizer_temporaries(cfg, "adamw", "fused") == 0
    assert optimizer_temporaries(cfg, "momentum", "single") == 0


def test_zero_stages_by_hand():
    """ZeRO (Rajbhandari et al. 2020): stage 1 shards the optimizer state over N ranks, stage 2 the gradients too,
    stage 3 the parameters too. 1000 parameters, 4 ranks, 4 + 4 + 8 bytes each."""
    full = {"parameters": 4000, "gradients": 4000, "optimizer_state": 8000}
    assert zero_model_states("ddp", 1000, 4) == full
    assert zero_model_states("zero1", 1000, 4) == {**full, "optimizer_state": 2000}
    assert zero_model_states("fsdp2_zero2", 1000, 4) == {**full, "gradients": 1000, "optimizer_state": 2000}
    assert zero_model_states("fsdp2_zero3", 1000, 4) == {
        "parameters": 1000,
        "gradients": 1000,
        "optimizer_state": 2000,
    }
    # the ZeRO paper's mixed-precision Adam: 2 + 2 + 12 bytes, 16 per parameter on one rank
    assert sum(zero_model_states("ddp", 10, 1, param_bytes=2, grad_bytes=2, state_bytes=12).values()) == 160


def test_rank_row_by_hand():
    """A rank's row: measured model states beside the ZeRO-1 formula (1000 parameters, 2 ranks: optimizer state
    8000 / 2), and the most communication memory alive at any moment of its timeline (700 B)."""
    from types import SimpleNamespace

    import numpy as np

    from anatomy_helpers.distributed.world import rank_row

    comm = np.array([0, 700, 300, 0])
    result = SimpleNamespace(
        strategy="zero1",
        rank=1,
        world_size=2,
        n_params=1000,
        model_states={"parameters": 4100, "gradients": 4000, "optimizer_state": 4012, "communication": 300},
        trace=SimpleNamespace(timeline=SimpleNamespace(category=lambda name: comm)),
        peak=SimpleNamespace(bytes=20000),
        max_memory_allocated=None,
    )
    row = rank_row(result)
    assert (row.parameters, row.gradients, row.optimizer_state, row.communication) == (4100, 4000, 4012, 300)
    assert (row.communication_peak, row.peak) == (700, 20000)
    assert (row.formula_parameters, row.formula_gradients, row.formula_optimizer_state) == (4000, 4000, 4000)
    assert row.model_states == 12112 and row.formula_model_states == 12000
