import json
import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from anatomy_helpers import (
    MemoryBudgetExceeded,
    StepTracker,
    get_batch,
    make_model,
    make_optimizer,
    track_steps,
    train_step,
)
from anatomy_helpers.tracking.events import CATEGORIES

from .conftest import SMALL, phase_end, storage_bytes


@pytest.fixture
def three_steps(small_run):
    """conftest's small_run: three tracked AdamW steps of SMALL, batch 4, computed once per session (read only)."""
    return small_run


def test_parameter_bytes_are_constant_and_exact(three_steps):
    model, _, trace = three_steps
    expected = storage_bytes([*model.parameters(), *model.buffers()])
    assert trace.baseline["parameters"] == expected
    assert np.all(trace.timeline.category("parameters") == expected)


def test_gradients_appear_in_backward_and_equal_parameter_bytes(three_steps):
    model, _, trace = three_steps
    grads = trace.timeline.category("gradients")
    first_backward = np.flatnonzero(trace.timeline.phase == 2)[0]
    assert np.all(grads[:first_backward] == 0)
    param_bytes = storage_bytes(model.parameters())
    for step in (1, 2, 3):
        assert phase_end(trace, step, "backward")["gradients"] == param_bytes
        assert phase_end(trace, step, "optimizer")["gradients"] == 0  # zero_grad(set_to_none=True)


def test_adam_state_is_twice_parameters_after_step_one(three_steps):
    model, opt, trace = three_steps
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    expected = storage_bytes(state)
    # exp_avg and exp_avg_sq are 2x parameter bytes; each parameter also has a 4-byte `step` scalar.
    assert expected == 2 * storage_bytes(params) + 4 * len(params)
    assert phase_end(trace, 1, "backward")["optimizer_state"] == 0
    assert phase_end(trace, 1, "optimizer")["optimizer_state"] == expected
    assert trace.peak(step=1, phase="backward").breakdown["optimizer_state"] == 0


def test_activations_return_to_zero_after_backward(three_steps):
    _, _, trace = three_steps
    for step in (1, 2, 3):
        assert phase_end(trace, step, "forward")["activations"] > 0
        assert phase_end(trace, step, "backward")["activations"] == 0


def test_later_steps_peak_higher_by_the_optimizer_state(three_steps):
    _, _, trace = three_steps
    p1, p2, p3 = (trace.peak(step=s, phase="backward") for s in (1, 2, 3))
    assert p2.bytes == p3.bytes
    assert p2.bytes - p1.bytes == p2.breakdown["optimizer_state"]


def test_inputs_are_the_batch(three_steps):
    _, _, trace = three_steps
    x, y = get_batch(4, SMALL["seq_len"])
    assert phase_end(trace, 1, "forward")["inputs"] == x.nbytes + y.nbytes


def test_phases_come_in_order(three_steps):
    _, _, trace = three_steps
    seen = [(ph.step, ph.phase) for ph in trace.phases() if ph.phase != "idle"]
    assert seen == [(s, p) for s in (1, 2, 3) for p in ("forward", "backward", "optimizer")]
    assert trace.training_steps() == [1, 2, 3]
    assert set(trace.step_times_s()) == {1, 2, 3}


def test_cpu_numbers_are_deterministic():
    runs = []
    for _ in range(2):
        model = make_model(device="cpu", **SMALL)
        runs.append(track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=4))
    a, b = runs
    assert np.array_equal(a.timeline.bytes, b.timeline.bytes)
    assert a.peak() == b.peak()


def test_views_are_counted_once(small):
    model, opt = small
    with StepTracker(model, opt) as tr:
        base = torch.ones(1000)
        expected = base.numel() * base.element_size()
        views = [base[:10], base.view(10, 100), base[::2], base.view(10, 100).t()]  # four views, one storage
        del base, views
    trace = tr.trace
    assert trace.timeline.total.max() - trace.baseline["parameters"] == expected


def test_saved_tensors_are_recorded_with_module(small):
    model, opt = small
    x, y = get_batch(2, SMALL["seq_len"])
    with StepTracker(model, opt) as tr:
        loss = model(x, y)[1]
        del loss
    saved = tr.trace.saved
    modules = {s.module for s in saved}
    assert {"blocks.0.attn", "blocks.0.mlp.gelu", "blocks.1.ln1"} <= modules
    assert all(0 < s.bytes <= s.storage_bytes for s in saved)
    # counted once per storage, the saved tensors are exactly the activations at their height (end of forward)
    distinct = {s.storage: s.storage_bytes for s in saved if s.category == "activations"}
    assert sum(distinct.values()) == tr.trace.timeline.category("activations").max()


