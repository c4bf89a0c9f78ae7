"""Tensor (and sequence) parallelism with torch's parallelize_module on the course GPT (distributed/tensor_parallel.py):
one rank dry-run on the fake process group, its block's saved activations against Korthikanti et al., part by part;
the Llama block's too (tp_plan.py's Llama plan: grouped-query heads split whole, the qkv rows in rank order), against
the terms derived in the paper's style (LLAMA_TERMS); real gloo ranks against the dry run, in one world."""

import dataclasses
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.distributed.tensor_parallel import (
    GAP_REASONS,
    LLAMA_TERM_MODULE,
    LLAMA_TERMS,
    TERM_MODULE,
    TP_SHARDED_TERMS,
    compare_tp_layer,
    format_tp_layer,
    korthikanti_tp_terms,
    layer_parts,
    llama_tp_terms,
    tp_dry_run,
    tp_whole_sbh,
)
from anatomy_helpers.distributed.tp_plan import check_tp, qkv_rank_order
from anatomy_helpers.prediction.formulas import KORTHIKANTI_TERMS
from anatomy_helpers.prediction.kept import layer_activation_bytes

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


# Models the formula does not assume (fp32 activations, dropout 0): their gaps are named, only for what they keep
OFF_FORMULA = {
    "fp32": ModelConfig(n_layer=1, d_model=64, n_head=4, seq_len=32, dropout=0.1, dtype="float32"),
    "bf16, dropout 0": ModelConfig(n_layer=1, d_model=64, n_head=4, seq_len=32, dropout=0.0, dtype="bfloat16"),
    "fp32, dropout 0": ModelConfig(n_layer=1, d_model=64, n_head=4, seq_len=32, dropout=0.0, dtype="float32"),
    "llama fp32, dropout 0": ModelConfig(
        n_layer=1, d_model=64, n_head=4, n_kv_head=2, seq_len=32, dropout=0.0, dtype="float32", block="llama"
    ),
}
OFF_KEYS = [("fp32", 1, False), ("bf16, dropout 0", 2, True), ("fp32, dropout 0", 1, False)]
OFF_KEYS += [("fp32, dropout 0", 2, True), ("llama fp32, dropout 0", 2, True)]


@pytest.fixture(scope="module")
def off_formula_runs():
    return {key: tp_dry_run(OFF_FORMULA[key[0]], key[1], sequence_parallel=key[2], batch_size=2) for key in OFF_KEYS}


@pytest.mark.parametrize("key", OFF_KEYS)
def test_fp32_and_dropout_0_parts_are_the_formula_plus_gaps_that_name_only_what_the_model_keeps(off_formula_runs, key):
    cfg = OFF_FORMULA[key[0]]
    parts = compare_tp_layer(off_formula_runs[key], cfg, 2)
    reasons = {r for p in parts for r in p.why.split(" + ") if r}
    for p in parts:
        assert p.measured == p.formula + p.known_gap, (key, p)
        assert all(r in GAP_REASONS for r in p.why.split(" + ") if r) and (p.why or p.known_gap == 0), p
    masks = [p for p in parts if p.module in ("attn.attn_drop", "attn.resid_drop", "mlp.drop")]
    if cfg.dropout == 0:
        assert "mask dtype" not in reasons and "no dropout" in reasons  # no mask exists to be wider
        assert all(p.measured == 0 and p.why == "no dropout" for p in masks)
    else:
        assert "no dropout" not in reasons and all(p.measured > 0 for p in masks)
    assert ("activation width" in reasons) == (cfg.dtype == "float32")


