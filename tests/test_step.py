"""The one training step (step.py): its plan is checked once, it does what it says, and every loop runs it."""

import sys

import pytest
import torch

from anatomy_helpers import get_batch, make_model, make_optimizer, track_steps
from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.distributed.ranks import RankJob, track_steps_untracked
from anatomy_helpers.lessons.lesson07_profiling import profile_steps
from anatomy_helpers.prediction.dryrun import dry_run_config
from anatomy_helpers.training.step import StepHooks, StepPlan, run_step

from .conftest import SMALL


@pytest.mark.parametrize(
    "field, value",
    [
        ("batch_size", 0),
        ("batch_size", 8.0),
        ("micro_batches", 0),
        ("micro_batches", True),
        ("autocast", "fp8"),
        ("world_size", 0),
        ("rank", 2),  # world_size is 2 below
        ("rank", -1),
        ("seed", -1),
        ("seed", 2**32),
        ("first_batch", 1.5),
        ("set_to_none", "yes"),
        ("optimizer_step", None),
        ("read_loss", "no"),
        ("batch", "not a function"),
        ("loss", 3),
        ("hooks", object()),
    ],
)
def test_a_bad_plan_field_is_a_value_error_naming_it(field, value):
    fields = {"world_size": 2, "batch_size": 8, field: value}
    with pytest.raises(ValueError, match=field):
        StepPlan(**fields)


def test_a_batch_that_cannot_be_split_is_refused():
    with pytest.raises(ValueError, match=r"multiple of micro_batches x world_size \(3 x 1\)"):
        StepPlan(batch_size=8, micro_batches=3)
    model = make_model(device="cpu", **SMALL)
    plan = StepPlan(micro_batches=2, batch=lambda i: get_batch(3, 32, step=i))  # 3 rows: known only when run
    with pytest.raises(ValueError, match="the batch has 3 rows"):
        run_step(model, make_optimizer(model, "sgd"), plan, 0)
    assert all(p.grad is None for p in model.parameters())  # refused before the forward


class PhaseLog(StepHooks):
    def __init__(self):
        self.log = []

    def before_step(self, model, plan, step):
        self.log.append(f"step {step}")

    def phase(self, name):
        self.log.append(name)
        return super().phase(name)


@pytest.mark.parametrize("micro_batches, optimizer_step", [(1, True), (2, True), (3, False)])
def test_each_micro_batch_runs_forward_then_backward_then_one_optimizer_phase(micro_batches, optimizer_step):
    model = make_model(device="cpu", **SMALL)
    hooks = PhaseLog()
    plan = StepPlan(batch_size=6, micro_batches=micro_batches, optimizer_step=optimizer_step, hooks=hooks)
    opt = make_optimizer(model, "sgd")
    for i in range(2):
        run_step(model, opt, plan, i)
    one = ["forward", "backward"] * micro_batches + ["optimizer"] * optimizer_step
    assert hooks.log == ["step 0", *one, "step 1", *one]


def test_a_rank_trains_its_own_rows_of_the_global_batch():
    """Rank 1 of 2 with 2 micro-batches: the gradients of rows 4-7 of the global batch of 8, averaged."""
    model = make_model(device="cpu", **SMALL)
    plan = StepPlan(batch_size=8, micro_batches=2, rank=1, world_size=2, seed=3, first_batch=5, optimizer_step=False)
    loss = run_step(model, make_optimizer(model, "sgd"), plan, 2)
    reference = make_model(device="cpu", **SMALL)
    x, y = get_batch(8, SMALL["seq_len"], step=7, seed=3)  # batch first_batch + step
    expected = reference(x[4:8], y[4:8])[1]
    expected.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert loss == pytest.approx(expected.item(), rel=1e-5)  # the micro-batches' losses, each divided by 2, summed


def _run_step_calls(work) -> list[StepPlan]:
    """The plans of every run_step call made while ``work()`` runs, seen by the interpreter, not by run_step."""
    plans = []

    def trace(frame, event, arg):  # a trace function, not a profile one: torch.profiler takes over sys.setprofile
        if event == "call" and frame.f_code is run_step.__code__:
            plans.append(frame.f_locals["plan"])

    old = sys.gettrace()
    sys.settrace(trace)
    try:
        work()
    finally:
        sys.settrace(old)
    return plans


def test_every_loop_of_the_course_runs_its_steps_through_run_step():
    model = make_model(device="cpu", **SMALL)
    tracked = _run_step_calls(lambda: track_steps(model, make_optimizer(model, "sgd"), steps=2, batch_size=4))
    assert [(p.batch_size, p.read_loss, p.batch) for p in tracked] == [(4, True, None)] * 2

    dry = _run_step_calls(lambda: dry_run_config(ModelConfig(**SMALL), batch_size=2, steps=2))
    assert len(dry) >= 2 and all(not p.read_loss and p.batch is not None for p in dry)  # fake: no values to read

    job = RankJob("ddp", batch_size=8, micro_batches=2, warmup=3, model=dict(SMALL))
    warm = _run_step_calls(lambda: track_steps_untracked(model, make_optimizer(model, "sgd"), job, 1, 2))
    assert [(p.rank, p.world_size, p.micro_batches, p.first_batch, p.seed) for p in warm] == [(1, 2, 2, 1000, 1)] * 3

    profiled = _run_step_calls(lambda: profile_steps(model, make_optimizer(model, "sgd"), steps=2, batch_size=4))
    assert len(profiled) == 2 and type(profiled[0].hooks).__name__ == "RecordPhases"
