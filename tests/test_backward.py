import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from anatomy_helpers import make_model, make_optimizer
from anatomy_helpers.backward import (
    backward_profile,
    largest_allocation,
    live_allocations,
    live_by_part,
    max_category,
    model_parts,
    part_of,
    phase_window,
    plot_backward_parts,
    plot_category,
    plot_timelines,
    track_training,
)
from anatomy_helpers.tracker import CATEGORIES

from .conftest import SMALL, storage_bytes

BATCH = 4


def phase_end(trace, step, phase):
    return next(ph for ph in trace.phases() if ph.step == step and ph.phase == phase).at_end


def fresh():
    model = make_model(device="cpu", **SMALL)
    return model, make_optimizer(model, "adamw")


def param_bytes_by_part(model):
    """Parameter bytes per model part, from the parameter names (tied weights counted once)."""
    out = dict.fromkeys(model_parts(SMALL["n_layer"]), 0)
    for name, p in model.named_parameters():
        out[part_of(name.rpartition(".")[0])] += p.numel() * p.element_size()
    return out


@pytest.fixture(scope="module")
def run():
    torch.set_num_threads(2)
    model, opt = fresh()
    return model, track_training(model, opt, steps=2, batch_size=BATCH)


@pytest.fixture(scope="module")
def forward_activations(run):
    _, trace = run
    return phase_end(trace, 1, "forward")["activations"]


def test_part_of_names_the_model_parts():
    assert part_of("blocks.3.mlp.fc") == "blocks.3"
    assert part_of("blocks.10") == "blocks.10"
    assert part_of("tok_emb") == part_of("pos_emb") == "embeddings"
    assert part_of("ln_f") == part_of("lm_head") == part_of("model") == "head"
    assert part_of("-") is None and part_of("optimizer.step") is None
    assert model_parts(2) == ["embeddings", "blocks.0", "blocks.1", "head"]


def test_every_gradient_is_mapped_to_its_parameter(run):
    model, trace = run
    names = [n for n, p in model.named_parameters()]
    mapped = trace.meta["grad_param"]
    assert sorted(mapped.values()) == sorted(names * 2)  # one fresh gradient storage per parameter per step


def test_parts_add_up_to_the_tracker_totals(run):
    _, trace = run
    parts, live = live_by_part(trace)
    assert parts == model_parts(SMALL["n_layer"])
    assert np.array_equal(live[1:, 0].sum(axis=1), trace.timeline.category("activations"))
    assert np.array_equal(live[1:, 1].sum(axis=1), trace.timeline.category("gradients"))


def test_gradients_per_part_equal_parameter_bytes_per_part(run):
    model, trace = run
    expected = param_bytes_by_part(model)
    for step in (1, 2):
        prof = backward_profile(trace, step)
        assert dict(zip(prof.parts, prof.gradients[-1].tolist())) == expected
        assert not prof.gradients_before.any()  # zero_grad(set_to_none=True) left none


def test_activations_are_released_in_reverse_order(run, forward_activations):
    _, trace = run
    prof = backward_profile(trace, 1)
    assert prof.activations_before.sum() == forward_activations
    assert not prof.activations[-1].any()
    released = prof.released_at()
    order = sorted(released, key=released.get)
    assert order == prof.parts[::-1]
    blocks = [f"blocks.{i}" for i in range(SMALL["n_layer"])]
    assert len({prof.activations_before[prof.parts.index(b)] for b in blocks}) == 1  # same bytes per block


def test_gradients_arrive_block_by_block_from_the_output(run):
    _, trace = run
    prof = backward_profile(trace, 2)
    start, done = prof.gradients_from(), prof.gradients_complete_at()
    backward_order = prof.parts[::-1]
    assert sorted(start, key=start.get) == backward_order
    for later, earlier in zip(backward_order, backward_order[1:]):
        assert done[later] < start[earlier]  # a part's gradients are all there before the next part's begin


def test_profile_of_a_missing_step_raises(run):
    _, trace = run
    with pytest.raises(ValueError, match="no backward samples"):
        backward_profile(trace, 7)