def test_an_fp32_dropout_0_block_keeps_what_its_shapes_say(off_formula_runs):
    """By hand, from the block's code: 4-byte activations (LayerNorms' inputs and their mean/rstd, the qkv input,
    q, k, v, the softmax output the matmul reads, the proj input, the fc input, GELU's input and fc2's input), the
    1-byte causal mask, and nothing for the dropouts."""
    cfg = OFF_FORMULA["fp32, dropout 0"]
    s, b, h, a = cfg.seq_len, 2, cfg.d_model, cfg.n_head
    sbh = s * b * h
    expected = 4 * (2 * sbh + 2 * 2 * b * s + sbh + 3 * sbh + a * s * s * b + sbh + sbh + 4 * sbh + 4 * sbh) + s * s
    parts = compare_tp_layer(off_formula_runs["fp32, dropout 0", 1, False], cfg, 2)
    assert sum(p.measured for p in parts) == expected


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
    from anatomy_helpers.core.model import CausalSelfAttention

    attn = CausalSelfAttention(ModelConfig(n_layer=1, d_model=32, n_head=4, seq_len=8))
    local = torch.nn.Linear(32, 3 * 16)  # 2 of the 4 heads
    attn.qkv, attn.proj = local, torch.nn.Linear(16, 32)
    assert attn(torch.randn(2, 8, 32)).shape == (2, 8, 32)


def test_two_real_gloo_ranks_keep_what_the_dry_run_says_and_compute_what_the_whole_model_does(runs, llama_runs):
    """The one real world of this module (distributed/ranks.py runs it): TP and TP+SP on 2 gloo processes, GPT-2's
    block and Llama's (bytes against the dry run), and the parallelised model's loss and gradients against the
    unsplit one's."""
    from anatomy_helpers.distributed.ranks import RankJob
    from anatomy_helpers.distributed.tensor_parallel import LabelledJob, TPEqualityJob
    from anatomy_helpers.distributed.world import run_world

    small = dict(n_layer=1, d_model=64, n_head=8, seq_len=16)  # fp32, no dropout: the values can be compared
    equal = [TPEqualityJob({**small, "n_kv_head": 4, "block": "llama"}, sp) for sp in (False, True)]
    jobs = [RankJob(s, steps=1, batch_size=BATCH, model=asdict(CFG)) for s in ("tp", "tp_sp")]
    llama = [RankJob(s, steps=1, warmup=1, batch_size=BATCH, model=asdict(LLAMA)) for s in ("tp", "tp_sp")]
    real = run_world([*jobs, *(LabelledJob(j, f"llama {j.strategy}") for j in llama), *equal, TPEqualityJob(small)], 2)
    fakes = {"tp": runs[(2, False)], "tp_sp": runs[(2, True)]}
    fakes |= {"llama tp": llama_runs[(2, False)], "llama tp_sp": llama_runs[(2, True)]}
    for strategy, fake in fakes.items():
        for rank in real[strategy]:
            assert rank.backend == "gloo" and rank.strategy == strategy
            assert layer_parts(rank.trace) == layer_parts(fake.trace), (strategy, rank.rank)
            acts = rank.trace.timeline.category("activations").max()
            assert acts == fake.trace.timeline.category("activations").max()
            assert [(c.phase, c.op, c.bytes) for c in rank.collectives] == [
                (c.phase, c.op, c.bytes) for c in fake.collectives
            ], (strategy, rank.rank)
    for strategy in ("tp_equality_llama", "tp_sp_equality_llama", "tp_equality_gpt2"):
        for rank in real[strategy]:
            assert rank.loss == pytest.approx(rank.whole_loss, rel=1e-6), (strategy, rank)
            assert rank.max_grad_error < 1e-5 and rank.n_grads > 0, (strategy, rank)


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


# ---- the Llama block ----------------------------------------------------------------------------------------------

# 16-bit activations and dropout on, as the formula assumes; 16 query heads sharing 8 key/value heads, so that
# t = 8 leaves each rank 2 query heads and the 1 key/value head they share
LLAMA = ModelConfig(
    n_layer=1, d_model=128, n_head=16, n_kv_head=8, seq_len=64, dropout=0.1, dtype="bfloat16", block="llama"
)
LLAMA_KEYS = [(1, False), (2, False), (2, True), (8, False), (8, True)]
SHARDED = ("attn", "attn.attn_drop", "attn.proj", "mlp", "mlp.proj")  # inside the column/row split pairs
WHOLE = ("ln1+ln2", "attn.qkv", "attn.resid_drop", "mlp.gate", "mlp.drop")  # replicated under plain TP


