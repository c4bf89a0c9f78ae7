import gc
import json
import pickle

import numpy as np
import pytest
import torch
from torch.cuda import _memory_viz

from anatomy_helpers import MemoryBudgetExceeded, StepTracker, get_batch, make_model, make_optimizer, track_steps
from anatomy_helpers.allocator import CachingAllocatorSim, replay, summarize_replay
from anatomy_helpers.first_step import (
    LimitedAllocatorSim,
    SimulatedOutOfMemory,
    StorageWatch,
    allocator_at,
    allocator_panel,
    budget_between,
    budget_panel,
    cuda_run_under_limit,
    format_replay_summary,
    min_limit_to_pass,
    model_state_tensors,
    optimizer_state_births,
    plot_allocator,
    plot_budget_run,
    plot_segment_map,
    replay_with_limit,
    run_under_budget,
    snapshot_from_replay,
    step_peak_table,
    try_budget,
    write_memory_viz,
)
from anatomy_helpers.plots import CourseFigure
from anatomy_helpers.tracker import CATEGORIES

from .conftest import SMALL, make_record, storage_bytes

MiB = 2**20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# Step 1 makes and frees a 3 MiB tensor (one 20 MiB segment, then cached). Step 2 keeps a 3 MiB tensor (it
# reuses the cached segment) and asks for 21 MiB, which needs a 22 MiB segment of its own: 42 MiB in all.
TWO_STEPS = [(1, 0, 3 * MiB), (1, 0, -3 * MiB), (2, 1, 3 * MiB), (2, 2, 21 * MiB)]


@pytest.fixture(scope="module")
def small_trace():
    torch.set_num_threads(2)
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "adamw")
    return model, opt, track_steps(model, opt, steps=3, batch_size=4)


# ---- the simulator under a limit -------------------------------------------------------------


def test_limited_sim_empties_its_cache_before_giving_up():
    sim = LimitedAllocatorSim(limit=30 * MiB)
    sim.malloc(0, 3 * MiB)  # a 20 MiB segment
    sim.free(0)  # cached: reserved stays 20 MiB
    sim.malloc(1, 11 * MiB)  # fits in the cached block: no new segment, no flush
    sim.free(1)
    assert sim.cache_flushes == 0 and sim.reserved == 20 * MiB
    sim.malloc(2, 21 * MiB)  # needs a 22 MiB segment: 42 > 30, so the free segment goes back first
    assert sim.cache_flushes == 1
    assert sim.reserved == 22 * MiB and sim.num_segments == 1


def test_limited_sim_raises_when_live_blocks_pin_the_segments():
    sim = LimitedAllocatorSim(limit=30 * MiB)
    sim.malloc(0, 3 * MiB)
    with pytest.raises(SimulatedOutOfMemory) as info:
        sim.malloc(1, 21 * MiB)
    err = info.value
    assert (err.requested, err.segment, err.reserved, err.limit) == (21 * MiB, 22 * MiB, 20 * MiB, 30 * MiB)
    assert err.allocated == 3 * MiB


def test_limited_sim_refuses_a_non_positive_limit():
    with pytest.raises(ValueError, match="positive"):
        LimitedAllocatorSim(0)


def test_replay_with_limit_names_the_failing_row_and_step():
    rec = make_record(TWO_STEPS)
    failed = replay_with_limit(rec, 40 * MiB)
    assert not failed.passed and failed.rows == 3 and failed.step == 2 and failed.requested == 21 * MiB
    assert failed.cache_flushes == 1
    assert replay_with_limit(rec, 42 * MiB).passed
    assert replay_with_limit(rec, 20 * MiB, through_step=1).passed  # step 1 alone needs one 20 MiB segment


def test_min_limit_to_pass_hand_computed():
    rec = make_record(TWO_STEPS)
    assert min_limit_to_pass(rec, through_step=1) == 20 * MiB
    assert min_limit_to_pass(rec) == 42 * MiB


def test_min_limit_to_pass_is_the_first_passing_limit_on_a_real_trace(small_trace):
    _, _, trace = small_trace
    rec = trace.allocation_record()
    found = min_limit_to_pass(rec)
    free_run = replay(rec)
    assert free_run["allocated"].max() <= found <= free_run["reserved"].max() + 2 * MiB
    assert replay_with_limit(rec, found).passed
    assert not replay_with_limit(rec, found - 2 * MiB).passed


