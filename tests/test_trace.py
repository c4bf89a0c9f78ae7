"""The Trace's query API, checked against what the timeline itself says (independently recomputed)."""

import numpy as np
import pytest

from anatomy_helpers.core.tables import Col, format_table
from anatomy_helpers.core.units import round_up
from anatomy_helpers.tracking.events import CATEGORIES, PHASES, AllocationRecord, model_part, model_parts

from .conftest import make_record


def test_window_is_the_samples_of_that_step_and_phase(small_trace):
    tl = small_trace.timeline
    for step in small_trace.training_steps():
        for phase in ("forward", "backward", "optimizer"):
            expected = [i for i in range(len(tl)) if tl.step[i] == step and PHASES[tl.phase[i]] == phase]
            assert small_trace.window(step, phase).tolist() == expected
    assert len(small_trace.window()) == len(tl)
    with pytest.raises(ValueError, match="phase must be one of"):
        small_trace.window(1, "fwd")


def test_phase_summaries_tile_the_timeline(small_trace):
    phases = small_trace.phases()
    assert phases[0].start == 0 and phases[-1].end == len(small_trace.timeline) - 1
    for a, b in zip(phases, phases[1:]):
        assert b.start == a.end + 1
    ph = small_trace.phase(2, "backward")
    assert ph.peak.bytes == small_trace.timeline.total[ph.start - 1 : ph.end + 1].max()  # the moment before too
    with pytest.raises(ValueError, match="step 9 has no 'forward' phase"):
        small_trace.phase(9, "forward")


def test_alive_at_sums_to_the_timeline_total(small_trace):
    tl = small_trace.timeline
    for i in (-1, 0, len(tl) // 3, len(tl) - 1):
        alive = small_trace.alive_at(i)
        total = sum(small_trace.baseline.values()) if i < 0 else int(tl.total[i])
        assert int(alive.sum()) == total
        by_cat = small_trace.at(i)
        for c in CATEGORIES:
            assert sum(r.bytes for r in small_trace.live_allocations(i, c)) == by_cat[c]


def test_live_by_module_adds_up_and_rejects_bad_moments(small_trace):
    i = small_trace.phase(1, "forward").end
    rows = small_trace.live_by_module(i, depth=1)
    assert sum(sum(r.values()) for r in rows.values()) == int(small_trace.timeline.total[i])
    for bad in (-5, len(small_trace.timeline), 1.5):
        with pytest.raises(ValueError, match="index must be"):
            small_trace.live_by_module(bad)
    with pytest.raises(ValueError, match="depth"):
        small_trace.live_by_module(i, depth=0)


def test_largest_allocation_is_the_largest_positive_row(small_trace):
    rec = small_trace.allocation_record()
    rows = [
        int(b)
        for b, s, p, c, sample in zip(rec.bytes, rec.step, rec.phase, rec.category, rec.sample)
        if b > 0 and s == 1 and PHASES[p] == "forward" and CATEGORIES[c] == "activations" and sample >= 0
    ]
    assert small_trace.largest_allocation("activations", 1, "forward") == max(rows)
    assert small_trace.largest_allocation("optimizer_state", 1, "forward") == 0


def test_allocation_record_replays_to_the_timeline(small_trace):
    rec = small_trace.allocation_record()
    on = rec.sample >= 0
    np.testing.assert_array_equal(np.cumsum(rec.bytes)[on], small_trace.timeline.total)
    assert rec.rows_through(0) == int((rec.sample < 0).sum())


def test_allocation_record_columns_must_have_one_length():
    rec = make_record([(1, 0, 512), (1, 0, -512)])
    with pytest.raises(ValueError, match="one length"):
        AllocationRecord(rec.sample, rec.time_s, rec.alloc_id[:1], rec.bytes, rec.category, rec.step, rec.phase)


def test_optimizer_phase_starts_from_the_moment_before_it(small_trace):
    ph = small_trace.optimizer_phase(2)
    before = small_trace.at(ph.start - 1)
    assert ph.state_before == before["optimizer_state"] and ph.extra_peak >= 0
    assert sum(ph.peak.values()) == sum(before.values()) + ph.extra_peak


def test_model_part_names_the_parts_in_forward_order():
    assert [model_part(n) for n in ("tok_emb", "blocks.3.mlp.fc", "ln_f", "model", "optimizer.step", "-")] == [
        "embeddings",
        "blocks.3",
        "head",
        "head",
        None,
        None,
    ]
    assert model_parts(2) == ["embeddings", "blocks.0", "blocks.1", "head"]


def test_round_up_and_the_table_formatter():
    assert [round_up(n, 512) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]
    np.testing.assert_array_equal(round_up(np.array([1, 1025]), 512), [512, 1536])
    with pytest.raises(ValueError):
        round_up(10, 0)
    text = format_table([Col("name", 6, align="<"), Col("bytes", 8, ",d")], [("a", 1234), ("bb", None)], note="(x)")
    lines = text.splitlines()
    assert lines[0].split() == ["name", "bytes", "(x)"] and lines[2].split() == ["a", "1,234"]
    assert lines[3].split() == ["bb", "-"] and set(lines[1]) == {"-"}
    with pytest.raises(ValueError, match="2 columns"):
        format_table([Col("a", 2), Col("b", 2)], [(1,)])


def test_table_rows_read_the_timeline(small_trace):
    # each row's total is the highest sample of its run of (step, phase), or the sample just before the run:
    # computed here from the timeline's own columns (test_trace_oracles checks the semantics on a hand-made trace)
    tl = small_trace.timeline
    key = tl.step * len(PHASES) + tl.phase
    starts = [i for i in range(len(tl)) if i == 0 or key[i] != key[i - 1]]
    runs = [(s, e - 1) for s, e in zip(starts, starts[1:] + [len(tl)]) if PHASES[tl.phase[s]] != "idle"]
    lines = small_trace.table().splitlines()
    assert len(lines) == 2 + len(runs) + 2
    total_column = 2 + len(small_trace.table_categories())
    for line, (s, e) in zip(lines[2:], runs):
        assert line.split()[:2] == [str(tl.step[s]), PHASES[tl.phase[s]]]
        highest = tl.total[max(s - 1, 0) : e + 1].max()
        assert float(line.split()[total_column]) == pytest.approx(highest / 2**20, abs=0.005)
