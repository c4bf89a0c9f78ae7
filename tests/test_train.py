"""The one training loop and the device choice: bad input gets a clear ValueError."""

import pytest
import torch

from anatomy_helpers import make_model, make_optimizer, pick_device, track_steps

from .conftest import SMALL


@pytest.mark.parametrize("device", ["gpu", "mps", "cuda:x", 3.0])
def test_pick_device_rejects_what_the_course_cannot_use(device):
    with pytest.raises(ValueError, match="device|course runs on"):
        pick_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_on_a_cpu_only_machine_is_a_clear_error_before_building_anything():
    with pytest.raises(ValueError, match="CUDA is not available here"):
        make_model(device="cuda", **SMALL)
    assert pick_device() == torch.device("cpu")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 0}, "steps"),
        ({"steps": 2.0}, "steps"),
        ({"steps": True}, "steps"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": "8"}, "batch_size"),
        ({"keep": "loss"}, "no option 'keep'"),  # a lesson's pitfall, now lessons/lesson02_backward.py's StepHooks
        ({"retain_graph": True}, "no option 'retain_graph'"),
    ],
)
def test_track_steps_rejects_bad_arguments(small, kwargs, match):
    model, opt = small
    with pytest.raises(ValueError, match=match):
        track_steps(model, opt, **kwargs)


def test_optimizer_step_false_keeps_gradients_and_has_no_optimizer_phase(small):
    model, opt = small
    trace = track_steps(model, opt, steps=1, batch_size=2, optimizer_step=False)
    assert {ph.phase for ph in trace.phases()} <= {"forward", "backward", "idle"}
    assert all(p.grad is not None for p in model.parameters())
    assert opt.state == {}


def test_after_step_is_called_once_per_step_in_order(small):
    model, opt = small
    seen = []
    track_steps(model, opt, steps=3, batch_size=2, after_step=seen.append)
    assert seen == [1, 2, 3]


def test_same_seed_same_weights_on_any_call_order():
    a = make_model(device="cpu", seed=3, **SMALL)
    make_model(device="cpu", seed=5, **SMALL)  # another model in between changes nothing
    b = make_model(device="cpu", seed=3, **SMALL)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert make_optimizer(a, "sgd").param_groups[0]["lr"] > 0


def test_autocast_keeps_fp32_model_states_and_saves_bf16_matmul_inputs(small):
    model, opt = small
    trace = track_steps(model, opt, steps=1, batch_size=2, autocast="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert any(s.dtype == torch.bfloat16 and s.category == "activations" for s in trace.saved)
    with pytest.raises(ValueError, match="autocast"):
        track_steps(model, opt, autocast="fp8")


def test_micro_batches_with_a_tracker_need_accumulate(small):
    from anatomy_helpers.tracking.tracker import StepTracker

    model, opt = small
    plain = StepTracker(model, opt)
    with pytest.raises(ValueError, match="accumulate=True"):
        track_steps(model, opt, steps=2, batch_size=4, micro_batches=2, tracker=plain)
    assert opt.state == {}  # refused before any step
    trace = track_steps(
        model, opt, steps=2, batch_size=4, micro_batches=2, tracker=StepTracker(model, opt, accumulate=True)
    )
    own = track_steps(model, opt, steps=2, batch_size=4, micro_batches=2)  # the tracker track_steps makes itself
    for t in (trace, own):  # two steps of two forward/backward passes each, not four steps
        assert [(p.step, p.phase) for p in t.phases() if p.phase != "idle"] == [
            (s, ph) for s in (1, 2) for ph in ("forward", "backward", "forward", "backward", "optimizer")
        ]


def test_a_tracker_of_another_model_or_a_bad_argument_is_refused_before_any_step():
    from anatomy_helpers import StepTracker

    model, other = make_model(device="cpu", **SMALL), make_model(device="cpu", **SMALL)
    opt, other_opt = make_optimizer(model, "sgd"), make_optimizer(other, "sgd")
    for tracker in (StepTracker(other, other_opt), object()):
        with pytest.raises(ValueError, match="tracker must be a StepTracker made for this model and optimizer"):
            track_steps(model, opt, steps=1, batch_size=2, tracker=tracker)
    bad = [dict(after_step="x"), dict(world_size=True), dict(world_size="2"), dict(micro_batches=2.0), dict(rank=0.5)]
    for kwargs in bad:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            track_steps(model, opt, steps=1, batch_size=2, **kwargs)
    assert all(p.grad is None for p in model.parameters())  # refused before anything ran
