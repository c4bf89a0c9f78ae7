"""anatomy_helpers.prediction.saved and the Korthikanti terms of anatomy_helpers.prediction.formulas: what autograd
saved, tensor by tensor.

Expected bytes are counted by hand from the model's shapes (numel * element size), never read off the package.
"""

import dataclasses
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from anatomy_helpers import StepTracker, get_batch, make_model, make_optimizer
from anatomy_helpers.prediction.formulas import (
    EXTRA_TERMS,
    KORTHIKANTI_TERMS,
    MASK_TERMS,
    korthikanti_layer_bytes,
    korthikanti_terms,
)
from anatomy_helpers.prediction.saved import (
    SavedRow,
    TermComparison,
    activations_by_part,
    attach_ops,
    compare_layer,
    comparison_table,
    distinct_bytes,
    first_savers,
    korthikanti_role,
    saved_by_op,
    saved_rows,
    saved_table,
)
from anatomy_helpers.tracking.events import SavedTensor

from .conftest import SMALL, THREADS


def fp32_layer_bytes(s: int, b: int, h: int, a: int) -> int:
    """Activation bytes one block of the course GPT saves: fp32, manual attention, no dropout (by hand).

    LN inputs 2*4sbh, LN mean+rstd 2*2*4sb, QKV input 4sbh, the Q, K, V copies 3*4sbh, the causal mask s*s
    (bool), the softmax output 4*a*s*s*b, out-proj input 4sbh, fc1 input 4sbh, GELU input 16sbh, fc2 input 16sbh.
    """
    return (8 + 4 + 12 + 4 + 4 + 16 + 16) * s * b * h + 16 * s * b + s * s + 4 * a * s * s * b


def fp32_outside_bytes(s: int, b: int, h: int, v: int) -> tuple[int, int]:
    """(embeddings, head) bytes outside the blocks, fp32: the position ids (s int64); the final LN's input and
    statistics (4sbh + 8sb), the LM head's input 4sbh, the log-probabilities 4sbv and the loss's total_weight (4)."""
    return 8 * s, 8 * s * b * h + 8 * s * b + 4 * s * b * v + 4


def col_end(header: str, name: str) -> int:
    """Where a right-aligned column ends: the end of its name in the header line."""
    return header.index(name) + len(name)


def value_at(line: str, end: int) -> str:
    """The right-aligned value that ends at column ``end`` of a table line."""
    return line[:end].split()[-1]


@pytest.fixture(scope="module")
def fp32_forward():
    """One tracked forward (loss included) of the SMALL fp32 model at batch 3, and its rows with ops attached."""
    torch.set_num_threads(THREADS)  # module fixtures run before the autouse one: the same threads as the tests
    model = make_model(device="cpu", **SMALL)
    x, y = get_batch(3, SMALL["seq_len"], seed=0)
    with StepTracker(model, make_optimizer(model, "sgd")) as tracker:
        out = model(x, y)
    del out
    trace = tracker.trace
    named = attach_ops(saved_rows(trace), saved_by_op(model, x, y))
    return model, trace, x, y, named


@pytest.fixture(scope="module")
def bf16_forward():
    """The SMALL model as Korthikanti et al. assume it (bf16, dropout 0.1), batch 2: rows with ops attached."""
    torch.set_num_threads(THREADS)  # module fixtures run before the autouse one: the same threads as the tests
    model = make_model(device="cpu", **SMALL, dtype="bfloat16", dropout=0.1)
    b = 2
    x, y = get_batch(b, SMALL["seq_len"], seed=0)
    with StepTracker(model, make_optimizer(model, "sgd")) as tracker:
        out = model(x, y)
    del out
    return b, attach_ops(saved_rows(tracker.trace), saved_by_op(model, x, y))


# ---- the closed form -------------------------------------------------------------------------


