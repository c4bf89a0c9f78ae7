from fractions import Fraction

import pytest
import torch

from anatomy_helpers import StepTracker, make_model, make_optimizer
from anatomy_helpers.activations import (
    KORTHIKANTI_TERMS,
    MASK_TERMS,
    activation_scaling,
    activations_at_block_starts,
    activations_by_block,
    attach_ops,
    block_of,
    compare_layer,
    distinct_bytes,
    first_savers,
    fit_line,
    fit_quadratic,
    korthikanti_layer_bytes,
    korthikanti_terms,
    measure_scaling,
    plot_activation_buildup,
    plot_formula_vs_measured,
    plot_saved_by_module,
    plot_scaling,
    saved_by_op,
    saved_rows,
    saved_table,
    track_forward,
)
from anatomy_helpers.plots import CourseFigure

from .conftest import SMALL

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


def test_mask_terms_are_formula_terms():
    names = {t for t, *_ in KORTHIKANTI_TERMS}
    assert set(MASK_TERMS) <= names


# ---- exact fits ------------------------------------------------------------------------------------


def test_fit_line_and_quadratic_are_exact():
    xs = [1, 2, 3, 4]
    slope, intercept, ok = fit_line(xs, [7 * x + 3 for x in xs])
    assert (slope, intercept, ok) == (7, 3, True)
    assert fit_line(xs, [1, 2, 4, 8])[2] is False
    (c0, c1, c2), ok = fit_quadratic([32, 64, 96, 128], [5 + 11 * x + 13 * x * x for x in (32, 64, 96, 128)])
    assert (c0, c1, c2, ok) == (5, 11, 13, True)
    assert fit_quadratic([1, 2, 3, 4], [1, 8, 27, 64])[1] is False  # a cubic is not a quadratic
    with pytest.raises(ValueError):
        fit_quadratic([1, 2], [1, 2])


# ---- saved tensors, named ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32_forward():
    torch.set_num_threads(2)
    model = make_model(device="cpu", **SMALL)
    trace, x, y = track_forward(model, batch_size=3)
    named = attach_ops(saved_rows(trace), saved_by_op(model, x, y))
    return model, trace, x, y, named


def test_every_saved_tensor_is_named_and_lines_up(fp32_forward):
    model, trace, _, _, named = fp32_forward
    assert len(named) == len(trace.saved) > 0
    assert all(r["op"] != "?" and r["op"].endswith(("Backward0", "Backward1")) for r in named)
    ln = [r for r in named if r["module"] == "blocks.0.ln1"]
    assert {r["attr"] for r in ln} == {"input", "weight", "bias", "result1", "result2"}
    assert {r["op"] for r in ln} == {"NativeLayerNormBackward0"}
    assert next(r for r in named if r["module"] == "blocks.0.mlp.gelu")["op"] == "GeluBackward0"


def test_attach_ops_rejects_a_different_forward(fp32_forward):
    model, trace, x, y, _ = fp32_forward
    other = saved_by_op(model, x[:2], y[:2])  # batch 2 instead of 3
    with pytest.raises(ValueError):
        attach_ops(saved_rows(trace), other)
    with pytest.raises(ValueError, match="not the same forward"):
        attach_ops(saved_rows(trace), other[:-1])


def test_distinct_bytes_equals_tracker_and_hand_count(fp32_forward):
    model, trace, x, _, named = fp32_forward
    b, s = x.shape
    h, a, v, L = model.cfg.d_model, model.cfg.n_head, model.cfg.vocab_size, model.cfg.n_layer
    # fp32, manual attention, no dropout, per layer (bytes): LN inputs 2*4sbh, LN mean+rstd 2*2*4sb, QKV input 4sbh,
    # Q, K, V copies 3*4sbh, causal mask s*s (bool), softmax output 4*a*s*s*b, out-proj input 4sbh,
    # fc1 input 4sbh, GELU input 16sbh, fc2 input 16sbh
    per_layer = (8 + 4 + 12 + 4 + 4 + 16 + 16) * s * b * h + 16 * s * b + s * s + 4 * a * s * s * b
    # outside the layers: position ids (s int64), final LN (4sbh + 8sb), LM head input 4sbh,
    # log-probabilities 4sbv, the loss's total_weight (one fp32)
    outside = 8 * s + 8 * s * b * h + 8 * s * b + 4 * s * b * v + 4
    parts = activations_by_block(named)
    assert all(parts[f"blocks.{i}"] == per_layer for i in range(L))
    assert distinct_bytes(named) == L * per_layer + outside
    assert distinct_bytes(named) == trace.timeline.category("activations")[-1]
    # the storages counted once: one row per distinct storage
    assert len(first_savers(named, None)) == len({r["storage"] for r in named})


def test_views_share_storage_and_count_once(fp32_forward):
    _, _, x, _, named = fp32_forward
    s = x.shape[1]
    attn = [r for r in named if r["module"] == "blocks.0.attn"]
    probs = next(r for r in attn if r["op"] == "SoftmaxBackward0")
    # att @ v is the second batched matmul (the higher sequence number); its `self` is the probabilities
    again = max((r for r in attn if r["op"] == "BmmBackward0" and r["attr"] == "self"), key=lambda r: r["seq"])
    assert again["shape"][-2:] == (s, s)
    assert again["storage"] == probs["storage"] and not again["first"]
    assert again["same_as"] == named.index(probs)
    table = saved_table(named, prefix="blocks.0.attn")
    assert f"= #{named.index(probs)}" in table
    assert f"{distinct_bytes([r for r in named if r['module'].startswith('blocks.0.attn')]):,} bytes" in table


