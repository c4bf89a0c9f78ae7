"""The recorder's state, the category-precedence table and the StepTracker's extension points, on hand-made cases.

Every expected figure is stated here from the tensors themselves (``numel * element_size``), never read back
from the code under test.
"""

import itertools

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from anatomy_helpers import track_steps
from anatomy_helpers.distributed.ranks import RankTracker
from anatomy_helpers.tracking.events import (
    ACTIVATIONS,
    CATEGORIES,
    CATEGORY_PRECEDENCE,
    COMMUNICATION,
    FORWARD,
    GRADIENTS,
    INPUTS,
    PARAMETERS,
    TEMPORARIES,
    Event,
    OpWindow,
    PhaseMark,
    winning_category,
)
from anatomy_helpers.tracking.recorder import MemoryBudgetExceeded, Recorder
from anatomy_helpers.tracking.scratch import SCRATCH_MIN_BYTES, splice_scratch
from anatomy_helpers.tracking.trace import Trace
from anatomy_helpers.tracking.tracker import StepTracker

F32 = 4  # bytes per float32 element


# ---- the precedence table ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "first, then, wins, why",
    [
        ("parameters", "activations", "parameters", "a weight saved for backward stays a parameter"),
        ("communication", "gradients", "gradients", "a gradient that is a view of a DDP bucket counts as gradients"),
        ("communication", "parameters", "parameters", "a parameter a collective broadcasts stays a parameter"),
        ("optimizer_state", "communication", "optimizer_state", "ZeRO's state shard read by a collective"),
        ("communication", "activations", "communication", "an FSDP all-gather saved for backward stays its buffer"),
        ("inputs", "activations", "inputs", "the token ids saved by the embedding stay inputs"),
        ("temporaries", "activations", "activations", "an op output saved for backward is an activation"),
        ("temporaries", "inputs", "inputs", "data made before the forward, handed to the model"),
        ("recomputed", "activations", "activations", "a recomputed tensor saved again for backward"),
    ],
)
def test_the_precedence_table_on_storages_that_qualify_twice(first, then, wins, why):
    assert winning_category(first, then) == wins, why
    assert winning_category(then, first) == wins, f"{why} (whichever is seen first)"


def test_the_precedence_table_ranks_every_category_once_and_refuses_unknown_names():
    assert sorted(CATEGORY_PRECEDENCE) == sorted(CATEGORIES)
    for a, b in itertools.combinations(CATEGORIES, 2):
        assert winning_category(a, b) in (a, b)
    assert winning_category("kernel_scratch", "kernel_scratch") == "kernel_scratch"
    with pytest.raises(ValueError, match="category must be one of"):
        winning_category("weights", "activations")


# ---- the recorder on hand-made storages ----------------------------------------------------------------------------


def _recording(**kwargs) -> Recorder:
    rec = Recorder("cpu", **kwargs)
    rec.begin()
    return rec


def test_mark_keeps_the_winning_category_whichever_order_the_storage_is_seen_in():
    rec = _recording()
    weight = torch.zeros(4, 8)
    rec.mark(weight, PARAMETERS)
    rec.mark(weight.t(), ACTIVATIONS)  # a transposed view, saved for backward: the same storage
    bucket = torch.zeros(100)
    rec.mark(bucket, COMMUNICATION)
    rec.mark(bucket[10:30].view(4, 5), GRADIENTS)  # gradient_as_bucket_view: the whole bucket is gradients
    gathered = torch.zeros(16)
    rec.mark(gathered, COMMUNICATION)
    rec.mark(gathered, ACTIVATIONS)
    assert rec.live_breakdown() == {
        **dict.fromkeys(CATEGORIES, 0),
        "parameters": 32 * F32,
        "gradients": 100 * F32,
        "communication": 16 * F32,
    }


def test_a_storage_is_registered_once_however_many_views_point_at_it():
    rec = _recording()
    t = torch.zeros(10)
    a = rec.mark(t, TEMPORARIES)
    assert rec.mark(t[2:5], ACTIVATIONS) == a == rec.allocation_id(t.view(2, 5))
    assert rec.allocation_id(torch.zeros(3), new=False) is None  # unknown and not new: not registered
    assert rec.samples == 1  # no baseline closed: every event counts


