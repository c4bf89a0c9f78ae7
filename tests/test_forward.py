"""anatomy_helpers.lessons.lesson01_forward (notebook 01): a tracked forward, block boundaries, the build-up plot,
scaling.

The saved-tensor core (saved_rows, attach_ops, saved_table, compare_layer ...) is tested in test_saved.py.
"""

import pytest
import torch

from anatomy_helpers import StepTracker, make_model, make_optimizer
from anatomy_helpers.lessons.lesson01_forward import (
    activation_scaling,
    activations_at_block_starts,
    block_boundaries,
    fit_line,
    fit_quadratic,
    forward_activation_bytes,
    measure_scaling,
    plot_activation_buildup,
    plot_formula_vs_measured,
    plot_saved_by_module,
    plot_scaling,
    track_forward,
)
from anatomy_helpers.prediction.saved import (
    TermComparison,
    activations_by_part,
    attach_ops,
    distinct_bytes,
    saved_by_op,
    saved_rows,
)
from anatomy_helpers.ui.plots import CourseFigure

from .conftest import SMALL, THREADS
from .test_saved import fp32_layer_bytes, fp32_outside_bytes


@pytest.fixture(scope="module")
def fp32_forward():
    torch.set_num_threads(THREADS)  # module fixtures run before the autouse one: the same threads as the tests
    model = make_model(device="cpu", **SMALL)
    trace, x, y = track_forward(model, batch_size=3)
    named = attach_ops(saved_rows(trace), saved_by_op(model, x, y))
    return model, trace, x, y, named


# ---- one tracked forward ---------------------------------------------------------------------------


def test_track_forward_tracks_one_forward_of_a_course_batch(fp32_forward):
    model, trace, x, y, _ = fp32_forward
    assert x.shape == y.shape == (3, SMALL["seq_len"]) and x.dtype == torch.long
    assert trace.training_steps() == [1]
    assert len(trace.window(1, "backward")) == len(trace.window(1, "optimizer")) == 0  # a forward only
    # the activations alive at the end are what the forward saved, counted by hand
    b, s, cfg = 3, SMALL["seq_len"], model.cfg
    embeddings, head = fp32_outside_bytes(s, b, cfg.d_model, cfg.vocab_size)
    expected = cfg.n_layer * fp32_layer_bytes(s, b, cfg.d_model, cfg.n_head) + embeddings + head
    assert trace.timeline.category("activations")[-1] == expected


def test_forward_activation_bytes_at_a_shorter_sequence():
    model = make_model(device="cpu", **SMALL)
    cfg, b, s = model.cfg, 2, SMALL["seq_len"] // 2
    embeddings, head = fp32_outside_bytes(s, b, cfg.d_model, cfg.vocab_size)
    expected = cfg.n_layer * fp32_layer_bytes(s, b, cfg.d_model, cfg.n_head) + embeddings + head
    assert forward_activation_bytes(model, b, s) == expected


# ---- block boundaries -------------------------------------------------------------------------------


def test_block_boundaries_are_in_forward_order_inside_the_forward(fp32_forward):
    model, trace, _, _, _ = fp32_forward
    bounds = block_boundaries(trace)
    assert list(bounds) == [f"blocks.{i}" for i in range(model.cfg.n_layer)] + ["ln_f"]
    starts = list(bounds.values())
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert set(starts) <= set(trace.window(1, "forward").tolist())


def test_block_starts_step_by_one_block_in_every_training_step(small_trace):
    rows = saved_rows(small_trace)
    b, s, h, a, L = 4, SMALL["seq_len"], SMALL["d_model"], SMALL["n_head"], SMALL["n_layer"]
    per_layer = fp32_layer_bytes(s, b, h, a)
    for step in small_trace.training_steps():
        starts = activations_at_block_starts(small_trace, step)
        assert list(starts) == [f"blocks.{i}" for i in range(L)] + ["ln_f"]
        values = list(starts.values())
        assert [y - x for x, y in zip(values, values[1:])] == [per_layer] * L
        assert activations_by_part([r for r in rows if r.step == step])["blocks.0"] == per_layer


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
    with pytest.raises(ValueError):
        fit_line([1], [1])


