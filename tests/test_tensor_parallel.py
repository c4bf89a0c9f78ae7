"""Tensor (and sequence) parallelism with torch's parallelize_module on the course GPT (distributed/tensor_parallel.py):
one rank dry-run on the fake process group, its block's saved activations against Korthikanti et al., part by part."""

import pytest
import torch
import torch.distributed as dist

from anatomy_helpers.distributed.tensor_parallel import (
    TERM_MODULE,
    TP_SHARDED_TERMS,
    compare_tp_layer,
    format_tp_layer,
    korthikanti_tp_terms,
    layer_parts,
    tp_dry_run,
)
from anatomy_helpers.distributed.tp_plan import check_tp, qkv_rank_order
from anatomy_helpers.model import ModelConfig
from anatomy_helpers.prediction.formulas import KORTHIKANTI_TERMS

# 16-bit activations and dropout on, as the formula assumes; 8 heads so that t = 8 leaves one head per rank
CFG = ModelConfig(n_layer=2, d_model=128, n_head=8, seq_len=64, dropout=0.1, dtype="bfloat16")
BATCH = 4


@pytest.fixture(scope="module")
def runs():
    return {
        (t, sp): tp_dry_run(CFG, t, sequence_parallel=sp, batch_size=BATCH)
        for t, sp in [(1, False), (2, False), (2, True), (8, False), (8, True)]
    }


@pytest.mark.parametrize("s, b, h, a", [(64, 4, 128, 8), (2048, 1, 4096, 32), (1024, 3, 768, 12)])
@pytest.mark.parametrize("t", [1, 2, 8])
def test_the_terms_sum_to_the_papers_closed_forms(s, b, h, a, t):
    tp = sum(korthikanti_tp_terms(s, b, h, a, t).values())
    sp = sum(korthikanti_tp_terms(s, b, h, a, t, sequence_parallel=True).values())
    assert tp == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert sp == pytest.approx(s * b * h / t * (34 + 5 * a * s / h), rel=1e-12)


def test_every_formula_term_has_the_module_that_saves_it():
    assert set(TERM_MODULE) == {term for term, *_ in KORTHIKANTI_TERMS}
    assert set(TP_SHARDED_TERMS) < set(TERM_MODULE)


@pytest.mark.parametrize("key", [(1, False), (2, False), (2, True), (8, False), (8, True)])
def test_each_part_is_the_formula_plus_its_known_gap_to_the_byte(runs, key):
    parts = compare_tp_layer(runs[key], CFG, BATCH)
    assert {p.module for p in parts} == set(TERM_MODULE.values())
    for p in parts:
        assert p.measured == p.formula + p.known_gap, (key, p)
    assert "total" in format_tp_layer(parts)


def test_sharded_parts_shrink_t_fold_and_the_rest_only_with_sequence_parallelism(runs):
    one = layer_parts(runs[(1, False)].trace)
    for t in (2, 8):
        tp, sp = layer_parts(runs[(t, False)].trace), layer_parts(runs[(t, True)].trace)
        for module in ("attn.proj", "mlp.gelu", "mlp.proj", "attn.attn_drop"):
            assert tp[module] * t == one[module] and sp[module] == tp[module]
        for module in ("ln1+ln2", "attn.resid_drop", "mlp.drop"):
            assert tp[module] == one[module] and sp[module] * t == one[module]
        assert sp["attn.qkv"] == one["attn.qkv"]  # torch keeps the gathered input (GAP_REASONS)


def test_qkv_rank_order_gives_each_rank_its_own_heads_q_k_and_v():
    c, t = 8, 4
    order = qkv_rank_order(c, t)
    assert sorted(order.tolist()) == list(range(3 * c))
    for r, chunk in enumerate(order.chunk(t)):
        rows = chunk.tolist()
        assert rows == [part * c + r * (c // t) + i for part in range(3) for i in range(c // t)]


def test_bad_tp_degrees_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="must divide n_head"):
        check_tp(CFG, 3)
    with pytest.raises(ValueError, match="positive integer"):
        check_tp(CFG, 0)
    with pytest.raises(ValueError, match="key/value heads"):  # the Llama block: whole key/value heads too
        check_tp(ModelConfig(n_layer=1, d_model=64, n_head=4, n_kv_head=1, seq_len=16, block="llama"), 2)
    with pytest.raises(ValueError, match="must divide n_head"):
        tp_dry_run(CFG, 16)
    assert not dist.is_initialized()


def test_the_attention_computes_its_local_heads_from_qkvs_width():
    """What makes the course GPT splittable: with a rank's share of qkv's columns, the attention runs its heads."""
    from anatomy_helpers.model import CausalSelfAttention

    attn = CausalSelfAttention(ModelConfig(n_layer=1, d_model=32, n_head=4, seq_len=8))
    local = torch.nn.Linear(32, 3 * 16)  # 2 of the 4 heads
    attn.qkv, attn.proj = local, torch.nn.Linear(16, 32)
    assert attn(torch.randn(2, 8, 32)).shape == (2, 8, 32)


def test_two_real_gloo_ranks_keep_what_the_dry_run_says_byte_for_byte(runs):
    """The one real world of this module: TP and TP+SP on 2 gloo processes (distributed/ranks.py runs them)."""
    from dataclasses import asdict

    from anatomy_helpers.distributed.ranks import RankJob
    from anatomy_helpers.distributed.world import run_world

    real = run_world([RankJob(s, steps=1, batch_size=BATCH, model=asdict(CFG)) for s in ("tp", "tp_sp")], 2)
    for strategy, sp in (("tp", False), ("tp_sp", True)):
        fake = runs[(2, sp)].trace
        for rank in real[strategy]:
            assert rank.backend == "gloo"
            assert layer_parts(rank.trace) == layer_parts(fake), (strategy, rank.rank)
            acts = rank.trace.timeline.category("activations").max()
            assert acts == fake.timeline.category("activations").max()
            assert [(c.phase, c.op, c.bytes) for c in rank.collectives] == [
                (c.phase, c.op, c.bytes) for c in runs[(2, sp)].collectives
            ], (strategy, rank.rank)


def test_dtensors_collectives_are_recorded_as_megatron_counts_them(runs):
    """TP: two all-reduces of the residual stream (s x b x h, 16-bit) per block in forward and two in backward;
    with sequence parallelism, no all-reduce in forward: each becomes a reduce-scatter (and an all-gather)."""
    stream = CFG.seq_len * BATCH * CFG.d_model * 2
    for t in (2, 8):
        tp = [(c.phase, c.op, c.bytes) for c in runs[(t, False)].collectives]
        per_phase = 2 * CFG.n_layer
        assert tp == [("forward", "all_reduce", stream)] * per_phase + [("backward", "all_reduce", stream)] * per_phase
        sp = [(c.phase, c.op) for c in runs[(t, True)].collectives]
        assert ("forward", "all_reduce") not in sp
        assert sp.count(("forward", "reduce_scatter_tensor")) == per_phase
    assert runs[(1, False)].collectives == []


def test_dtensors_cpu_rng_warning_is_silenced_inside_the_dry_run_only():
    """Sequence-parallel dropout on a CPU mesh makes DTensor warn (torch/distributed/tensor/_random.py); the dry run
    draws no random numbers, so tp_dry_run silences exactly that message, with a filter that ends with the run."""
    import warnings

    from anatomy_helpers.distributed.tensor_parallel import DTENSOR_RNG_WARNING

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp_dry_run(CFG, 2, sequence_parallel=True, batch_size=2)
    assert not [w for w in caught if DTENSOR_RNG_WARNING in str(w.message)], [str(w.message) for w in caught]