def test_no_grad_forward_saves_nothing(small):
    model, opt = small
    x, y = get_batch(2, SMALL["seq_len"])
    with StepTracker(model, opt) as tr, torch.no_grad():
        model(x, y)
    assert tr.trace.saved == []
    assert tr.trace.timeline.category("activations").max() == 0


def _no_hooks_left(model, opt):
    assert _get_current_dispatch_mode() is None
    assert not hasattr(model, "_anatomy_tracker")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert "zero_grad" not in vars(opt)
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    assert torch.clear_autocast_cache is torch._C.clear_autocast_cache  # the tracker orders its frees while it runs


def test_hooks_are_removed_on_exit_and_on_error(small):
    model, opt = small
    track_steps(model, opt, steps=1, batch_size=2)
    _no_hooks_left(model, opt)
    with pytest.raises(KeyError):
        with StepTracker(model, opt):
            model(*get_batch(2, SMALL["seq_len"]))[1].backward()
            {}["a step that fails half way"]
    _no_hooks_left(model, opt)
    # saved-tensor hooks are gone too: a forward outside the tracker is not recorded
    with StepTracker(model, opt) as tr:
        pass
    model(*get_batch(2, SMALL["seq_len"]))
    assert tr.trace.saved == []


def test_tracking_the_same_model_twice_works(small):
    model, opt = small
    first = track_steps(model, opt, steps=2, batch_size=2)
    second = track_steps(model, opt, steps=2, batch_size=2)
    # the second run starts with Adam state already there, so its first step peaks like a later step
    assert second.baseline["optimizer_state"] > 0
    assert second.peak(step=1).bytes == first.peak(step=2).bytes


def test_misuse_raises_clear_errors(small):
    model, opt = small
    with pytest.raises(ValueError, match="needs the optimizer"):
        StepTracker(model, None)
    other = make_model(device="cpu", **SMALL)
    with pytest.raises(ValueError, match="none of the model's parameters"):
        StepTracker(model, make_optimizer(other))
    with StepTracker(model, opt):
        with pytest.raises(RuntimeError, match="already running on this model"):
            with StepTracker(model, opt):
                pass
    with pytest.raises(RuntimeError, match="when the `with StepTracker"):
        _ = StepTracker(model, opt).trace
    for bad in (0, -1, float("nan"), float("inf"), "100", True):
        with pytest.raises(ValueError, match="budget_bytes"):
            StepTracker(model, opt, budget_bytes=bad)


def test_budget_raises_with_step_phase_module_and_breakdown(small):
    model, opt = small
    measured = track_steps(model, opt, steps=2, batch_size=4)
    budget = (measured.peak(step=1).bytes + measured.peak(step=2).bytes) // 2
    fresh = make_model(device="cpu", **SMALL)
    fresh_opt = make_optimizer(fresh, "adamw")
    with pytest.raises(MemoryBudgetExceeded) as err:
        track_steps(fresh, fresh_opt, steps=3, batch_size=4, budget_bytes=budget)
    e = err.value
    assert e.step == 2 and e.phase in ("forward", "backward") and e.module != "-"
    assert set(e.breakdown) == set(CATEGORIES) and e.breakdown["optimizer_state"] > 0
    assert "step 2" in str(e) and "MiB" in str(e)
    assert e.trace.training_steps() == [1, 2]
    _no_hooks_left(fresh, fresh_opt)


def _profiled_peak(model, opt, batch, tmp_path):
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export_memory_timeline is deprecated (FutureWarning)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
            train_step(model, opt, *batch)
        p.export_memory_timeline(str(tmp_path / "timeline.json"), device="cpu")
    _, sizes = json.loads((tmp_path / "timeline.json").read_text())
    return max(sum(s) for s in sizes)