def test_allocations_resizes_and_frees_become_the_trace_in_order():
    rec = _recording()
    weight = torch.zeros(6)
    rec.mark(weight, PARAMETERS)
    rec.close_baseline()
    t = torch.zeros(10)
    a = rec.allocation_id(t)
    t.untyped_storage().resize_(20 * F32)  # grown in place, as an out= op does
    assert rec.allocation_id(t) == a
    assert rec.samples == 2  # the lookup recorded the growth
    rec.resize(a, 20 * F32)  # already recorded at that size: nothing new
    assert rec.samples == 2
    del t  # the weak reference reports the free
    trace = rec.end()
    assert trace.baseline["parameters"] == 6 * F32
    assert trace.alloc_deltas.tolist() == [10 * F32, 10 * F32, -20 * F32]
    assert trace.timeline.total.tolist() == [16 * F32, 26 * F32, 6 * F32]
    assert trace.alloc_category.tolist() == [PARAMETERS, TEMPORARIES]


def test_frees_at_one_moment_are_recorded_oldest_allocation_first():
    """Leaving torch.autocast frees its weight casts in hash-map order (addresses): the recorder fixes the order."""
    rec = _recording()
    rec.close_baseline()
    ts = [torch.zeros(n) for n in (1, 2, 3)]
    ids = [rec.allocation_id(t) for t in ts]
    with rec.frees_in_allocation_order():
        ts.reverse()
        while ts:
            ts.pop(0)  # newest first
        assert rec.samples == 3  # held until the block ends
    del ts
    after = torch.zeros(5)
    rec.allocation_id(after)  # an allocation after the block: recorded after the frees
    del after
    trace = rec.end()
    assert trace.alloc_ids.tolist() == [*ids, *ids, 3, 3]
    assert trace.alloc_deltas.tolist() == [F32, 2 * F32, 3 * F32, -F32, -2 * F32, -3 * F32, 5 * F32, -5 * F32]


def test_a_free_after_end_is_not_recorded():
    rec = _recording()
    t = torch.zeros(4)
    rec.mark(t, TEMPORARIES)
    rec.close_baseline()
    trace = rec.end()
    del t
    assert len(trace.timeline) == 0 and len(rec._events) == 1


def test_the_budget_counts_the_baseline_as_a_whole_then_each_allocation():
    rec = _recording(budget_bytes=100)
    big = torch.zeros(30)  # 120 bytes alive before training: over the budget
    rec.mark(big, PARAMETERS)  # not raised while registering the baseline ...
    with pytest.raises(MemoryBudgetExceeded, match="before training starts") as err:
        rec.close_baseline()  # ... but when it closes
    assert err.value.step == 0 and err.value.breakdown["parameters"] == 120
    rec = _recording(budget_bytes=100)
    weights = torch.zeros(20)  # 80 bytes: fits
    rec.mark(weights, PARAMETERS)
    rec.close_baseline()
    rec.allocation_id(torch.zeros(5))  # 100 bytes live: not over (and freed again at once)
    with pytest.raises(MemoryBudgetExceeded, match="step 1, idle phase") as err:
        rec.allocation_id(torch.zeros(6))  # 24 more bytes: 104 > 100
    assert err.value.requested == 24 and err.value.breakdown["temporaries"] == 24


class _Wrapper(Recorder):
    """A recorder whose tensors may carry their bytes in another tensor (as a DTensor does in its local shard)."""

    def storage_tensor(self, t):
        return getattr(t, "local_shard", t)


def test_storage_tensor_is_where_every_lookup_goes():
    rec = _Wrapper("cpu")
    rec.begin()
    shard = torch.zeros(6)
    wrapper = torch.zeros(24)  # the "global" tensor: not what this recorder counts
    wrapper.local_shard = shard
    a = rec.mark(wrapper, PARAMETERS)
    assert rec.allocation_id(shard) == a
    assert rec.live_breakdown()["parameters"] == 6 * F32