def test_sdpa_saves_q_k_v_as_views_of_one_storage():
    model = make_model(device="cpu", **{**SMALL, "n_layer": 1}, attn_impl="sdpa")
    trace, x, y = track_forward(model, batch_size=2)
    named = attach_ops(saved_rows(trace), saved_by_op(model, x, y))
    qkv = [r for r in named if r["attr"] in ("query", "key", "value")]
    assert len(qkv) == 3 and len({r["storage"] for r in qkv}) == 1
    b, s, h = 2, SMALL["seq_len"], SMALL["d_model"]
    assert qkv[0]["storage_bytes"] == 3 * b * s * h * 4 == 3 * qkv[0]["bytes"]


def test_block_starts_step_by_one_block(fp32_forward):
    model, trace, _, _, named = fp32_forward
    starts = activations_at_block_starts(trace)
    assert list(starts) == [f"blocks.{i}" for i in range(model.cfg.n_layer)] + ["ln_f"]
    steps = [b - a for a, b in zip(list(starts.values()), list(starts.values())[1:])]
    assert steps == [activations_by_block(named)["blocks.0"]] * model.cfg.n_layer


def test_block_of():
    assert block_of("blocks.11.attn.qkv") == "blocks.11"
    assert block_of("pos_emb") == block_of("drop") == "embeddings"
    assert block_of("ln_f") == block_of("model") == "head + loss"


# ---- the formula next to a measured layer -----------------------------------------------------------


def test_compare_layer_bf16_with_dropout():
    model = make_model(device="cpu", **SMALL, dtype="bfloat16", dropout=0.1)
    b = 2
    trace, x, y = track_forward(model, batch_size=b)
    named = attach_ops(saved_rows(trace), saved_by_op(model, x, y))
    s, h, a = SMALL["seq_len"], SMALL["d_model"], SMALL["n_head"]
    formula = korthikanti_terms(s, b, h, a)
    for layer in range(SMALL["n_layer"]):
        rows = {c["term"]: c for c in compare_layer(named, layer, s, b, h, a)}
        assert "other" not in rows
        for term, nbytes in formula.items():
            mask_dtype_size = rows[term]["element_size"] if term in MASK_TERMS else 1
            assert rows[term]["measured"] == nbytes * mask_dtype_size, term
        # CPU dropout keeps the scaled noise in the model dtype: 2 bytes per element in bf16
        assert all(rows[t]["element_size"] == 2 for t in MASK_TERMS)
        ln_stats = rows["LayerNorm mean/rstd"]
        assert ln_stats["measured"] == 2 * 2 * s * b * ln_stats["element_size"]
        assert rows["causal mask"]["measured"] == s * s
        assert sum(r["measured"] for r in rows.values()) == activations_by_block(named)[f"blocks.{layer}"]
    fig = plot_formula_vs_measured(list(rows.values()))
    assert isinstance(fig, CourseFigure) and "MiB" in fig.axes[0].get_xlabel()


# ---- scaling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["manual", "sdpa"])
def test_scaling_is_affine_in_batch_and_quadratic_only_for_manual(impl):
    L, h, a = 2, 32, 2
    res = measure_scaling(impl, (1, 2, 3), (8, 16, 24, 32), n_layer=L, d_model=h, n_head=a)
    slope, constant, affine = res.batch_fit()
    (c0, c1, c2), quadratic = res.seq_fit()
    assert affine and quadratic
    s, b = res.seq_len, res.batch_size
    mask = L * s * s if impl == "manual" else 0  # one (1, 1, s, s) bool per layer
    assert constant == mask + 8 * s + 4  # + position ids + total_weight
    assert c2 == (L * (4 * a * b + 1) if impl == "manual" else 0)
    assert c0 == 4
    fig = plot_scaling([res])
    assert isinstance(fig, CourseFigure) and "MiB" in fig.axes[0].get_ylabel()


def test_activation_scaling_panel_function(capsys):
    fig = activation_scaling(batch_size=2, seq_len=32, n_layer=1, d_model=32)
    out = capsys.readouterr().out
    assert "exact at every point" in out and "NOT" not in out
    assert len(fig.axes) == 2 and all(ax.get_title() for ax in fig.axes)


def test_no_grad_and_inference_mode_save_nothing():
    model = make_model(device="cpu", **SMALL)
    x = torch.zeros(2, SMALL["seq_len"], dtype=torch.long)
    for mode in (torch.no_grad, torch.inference_mode):
        with StepTracker(model, make_optimizer(model, "sgd")) as tr, mode():
            model(x, x)
        assert tr.trace.saved == []
        assert tr.trace.timeline.category("activations").max() == 0


def test_plots_are_course_figures(fp32_forward):
    _, trace, _, _, named = fp32_forward
    for fig in (plot_activation_buildup(trace, named), plot_saved_by_module(named)):
        assert isinstance(fig, CourseFigure)
        assert all(ax.get_title() for ax in fig.axes)
        assert any("MiB" in ax.get_xlabel() or "MiB" in ax.get_ylabel() for ax in fig.axes)