def test_allocator_at_agrees_with_replay(small_trace):
    _, _, trace = small_trace
    rec = trace.allocation_record()
    result = replay(rec)
    for row in (0, len(rec["bytes"]) // 3, len(rec["bytes"]) - 1):
        sim = allocator_at(rec, row)
        assert (sim.allocated, sim.reserved) == (result["allocated"][row], result["reserved"][row])
        assert sum(seg["size"] for seg in sim.segments()) == sim.reserved


# ---- snapshots in torch's format ----------------------------------------------------------------


def test_snapshot_of_a_hand_made_replay_reads_in_memory_viz():
    rec = make_record(TWO_STEPS[:3])  # one 20 MiB segment holding one 3 MiB block at the end
    snap = snapshot_from_replay(rec)
    (seg,) = snap["segments"]
    assert seg["total_size"] == 20 * MiB and seg["segment_type"] == "large"
    assert [b["state"] for b in seg["blocks"]] == ["active_allocated", "inactive"]
    assert [b["size"] for b in seg["blocks"]] == [3 * MiB, 17 * MiB]
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions == ["segment_alloc", "alloc", "free_requested", "free_completed", "alloc"]
    summary = _memory_viz.segsum(snap)
    assert "segments: 1" in summary and "total_reserved: 20.0MiB" in summary and "total_allocated: 3.0MiB" in summary
    text = _memory_viz.trace(snap)
    assert text.count("cudaMalloc(") == 1 and "del " in text


def test_snapshot_of_a_real_trace_matches_the_simulator(small_trace, tmp_path):
    _, _, trace = small_trace
    rec = trace.allocation_record()
    row = int(np.flatnonzero(rec["step"] == 2)[-1])
    sim = allocator_at(rec, row)
    snap = snapshot_from_replay(rec, row, trace)
    assert sum(s["total_size"] for s in snap["segments"]) == sim.reserved
    active = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sum(b["size"] for b in active) == sim.allocated
    assert all(b["requested_size"] <= b["size"] for b in active)
    assert all(len(b["frames"]) == 1 for b in active)  # each block names its module and category
    assert _memory_viz.trace(snap).count("cudaMalloc(") == sim.segments_created
    html_path = write_memory_viz(snap, tmp_path / "sim.html", tmp_path / "sim.pickle")
    html = html_path.read_text()
    assert "Active Memory Timeline" in html
    payload = json.loads(html.split("const local_files = ")[1].split("\n")[0])
    assert payload[0]["name"] == "snapshot.pickle"
    with open(tmp_path / "sim.pickle", "rb") as f:
        assert pickle.load(f) == snap


# ---- section 1 helpers -------------------------------------------------------------------------------


def test_optimizer_state_is_born_in_step_one(small_trace):
    model, opt, trace = small_trace
    params = list(model.parameters())
    count, nbytes = optimizer_state_births(trace, 1)
    assert count == 3 * len(params)  # exp_avg, exp_avg_sq and the CPU step scalar
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert nbytes == storage_bytes(state) == 2 * storage_bytes(params) + 4 * len(params)
    assert optimizer_state_births(trace, 2) == (0, 0)


def test_step_peak_table_has_a_line_per_step(small_trace):
    _, _, trace = small_trace
    lines = step_peak_table(trace).splitlines()
    assert len(lines) == 2 + 3
    for s, line in zip((1, 2, 3), lines[2:]):
        assert line.split()[:2] == [str(s), f"{trace.peak(step=s).bytes / MiB:.2f}"]


def test_format_replay_summary_rows(small_trace):
    _, _, trace = small_trace
    result = replay(trace.allocation_record())
    lines = format_replay_summary(result).splitlines()
    rows = summarize_replay(result)
    assert len(lines) == 2 + len(rows)
    for row, line in zip(rows[1:], lines[3:]):
        assert line.split()[:2] == [str(row["step"]), str(row["segments_created"])]


# ---- budgets and leaks --------------------------------------------------------------------------------


def test_budget_between_lies_between_the_peaks(small_trace):
    _, _, trace = small_trace
    budget = budget_between(trace, round_to=1024)
    assert budget % 1024 == 0
    assert trace.peak(step=1).bytes < budget < trace.peak(step=2).bytes


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


def test_tracked_forward_without_backward_leaves_nothing_behind():
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "adamw")
    x, y = get_batch(4, SMALL["seq_len"])
    with StorageWatch() as watch:
        with StepTracker(model, opt):
            loss = model(x, y)[1]
        del loss  # the graph is dropped without backward
    gc.collect()
    assert watch.alive_bytes(exclude=model_state_tensors(model, opt)) == 0