def test_largest_temporaries_are_gradients_of_the_widest_activations(run):
    model, trace = run
    B, T, h = BATCH, SMALL["seq_len"], SMALL["d_model"]
    # backward: the gradient with respect to the MLP's hidden activation (B, T, 4h), fp32
    assert largest_allocation(trace, "temporaries", 2, "backward") == B * T * 4 * h * 4
    # forward: the qkv projection's output (B, T, 3h), split into views that matmul copies
    assert largest_allocation(trace, "temporaries", 2, "forward") == B * T * 3 * h * 4
    assert max_category(trace, "temporaries", 2, "backward") > max_category(trace, "temporaries", 2, "forward")
    assert largest_allocation(trace, "optimizer_state", 2, "backward") == 0


def test_live_allocations_add_up_to_the_category(run):
    _, trace = run
    for index in (phase_window(trace, 2, "backward")[5], trace.peak().index):
        for cat in CATEGORIES:
            rows = live_allocations(trace, int(index), cat)
            assert sum(b for b, _ in rows) == trace.timeline.category(cat)[index]
            assert [b for b, _ in rows] == sorted((b for b, _ in rows), reverse=True)


def test_set_to_none_false_keeps_gradients_and_reuses_them():
    model, opt = fresh()
    trace = track_training(model, opt, steps=2, batch_size=BATCH, set_to_none=False)
    params = storage_bytes(model.parameters())
    assert phase_end(trace, 1, "optimizer")["gradients"] == params
    grads_in_step2 = trace.timeline.category("gradients")[trace.timeline.step == 2]
    assert (grads_in_step2 == params).all()
    rec = trace.allocation_record()
    new_grads = (rec["category"] == CATEGORIES.index("gradients")) & (rec["bytes"] > 0) & (rec["step"] == 2)
    assert not new_grads.any()  # accumulated in place into step 1's storages


def test_retain_graph_keeps_activations_until_the_loss_dies(forward_activations):
    model, opt = fresh()
    trace = track_training(model, opt, steps=2, batch_size=BATCH, retain_graph=True)
    for step in (1, 2):
        assert phase_end(trace, step, "backward")["activations"] == forward_activations
    # the loop drops `loss` at the end of step 1: its graph dies then, not at the end of training
    assert phase_end(trace, 2, "idle")["activations"] == 0


def test_keeping_the_loss_after_backward_costs_only_the_loss_itself(run):
    model, opt = fresh()
    trace = track_training(model, opt, steps=2, batch_size=BATCH, keep="loss")
    _, reference = run
    scalar = torch.zeros((), dtype=torch.float32).element_size()  # step 1's loss, still referenced
    assert trace.peak(step=2).bytes == reference.peak(step=2).bytes + scalar
    assert phase_end(trace, 2, "backward")["activations"] == 0


def test_keeping_a_validation_loss_keeps_its_graph(forward_activations):
    model, opt = fresh()
    trace = track_training(model, opt, steps=2, batch_size=BATCH, keep="val_loss")
    for step in (1, 2):
        assert phase_end(trace, step, "backward")["activations"] == step * forward_activations


def test_forward_backward_only_keeps_gradients():
    model, opt = fresh()
    trace = track_training(model, opt, steps=1, batch_size=BATCH, forward_backward_only=True)
    assert [ph.phase for ph in trace.phases() if ph.phase != "idle"] == ["forward", "backward"]
    assert all(p.grad is not None for p in model.parameters())
    assert trace.timeline.category("gradients")[-1] == storage_bytes(p.grad for p in model.parameters())


def test_bad_arguments_raise():
    model, opt = fresh()
    with pytest.raises(ValueError, match="keep"):
        track_training(model, opt, keep="everything")
    with pytest.raises(ValueError, match="steps"):
        track_training(model, opt, steps=0)


def test_plots_return_labelled_figures(run):
    _, trace = run
    fig = plot_backward_parts(backward_profile(trace, 2), mark=trace.peak().index)
    assert isinstance(fig, Figure) and fig.axes[0].get_title()
    assert "MiB" in fig.axes[0].get_ylabel() and "MiB" in fig.axes[1].get_ylabel()
    fig = plot_category(trace, "temporaries", 2)
    assert "MiB" in fig.axes[0].get_ylabel() and fig.axes[0].get_title()
    fig = plot_timelines({"a": trace, "b": trace})
    assert len([ax for ax in fig.axes if ax.get_title()]) == 2
    with pytest.raises(ValueError):
        plot_category(trace, "temporaries", 9)
