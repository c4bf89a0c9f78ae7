"""A budget of live tensor bytes on CPU: steps that pass, the step that fails, and what a failure leaves behind."""

import gc

import pytest
import torch

from anatomy_helpers import MemoryBudgetExceeded, StepTracker, get_batch, make_model, make_optimizer, track_steps
from anatomy_helpers.training.budget import (
    StorageWatch,
    budget_between,
    model_state_tensors,
    run_under_budget,
    try_budget,
)
from anatomy_helpers.ui.plots import plot_budget_run

from .conftest import SMALL, storage_bytes

MiB = 2**20


def test_budget_between_needs_a_gap():
    model = make_model(device="cpu", **SMALL)
    trace = track_steps(model, make_optimizer(model, "sgd"), steps=2, batch_size=4)  # no state: equal peaks
    with pytest.raises(ValueError, match="no budget"):
        budget_between(trace, round_to=1)


def test_storage_watch_sees_new_storages_only():
    before = torch.arange(100.0)
    with StorageWatch() as watch:
        kept = torch.ones(1000)  # 4000 bytes, kept
        dropped = torch.zeros(10)
        view = before[2:5]  # a view of older memory: not new
        inplace = kept.mul_(2)  # in place: the same storage
        del dropped
    assert inplace.untyped_storage()._cdata == kept.untyped_storage()._cdata and view.numel() == 3
    gc.collect()
    assert watch.alive_bytes() == kept.nbytes == 4000
    assert watch.alive_bytes(exclude=[kept]) == 0
    assert watch.alive_bytes(device="meta") == 0


def test_tracked_forward_without_backward_leaves_nothing_behind(small):
    model, opt = small
    x, y = get_batch(4, SMALL["seq_len"])
    with StorageWatch() as watch:
        with StepTracker(model, opt):
            loss = model(x, y)[1]
        del loss  # the graph is dropped without backward
    gc.collect()
    assert watch.alive_bytes(exclude=model_state_tensors(model, opt)) == 0


# The SMALL model at batch 4 with AdamW (conftest's small_trace), under a budget halfway between its step-1 and
# step-2 peaks; each case changes one thing. The expected outcome of each is written here from what the change
# does to the step-2 peak, and checked against the change's own run without a budget.
BUDGET_CASES = {
    "unchanged": ({}, 2),  # step 2 carries AdamW's state, born at the end of step 1: over the budget
    "sgd": ({"optimizer": "sgd"}, None),  # no state: every step is like step 1
    "batch 2": ({"batch_size": 2}, None),  # half the activations
    # checkpointing keeps fewer activations, but at this size the parameters, gradients and state dominate and
    # one recomputed block in backward is enough to go over: it still fails at step 2
    "checkpoint": ({"checkpoint": "full"}, 2),
}


@pytest.mark.parametrize("case", list(BUDGET_CASES))
def test_a_budget_between_the_step_peaks(small_trace, case):
    change, failed_step = BUDGET_CASES[case]
    budget = budget_between(small_trace, round_to=1024)
    assert budget % 1024 == 0 and small_trace.peak(step=1).bytes < budget < small_trace.peak(step=2).bytes
    kw = {"batch_size": 4, "optimizer": "adamw", "checkpoint": "none", **change}

    def fresh():
        model = make_model(device="cpu", checkpoint=kw["checkpoint"], **SMALL)
        return model, make_optimizer(model, kw["optimizer"])

    free = track_steps(*fresh(), steps=3, batch_size=kw["batch_size"])  # the same run without a budget
    over = [s for s in free.training_steps() if free.peak(step=s).bytes > budget]
    assert (over[0] if over else None) == failed_step

    model, opt = fresh()
    with StorageWatch() as watch:
        run = run_under_budget(model, opt, budget, steps=3, batch_size=kw["batch_size"])
    assert run.failed_step == failed_step and run.passed == (failed_step is None)
    if failed_step is None:
        assert run.completed == [1, 2, 3] and run.trace.training_steps() == [1, 2, 3]
        assert run.step_peaks() == {s: free.peak(step=s).bytes for s in (1, 2, 3)}
        assert max(run.step_peaks().values()) <= budget
        return
    assert run.completed == list(range(1, failed_step))
    assert run.trace.training_steps() == list(range(1, failed_step + 1))
    live = sum(run.breakdown.values())
    assert live > budget >= live - run.requested  # this request crossed the line
    assert run.breakdown["optimizer_state"] == storage_bytes(
        [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    )
    assert f"step {failed_step}" in run.message and f"step {failed_step} FAILED in {run.phase}" in run.summary()
    gc.collect()
    assert watch.alive_bytes(exclude=model_state_tensors(model, opt)) == 0  # the failed step left nothing
    assert all(p.grad is None for p in model.parameters())
    # the tracker itself raises at the same place, and try_budget (a fresh model) fails there too
    with pytest.raises(MemoryBudgetExceeded) as info:
        track_steps(*fresh(), steps=3, batch_size=kw["batch_size"], budget_bytes=budget)
    again = try_budget(budget, steps=3, device="cpu", **kw, **SMALL)
    where = (run.failed_step, run.phase, run.module)
    assert (info.value.step, info.value.phase, info.value.module) == where
    assert (again.failed_step, again.phase, again.module) == where


def test_plot_budget_run(small_trace):
    run = try_budget(budget_between(small_trace, round_to=1024), batch_size=4, steps=2, device="cpu", **SMALL)
    fig = plot_budget_run(run.trace, run.budget, title="t")
    assert fig.axes[0].get_title() == "t" and fig.axes[0].get_ylim()[1] > run.budget / MiB
