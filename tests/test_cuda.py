"""The real-GPU helpers: they refuse a CPU device by name, compare the simulator with a CUDA trace, and (marked
``cuda``, run by scripts/gpu_check.py) measure the real caching allocator."""

import inspect
import os

import numpy as np
import pytest
import torch

from anatomy_helpers.lessons.lesson04_first_step import plot_allocator
from anatomy_helpers.prediction import cuda
from anatomy_helpers.prediction.allocator import replay
from anatomy_helpers.prediction.cuda import (
    CudaStats,
    SimVsReal,
    choose_cuda_limit,
    cuda_reserved_check,
    cuda_run_under_limit,
    cuda_vs_simulated,
    format_cuda_step_stats,
    format_cuda_vs_simulated,
)
from anatomy_helpers.tracking.events import CudaMark, PhaseMark, Timeline
from anatomy_helpers.tracking.trace import Trace

MiB = 2**20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Every public helper that takes a device; each must refuse a CPU one before touching CUDA.
DEVICE_HELPERS = {
    "cuda_release": lambda dev: cuda.cuda_release(dev),
    "cuda_warm_up": lambda dev: cuda.cuda_warm_up(dev),
    "cuda_stats": lambda dev: cuda.cuda_stats(dev),
    "cuda_run_under_limit": lambda dev: cuda.cuda_run_under_limit(None, steps=1, device=dev),
    "cuda_step_stats": lambda dev: cuda.cuda_step_stats(steps=1, device=dev),
    "choose_cuda_limit": lambda dev: cuda.choose_cuda_limit(device=dev),
    "cuda_reserved_check": lambda dev: cuda.cuda_reserved_check(steps=1, device=dev),
}


def test_every_device_helper_is_listed():
    public = {
        name
        for name, f in vars(cuda).items()
        if inspect.isfunction(f) and f.__module__ == cuda.__name__ and not name.startswith("_")
    }
    assert {name for name in public if "device" in inspect.signature(getattr(cuda, name)).parameters} == set(
        DEVICE_HELPERS
    )


@pytest.mark.parametrize("name", sorted(DEVICE_HELPERS))
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_cuda_helpers_refuse_a_cpu_device(name, device, monkeypatch):
    # The helper's own message, raised before any work: without the check these calls would fail differently
    # (CUDA missing) or, on a GPU machine, run on the GPU, and this exact text would not appear.
    def no_work(*args, **kwargs):
        raise AssertionError("the helper started working before it checked its device")

    for work in ("make_model", "make_optimizer", "track_steps", "train_step"):
        monkeypatch.setattr(cuda, work, no_work)
    with pytest.raises(ValueError, match=rf"^this helper needs a CUDA device, got {torch.device(device)}$"):
        DEVICE_HELPERS[name](device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="^CUDA is not available here$"):
        cuda.cuda_stats("cuda")


# ---- the simulator against a CUDA trace, hand-made ----------------------------------------------


def hand_made_cuda_trace():
    """A trace as the tracker records it on CUDA, written by hand.

    Before tracking: a 3 MiB parameter (allocation 0). Step 1 (forward): 512 KiB (1) and 21 MiB (2) allocated,
    then freed. Step 2 (forward): 21 MiB (3) allocated, then freed. The "real" allocator counters say what the
    simulator cannot know: 5 MiB of other memory already allocated when tracking began (in a 6 MiB reservation),
    and an 8 MiB workspace allocated in step 1 and kept (in an 8 MiB segment of its own).
    """
    ids = np.array([1, 2, 2, 1, 3, 3])
    deltas = np.array([512 * 1024, 21 * MiB, -21 * MiB, -512 * 1024, 21 * MiB, -21 * MiB])
    step = np.array([1, 1, 1, 1, 2, 2])
    n = len(ids)
    act = np.cumsum(deltas)
    by_cat = np.zeros((n, 6), dtype=np.int64)
    by_cat[:, 0] = 3 * MiB  # the parameter
    by_cat[:, 4] = act  # everything else as activations
    timeline = Timeline(
        time_s=np.arange(n) * 1e-3,
        step=step,
        phase=np.ones(n, dtype=np.int64),
        module=np.zeros(n, dtype=np.int64),
        bytes=by_cat,
        module_names=["-"],
        # the real counters after each sample (MiB): at entry 8 allocated (5 others + the parameter), 26 reserved
        # (6 + its 20 MiB segment); the workspace adds 8 and 8 at once; 512 KiB in a 2 MiB segment; the 21 MiB
        # tensors in a 22 MiB block of a 22 MiB segment
        cuda_allocated=(np.array([16.5, 38.5, 16.5, 16, 38, 16]) * MiB).astype(np.int64),
        cuda_reserved=np.array([36, 58, 58, 58, 58, 58]) * MiB,
    )
    return Trace(
        timeline=timeline,
        alloc_category=np.array([0, 4, 4, 4]),
        alloc_module=np.zeros(4, dtype=np.int64),
        alloc_ids=ids,
        alloc_deltas=deltas,
        baseline_ids=np.array([0]),
        baseline_bytes=np.array([3 * MiB]),
        phase_marks=[PhaseMark(0, 0.0, 1, "forward"), PhaseMark(4, 0.004, 2, "forward")],
        saved=[],
        grad_param={},
        device="cuda:0",
        duration_s=0.006,
        cuda_at_entry=CudaMark(-1, allocated=(5 + 3) * MiB, reserved=(6 + 20) * MiB, requested=(5 + 3) * MiB),
    )