def test_peak_agrees_with_torch_profiler_and_memtracker(tmp_path):
    """Same warm step of the default model, measured three ways."""
    model = make_model(device="cpu")
    opt = make_optimizer(model, "adamw")
    train_step(model, opt, *get_batch(8, 128, step=0))  # warm-up: Adam state exists, as in later steps
    batch = get_batch(8, 128, step=1)
    with StepTracker(model, opt) as tr:
        train_step(model, opt, *batch)
    ours = tr.trace.peak().bytes

    profiled = _profiled_peak(model, opt, batch, tmp_path)
    assert abs(ours - profiled) / profiled <= 0.005, (ours, profiled)

    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    mt = mem_tracker.MemTracker()
    mt.track_external(model, opt)
    with mt:
        train_step(model, opt, *batch)
    theirs = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(ours - theirs) / theirs <= 0.005, (ours, theirs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_total_matches_the_allocator():
    model = make_model(device="cuda")
    opt = make_optimizer(model, "adamw")
    train_step(model, opt, *get_batch(8, 128, step=0, device="cuda"))  # warm-up: cuBLAS workspaces, Adam state
    torch.cuda.synchronize()
    with StepTracker(model, opt) as tr:
        for i in range(2):
            train_step(model, opt, *get_batch(8, 128, step=i + 1, device="cuda"))
    trace = tr.trace
    allocated0, requested0 = trace.cuda_at_entry.allocated, trace.cuda_at_entry.requested
    exact = np.r_[trace.replay_baseline(), trace.replay_totals()]  # exact[k]: after k samples
    rounded = np.r_[trace.replay_baseline(512), trace.replay_totals(512)]
    before_exact = requested0 - exact[0]  # what was alive before tracking began
    before_rounded = allocated0 - rounded[0]
    marks = trace.cuda_marks
    assert len(marks) >= 6
    for sample, allocated, requested in ((m.index, m.allocated, m.requested) for m in marks):
        # the allocator's requested bytes are the tensors' own sizes: they must agree exactly
        assert requested - before_exact == exact[sample]
        # memory_allocated counts blocks: each rounded up to 512 B (an unsplit block can be larger still)
        assert allocated - before_rounded >= rounded[sample]
    # between phase changes, at every allocation, the per-sample counter agrees within the 512-byte rounding
    allocs = trace.alloc_deltas > 0
    diff = trace.timeline.cuda_allocated[allocs] - before_rounded - rounded[1:][allocs]
    assert diff.min() >= 0


def test_slices_of_tensors_made_before_tracking_are_not_allocations(small):
    model, opt = small
    dataset = torch.ones(10_000)
    with StepTracker(model, opt) as tr:
        window = dataset[100:110]  # a view: no new memory
        copy = window.clone()  # 10 floats of new memory
        del window, copy
    trace = tr.trace
    assert trace.timeline.total.max() - trace.baseline["parameters"] == 40


def test_tracking_does_not_change_gradients(small):
    model, opt = small
    x, y = get_batch(2, SMALL["seq_len"])
    model(x, y)[1].backward()
    plain = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    with StepTracker(model, opt):
        model(x, y)[1].backward()
    for g, p in zip(plain, model.parameters()):
        assert torch.equal(g, p.grad)


def test_a_graph_never_backpropagated_is_freed(small):
    model, opt = small
    x, y = get_batch(2, SMALL["seq_len"])
    with StepTracker(model, opt) as tr:
        loss = model(x, y)[1]  # softmax saves its own output: no reference cycle may keep it alive
        del loss
    assert tr.trace.timeline.category("activations")[-1] == 0


# ---- robustness: nothing left behind, whatever fails -----------------------------------------------------


@pytest.mark.parametrize("stage", ["claim", "register", "hooks", "dispatch mode", "saved-tensor hooks"])
def test_a_failure_while_entering_leaves_nothing_installed(small, monkeypatch, stage):
    model, opt = small

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected failure at {stage}")

    if stage == "claim":
        monkeypatch.setattr(StepTracker, "_claim", boom)
    elif stage == "register":
        monkeypatch.setattr(StepTracker, "_register_existing", boom)
    elif stage == "hooks":  # fail half-way through installing the module hooks
        calls = {"n": 0}
        original = torch.nn.Module.register_forward_hook

        def some_then_boom(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 5:
                boom()
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.nn.Module, "register_forward_hook", some_then_boom)
    elif stage == "dispatch mode":
        from anatomy_helpers.tracking import tracker as tracker_module

        monkeypatch.setattr(tracker_module._OpWatcher, "__enter__", boom)
    with pytest.raises(RuntimeError, match="injected|hooks"):
        if stage == "saved-tensor hooks":  # torch itself refuses new saved-tensor hooks in here
            with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this test"):
                with StepTracker(model, opt):
                    pass
        else:
            with StepTracker(model, opt):
                pass
    monkeypatch.undo()
    _no_hooks_left(model, opt)
    trace = track_steps(model, opt, steps=1, batch_size=2)  # and the model can be tracked again
    assert trace.training_steps() == [1]


def test_a_users_own_zero_grad_is_restored(small):
    model, opt = small
    calls = []
    own = opt.zero_grad

    def my_zero_grad(*args, **kwargs):
        calls.append(1)
        own(*args, **kwargs)

    opt.zero_grad = my_zero_grad
    track_steps(model, opt, steps=2, batch_size=2)
    assert opt.zero_grad is my_zero_grad and len(calls) == 2


def test_two_trackers_at_once_are_refused(small):
    model, opt = small
    other = make_model(device="cpu", **SMALL)
    other_opt = make_optimizer(other, "sgd")
    with StepTracker(model, opt):
        with pytest.raises(RuntimeError, match="another model"):
            with StepTracker(other, other_opt):
                pass
    _no_hooks_left(other, other_opt)
    track_steps(other, other_opt, steps=1, batch_size=2)  # fine once the first one is done


def test_a_budget_below_the_model_itself_fails_before_step_one(small):
    model, opt = small
    with pytest.raises(MemoryBudgetExceeded) as err:
        track_steps(model, opt, steps=2, batch_size=2, budget_bytes=1)
    e = err.value
    expected = storage_bytes([*model.parameters(), *model.buffers()])
    assert e.step == 0 and e.requested == expected and e.breakdown["parameters"] == expected
    assert "before training starts" in str(e)
    assert len(e.trace.timeline) == 0 and e.trace.baseline["parameters"] == expected
    _no_hooks_left(model, opt)


def test_on_device_matches_the_type_and_the_index_only_when_given():
    from types import SimpleNamespace

    from anatomy_helpers.core.tensors import on_device

    on_gpu0 = SimpleNamespace(device=torch.device("cuda", 0))  # on_device only reads .device
    assert on_device(on_gpu0, "cuda") and on_device(on_gpu0, "cuda:0") and not on_device(on_gpu0, "cuda:1")
    assert not on_device(on_gpu0, "cpu") and on_device(on_gpu0, None)
    cpu = torch.ones(2)
    assert on_device(cpu, "cpu") and on_device(cpu, torch.device("cpu", 0)) and not on_device(cpu, "cuda")


def test_targets_handed_only_to_the_loss_are_inputs(small):
    import torch.nn.functional as F

    model, opt = small
    with StepTracker(model, opt) as tr:
        x, y = get_batch(2, SMALL["seq_len"])
        logits = model(x)[0]  # the model never sees y
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))  # nll_loss saves y for backward
        loss.backward()
        del logits, loss
    trace = tr.trace
    saved_y = [s for s in trace.saved if s.dtype == torch.int64 and s.shape == (y.numel(),)]
    assert saved_y and all(s.category == "inputs" for s in saved_y)
    assert phase_end(trace, 1, "forward")["inputs"] == x.nbytes + y.nbytes


