"""The Trace's query API on a hand-made trace whose every answer is worked out here, by hand, from its design.

Sizes are in quarter MiB so each total prints exactly with two decimals. The design (bytes alive after each sample;
parameters are a 10 MiB baseline storage, allocation 0):

    sample  step phase      module          change                 total (MiB)
      0     1    forward    blocks.0        +3   activations (a1)  13
      1     1    forward    blocks.0        +2   temporaries (a2)  15      <- step 1 forward's peak
      2     1    forward    blocks.0        -2   a2                13
      3     1    forward    blocks.0        +1   activations (a3)  14      <- the moment before backward
      4     1    backward   head            -3   a1                11
      5     1    backward   head            +2.5 gradients (a4)    13.5    <- backward's highest own sample
      6     1    backward   head            -1   a3                12.5
      7     1    optimizer  optimizer.step  +4   state (a5)        16.5
      8     1    optimizer  optimizer.step  +0.5 temporaries (a6)  17      <- step 1's peak (second highest)
      9     1    optimizer  optimizer.step  -0.5 a6                16.5
     10     1    optimizer  optimizer.step  -2.5 a4 (zero_grad)    14
     11     2    forward    blocks.0        +6   activations (a7)  20      <- the trace's peak
     12     2    forward    blocks.0        -6   a7                14
     13     2    backward   head            +0.25 temporaries (a8) 14.25   <- also step 2 optimizer's peak
     14     2    optimizer  optimizer.step  -0.25 a8               14      (an optimizer phase that only frees)

The semantics stated independently of trace.py: a window's peak is its highest sample; a phase's peak also counts
the moment just before the phase (what the previous phase left alive), reported as that phase's.
"""

import numpy as np
import pytest

from anatomy_helpers.tracking.events import CATEGORIES, PHASES, PhaseMark
from anatomy_helpers.tracking.trace import Trace

Q = 2**18  # a quarter MiB
MiB = 2**20
MODULES = ["-", "blocks.0", "head", "optimizer.step"]
CAT = {c: i for i, c in enumerate(CATEGORIES)}
ALLOC_CATEGORY = np.array(
    [CAT[c] for c in ("parameters", "activations", "temporaries", "activations", "gradients", "optimizer_state")]
    + [CAT["temporaries"], CAT["activations"], CAT["temporaries"]]
)
#: (step, phase, module, allocation id, change in quarter MiB)
ROWS = [
    (1, "forward", 1, 1, 12),
    (1, "forward", 1, 2, 8),
    (1, "forward", 1, 2, -8),
    (1, "forward", 1, 3, 4),
    (1, "backward", 2, 1, -12),
    (1, "backward", 2, 4, 10),
    (1, "backward", 2, 3, -4),
    (1, "optimizer", 3, 5, 16),
    (1, "optimizer", 3, 6, 2),
    (1, "optimizer", 3, 6, -2),
    (1, "optimizer", 3, 4, -10),
    (2, "forward", 1, 7, 24),
    (2, "forward", 1, 7, -24),
    (2, "backward", 2, 8, 1),
    (2, "optimizer", 3, 8, -1),
]
TOTALS_MIB = [13, 15, 13, 14, 11, 13.5, 12.5, 16.5, 17, 16.5, 14, 20, 14, 14.25, 14]


def hand_trace() -> Trace:
    events = [(0, 0, 40 * Q, 0, 0, 0)]  # the baseline: 10 MiB of parameters
    marks, last = [], None
    for i, (step, phase, module, aid, q) in enumerate(ROWS):
        events.append((1000 * (i + 1), aid, q * Q, step, PHASES.index(phase), module))
        if (step, phase) != last:
            marks.append(PhaseMark(1 + i, float(i), step, phase))
            last = (step, phase)
    return Trace.from_events(
        events=np.array(events, dtype=np.int64),
        n_baseline=1,
        start_ns=0,
        alloc_category=ALLOC_CATEGORY,
        module_names=MODULES,
        phase_marks=marks,
        alloc_module=np.array([1, 1, 1, 1, 2, 3, 3, 1, 2]),
        saved=[],
        grad_param={},
        device="cpu",
        duration_s=20.0,
    )


@pytest.fixture(scope="module")
def trace():
    return hand_trace()


def test_the_design_adds_up(trace):
    np.testing.assert_array_equal(trace.timeline.total, np.array(TOTALS_MIB) * MiB)


def test_the_peak_is_the_highest_sample_not_the_second(trace):
    pk = trace.peak()
    assert (pk.bytes, pk.index, pk.step, pk.phase, pk.module) == (20 * MiB, 11, 2, "forward", "blocks.0")
    held = {"parameters": 10 * MiB, "optimizer_state": 4 * MiB, "activations": 6 * MiB}
    assert pk.breakdown == {**dict.fromkeys(CATEGORIES, 0), **held}
    step1 = trace.peak(step=1)
    assert (step1.bytes, step1.index, step1.phase) == (17 * MiB, 8, "optimizer")
    forward = trace.peak(step=1, phase="forward")
    assert (forward.bytes, forward.index) == (15 * MiB, 1)
    assert str(pk) == "20.00 MiB at step 2, forward, in blocks.0"


