"""Gradient accumulation: k micro-batches per step, one optimizer step, and the tracker's micro-steps."""

import pytest
import torch

from anatomy_helpers import make_model, make_optimizer, track_steps

from .conftest import SMALL, THREADS, numel


@pytest.fixture(scope="module")
def runs():
    """{k: (model, trace)} of two tracked AdamW steps at global batch 8 in k micro-batches."""
    torch.set_num_threads(THREADS)  # module fixtures run before the autouse one: the same threads as the tests
    out = {}
    for k in (1, 2, 4):
        model = make_model(device="cpu", **SMALL)
        out[k] = model, track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=8, micro_batches=k)
    return out


@pytest.mark.parametrize("k", [2, 4])
def test_a_step_is_k_forward_backward_pairs_then_one_optimizer_phase(runs, k):
    trace = runs[k][1]
    assert trace.training_steps() == [1, 2]
    for step in (1, 2):
        kinds = [ph.phase for ph in trace.phases() if ph.step == step and ph.phase != "idle"]
        assert kinds == ["forward", "backward"] * k + ["optimizer"]


def test_without_accumulation_each_forward_after_a_backward_is_a_new_step(small):
    model, opt = small
    trace = track_steps(model, opt, steps=2, batch_size=4, optimizer_step=False)
    assert trace.training_steps() == [1, 2]


@pytest.mark.parametrize("k", [2, 4])
def test_activations_are_bounded_by_one_micro_batch(runs, k):
    """The activation peak of k micro-batches of 8 // k rows is that of one plain step at batch 8 // k."""
    model = make_model(device="cpu", **SMALL)
    plain = track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=8 // k)
    accumulated = runs[k][1]
    assert accumulated.timeline.category("activations").max() == plain.timeline.category("activations").max()
    assert accumulated.timeline.category("activations").max() < runs[1][1].timeline.category("activations").max()


def test_gradients_persist_across_micro_steps(runs):
    model, trace = runs[2]
    grad_bytes = numel(model) * 4  # fp32: one gradient per parameter, computed from the model itself
    runs_of_step = [ph for ph in trace.phases() if ph.step == 2 and ph.phase in ("forward", "backward")]
    first_backward, second_forward = runs_of_step[1], runs_of_step[2]
    assert first_backward.at_end["gradients"] == grad_bytes  # every gradient alive after micro-step 1
    assert trace.at(second_forward.start)["gradients"] == grad_bytes  # ... and through micro-step 2's forward
    assert trace.optimizer_phase(2).peak["gradients"] == grad_bytes


def test_model_states_do_not_change_with_k(runs):
    ends = {k: trace.phase(2, "optimizer").at_end for k, (_, trace) in runs.items()}
    for k in (2, 4):
        assert ends[k]["parameters"] == ends[1]["parameters"]
        assert ends[k]["optimizer_state"] == ends[1]["optimizer_state"]


def test_accumulated_gradients_are_the_global_batch_mean():
    grads = {}
    for k in (1, 4):
        model = make_model(device="cpu", **SMALL)
        track_steps(model, make_optimizer(model, "sgd"), steps=1, batch_size=8, micro_batches=k, optimizer_step=False)
        grads[k] = [p.grad for p in model.parameters()]
    for a, b in zip(grads[1], grads[4]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [({"micro_batches": 0}, "micro_batches"), ({"micro_batches": 3}, "multiple")])
def test_bad_micro_batches_are_clear_errors(small, kwargs, match):
    model, opt = small
    with pytest.raises(ValueError, match=match):
        track_steps(model, opt, batch_size=8, **kwargs)


def test_micro_step_of_counts_the_forwards_of_the_step_so_far(runs):
    from anatomy_helpers.lessons.lesson08_scaling import micro_step_of

    trace = runs[4][1]
    forwards = [ph for ph in trace.phases() if ph.step == 2 and ph.phase == "forward"]
    assert [micro_step_of(trace, ph.start) for ph in forwards] == [1, 2, 3, 4]
    assert micro_step_of(trace, trace.optimizer_phase(2).start) == 4


def test_accumulation_sweep_rows_come_from_the_traces():
    from anatomy_helpers.lessons.lesson08_scaling import accumulation_sweep, format_accumulation

    rows, traces = accumulation_sweep((1, 2), batch_size=4, device="cpu", **SMALL)
    for row in rows:
        trace = traces[row.micro_batches]
        assert row.peak == trace.peak(step=2).bytes
        assert row.activations == trace.timeline.category("activations")[trace.window(step=2)].max()
    assert "2/2" in format_accumulation(rows)  # k = 2 peaks in its second micro-step
