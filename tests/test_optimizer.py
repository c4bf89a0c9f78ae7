"""Lesson 03: optimizer state, the optimizer's temporaries, bytes per parameter, master weights, table and plots.

Expected sizes come from the tensors themselves (numel * element_size), never from the tracker.
"""

import matplotlib.pyplot as plt
import pytest
import torch

from anatomy_helpers import get_batch, make_model, make_optimizer, track_steps
from anatomy_helpers.core.tensors import largest_tensor_bytes, state_bytes_by_key
from anatomy_helpers.core.units import MiB
from anatomy_helpers.lessons.lesson03_optimizer import (
    IMPLEMENTATIONS,
    TABLE_SETUPS,
    BytesPerParam,
    MasterWeightAdamW,
    Setup,
    build_optimizer,
    bytes_per_param,
    format_bytes_per_param,
    measure_setup,
    optimizer_bars,
    plot_bytes_per_param,
)
from anatomy_helpers.ui.plots import CourseFigure

from .conftest import SMALL, numel, storage_bytes


def tracked(name="adamw", implementation="single-tensor", steps=2):
    model = make_model(device="cpu", **SMALL)
    opt = build_optimizer(model, name, implementation)
    return model, opt, track_steps(model, opt, steps=steps, batch_size=2)


def hyperparameters(opt):
    return {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "foreach", "fused")}


def run_steps(model, opt, steps=3):
    for s in range(steps):
        x, y = get_batch(2, SMALL["seq_len"], step=s)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()


# ---- the optimizers and their state --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_build_optimizer_keeps_the_course_hyperparameters(name, implementation):
    model = make_model(device="cpu", **SMALL)
    opt = build_optimizer(model, name, implementation)
    reference = make_optimizer(model, name)
    assert type(opt) is type(reference)
    assert hyperparameters(opt) == hyperparameters(reference)
    group = opt.param_groups[0]
    assert bool(group.get("fused")) == (implementation == "fused")
    assert bool(group.get("foreach")) == (implementation == "foreach")


def test_build_optimizer_rejects_unknown_implementation():
    with pytest.raises(ValueError, match="implementation"):
        build_optimizer(make_model(device="cpu", **SMALL), "adamw", "vectorised")


def test_adam_state_is_twice_the_parameters_plus_a_step_scalar_each(small_run):
    """The one test of "Adam keeps 2x the parameters": by state name, in the tracker, and its lazy birth."""
    model, opt, trace = small_run
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    step_bytes = len(params) * torch.empty((), dtype=torch.float32).element_size()
    assert state_bytes_by_key(opt) == {"step": step_bytes, "exp_avg": param_bytes, "exp_avg_sq": param_bytes}
    ph1, ph2 = trace.optimizer_phase(1), trace.optimizer_phase(2)
    assert ph1.state_before == 0  # nothing before the first step(): the state is created lazily inside it
    assert ph1.state_after == ph2.state_before == ph2.state_after == 2 * param_bytes + step_bytes
    assert ph1.extra_peak > 2 * param_bytes  # the state and the update's temporaries
    assert ph2.extra_peak == ph2.temporaries > 0  # later steps: only temporaries come and go
    backward_peaks = [trace.peak(step=s, phase="backward").bytes for s in (1, 2)]
    assert backward_peaks[1] - backward_peaks[0] == ph1.state_after  # the same backward, now on top of the state
    with pytest.raises(ValueError, match="no 'optimizer' phase"):
        trace.optimizer_phase(4)


def test_momentum_state_is_one_buffer_per_parameter():
    model = make_model(device="cpu", **SMALL)
    opt = build_optimizer(model, "momentum")
    assert state_bytes_by_key(opt) == {}  # nothing before the first step
    run_steps(model, opt, steps=1)
    assert state_bytes_by_key(opt) == {"momentum_buffer": sum(p.numel() * p.element_size() for p in model.parameters())}


def test_state_bytes_count_every_device_unless_one_is_named():
    model = make_model(device="cpu", **SMALL)
    opt = build_optimizer(model, "adamw", "fused")
    run_steps(model, opt, steps=1)
    every = state_bytes_by_key(opt)
    assert every == state_bytes_by_key(opt, device="cpu") == state_bytes_by_key(opt, device=None)
    assert every["step"] == 4 * len(list(model.parameters()))  # fused: one 4-byte float32 step per parameter
    assert state_bytes_by_key(opt, device="meta") == dict.fromkeys(every, 0)