def test_a_phase_peak_counts_the_moment_before_the_phase(trace):
    # backward's own samples reach 13.5 MiB; the moment before it (the end of forward) held 14
    pk = trace.peak(step=1, phase="backward")
    assert (pk.bytes, pk.index, pk.step, pk.phase, pk.module) == (14 * MiB, 3, 1, "backward", "head")
    assert pk.breakdown["activations"] == 4 * MiB and pk.breakdown["gradients"] == 0
    # an optimizer phase that only frees peaks at the moment before it
    opt = trace.peak(step=2, phase="optimizer")
    assert (opt.bytes, opt.index, opt.step, opt.phase) == (14.25 * MiB, 13, 2, "optimizer")
    # without a step, the highest of the phase's runs: step 1's 17 MiB
    assert trace.peak(phase="optimizer").bytes == 17 * MiB
    # a phase whose own samples are higher than the moment before it keeps its own peak
    assert trace.peak(step=2, phase="backward").index == 13


def test_windows_and_phase_runs(trace):
    assert trace.window(1, "backward").tolist() == [4, 5, 6]
    assert trace.window(phase="forward").tolist() == [0, 1, 2, 3, 11, 12]
    assert trace.window(step=2).tolist() == [11, 12, 13, 14]
    assert [(p.step, p.phase, p.start, p.end) for p in trace.phases()] == [
        (1, "forward", 0, 3),
        (1, "backward", 4, 6),
        (1, "optimizer", 7, 10),
        (2, "forward", 11, 12),
        (2, "backward", 13, 13),
        (2, "optimizer", 14, 14),
    ]
    ph = trace.phase(1, "optimizer")
    assert ph.at_end == {**dict.fromkeys(CATEGORIES, 0), "parameters": 10 * MiB, "optimizer_state": 4 * MiB}
    assert ph.dominant == "parameters" and trace.phase(2, "forward").peak.bytes == 20 * MiB
    assert trace.training_steps() == [1, 2] and trace.steps == [1, 2]


def test_optimizer_phase_by_hand(trace):
    one = trace.optimizer_phase(1)
    assert (one.start, one.end, one.peak_index) == (7, 10, 8)
    assert (one.state_before, one.state_after) == (0, 4 * MiB)
    assert one.temporaries == MiB // 2 and one.extra_peak == 17 * MiB - 12.5 * MiB
    two = trace.optimizer_phase(2)  # allocates nothing: its peak is the moment before it, nothing extra
    assert (two.peak_index, two.extra_peak, two.temporaries) == (13, 0, 0)
    assert two.peak["temporaries"] == MiB // 4


def test_moments_by_hand(trace):
    assert trace.at(-1) == {**dict.fromkeys(CATEGORIES, 0), "parameters": 10 * MiB}
    assert trace.at(5)["gradients"] == 2.5 * MiB and trace.at(5)["activations"] == MiB
    alive = trace.alive_at(6)
    assert alive.tolist() == [40 * Q, 0, 0, 0, 10 * Q, 0, 0, 0, 0]
    assert trace.alive_at(0).tolist() == [40 * Q, 12 * Q] + [0] * 7
    rows = trace.live_allocations(1)
    assert [(r.alloc_id, r.bytes, r.category, r.module) for r in rows] == [
        (0, 10 * MiB, "parameters", "blocks.0"),
        (1, 3 * MiB, "activations", "blocks.0"),
        (2, 2 * MiB, "temporaries", "blocks.0"),
    ]
    assert trace.live_by_module(5, depth=1) == {
        "blocks": {**dict.fromkeys(CATEGORIES, 0), "parameters": 10 * MiB, "activations": MiB},
        "head": {**dict.fromkeys(CATEGORIES, 0), "gradients": 2.5 * MiB},
    }


def test_allocations_by_hand(trace):
    assert trace.largest_allocation("activations", 2, "forward") == 6 * MiB
    assert trace.largest_allocation("activations", 1) == 3 * MiB
    assert trace.largest_allocation("gradients", 2) == 0
    rec = trace.allocation_record()
    assert rec.sample.tolist() == [-1, *range(15)] and rec.bytes[0] == 10 * MiB
    # rounded to 3 MiB blocks: the 10 MiB baseline takes 12, then +3 and +2 take 3 each
    assert trace.replay_baseline(MiB) == 10 * MiB and trace.replay_baseline(3 * MiB) == 12 * MiB
    assert trace.replay_totals(3 * MiB)[:2].tolist() == [15 * MiB, 18 * MiB]


def test_the_table_rows_are_each_phases_peak_by_hand(trace):
    assert trace.table_categories() == ["parameters", "optimizer_state", "gradients", "activations", "temporaries"]
    rows = [line.split() for line in trace.table().splitlines()[2:-2]]
    assert rows == [
        ["1", "forward", "10.00", "0.00", "0.00", "3.00", "2.00", "15.00", "blocks.0"],
        ["1", "backward", "10.00", "0.00", "0.00", "4.00", "0.00", "14.00", "head"],
        ["1", "optimizer", "10.00", "4.00", "2.50", "0.00", "0.50", "17.00", "optimizer.step"],
        ["2", "forward", "10.00", "4.00", "0.00", "6.00", "0.00", "20.00", "blocks.0"],
        ["2", "backward", "10.00", "4.00", "0.00", "0.00", "0.25", "14.25", "head"],
        ["2", "optimizer", "10.00", "4.00", "0.00", "0.00", "0.25", "14.25", "optimizer.step"],
    ]
    assert trace.table().splitlines()[-1] == "peak: 20.00 MiB at step 2, forward, in blocks.0"


def test_step_times_by_hand(trace):
    # steps start at the first phase mark: step 1 at 0 s (sample 0), step 2 at 11 s; the trace lasted 20 s
    assert trace.step_times_s() == {1: 11.0, 2: 9.0}