def test_run_under_budget_fails_at_step_two_and_cleans_up(small_trace):
    _, _, trace = small_trace
    budget = budget_between(trace, round_to=1024)
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "adamw")
    with StorageWatch() as watch:
        run = run_under_budget(model, opt, budget, steps=3, batch_size=4)
    assert not run.passed and run.failed_step == 2 and run.completed == [1]
    assert run.trace.training_steps() == [1, 2]
    live = sum(run.breakdown.values())
    assert live > budget >= live - run.requested
    assert run.breakdown["optimizer_state"] == storage_bytes(
        [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    )
    assert "step 2" in run.message and "step 2 FAILED" in run.summary()
    gc.collect()
    assert watch.alive_bytes(exclude=model_state_tensors(model, opt)) == 0
    assert all(p.grad is None for p in model.parameters())


def test_the_tracker_budget_is_exceeded_exactly_as_run_under_budget_says(small_trace):
    _, _, trace = small_trace
    budget = budget_between(trace, round_to=1024)
    model = make_model(device="cpu", **SMALL)
    with pytest.raises(MemoryBudgetExceeded) as info:
        track_steps(model, make_optimizer(model, "adamw"), steps=3, batch_size=4, budget_bytes=budget)
    run = try_budget(budget, batch_size=4, steps=3, device="cpu", **SMALL)
    assert (info.value.step, info.value.phase, info.value.module) == (run.failed_step, run.phase, run.module)


@pytest.fixture(scope="module")
def budget_at_batch_8():
    """A budget between step 1's and step 2's peaks for the small model at batch 8 (activations dominate)."""
    torch.set_num_threads(2)
    model = make_model(device="cpu", **SMALL)
    return budget_between(track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=8), round_to=1024)


@pytest.mark.parametrize("fix", [{}, {"optimizer": "sgd"}, {"checkpoint": "full"}, {"batch_size": 4}])
def test_fixes_fit_under_the_budget(budget_at_batch_8, fix):
    run = try_budget(budget_at_batch_8, steps=3, device="cpu", **{"batch_size": 8, **fix}, **SMALL)
    if not fix:  # unchanged, it fails at step 2
        assert run.failed_step == 2
        return
    assert run.passed and run.completed == [1, 2, 3]
    assert max(run.step_peaks().values()) <= budget_at_batch_8


# ---- plots and panels ---------------------------------------------------------------------------------


def test_plots_are_course_figures(small_trace):
    _, _, trace = small_trace
    rec = trace.allocation_record()
    fig = plot_allocator(replay(rec), trace)
    assert isinstance(fig, CourseFigure) and len(fig.axes) == 1 and "MiB" in fig.axes[0].get_ylabel()
    sim = allocator_at(rec, len(rec["bytes"]) - 1)
    fig = plot_segment_map(sim, trace.alloc_category)
    assert len(fig.axes[0].get_yticklabels()) == sim.num_segments and fig.axes[0].get_title()
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend[-1] == "cached, free" and set(legend[:-1]) <= {c.replace("_", " ") for c in CATEGORIES}
    run = try_budget(budget_between(trace, round_to=1024), batch_size=4, steps=2, device="cpu", **SMALL)
    fig = plot_budget_run(run.trace, run.budget, title="t")
    assert fig.axes[0].get_title() == "t" and fig.axes[0].get_ylim()[1] > run.budget / MiB


def test_panels_print_and_plot(capsys):
    fig = allocator_panel(batch_size=2, steps=2, device="cpu", **SMALL)
    assert isinstance(fig, CourseFigure)
    fig = budget_panel(budget_mib=1, batch_size=2, steps=2, device="cpu", **SMALL)
    assert isinstance(fig, CourseFigure)
    out = capsys.readouterr().out
    assert "batch 2: tracked peak" in out and "budget 1.00 MiB" in out


def fake_cuda_trace(trace, offset):
    """A CPU trace dressed up as a CUDA one: the simulator plays the real allocator, ``offset`` bytes of other
    memory sit underneath (copies the trace, whose timeline gets the two counters a CUDA trace has)."""
    import copy

    fake = copy.copy(trace)
    fake.timeline = copy.copy(trace.timeline)
    fake.meta = dict(trace.meta)
    result = replay(trace.allocation_record())
    on = result["sample"] >= 0
    fake.timeline.cuda_allocated = result["allocated"][on] + offset
    fake.timeline.cuda_reserved = result["reserved"][on] + offset
    n0 = int((~on).sum())
    start = (int(result["allocated"][n0 - 1]) + offset, int(result["reserved"][n0 - 1]) + offset, 0)
    fake.meta["cuda_at_entry"] = start
    return fake