def test_reset_brings_back_exactly_the_state_init_declared():
    fresh = vars(Recorder("cpu", budget_bytes=10**6, accumulate=True)).copy()
    rec = Recorder("cpu", budget_bytes=10**6, accumulate=True)
    rec.begin()
    kept = [torch.zeros(3), torch.zeros(5)]
    rec.mark(kept[0], PARAMETERS, rec._code("blocks.0"))
    rec.close_baseline()
    rec.mark(kept[1], INPUTS)
    rec._set_phase(FORWARD)
    rec.end()
    assert set(vars(rec)) == set(fresh)  # nothing recorded made a field of its own
    rec.reset()
    assert vars(rec) == fresh
    assert rec.step == 1 and rec.phase == "idle" and not rec.recording and rec.samples == 0


def test_a_tracked_run_makes_no_field_its_init_did_not_declare(small):
    model, opt = small
    declared = set(vars(StepTracker(model, opt)))
    tracker = StepTracker(model, opt)
    track_steps(model, opt, steps=1, batch_size=2, tracker=tracker)
    assert set(vars(tracker)) == declared


# ---- the typed rows: Trace.from_events and splice_scratch on hand-made events ------------------------------------


def test_from_events_reads_the_rows_by_field():
    events = [
        Event(time_ns=0, alloc_id=0, delta=64, step=0, phase=0, module=0),  # baseline: a parameter
        Event(time_ns=2_000, alloc_id=1, delta=32, step=1, phase=1, module=1),
        Event(time_ns=3_000, alloc_id=1, delta=-32, step=1, phase=2, module=1),
    ]
    trace = Trace.from_events(
        events=np.array(events, dtype=np.int64),
        n_baseline=1,
        start_ns=1_000,
        alloc_category=np.array([PARAMETERS, ACTIVATIONS]),
        alloc_module=np.array([0, 1]),
        module_names=["-", "model"],
        phase_marks=[PhaseMark(1, 0.0, 1, "forward"), PhaseMark(2, 0.0, 1, "backward")],
        saved=[],
        grad_param={},
        device="cpu",
        duration_s=1.0,
    )
    assert trace.baseline["parameters"] == 64
    assert trace.timeline.category("activations").tolist() == [32, 0]
    assert trace.timeline.time_s.tolist() == [1e-6, 2e-6]
    assert trace.timeline.phase.tolist() == [1, 2]
    assert [m.index for m in trace.phase_marks] == [0, 1]


def test_splice_scratch_puts_a_pair_right_after_the_ops_outputs_and_moves_later_marks():
    events = [Event(10, 0, 100, 1, 1, 4), Event(20, 1, 100, 1, 1, 5), Event(30, 1, -100, 1, 2, 5)]
    windows = [OpWindow(15, 25, 2, 1, 1, 5)]  # the op that made allocation 1, between 15 and 25 ns
    scratch = 4 * SCRATCH_MIN_BYTES
    # the allocator: the op's output, then a work buffer taken and given back inside the op
    memory = np.array([[16, 100], [17, scratch], [18, -scratch]], dtype=np.int64)
    marks = [PhaseMark(0, 0.0, 1, "forward"), PhaseMark(2, 0.0, 1, "backward")]
    made = []

    def new_allocation(nbytes, module):
        made.append((nbytes, module))
        return 7

    spliced, moved = splice_scratch(events, windows, memory, marks, new_allocation)
    assert made == [(scratch, 5)]
    assert spliced == [events[0], events[1], Event(20, 7, scratch, 1, 1, 5), Event(20, 7, -scratch, 1, 1, 5), events[2]]
    assert [m.index for m in moved] == [0, 4]  # the backward mark follows the pair inserted before it
    small = np.array([[16, 100], [17, SCRATCH_MIN_BYTES - 1], [18, 1 - SCRATCH_MIN_BYTES]], dtype=np.int64)
    assert splice_scratch(events, windows, small, marks, new_allocation)[0] == events  # below the threshold


# ---- the StepTracker's extension points ------------------------------------------------------------------------------