def test_korthikanti_terms_match_a_hand_computation():
    s, b, h, a = 3, 2, 5, 7
    sbh, as2b = s * b * h, a * s * s * b  # 30 and 126
    terms = korthikanti_terms(s, b, h, a)
    # the paper's breakdown, written out by hand
    assert terms["QKV input"] == 2 * 30
    assert terms["Q and K"] == 4 * 30
    assert terms["softmax output"] == 2 * 126
    assert terms["softmax dropout mask"] == 126
    assert terms["dropout output"] == 2 * 126
    assert terms["V"] == 2 * 30
    assert terms["out-proj input"] == 2 * 30
    assert terms["attn dropout mask"] == 30
    assert terms["fc1 input"] == 2 * 30
    assert terms["GELU input"] == 8 * 30
    assert terms["fc2 input"] == 8 * 30
    assert terms["MLP dropout mask"] == 30
    assert terms["LayerNorm inputs"] == 4 * 30
    attention = sum(v for (t, part, _, _), v in zip(KORTHIKANTI_TERMS, terms.values()) if part == "attention")
    mlp = sum(v for (t, part, _, _), v in zip(KORTHIKANTI_TERMS, terms.values()) if part == "mlp")
    assert attention == 11 * sbh + 5 * as2b
    assert mlp == 19 * sbh
    # s*b*h*(34 + 5*a*s/h), computed with exact fractions
    assert sum(terms.values()) == korthikanti_layer_bytes(s, b, h, a) == sbh * (34 + Fraction(5 * a * s, h))


def test_korthikanti_layer_bytes_gpt3_sized_layer():
    # s=2048, b=1, h=12288, a=96: 2048 * 12288 = 25,165,824; 34 + 5*96*2048/12288 = 34 + 80 = 114
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == 25_165_824 * 114 == 2_868_903_936


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_korthikanti_terms_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="positive integer"):
        korthikanti_terms(bad, 1, 1, 1)


def test_mask_terms_are_formula_terms_and_extras_are_not():
    names = {t for t, *_ in KORTHIKANTI_TERMS}
    assert set(MASK_TERMS) <= names
    assert not set(EXTRA_TERMS) & names


# ---- saved_rows on hand-made records --------------------------------------------------------------