def test_largest_tensor_bytes():
    ts = [torch.zeros(3, dtype=torch.float32), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(2, 2)]
    assert largest_tensor_bytes(ts) == 2 * 2 * 4
    assert largest_tensor_bytes([]) == 0


# ---- master weights ----------------------------------------------------------------------------------------------
def test_master_weight_adamw_matches_torch_adamw_on_fp32():
    a, b = make_model(device="cpu", **SMALL), make_model(device="cpu", **SMALL)
    run_steps(a, torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=False))
    run_steps(b, MasterWeightAdamW(b.parameters(), lr=1e-2, weight_decay=0.1))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    fresh = make_model(device="cpu", **SMALL)
    assert not any(torch.equal(pa, pf) for pa, pf in zip(a.parameters(), fresh.parameters()) if pa.ndim == 2)


def test_master_weight_adamw_updates_fp32_masters_and_rounds_into_bf16():
    model = make_model(device="cpu", dtype="bfloat16", **SMALL)
    params = list(model.parameters())
    shadow = [p.detach().float().clone().requires_grad_() for p in params]  # the fp32 weights, independently
    reference = torch.optim.AdamW(shadow, lr=1e-2, weight_decay=0.1, foreach=False)
    opt = MasterWeightAdamW(params, lr=1e-2, weight_decay=0.1, keep_fp32_grads=True)
    for s in range(2):
        x, y = get_batch(2, SMALL["seq_len"], step=s)
        model(x, y)[1].backward()
        for p, q in zip(params, shadow):
            q.grad = p.grad.float()
        reference.step()
        opt.step()
        opt.zero_grad()
    for p, q in zip(params, shadow):
        assert p.dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["master"], q.detach())
        assert torch.equal(p, q.detach().to(torch.bfloat16))
    assert any(not torch.equal(q.detach(), q.detach().to(torch.bfloat16).float()) for q in shadow)  # masters are finer


def test_master_weight_state_is_created_at_construction_then_lazily():
    model = make_model(device="cpu", dtype="bfloat16", **SMALL)
    n = numel(model)
    opt = MasterWeightAdamW(model.parameters())
    assert state_bytes_by_key(opt) == {"master": 4 * n}
    run_steps(model, opt, steps=1)
    assert state_bytes_by_key(opt) == {"master": 4 * n, "exp_avg": 4 * n, "exp_avg_sq": 4 * n}
    assert all(s["step"] == 1 for s in opt.state.values())


@pytest.mark.parametrize("keep", [True, False])
def test_master_weight_temporaries_are_the_fp32_gradients(keep):
    model, opt = Setup("x", dtype="bfloat16", master_weights=True, keep_fp32_grads=keep).build(device="cpu", **SMALL)
    trace = track_steps(model, opt, steps=2, batch_size=2)
    largest_numel = max(p.numel() for p in model.parameters())
    expected = 4 * numel(model) if keep else 4 * largest_numel
    assert trace.optimizer_phase(2).temporaries == expected


# ---- temporaries and bytes per parameter -------------------------------------------------------------------------
def test_temporaries_by_implementation():
    params = list(make_model(device="cpu", **SMALL).parameters())
    largest = max(p.numel() for p in params) * 4
    param_bytes = 4 * sum(p.numel() for p in params)
    temps = {impl: tracked("adamw", impl)[2].optimizer_phase(2).temporaries for impl in IMPLEMENTATIONS}
    assert temps["foreach"] == param_bytes  # the sqrt of every exp_avg_sq at once
    assert 2 * largest <= temps["single-tensor"] <= 3 * largest
    assert temps["fused"] == 0


def test_optimizer_that_allocates_nothing_peaks_just_before_step():
    model, _, trace = tracked("sgd")
    ph = trace.optimizer_phase(2)
    assert ph.peak_index == ph.start - 1
    assert ph.temporaries == ph.extra_peak == 0
    assert ph.peak["gradients"] == 4 * numel(model)