@pytest.fixture(scope="module")
def llama_runs():
    return {(t, sp): tp_dry_run(LLAMA, t, sequence_parallel=sp, batch_size=BATCH) for t, sp in LLAMA_KEYS}


@pytest.mark.parametrize(
    "s, b, h, a, F", [(64, 4, 128, 16, 512), (4096, 1, 8192, 64, 28672), (2048, 2, 4096, 32, 11008)]
)
@pytest.mark.parametrize("t", [1, 2, 8])
def test_the_llama_terms_sum_to_their_closed_forms(s, b, h, a, F, t):
    tp = sum(llama_tp_terms(s, b, h, a, F, t).values())
    sp = sum(llama_tp_terms(s, b, h, a, F, t, sequence_parallel=True).values())
    assert tp == pytest.approx(s * b * h * (14 + (8 + 8 * F / h) / t + 5 * a * s / (h * t)), rel=1e-12)
    assert sp == pytest.approx(s * b * h / t * (22 + 8 * F / h + 5 * a * s / h), rel=1e-12)


@pytest.mark.parametrize("kv, ratio, b", [(8, 4, 4), (16, 4, 2), (4, 3, 3)])
def test_the_llama_terms_plus_the_known_gaps_are_the_closed_forms_block_terms(kv, ratio, b):
    """Two derivations of one block, from the same code: estimate.py's module by module (bytes as CPU keeps them)
    and LLAMA_TERMS (Korthikanti's units), joined by GAP_REASONS' rules: 2-byte masks, the causal mask, the rms."""
    cfg = ModelConfig(
        n_layer=1, d_model=128, n_head=16, n_kv_head=kv, mlp_ratio=ratio, seq_len=64, dropout=0.1,
        dtype="bfloat16", block="llama",
    )  # fmt: skip
    s, h, a, F = cfg.seq_len, cfg.d_model, cfg.n_head, ratio * cfg.d_model
    terms = llama_tp_terms(s, b, h, a, F, 1)
    masks = sum(v for term, v in terms.items() if "mask" in term)
    assert sum(terms.values()) + masks + s * s + 2 * b * s * 2 == layer_activation_bytes(cfg, b)


def test_every_llama_term_names_a_module_of_the_block():
    modules = {name for name, _ in torch.nn.Module.named_modules(_block())} | {"ln1+ln2"}
    assert set(LLAMA_TERM_MODULE.values()) <= modules
    assert len(LLAMA_TERM_MODULE) == len(LLAMA_TERMS)


def _block():
    from anatomy_helpers.core.model import LlamaBlock

    return LlamaBlock(ModelConfig(n_layer=1, d_model=32, n_head=4, seq_len=8, block="llama"))


@pytest.mark.parametrize("key", LLAMA_KEYS)
def test_each_llama_part_is_the_formula_plus_its_known_gap_to_the_byte(llama_runs, key):
    parts = compare_tp_layer(llama_runs[key], LLAMA, BATCH)
    assert {p.module for p in parts} == set(LLAMA_TERM_MODULE.values())
    for p in parts:
        assert p.measured == p.formula + p.known_gap, (key, p)
        assert p.why in GAP_REASONS or (p.why == "" and p.known_gap == 0), p


def test_batch_1_without_gqa_is_refused_where_v_is_a_view_of_the_whole_qkv_output():
    from anatomy_helpers.distributed.tensor_parallel import TPRun

    cfg = ModelConfig(**{**asdict(LLAMA), "n_kv_head": None})
    with pytest.raises(ValueError, match="b > 1 or grouped-query attention"):
        compare_tp_layer(TPRun(2, False, trace=None, collectives=[]), cfg, 1)


