import matplotlib
import pytest
import torch

from anatomy_helpers import get_batch, make_model, make_optimizer, track_steps
from anatomy_helpers.optim_memory import (
    IMPLEMENTATIONS,
    TABLE_SETUPS,
    MasterWeightAdamW,
    Setup,
    build_optimizer,
    bytes_per_param,
    format_bytes_per_param,
    largest_tensor_bytes,
    measure_setup,
    optimizer_bars,
    optimizer_phase,
    plot_bytes_per_param,
    plot_optimizer_phase,
    state_bytes_by_key,
)
from anatomy_helpers.plots import CourseFigure

from .conftest import SMALL, storage_bytes

matplotlib.use("Agg")


def numel(model):
    return sum(p.numel() for p in model.parameters())


def tracked(name="adamw", implementation="single-tensor", steps=2):
    model = make_model(device="cpu", **SMALL)
    opt = build_optimizer(model, name, implementation)
    return model, opt, track_steps(model, opt, steps=steps, batch_size=2)


def hyperparameters(opt):
    return {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "foreach", "fused")}


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


def run_steps(model, opt, steps=3):
    for s in range(steps):
        x, y = get_batch(2, SMALL["seq_len"], step=s)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()


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
    assert optimizer_phase(trace, 2).temporaries == expected


def test_optimizer_phase_sees_lazy_state_and_no_growth_later():
    model, opt, trace = tracked("adamw")
    ph1, ph2 = optimizer_phase(trace, 1), optimizer_phase(trace, 2)
    state = storage_bytes([v for s in opt.state.values() for v in s.values()])
    assert ph1.state_before == 0 and ph1.state_after == state
    assert ph2.state_before == ph2.state_after == state
    assert ph2.extra_peak == ph2.temporaries > 0
    assert ph1.extra_peak > state  # the state and the temporaries of the update
    with pytest.raises(ValueError, match="no optimizer phase"):
        optimizer_phase(trace, 3)


def test_temporaries_by_implementation():
    params = list(make_model(device="cpu", **SMALL).parameters())
    largest = max(p.numel() for p in params) * 4
    param_bytes = 4 * sum(p.numel() for p in params)
    temps = {impl: optimizer_phase(tracked("adamw", impl)[2], 2).temporaries for impl in IMPLEMENTATIONS}
    assert temps["foreach"] == param_bytes  # the sqrt of every exp_avg_sq at once
    assert 2 * largest <= temps["single-tensor"] <= 3 * largest
    assert temps["fused"] == 0


def test_optimizer_that_allocates_nothing_peaks_just_before_step():
    model, _, trace = tracked("sgd")
    ph = optimizer_phase(trace, 2)
    assert ph.peak_index == ph.start - 1
    assert ph.temporaries == ph.extra_peak == 0
    assert ph.peak["gradients"] == 4 * numel(model)


def test_bytes_per_param_fp32_adamw():
    model, opt, trace = tracked("adamw", "fused")
    n, n_tensors = numel(model), len(list(model.parameters()))
    row = bytes_per_param(trace, model, label="fused")
    assert row.num_params == n and row.label == "fused"
    assert row.weights == 4 and row.gradients == 4  # the attention-mask buffers are left out
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


def test_state_bytes_by_key():
    model = make_model(device="cpu", **SMALL)
    opt = build_optimizer(model, "momentum")
    run_steps(model, opt, steps=1)
    assert state_bytes_by_key(opt) == {"momentum_buffer": 4 * numel(model)}
    assert state_bytes_by_key(opt, device="meta") == {"momentum_buffer": 0}


def test_setup_validation_and_table_labels():
    with pytest.raises(ValueError, match="AdamW only"):
        Setup("x", optimizer="sgd", master_weights=True).build(device="cpu", **SMALL)
    model, opt = Setup("y", dtype="bfloat16").build(device="cpu", **SMALL)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert isinstance(opt, torch.optim.AdamW)
    assert len({s.label for s in TABLE_SETUPS}) == len(TABLE_SETUPS)


def test_largest_tensor_bytes():
    ts = [torch.zeros(3, dtype=torch.float32), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(2, 2)]
    assert largest_tensor_bytes(ts) == 16
    assert largest_tensor_bytes([]) == 0


def test_plots_return_course_figures(capsys):
    import matplotlib.pyplot as plt

    model, _, trace = tracked("adamw")
    fig = plot_optimizer_phase(trace, steps=(1, 2))
    assert isinstance(fig, CourseFigure) and len(fig.axes) == 2
    fig = plot_optimizer_phase({"a": trace, "b": trace}, steps=(2,))
    assert [ax.get_title() for ax in fig.axes] == ["a: step 2", "b: step 2"]
    row = bytes_per_param(trace, model, label="adamw")
    fig = plot_bytes_per_param([row, row])
    assert isinstance(fig, CourseFigure) and "bytes per parameter" in fig.axes[0].get_xlabel()
    table = format_bytes_per_param([row])
    assert "adamw" in table and f"{row.total:.2f}" in table
    fig = optimizer_bars(d_model=32, n_layer=1, batch_size=2, seq_len=16, device="cpu")
    assert isinstance(fig, CourseFigure) and "MiB" in fig.axes[0].get_ylabel()
    out = capsys.readouterr().out
    assert all(name in out for name in ("sgd", "momentum", "adam", "adamw"))
    assert plt.get_fignums() == []  # no pyplot figure left open