# ---- scaling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["manual", "sdpa"])
def test_scaling_is_affine_in_batch_and_quadratic_only_for_manual(impl):
    L, h, a = 2, 32, 2
    res = measure_scaling(impl, (1, 2, 3), (8, 16, 24, 32), n_layer=L, d_model=h, n_head=a)
    assert (res.batch_sizes, res.seq_lens) == ([1, 2, 3], [8, 16, 24, 32])
    slope, constant, affine = res.batch_fit()
    (c0, c1, c2), quadratic = res.seq_fit()
    assert affine and quadratic
    s, b = res.seq_len, res.batch_size
    assert (s, b) == (32, 3)  # the longest sequence, the largest batch
    mask = L * s * s if impl == "manual" else 0  # one (1, 1, s, s) bool per layer
    assert constant == mask + 8 * s + 4  # + position ids + total_weight
    assert c2 == (L * (4 * a * b + 1) if impl == "manual" else 0)
    assert c0 == 4
    assert res.summary().count("exact at every point") == 2
    fig = plot_scaling([res])
    assert isinstance(fig, CourseFigure) and "MiB" in fig.axes[0].get_ylabel()


def test_activation_scaling_panel_function(capsys):
    fig = activation_scaling(batch_size=2, seq_len=32, n_layer=1, d_model=32)
    out = capsys.readouterr().out
    assert "exact at every point" in out and "NOT" not in out
    assert len(fig.axes) == 2 and all(ax.get_title() for ax in fig.axes)


# ---- no graph, no activations -------------------------------------------------------------------------


def test_no_grad_and_inference_mode_save_nothing():
    model = make_model(device="cpu", **SMALL)
    x = torch.zeros(2, SMALL["seq_len"], dtype=torch.long)
    for mode in (torch.no_grad, torch.inference_mode):
        with StepTracker(model, make_optimizer(model, "sgd")) as tr, mode():
            model(x, x)
        assert tr.trace.saved == []
        assert tr.trace.timeline.category("activations").max() == 0


# ---- plots -------------------------------------------------------------------------------------------


def test_plots_are_course_figures(fp32_forward):
    _, trace, _, _, named = fp32_forward
    for fig in (plot_activation_buildup(trace, named), plot_saved_by_module(named)):
        assert isinstance(fig, CourseFigure)
        assert all(ax.get_title() for ax in fig.axes)
        assert any("MiB" in ax.get_xlabel() or "MiB" in ax.get_ylabel() for ax in fig.axes)


def test_buildup_bars_are_the_parts_in_forward_order(fp32_forward):
    _, trace, _, _, named = fp32_forward
    bars = plot_activation_buildup(trace, named).axes[1]
    labels = [t.get_text() for t in bars.get_yticklabels()]
    assert labels == ["embeddings", "block 0", "block 1", "head"]
    parts = activations_by_part(named)
    widths = [p.get_width() for p in bars.patches]
    assert widths == pytest.approx([v / 2**20 for v in parts.values()])  # MiB, the unit of the x label
    assert sum(parts.values()) == distinct_bytes(named)
    with pytest.raises(ValueError, match="no forward samples"):
        plot_activation_buildup(trace, named, step=2)


def test_plot_formula_vs_measured_has_a_pair_of_bars_per_term():
    comparison = [
        TermComparison("QKV input", "attention", 2 * 2**20, 2 * 2**20, "bfloat16", 2),
        TermComparison("MLP dropout mask", "mlp", 2**20, 2 * 2**20, "bfloat16", 2),
    ]
    fig = plot_formula_vs_measured(comparison)
    ax = fig.axes[0]
    assert isinstance(fig, CourseFigure) and "MiB" in ax.get_xlabel()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["QKV input", "MLP dropout mask"]
    assert [p.get_width() for p in ax.patches] == [2, 1, 2, 2]  # formula bars, then measured bars (MiB)
    assert [t.get_text().strip() for t in ax.texts] == ["+1.000"]  # only the term that differs is labelled