def test_bytes_per_param_fp32_adamw():
    model, opt, trace = tracked("adamw", "fused")
    n, n_tensors = numel(model), len(list(model.parameters()))
    assert storage_bytes(model.buffers()) > 0  # the attention masks, which the weights must leave out
    row = bytes_per_param(trace, model, label="fused")
    assert row.num_params == n and row.label == "fused"
    assert row.weights == 4 and row.gradients == 4
    assert row.optimizer_state * n == 8 * n + 4 * n_tensors  # exp_avg + exp_avg_sq + one 4-byte step each
    assert row.temporaries == 0
    assert row.as_bytes() == {"weights": 4 * n, "gradients": 4 * n, "optimizer_state": 8 * n + 4 * n_tensors,
                              "temporaries": 0}  # fmt: skip
    assert row.total == pytest.approx(16 + 4 * n_tensors / n)


def test_measure_setup_mixed_precision_is_20_bytes_with_fp32_grads():
    model = make_model(device="cpu", **SMALL)
    row = measure_setup(TABLE_SETUPS[-1], device="cpu", **SMALL)
    assert row.num_params == numel(model)
    assert (row.weights, row.gradients, row.optimizer_state, row.temporaries) == (2, 2, 12, 4)
    assert row.total == 20


def test_setup_validation_and_table_labels():
    with pytest.raises(ValueError, match="AdamW only"):
        Setup("x", optimizer="sgd", master_weights=True).build(device="cpu", **SMALL)
    model, opt = Setup("y", dtype="bfloat16").build(device="cpu", **SMALL)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert isinstance(opt, torch.optim.AdamW)
    assert len({s.label for s in TABLE_SETUPS}) == len(TABLE_SETUPS)


def test_format_bytes_per_param_writes_one_row_per_setup():
    rows = [
        BytesPerParam("fp32, SGD", 1000, 4.0, 4.0, 0.0, 0.0),
        BytesPerParam("a much longer setup label", 1000, 2.0, 2.0, 12.0, 0.333),
    ]
    lines = format_bytes_per_param(rows).splitlines()
    assert lines[0].split()[:2] == ["setup", "weights"] and lines[0].endswith("(bytes per parameter)")
    assert set(lines[1]) == {"-"} and len(lines) == 2 + len(rows)
    assert lines[2].startswith("fp32, SGD ") and lines[2].split()[-5:] == ["4.00", "4.00", "0.00", "0.00", "8.00"]
    assert lines[3].startswith("a much longer setup label ")
    assert lines[3].split()[-5:] == ["2.00", "2.00", "12.00", "0.33", "16.33"]  # total = 2 + 2 + 12 + 0.333
    assert len({len(line) for line in lines[2:]}) == 1  # the columns line up whatever the label


# ---- figures -----------------------------------------------------------------------------------------------------
def test_plot_bytes_per_param_stacks_the_four_parts():
    rows = [BytesPerParam("a", 10, 4.0, 4.0, 8.0, 0.0), BytesPerParam("b", 10, 2.0, 2.0, 12.0, 4.0)]
    fig = plot_bytes_per_param(rows)
    ax = fig.axes[0]
    assert isinstance(fig, CourseFigure) and "bytes per parameter" in ax.get_xlabel()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    widths = sorted(round(p.get_width(), 6) for p in ax.patches)
    assert widths == sorted([4.0, 4.0, 8.0, 0.0, 2.0, 2.0, 12.0, 4.0])
    # every label inside the frame: the textbook lines' above the first bar, the totals right of the longest bar
    (x0, x1), (y_bottom, y_top) = ax.get_xlim(), ax.get_ylim()
    marks = {t.get_text(): t.get_position() for t in ax.texts}
    assert {"16 B", "20 B", "16.0", "20.0"} <= set(marks)
    for text, (x, y) in marks.items():
        assert x0 < x < x1 and y_top < y < y_bottom, text  # y is inverted: the first row on top
    assert marks["16 B"][1] < -0.5  # above the first bar (at y = 0), not on it
    assert marks["20.0"][0] + 1.5 < x1  # the longest total's label has room before the frame
    assert plt.get_fignums() == []