def test_llama_parts_shrink_t_fold_inside_the_split_pairs_and_the_rest_only_with_sequence_parallelism(llama_runs):
    one = layer_parts(llama_runs[(1, False)].trace)
    for t in (2, 8):
        tp, sp = layer_parts(llama_runs[(t, False)].trace), layer_parts(llama_runs[(t, True)].trace)
        mask = LLAMA.seq_len**2  # the causal mask (bool) every rank's core keeps whole
        tp["attn"], sp["attn"] = tp["attn"] - mask, sp["attn"] - mask
        for module in SHARDED:
            assert tp[module] * t == one[module] - (mask if module == "attn" else 0), (t, module)
            assert sp[module] == tp[module], (t, module)
        for module in WHOLE:
            assert tp[module] == one[module], (t, module)
        for module in ("attn.resid_drop", "mlp.drop"):
            assert sp[module] * t == one[module]
        # torch's ColwiseParallel keeps the gathered input, once for the SwiGLU's gate and up (GAP_REASONS)
        assert sp["attn.qkv"] == one["attn.qkv"] and sp["mlp.gate"] == one["mlp.gate"]


def test_sequence_parallel_gathers_the_swiglu_input_once(llama_runs):
    """Per block in forward: the qkv input, the SwiGLU's input (one gather for gate and up) and the block's output
    are all-gathered; the two projections' outputs reduce-scattered."""
    for t in (2, 8):
        ops = [c.op for c in llama_runs[(t, True)].collectives if c.phase == "forward"]
        assert ops.count("all_gather_into_tensor") == 3 * LLAMA.n_layer, ops
        assert ops.count("reduce_scatter_tensor") == 2 * LLAMA.n_layer, ops


def test_the_gqa_qkv_rank_order_gives_each_rank_its_heads():
    H, K, D, t = 8, 2, 4, 2  # rank r: query heads 4r..4r+3, which repeat_interleave maps to key/value head r
    order = qkv_rank_order(H * D, t, K * D)
    assert sorted(order.tolist()) == list(range((H + 2 * K) * D))
    q_rows, kv_rows = H * D // t, K * D // t
    for r, chunk in enumerate(order.chunk(t)):
        assert chunk.tolist() == (
            list(range(r * q_rows, (r + 1) * q_rows))
            + list(range(H * D + r * kv_rows, H * D + (r + 1) * kv_rows))
            + list(range((H + K) * D + r * kv_rows, (H + K) * D + (r + 1) * kv_rows))
        ), r
    assert torch.equal(qkv_rank_order(32, 4), qkv_rank_order(32, 4, 32))  # GPT-2: k and v as wide as q


def test_tp_degrees_that_split_a_key_value_head_are_refused():
    check_tp(LLAMA, 8)
    with pytest.raises(ValueError, match=r"must divide the key/value heads \(n_kv_head = 8\)"):
        check_tp(ModelConfig(**{**asdict(LLAMA), "n_head": 32, "d_model": 256}), 16)
    with pytest.raises(ValueError, match="must divide n_head"):
        tp_dry_run(LLAMA, 32)
    assert not dist.is_initialized()


def test_the_llama_attention_computes_its_local_heads_from_qkvs_width():
    from anatomy_helpers.core.model import LlamaAttention

    attn = LlamaAttention(ModelConfig(n_layer=1, d_model=32, n_head=8, n_kv_head=4, seq_len=8, block="llama"))
    attn.qkv = torch.nn.Linear(32, (4 + 2 * 2) * 4, bias=False)  # one rank of 2: 4 query heads, 2 key/value heads
    attn.proj = torch.nn.Linear(16, 32, bias=False)
    assert attn(torch.randn(2, 8, 32)).shape == (2, 8, 32)