def test_cuda_vs_simulated_on_a_hand_made_trace():
    # The simulator by hand: the parameter opens a 20 MiB segment (3 MiB allocated); step 1 adds a 2 MiB small-pool
    # segment and a 22 MiB one for the 21 MiB tensor, both freed and kept: +24 MiB reserved, +0 allocated at the
    # end of step 1. Step 2's 21 MiB reuses the cached 22 MiB block: no change at its end.
    # The real counters grow by 2 + 22 + 8 (the workspace) = 32 MiB reserved, 8 MiB allocated (the workspace).
    rows = cuda_vs_simulated(hand_made_cuda_trace())
    assert rows == [
        SimVsReal(step=1, real_reserved=32 * MiB, sim_reserved=24 * MiB, real_allocated=8 * MiB, sim_allocated=0),
        SimVsReal(step=2, real_reserved=32 * MiB, sim_reserved=24 * MiB, real_allocated=8 * MiB, sim_allocated=0),
    ]
    assert rows[0].relative_difference == -0.25
    lines = format_cuda_vs_simulated(rows).splitlines()
    assert len(lines) == 2 + 2
    assert lines[2].split() == ["1", "32.00", "24.00", "8.00", "8.00", "0.00"]


def test_cuda_vs_simulated_refuses_a_cpu_trace(small_trace):
    with pytest.raises(ValueError, match="not recorded on CUDA"):
        cuda_vs_simulated(small_trace)


def test_plot_allocator_draws_the_real_counters_of_a_cuda_trace():
    trace = hand_made_cuda_trace()
    fig = plot_allocator(replay(trace.allocation_record()), trace)
    assert len(fig.axes) == 2 and "since tracking began" in fig.axes[1].get_ylabel()
    (reserved_line,) = [ln for ln in fig.axes[1].get_lines() if ln.get_label() == "memory_reserved()"]
    assert reserved_line.get_ydata().max() == 32  # MiB above the counters at entry


def test_format_cuda_step_stats():
    rows = [
        CudaStats(10 * MiB, 30 * MiB, 20 * MiB, 30 * MiB, 19 * MiB, 3, 0, step=1, new_segments=3),
        CudaStats(14 * MiB, 30 * MiB, 25 * MiB, 30 * MiB, 24 * MiB, 3, 0, step=2, new_segments=0),
    ]
    lines = format_cuda_step_stats(rows).splitlines()
    assert lines[0].split()[-1] == "(MiB)" and len(lines) == 4
    assert lines[2].split() == ["1", "20.00", "30.00", "10.00", "30.00", "3"]
    assert lines[3].split() == ["2", "25.00", "30.00", "14.00", "30.00", "0"]


# ---- on a GPU (run by scripts/gpu_check.py) -----------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
def test_cuda_simulated_reserved_within_5_percent_of_memory_reserved():
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        pytest.skip("expandable segments grow in place: the simulator models the default allocator")
    rows = cuda_reserved_check(steps=4, batch_size=8)
    report = "\n".join(f"step {r.step}: real {r.real_reserved:,} sim {r.sim_reserved:,}" for r in rows)
    assert [r.step for r in rows] == [1, 2, 3, 4], report
    for r in rows:
        assert abs(r.relative_difference) <= 0.05, report
    assert rows[3].real_reserved == rows[2].real_reserved, report  # the real cache plateaus too


@pytest.mark.cuda
@needs_cuda
def test_cuda_oom_under_a_memory_fraction_passes_step_1_and_fails_step_2():
    choice = choose_cuda_limit(batch_size=8)
    assert choice.limit is not None, (choice.how, choice.dry_run)
    run = cuda_run_under_limit(choice.limit, steps=3, batch_size=8)
    assert run.completed == [1] and run.failed_step == 2, run.summary()
    assert "out of memory" in run.message.lower()
    assert torch.cuda.get_per_process_memory_fraction() == 1.0
    assert run.after.allocated <= run.before.allocated  # everything released
    fixed = cuda_run_under_limit(choice.limit, steps=3, batch_size=8, optimizer="sgd")
    assert fixed.passed, fixed.summary()