# ---- the plotted data against what each figure claims (tests/figure_data.py reads a figure back) ----


def test_the_buildup_line_draws_the_live_activations_of_the_forward(fp32_forward):
    import numpy as np

    from .figure_data import line, numbers_in, unit_bytes

    _, trace, _, _, named = fp32_forward
    fig = plot_activation_buildup(trace, named)
    ax, bx = fig.axes
    scale = unit_bytes(ax.get_ylabel())
    forward = trace.window(1, "forward")
    acts = trace.timeline.category("activations")[forward]
    live = line(ax, "activations (live)")
    assert list(live.get_xdata()) == list(range(len(forward)))
    np.testing.assert_allclose(live.get_ydata() * scale, acts)
    # a dot on the line just before each block (and the head) starts: the bytes alive when it begins
    starts = activations_at_block_starts(trace)
    dots = sorted(float(ln.get_ydata()[0]) * scale for ln in ax.get_lines() if ln.get_marker() == "o")
    assert dots == pytest.approx(sorted(v for v in starts.values() if v), abs=1e-6)
    # each bar's label states its width (MiB), the part's saved bytes
    parts = activations_by_part(named)
    assert [numbers_in(t.get_text())[0] for t in bx.texts] == [
        round(v / unit_bytes(bx.get_xlabel()), 2) for v in parts.values()
    ]


def test_saved_by_module_draws_each_sub_modules_first_saved_storages(fp32_forward):
    """Each bar: the bytes of the distinct activation storages a sub-module of blocks.0 saved first, summed here from
    the trace's saved tensors (the first row naming each storage), and its label states that number."""
    from .figure_data import numbers_in, unit_bytes

    _, trace, _, _, named = fp32_forward
    first: dict[int, object] = {}
    for t in trace.saved:
        first.setdefault(t.storage, t)
    want: dict[str, int] = {}
    for t in first.values():
        if t.category == "activations" and t.module.startswith("blocks.0"):
            want[t.module] = want.get(t.module, 0) + t.storage_bytes
    ax = plot_saved_by_module(named).axes[0]
    scale = unit_bytes(ax.get_xlabel())
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert dict(zip(names, (p.get_width() * scale for p in ax.patches), strict=True)) == pytest.approx(want)
    assert [numbers_in(t.get_text())[0] for t in ax.texts] == [round(want[n] / scale, 2) for n in names]


def test_the_scaling_plot_draws_the_measured_points_and_the_exact_fits_through_them():
    import numpy as np

    from .figure_data import line, unit_bytes

    res = measure_scaling("manual", (1, 2, 3), (8, 16, 24), n_layer=1, d_model=32, n_head=2)
    ax, bx = plot_scaling([res]).axes
    scale = unit_bytes(ax.get_ylabel())
    for axes, xs, ys, degree in ((ax, res.batch_sizes, res.batch_bytes, 1), (bx, res.seq_lens, res.seq_bytes, 2)):
        measured = line(axes, "manual: measured")
        assert list(measured.get_xdata()) == xs and list(measured.get_ydata() * scale) == pytest.approx(ys)
        [fit] = [ln for ln in axes.get_lines() if ln.get_label().startswith("manual: fit")]
        exact = np.polyfit(xs, ys, degree)  # through every measured point: the fit the plot says it draws
        assert np.polyval(exact, xs) == pytest.approx(ys)
        np.testing.assert_allclose(fit.get_ydata() * scale, np.polyval(exact, fit.get_xdata()), rtol=1e-6)
    linear = line(bx, "manual: its linear part")  # the quadratic's a + b·s: the gap to the fit is its c·s²
    c2, c1, c0 = np.polyfit(res.seq_lens, res.seq_bytes, 2)
    assert c2 > 0
    np.testing.assert_allclose(linear.get_ydata() * scale, c0 + c1 * linear.get_xdata(), rtol=1e-6)