def test_the_llama_2d_rank_states_read_the_llama_plan():
    """TP x FSDP2 (tp_fsdp) model states from the shapes (mesh_states_rule) read the Llama plan's split dims: here
    against the real tensors, TP's torch.chunk of each split weight, then FSDP2's padded dim-0 chunk over 2 nodes."""
    from anatomy_helpers import make_model
    from anatomy_helpers.distributed.fake_world import STEP_BYTES, mesh_states_rule
    from anatomy_helpers.distributed.mesh2d import tp_split_dims

    model = dict(n_layer=1, d_model=32, n_head=4, n_kv_head=2, seq_len=16, block="llama")
    split = tp_split_dims(block="llama")
    colwise, rowwise = ("attn.qkv", "mlp.gate", "mlp.up"), ("attn.proj", "mlp.proj")
    assert {k for k, d in split.items() if d == 0} == {f"{m}.{w}" for m in colwise for w in ("weight", "bias")}
    assert {k for k, d in split.items() if d == 1} == {f"{m}.weight" for m in rowwise}
    tp, dp = 2, 2
    gpt = make_model(device="cpu", **model)
    buffers = sum(b.nbytes for b in gpt.buffers())  # the causal mask, the rotary tables: whole on every rank
    for rank in range(tp * dp):
        params = state = 0
        for name, p in gpt.named_parameters():
            dim = split.get(name.split(".", 2)[-1]) if name.startswith("blocks.") else None
            local = p.detach() if dim is None else p.detach().chunk(tp, dim=dim)[rank % tp]
            pieces = local.chunk(dp, dim=0)
            params += pieces[0].nbytes
            state += 2 * (pieces[rank // tp].nbytes if rank // tp < len(pieces) else 0) + STEP_BYTES
        expected = {"parameters": params + buffers, "gradients": params, "optimizer_state": state}
        assert mesh_states_rule(model, tp * dp, tp, rank) == expected, rank


def test_the_lessons_tables_print_each_term_and_each_part(llama_runs):
    """Notebook 11's two tables: the formula term by term (format_llama_terms) and the parts side by side."""
    from anatomy_helpers.distributed.tensor_parallel import format_llama_terms
    from anatomy_helpers.lessons.lesson11_scale import format_tp_columns

    terms = format_llama_terms(LLAMA, BATCH)
    assert all(term in terms for term, *_ in LLAMA_TERMS)
    assert f"{sum(llama_tp_terms(64, BATCH, 128, 16, 512, 8).values()):,.0f}" in terms.splitlines()[-1]
    with pytest.raises(ValueError, match="Llama block"):
        format_llama_terms(ModelConfig(n_layer=1, d_model=32, n_head=4, seq_len=8), 2)
    layers = {f"t={t}": compare_tp_layer(llama_runs[(t, False)], LLAMA, BATCH) for t in (2, 8)}
    table = format_tp_columns(layers)
    last = table.splitlines()[-1].split()
    assert last[0] == "total" and len(last) == 7
    assert last[1] == f"{sum(layer_parts(llama_runs[(2, False)].trace).values()):,}"


def test_what_tp_leaves_whole_counts_the_models_own_width_and_masks():
    """By hand: GPT-2's unsharded terms are the LayerNorm inputs (4 sbh), the QKV and fc1 inputs (2 + 2) and two
    1-byte residual masks (1 + 1): 10 in 16 bits with dropout; fp32 doubles the 2-byte terms (16 + 2 = 18); dropout
    0 drops the masks (16 in fp32). Llama's: both RMSNorms' tensors (4 + 4), the qkv and gate/up inputs, the masks."""
    gpt2 = ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=8, dropout=0.1, dtype="bfloat16")
    assert tp_whole_sbh(gpt2) == 10
    assert tp_whole_sbh(dataclasses.replace(gpt2, dtype="float32")) == 18
    assert tp_whole_sbh(dataclasses.replace(gpt2, dtype="float32", dropout=0.0)) == 16
    assert tp_whole_sbh(dataclasses.replace(gpt2, dropout=0.0)) == 8
    assert tp_whole_sbh(dataclasses.replace(gpt2, block="llama")) == 14