def test_optimizer_bars_prints_and_plots_every_optimizer(capsys):
    fig = optimizer_bars(d_model=32, n_layer=1, batch_size=2, seq_len=16, device="cpu")
    assert isinstance(fig, CourseFigure) and "MiB" in fig.axes[0].get_ylabel()
    lines = capsys.readouterr().out.splitlines()
    params = list(make_model(device="cpu", d_model=32, n_layer=1, n_head=4, seq_len=16).parameters())
    n = sum(p.numel() for p in params)
    assert lines[0] == f"{n:,} parameters = {4 * n / MiB:.2f} MiB in fp32; single-tensor implementation"
    assert [line.split()[0] for line in lines[1:]] == ["sgd", "momentum", "adam", "adamw"]
    adamw_state = 8 * n + 4 * len(params)  # exp_avg and exp_avg_sq in fp32, and a 4-byte step per tensor
    assert f"optimizer state {adamw_state / MiB:.2f};" in lines[-1]
    assert plt.get_fignums() == []  # no pyplot figure left open


def test_the_panel_shows_what_the_implementation_changes():
    """Its step peaks are in backward, where no optimizer has run: the diamonds (step 2's optimizer-phase peaks)
    must move with the implementation, or the panel's dropdown would change nothing on screen."""
    import contextlib
    import io

    from anatomy_helpers.lessons.lesson03_optimizer import optimizer_bars
    from anatomy_helpers.ui.widgets import figure_digest

    digests = {}
    for impl in ("single-tensor", "foreach", "fused"):
        with contextlib.redirect_stdout(io.StringIO()):
            fig = optimizer_bars(d_model=64, n_layer=1, implementation=impl, batch_size=2, seq_len=32, device="cpu")
        digests[impl] = figure_digest(fig)
        marks = [line for line in fig.axes[0].get_lines() if line.get_marker() == "D"]
        assert len(marks) == 1 and "optimizer-phase peak" in marks[0].get_label()
    assert len(set(digests.values())) == 3


def test_optimizer_bars_stack_each_optimizers_model_states_up_to_its_peak(capsys):
    """Each bar (notebook 03's panel): parameters, gradients and optimizer state as step 2's optimizer phase begins,
    counted here from the model's tensors (sgd keeps no state, momentum one buffer, Adam and AdamW two moments and a
    step per tensor), topped up to the run's peak; the number over it states the peak, and AdamW's peak is what a
    second tracked run of the same setup measures."""
    from .figure_data import numbers_in, unit_bytes

    fig = optimizer_bars(d_model=32, n_layer=1, batch_size=2, seq_len=16, device="cpu")
    capsys.readouterr()
    ax = fig.axes[0]
    scale = unit_bytes(ax.get_ylabel())
    names = [t.get_text() for t in ax.get_xticklabels()]
    assert names == ["sgd", "momentum", "adam", "adamw"]
    model = make_model(device="cpu", d_model=32, n_layer=1, n_head=4, seq_len=16)
    params = list(model.parameters())
    n, tensors = sum(p.numel() for p in params), len(params)
    weights = storage_bytes([*params, *model.buffers()])  # the buffers (the causal mask) count as parameters
    state = {"sgd": 0, "momentum": 4 * n, "adam": 8 * n + 4 * tensors, "adamw": 8 * n + 4 * tensors}
    heights = {c.get_label(): [b.get_height() * scale for b in c.patches] for c in ax.containers}
    assert heights["parameters"] == pytest.approx([weights] * 4) and heights["gradients"] == pytest.approx([4 * n] * 4)
    assert heights["optimizer state"] == pytest.approx([state[name] for name in names])
    tops = [max(b.get_y() + b.get_height() for b in ax.patches if abs(b.get_x() + b.get_width() / 2 - i) < 0.01)
            for i in range(4)]  # fmt: skip
    assert [numbers_in(t.get_text())[0] for t in ax.texts] == [round(top, 1) for top in tops]
    again = track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=2)
    assert tops[3] * scale == pytest.approx(again.timeline.bytes.sum(axis=1).max())
    [diamonds] = [ln for ln in ax.get_lines() if ln.get_marker() == "D"]
    in_phase = again.timeline.bytes[again.window(2, "optimizer")].sum(axis=1).max()
    assert diamonds.get_ydata()[3] * scale == pytest.approx(in_phase)