class _Extended(StepTracker):
    """Uses every extension point, noting when each is called and what the tracker was doing then."""

    def __init__(self, model, optimizer, extra, side_state):
        super().__init__(model, optimizer, kernel_scratch=False)
        self.extra, self.side_state = extra, side_state
        self.calls: list[tuple] = []

    def on_baseline(self):
        self.calls.append(("baseline", self.recording, self._n_baseline))
        self.mark(self.extra, COMMUNICATION)

    def state_tensors(self):
        self.calls.append(("state", self.step))
        return super().state_tensors() + [self.side_state]

    def on_optimizer_step(self):
        self.calls.append(("optimizer", self.step, self.phase))

    def inner_modes(self):
        return [_SeesOpsFirst(self)]


class _SeesOpsFirst(TorchDispatchMode):
    def __init__(self, tracker):
        super().__init__()
        self.tracker, self.empties = tracker, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.tracker.samples
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.zeros_like.default:  # allocates: the tracker has recorded it when func returns
            self.empties.append(self.tracker.samples - before)
        return out


def test_extension_points_are_called_when_their_docstrings_say(small):
    model, opt = small
    extra, side_state = torch.zeros(40), torch.zeros(12)
    tracker = _Extended(model, opt, extra, side_state)
    trace = track_steps(model, opt, steps=2, batch_size=2, tracker=tracker)
    assert tracker.calls == [
        ("state", 1),  # on entering, before the baseline closes
        ("baseline", True, None),
        ("optimizer", 1, "optimizer"),
        ("state", 1),  # after step 1's optimizer.step()
        ("optimizer", 2, "optimizer"),
        ("state", 2),
    ]
    # a fresh AdamW has no state yet: what was alive as optimizer state when tracking began is the side state alone
    assert trace.baseline["optimizer_state"] == 12 * F32
    assert trace.baseline["communication"] == 40 * F32
    assert torch._C._len_torch_dispatch_stack() == 0  # the inner mode left with the tracker's own


def test_an_inner_mode_sees_each_op_before_the_tracker_records_its_outputs(small):
    model, opt = small
    tracker = _Extended(model, opt, torch.zeros(1), torch.zeros(1))
    with tracker:
        x = torch.ones(3, 5)
        with tracker.inner_modes()[0] as mode:  # a second instance, innermost: it sees the op first of all
            torch.zeros_like(x)
    assert mode.empties == [1]  # one new storage recorded between its call of the op and the op's return


def test_the_rank_tracker_counts_a_bucket_its_gradients_view_as_gradients_and_reads_watched_sizes(small):
    model, opt = small
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    bucket = torch.zeros(n)  # DDP's bucket with gradient_as_bucket_view=True: every gradient is a view of it
    offset = 0
    for p in params:
        p.grad = bucket[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    gathered = torch.zeros(64)  # an FSDP all-gather output, resized to 0 in place (resharded) outside any op
    tracker = RankTracker(model, opt, communication=[bucket], watched=[gathered])
    with tracker:
        gathered.untyped_storage().resize_(0)
        torch.ones(1)  # the next op: the watched storage's size is read before it runs
    trace = tracker.trace
    assert trace.baseline["gradients"] == n * F32 and trace.baseline["communication"] == 64 * F32
    assert trace.at(len(trace.timeline) - 1)["communication"] == 0
    shard = torch.zeros(3)
    dtensor_like = torch.zeros(12)  # what the rank tracker takes for a DTensor: a local tensor and a mesh
    dtensor_like._local_tensor, dtensor_like.device_mesh = shard, None
    assert tracker.storage_tensor(dtensor_like) is shard


def test_the_rank_tracker_refuses_a_watched_tensor_whose_storage_was_swapped(small):
    # It reads each watched storage it found at the start (FSDP2 resizes them in place): one swapped for another
    # (set_) would go unseen, so the next optimizer step refuses the run instead of answering from the old storage.
    model, opt = small
    gathered = torch.zeros(64)
    tracker = RankTracker(model, opt, watched=[gathered])
    with pytest.raises(RuntimeError, match="changed storage"):
        with tracker:
            gathered.set_(torch.zeros(8).untyped_storage())
            tracker.on_optimizer_step()