def test_cuda_vs_simulated_on_a_trace_whose_allocator_is_the_simulator(small_trace):
    from anatomy_helpers.first_step import cuda_vs_simulated, format_cuda_vs_simulated

    _, _, trace = small_trace
    with pytest.raises(ValueError, match="not recorded on CUDA"):
        cuda_vs_simulated(trace)
    rows = cuda_vs_simulated(fake_cuda_trace(trace, offset=7 * MiB))
    assert [r["step"] for r in rows] == [1, 2, 3]
    per_step = {r["step"]: r for r in summarize_replay(replay(trace.allocation_record()))}
    for r in rows:  # growth since tracking began, so the offset cancels; the "real" numbers are the simulator's
        assert (
            r["real_reserved"] == r["sim_reserved"] == per_step[r["step"]]["reserved_end"] - per_step[0]["reserved_end"]
        )
        assert r["real_allocated"] == r["sim_allocated"]
    assert len(format_cuda_vs_simulated(rows).splitlines()) == 2 + 3
    fig = plot_allocator(replay(trace.allocation_record()), fake_cuda_trace(trace, offset=7 * MiB))
    assert len(fig.axes) == 2 and "since tracking began" in fig.axes[1].get_ylabel()


def test_cuda_helpers_refuse_a_cpu_device():
    with pytest.raises((ValueError, RuntimeError)):
        cuda_run_under_limit(None, device="cpu")


# ---- on a GPU (run by scripts/gpu_check.py) -----------------------------------------------------------


@needs_cuda
def test_cuda_simulated_reserved_within_5_percent_of_memory_reserved():
    import os

    from anatomy_helpers.first_step import cuda_reserved_check

    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        pytest.skip("expandable segments grow in place: the simulator models the default allocator")

    rows = cuda_reserved_check(steps=4, batch_size=8)
    report = "\n".join(f"step {r['step']}: real {r['real_reserved']:,} sim {r['sim_reserved']:,}" for r in rows)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], report
    for r in rows:
        assert abs(r["relative_difference"]) <= 0.05, report
    assert rows[3]["real_reserved"] == rows[2]["real_reserved"], report  # the real cache plateaus too


@needs_cuda
def test_cuda_oom_under_a_memory_fraction_passes_step_1_and_fails_step_2():
    from anatomy_helpers.first_step import choose_cuda_limit

    choice = choose_cuda_limit(batch_size=8)
    assert choice.limit is not None, (choice.how, choice.dry_run)
    run = cuda_run_under_limit(choice.limit, steps=3, batch_size=8)
    assert run.completed == [1] and run.failed_step == 2, run.summary()
    assert "out of memory" in run.message.lower()
    assert torch.cuda.get_per_process_memory_fraction() == 1.0
    assert run.after["allocated"] <= run.before["allocated"]  # everything released
    fixed = cuda_run_under_limit(choice.limit, steps=3, batch_size=8, optimizer="sgd")
    assert fixed.passed, fixed.summary()


@needs_cuda
def test_cuda_snapshot_is_recorded_dumped_and_rendered(tmp_path):
    from anatomy_helpers.first_step import cuda_release, record_cuda_snapshot

    model = make_model(device="cuda", **SMALL)
    opt = make_optimizer(model, "adamw")

    def one_step():
        loss = model(*get_batch(4, SMALL["seq_len"], device="cuda"))[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    snap = record_cuda_snapshot(one_step, tmp_path / "snap.pickle", max_entries=10_000)
    actions = {e["action"] for e in snap["device_traces"][torch.cuda.current_device()]}
    assert {"alloc", "free_requested"} <= actions
    assert snap["segments"] and "total_reserved" in _memory_viz.segsum(snap)
    assert "Active Memory Timeline" in write_memory_viz(snap, tmp_path / "snap.html").read_text()
    n_before = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
    extra = torch.ones(1024, device="cuda")  # recording is off again: this is not logged
    n_after = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
    assert n_after == n_before
    del extra
    cuda_release()


def test_replay_of_hand_made_record_matches_plain_sim():
    # allocator_at must replay exactly like CachingAllocatorSim driven by hand.
    rec = make_record(TWO_STEPS)
    sim = CachingAllocatorSim()
    sim.malloc(0, 3 * MiB)
    sim.free(0)
    sim.malloc(1, 3 * MiB)
    sim.malloc(2, 21 * MiB)
    replayed = allocator_at(rec, 3)
    assert replayed.segments() == sim.segments()