def _saved(storage: int, module: str, nbytes: int = 16, category: str = "activations") -> SavedTensor:
    return SavedTensor(1, module, (nbytes // 4,), torch.float32, nbytes, storage, nbytes, category)


def test_saved_rows_mark_each_storages_first_saver():
    saved = [_saved(7, "tok_emb"), _saved(3, "blocks.0.ln1"), _saved(7, "blocks.0.attn"), _saved(3, "ln_f")]
    rows = saved_rows(SimpleNamespace(saved=saved))
    assert all(isinstance(r, SavedRow) for r in rows)
    assert [(r.first, r.same_as) for r in rows] == [(True, 0), (True, 1), (False, 0), (False, 1)]
    assert [r.module for r in rows] == [s.module for s in saved]  # the records themselves, unchanged
    assert distinct_bytes(rows) == 32 and [r.storage for r in first_savers(rows)] == [7, 3]


def test_activations_by_part_is_in_forward_order_whatever_the_rows_order():
    saved = [
        _saved(0, "lm_head", 8),
        _saved(1, "blocks.10.mlp.fc", 16),
        _saved(2, "blocks.2.attn", 32),
        _saved(3, "pos_emb", 64),
        _saved(4, "blocks.2.ln1", 128),
        _saved(5, "model", 256),  # the loss: the root module's own op
        _saved(6, "blocks.10.attn", 512, category="parameters"),  # not an activation: left out
    ]
    parts = activations_by_part(saved_rows(SimpleNamespace(saved=saved)))
    # numeric block order (blocks.2 before blocks.10), absent blocks left out, none lost
    assert list(parts.items()) == [("embeddings", 64), ("blocks.2", 32 + 128), ("blocks.10", 16), ("head", 8 + 256)]


# ---- saved tensors of a real forward, named ----------------------------------------------------------


def test_every_saved_tensor_is_named_and_lines_up(fp32_forward):
    model, trace, _, _, named = fp32_forward
    assert len(named) == len(trace.saved) > 0
    assert all(r.op != "?" and r.op.endswith(("Backward0", "Backward1")) for r in named)
    ln = [r for r in named if r.module == "blocks.0.ln1"]
    assert {r.attr for r in ln} == {"input", "weight", "bias", "result1", "result2"}
    assert {r.op for r in ln} == {"NativeLayerNormBackward0"}
    assert next(r for r in named if r.module == "blocks.0.mlp.gelu").op == "GeluBackward0"
    # attach_ops adds the op and keeps the rest of the record
    plain = saved_rows(trace)
    assert [dataclasses.replace(r, op=None, attr=None, seq=None) for r in named] == plain
    assert all(p.op is None for p in plain)


def test_attach_ops_rejects_a_different_forward(fp32_forward):
    model, trace, x, y, _ = fp32_forward
    other = saved_by_op(model, x[:2], y[:2])  # batch 2 instead of 3
    with pytest.raises(ValueError, match="tracker has"):
        attach_ops(saved_rows(trace), other)
    with pytest.raises(ValueError, match="not the same forward"):
        attach_ops(saved_rows(trace), other[:-1])


def test_attach_ops_rejects_a_different_grouping_into_storages(fp32_forward):
    model, trace, x, y, named = fp32_forward
    ops = saved_by_op(model, x, y)
    i = next(i for i, r in enumerate(named) if not r.first)  # a view of a storage an earlier row saved
    split = [dataclasses.replace(o, storage=10_000) if k == i else o for k, o in enumerate(ops)]
    with pytest.raises(ValueError, match="group storages differently"):
        attach_ops(saved_rows(trace), split)
    j = next(k for k, r in enumerate(named) if k > 0 and r.first)  # a storage of its own, not row 0's
    merged = [dataclasses.replace(o, storage=ops[0].storage) if k == j else o for k, o in enumerate(ops)]
    with pytest.raises(ValueError, match="group storages differently"):
        attach_ops(saved_rows(trace), merged)


def test_distinct_bytes_and_parts_equal_a_hand_count(fp32_forward):
    model, trace, x, _, named = fp32_forward
    b, s = x.shape
    cfg = model.cfg
    per_layer = fp32_layer_bytes(s, b, cfg.d_model, cfg.n_head)
    embeddings, head = fp32_outside_bytes(s, b, cfg.d_model, cfg.vocab_size)
    parts = activations_by_part(named)
    assert parts == {"embeddings": embeddings, **{f"blocks.{i}": per_layer for i in range(cfg.n_layer)}, "head": head}
    assert list(parts) == ["embeddings", *(f"blocks.{i}" for i in range(cfg.n_layer)), "head"]
    assert distinct_bytes(named) == cfg.n_layer * per_layer + embeddings + head
    assert distinct_bytes(named) == trace.timeline.category("activations")[-1]
    # the storages counted once: one first saver per distinct storage
    assert len(first_savers(named, None)) == len({r.storage for r in named})


def test_saved_rows_per_step_of_a_training_run(small_trace):
    rows = saved_rows(small_trace)
    b, s, h, a = 4, SMALL["seq_len"], SMALL["d_model"], SMALL["n_head"]
    per_layer = fp32_layer_bytes(s, b, h, a)
    for step in small_trace.training_steps():
        mine = [r for r in rows if r.step == step]
        # fresh activations every step: none is a view of a storage an earlier step saved
        assert mine and all(rows[r.same_as].step == step for r in mine if r.category == "activations")
        parts = activations_by_part(mine)
        assert [parts[f"blocks.{i}"] for i in range(SMALL["n_layer"])] == [per_layer] * SMALL["n_layer"]
        fwd_end = small_trace.timeline.category("activations")[small_trace.window(step, "forward")[-1]]
        assert distinct_bytes(mine) == fwd_end


def test_views_share_storage_and_count_once(fp32_forward):
    _, _, x, _, named = fp32_forward
    s = x.shape[1]
    attn = [r for r in named if r.module == "blocks.0.attn"]
    probs = next(r for r in attn if r.op == "SoftmaxBackward0")
    # att @ v is the second batched matmul (the higher sequence number); its `self` is the probabilities
    again = max((r for r in attn if r.op == "BmmBackward0" and r.attr == "self"), key=lambda r: r.seq)
    assert again.shape[-2:] == (s, s)
    assert again.storage == probs.storage and not again.first
    assert again.same_as == named.index(probs)


def test_sdpa_saves_q_k_v_as_views_of_one_storage():
    model = make_model(device="cpu", **{**SMALL, "n_layer": 1}, attn_impl="sdpa")
    b, s, h = 2, SMALL["seq_len"], SMALL["d_model"]
    x, y = get_batch(b, s, seed=0)
    with StepTracker(model, make_optimizer(model, "sgd")) as tracker:
        out = model(x, y)
    del out
    named = attach_ops(saved_rows(tracker.trace), saved_by_op(model, x, y))
    qkv = [r for r in named if r.attr in ("query", "key", "value")]
    assert len(qkv) == 3 and len({r.storage for r in qkv}) == 1
    assert qkv[0].storage_bytes == 3 * b * s * h * 4 == 3 * qkv[0].bytes


# ---- saved_table -------------------------------------------------------------------------------


def test_saved_table_with_ops_lists_each_row_and_counts_storages_once(fp32_forward):
    model, _, x, _, named = fp32_forward
    b, s = x.shape
    h, a = model.cfg.d_model, model.cfg.n_head
    prefix = "blocks.0.attn"
    chosen = [i for i, r in enumerate(named) if r.module.startswith(prefix)]
    lines = saved_table(named, prefix=prefix).splitlines()
    header, body, footer = lines[0], lines[2 : 2 + len(chosen)], lines[-1]
    assert "saved by op.attr" in header
    assert set(lines[1]) == {"-"} and set(lines[-2]) == {"-"} and len(lines) == len(chosen) + 4
    bytes_end, counted_end = col_end(header, "bytes"), col_end(header, "counted")
    for i, line in zip(chosen, body):
        r = named[i]
        assert line.split()[:3] == [str(i), r.module, f"{r.op}.{r.attr}"]
        assert value_at(line, bytes_end) == f"{r.bytes:,}"
        assert ("= #" not in line) == r.first
    counted = [value_at(line, counted_end) for line in body]
    # qkv.weight and proj.weight: each Linear saves its weight (a parameter, not new memory)
    assert counted.count("parameter") == 2
    # activations: the qkv input, the Q, K and V copies, the causal mask, the probabilities (saved twice:
    # by softmax and by att @ v, one storage) and the output projection's input
    expected = 4 * s * b * h + 3 * 4 * s * b * h + s * s + 4 * a * s * s * b + 4 * s * b * h
    assert sum(int(c.replace(",", "")) for c in counted if c[0].isdigit()) == expected
    assert counted.count("-") == 1  # the probabilities' second view
    assert footer == f"activations: 7 distinct storages, {expected:,} bytes ({expected / 2**20:.2f} MiB)"


def test_saved_table_without_ops_and_without_prefix(fp32_forward):
    _, trace, _, _, named = fp32_forward
    plain = saved_rows(trace)
    lines = saved_table(plain).splitlines()
    assert "saved by op.attr" not in lines[0] and "module" in lines[0]
    assert len(lines) == len(plain) + 4
    assert [line.split()[:2] for line in lines[2:-2]] == [[str(i), r.module] for i, r in enumerate(plain)]
    total = distinct_bytes(named)  # counted above against the hand count
    assert lines[-1].startswith(f"activations: {len({r.storage for r in plain if r.category == 'activations'})} ")
    assert f"{total:,} bytes" in lines[-1]
    # rows without ops next to rows with ops: no op column (the op-less rows have nothing to show)
    assert "saved by op.attr" not in saved_table([*plain[:1], *named[1:]]).splitlines()[0]


# ---- the formula next to a measured layer -----------------------------------------------------------


def _row(module: str, op: str, attr: str) -> SavedRow:
    return SavedRow(1, module, (1,), torch.bfloat16, 2, 0, 2, "activations", op=op, attr=attr, seq=0)


def test_korthikanti_role_names_a_layers_tensors():
    assert korthikanti_role(_row("blocks.3.ln2", "NativeLayerNormBackward0", "input")) == "LayerNorm inputs"
    assert korthikanti_role(_row("blocks.3.ln1", "NativeLayerNormBackward0", "result2")) == "LayerNorm mean/rstd"
    assert korthikanti_role(_row("blocks.3.mlp.gelu", "GeluBackward0", "self")) == "GELU input"
    bmm = "BmmBackward0"
    assert korthikanti_role(_row("blocks.3.attn", bmm, "self"), bmm_rank=0) == "Q and K"
    assert korthikanti_role(_row("blocks.3.attn", bmm, "mat2"), bmm_rank=1) == "V"
    assert korthikanti_role(_row("blocks.3.attn", bmm, "self"), bmm_rank=1) == "dropout output"
    assert korthikanti_role(_row("blocks.3.attn", "MaskedFillBackward0", "mask")) == "causal mask"
    assert korthikanti_role(_row("blocks.3.attn", "CloneBackward0", "self")) == "other"


def test_compare_layer_bf16_with_dropout(bf16_forward):
    b, named = bf16_forward
    s, h, a = SMALL["seq_len"], SMALL["d_model"], SMALL["n_head"]
    formula = korthikanti_terms(s, b, h, a)
    for layer in range(SMALL["n_layer"]):
        comparison = compare_layer(named, layer, s, b, h, a)
        assert all(isinstance(c, TermComparison) for c in comparison)
        rows = {c.term: c for c in comparison}
        assert list(rows) == [*formula, *EXTRA_TERMS]  # the formula's order, then the extras
        for term, nbytes in formula.items():
            mask_dtype_size = rows[term].element_size if term in MASK_TERMS else 1
            assert rows[term].measured == nbytes * mask_dtype_size, term
            assert rows[term].formula == nbytes and rows[term].difference == rows[term].measured - nbytes
        # CPU dropout keeps the scaled noise in the model dtype: 2 bytes per element in bf16
        assert all(rows[t].element_size == 2 and rows[t].dtype == "bfloat16" for t in MASK_TERMS)
        ln_stats = rows["LayerNorm mean/rstd"]
        assert ln_stats.formula == 0 and ln_stats.part == "extra"
        assert ln_stats.measured == 2 * 2 * s * b * ln_stats.element_size
        assert rows["causal mask"].measured == s * s and rows["causal mask"].dtype == "bool"
        assert sum(c.measured for c in comparison) == activations_by_part(named)[f"blocks.{layer}"]


def test_comparison_table_rows_totals_and_ratio(bf16_forward):
    b, named = bf16_forward
    s, h, a = SMALL["seq_len"], SMALL["d_model"], SMALL["n_head"]
    comparison = compare_layer(named, 0, s, b, h, a)
    stats_el = next(c.element_size for c in comparison if c.term == "LayerNorm mean/rstd")
    formula = korthikanti_layer_bytes(s, b, h, a)
    # by hand: the three masks take 2 bytes per element instead of 1 (a*s*s*b + s*b*h + s*b*h more), plus the
    # two LayerNorms' mean and rstd (2 * 2 * s*b elements) and the causal mask (s*s bools)
    measured = formula + (a * s * s * b + 2 * s * b * h) + 2 * 2 * s * b * stats_el + s * s
    lines = comparison_table(comparison).splitlines()
    header = lines[0]
    ends = {name: col_end(header, name) for name in ("formula", "measured", "difference")}
    body = lines[2 : 2 + len(comparison)]
    assert set(lines[1]) == {"-"} and set(lines[2 + len(comparison)]) == {"-"}
    for c, line in zip(comparison, body):
        assert line.startswith(c.term + " ")
        assert value_at(line, ends["formula"]) == f"{c.formula:,}"
        assert value_at(line, ends["measured"]) == f"{c.measured:,}"
        assert value_at(line, ends["difference"]) == f"{c.measured - c.formula:+,}"
    total, ratio = lines[-2], lines[-1]
    assert total.startswith("one layer ")
    # the totals sit under their columns
    assert value_at(total, ends["formula"]) == f"{formula:,}"
    assert value_at(total, ends["measured"]) == f"{measured:,}"
    assert value_at(total, ends["difference"]) == f"{measured - formula:+,}"
    assert len(total) == len(header)
    assert ratio == f"measured / formula = {measured / formula:.3f}"