def test_ops_are_classified_by_what_their_outputs_are():
    from anatomy_helpers.core.tensors import ALLOCATES, IN_PLACE, REUSES, VIEWS, op_outputs

    aten = torch.ops.aten
    expected = {
        aten.mm.default: ALLOCATES,
        aten._foreach_add_.List: ALLOCATES,  # returns nothing: nothing to register
        aten.view.default: VIEWS,
        aten.detach.default: VIEWS,
        aten.split.Tensor: VIEWS,  # a list of views
        aten.add_.Tensor: IN_PLACE,
        aten.lerp_.Scalar: IN_PLACE,
        aten.add.out: REUSES,  # out= may resize the tensor it writes
        aten.resize_.default: REUSES,
        aten.set_.source_Storage: REUSES,
    }
    assert {op: op_outputs(op) for op in expected} == expected


@pytest.mark.parametrize("kernel_scratch", [True, False])
def test_out_ops_that_resize_are_counted_and_in_place_ops_allocate_nothing(small, kernel_scratch):
    model, opt = small
    a, b = torch.ones(100), torch.ones(100)
    with StepTracker(model, opt, kernel_scratch=kernel_scratch) as tr:
        out = torch.empty(0)  # 0 bytes
        torch.add(a, b, out=out)  # resized to 100 floats by the out= op
        out.mul_(2)  # in place: no new memory
        a.add_(1)  # in place on memory made before tracking: not an allocation
        grown = tr._live_bytes
        del out
    trace = tr.trace
    params = trace.baseline["parameters"]
    assert grown - params == 400
    assert trace.timeline.total.max() - params == 400
    assert trace.timeline.total[-1] == params


def test_watching_makes_autograd_sum_residual_gradients_out_of_place(small):
    """What the tracker's docstring says watching changes: one extra `add` per residual connection per step."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    from anatomy_helpers.tracking.scratch import quiet_stderr

    class CountAdds(TorchDispatchMode):
        adds = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.adds += func._schema.name == "aten::add"
            return func(*args, **(kwargs or {}))

    model, opt = small
    x, y = get_batch(4, SMALL["seq_len"])
    train_step(model, opt, x, y)  # warm: Adam's state exists
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, opt, x, y)
    unwatched = sum(e.count for e in prof.key_averages() if e.key == "aten::add")
    with CountAdds() as watch:
        train_step(model, opt, x, y)
    residual_connections = 2 * SMALL["n_layer"]  # attention and MLP in each block
    assert watch.adds - unwatched == residual_connections
