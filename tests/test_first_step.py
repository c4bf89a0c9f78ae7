"""Lesson 04's own helpers: the step peak table, optimizer-state births, the replay summary, the allocator plots
and the two slider panels."""

import pytest
import torch

from anatomy_helpers.lessons.lesson04_first_step import (
    allocator_panel,
    budget_panel,
    format_replay_summary,
    optimizer_state_births,
    plot_allocator,
    plot_segment_map,
    step_peak_table,
)
from anatomy_helpers.prediction.allocator import allocator_at, replay
from anatomy_helpers.tracking.events import CATEGORIES
from anatomy_helpers.ui.plots import CourseFigure

from .conftest import SMALL, make_record, storage_bytes
from .test_trace_oracles import hand_trace

MiB = 2**20


def test_optimizer_state_is_born_in_step_one(small_run):
    model, opt, trace = small_run
    params = list(model.parameters())
    count, nbytes = optimizer_state_births(trace, 1)
    assert count == 3 * len(params)  # exp_avg, exp_avg_sq and the CPU step scalar
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert nbytes == storage_bytes(state) == 2 * storage_bytes(params) + 4 * len(params)
    assert optimizer_state_births(trace, 2) == (0, 0)


def test_step_peak_table_of_a_hand_made_trace():
    # test_trace_oracles' design: step 1 peaks at 17 MiB in its optimizer phase (state 4, gradients 2.5, a 0.5 MiB
    # temporary), step 2 at 20 MiB in its forward (6 MiB of activations beside the state)
    lines = step_peak_table(hand_trace()).splitlines()
    assert "optimizer state" in lines[0] and lines[0].endswith("(MiB)")
    assert [line.split() for line in lines[2:]] == [
        ["1", "17.00", "optimizer,", "optimizer.step", "10.00", "4.00", "2.50", "0.00", "0.50", "0.00"],
        ["2", "20.00", "forward,", "blocks.0", "10.00", "4.00", "0.00", "6.00", "0.00", "0.00"],
    ]


def test_step_peak_table_reads_the_timeline(small_trace):
    tl = small_trace.timeline
    lines = step_peak_table(small_trace).splitlines()
    assert len(lines) == 2 + 3
    for s, line in zip((1, 2, 3), lines[2:]):
        highest = tl.total[tl.step == s].max()  # the step's highest sample, straight from the timeline
        assert line.split()[:2] == [str(s), f"{highest / MiB:.2f}"]


def test_format_replay_summary_hand_made():
    # The record of test_allocator's TWO_STEPS plus a baseline row: a 512 B storage alive at the start (step 0),
    # in a 2 MiB small-pool segment. Step 1: one 20 MiB segment for 3 MiB; step 2: the cached segment reused, and a
    # 22 MiB one for 21 MiB (handed out whole): peak allocated 0.5 KiB + 3 + 22 MiB, reserved 2 + 20 + 22 MiB.
    rec = make_record([(0, 9, 512), (1, 0, 3 * MiB), (1, 0, -3 * MiB), (2, 1, 3 * MiB), (2, 2, 21 * MiB)])
    lines = format_replay_summary(replay(rec)).splitlines()
    assert [line.split() for line in lines[2:]] == [
        ["0", "(start)", "1", "2.00", "0.00", "2.00", "2.00"],
        ["1", "1", "22.00", "3.00", "22.00", "19.00"],
        ["2", "1", "44.00", "25.00", "44.00", "19.00"],
    ]


def test_format_replay_summary_adds_up_to_the_replay(small_trace):
    result = replay(small_trace.allocation_record())
    rows = [line.split() for line in format_replay_summary(result).splitlines()[2:]]
    # step 0: what was alive at the start; then every step with events (the trailing idle one included)
    assert [r[0] for r in rows] == ["0", *map(str, small_trace.steps)] and rows[0][1] == "(start)"
    rows[0].pop(1)
    # every cudaMalloc of the replay falls in exactly one step; the last step ends with what the replay ends with
    assert sum(int(r[1]) for r in rows) == result.segments_created[-1]
    assert rows[-1][2] == f"{result.reserved[-1] / MiB:.2f}"
    assert max(float(r[3]) for r in rows) == pytest.approx(result.allocated.max() / MiB, abs=0.005)


def test_plots_are_course_figures(small_trace):
    rec = small_trace.allocation_record()
    fig = plot_allocator(replay(rec), small_trace)
    assert isinstance(fig, CourseFigure) and len(fig.axes) == 1 and "MiB" in fig.axes[0].get_ylabel()
    assert "caching allocator" in fig.get_suptitle() and fig.axes[0].get_title() == ""  # a figure title: not clipped
    widths = {line.get_label(): line.get_linewidth() for line in fig.axes[0].get_lines()}
    allocated = next(w for label, w in widths.items() if label.startswith("allocated"))
    assert allocated > 2 * widths["tracked tensor bytes (exact)"]  # the two nearly equal lines both stay visible
    sim = allocator_at(rec, len(rec) - 1)
    fig = plot_segment_map(sim, small_trace.alloc_category)
    assert len(fig.axes[0].get_yticklabels()) == sim.num_segments and fig.axes[0].get_title()
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend[-1] == "cached, free" and set(legend[:-1]) <= {c.replace("_", " ") for c in CATEGORIES}


def test_segment_map_of_a_hand_made_record():
    # two small-pool blocks in one 2 MiB segment, and a 3 MiB block in a 20 MiB segment; small pool first
    sim = allocator_at(make_record([(1, 0, 3 * MiB), (1, 1, 512), (1, 2, 1024)]), 2)
    fig = plot_segment_map(sim, [CATEGORIES.index("activations")] * 3)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["small #1", "large #0"]
    assert ax.get_title() == "Segments: 2 held, 22 MiB reserved, 3.0 MiB allocated"


def test_panels_print_and_plot(capsys):
    fig = allocator_panel(batch_size=2, steps=2, device="cpu", **SMALL)
    assert fig.get_suptitle() == "batch 2: simulated reserved vs allocated"
    # SMALL's parameters (4 B x 105,920) and AdamW's two moments (8 B x 105,920) alone are 1.21 MiB: over a
    # 1 MiB budget by step 1's optimizer phase at the latest; 100 MiB holds every step many times over
    fig = budget_panel(budget_mib=1, batch_size=2, steps=2, device="cpu", **SMALL)
    assert fig.axes[0].get_title() == "adamw, batch 2, checkpoint none: out of budget in step 1"
    fig = budget_panel(budget_mib=100, batch_size=2, steps=2, device="cpu", **SMALL)
    assert fig.axes[0].get_title() == "adamw, batch 2, checkpoint none: every step fits"
    out = capsys.readouterr().out
    assert "batch 2: tracked peak" in out and "budget 1.00 MiB: step 1 FAILED" in out


# ---- the plotted data against what each figure claims (tests/figure_data.py reads a figure back) ----


def test_the_allocator_plot_draws_the_replays_counters_and_the_tracked_bytes(small_trace):
    """The lines are the replay's memory_allocated / memory_reserved after each row of the record, placed at the
    row's timeline sample, and the trace's own total; allocated holds every tracked byte (rounded up to blocks)
    and reserved holds what is allocated."""
    import numpy as np

    from anatomy_helpers.ui.plots import CATEGORY_COLORS

    from .figure_data import line, unit_bytes

    result = replay(small_trace.allocation_record())
    ax = plot_allocator(result, small_trace).axes[0]
    scale = unit_bytes(ax.get_ylabel())
    on = result.sample >= 0
    reserved, allocated = line(ax, "reserved (segments)"), line(ax, "allocated (blocks: the tensors rounded up)")
    for drawn, values in ((reserved, result.reserved[on]), (allocated, result.allocated[on])):
        assert list(drawn.get_xdata()) == list(result.sample[on])
        np.testing.assert_allclose(drawn.get_ydata() * scale, values)
    tracked = line(ax, "tracked tensor bytes (exact)")
    np.testing.assert_allclose(tracked.get_ydata() * scale, small_trace.timeline.bytes.sum(axis=1))
    assert tracked.get_color() == CATEGORY_COLORS["activations"]
    at = result.sample[on]
    assert (result.allocated[on] >= small_trace.timeline.bytes.sum(axis=1)[at]).all()
    assert (result.reserved >= result.allocated).all()


def test_the_segment_map_draws_every_block_at_its_offset_in_its_categorys_colour():
    from matplotlib.colors import to_hex

    from anatomy_helpers.ui.plots import CATEGORY_COLORS

    from .figure_data import bars

    rows = [(1, 0, 3 * MiB), (1, 1, 512), (1, 2, 1024), (1, 0, -3 * MiB)]  # then the 3 MiB block is freed
    cats = [CATEGORIES.index(c) for c in ("activations", "gradients", "parameters")]
    sim = allocator_at(make_record(rows), 3)
    ax = plot_segment_map(sim, cats).axes[0]
    drawn = bars(ax)
    white = to_hex("white")
    # small #1 (row 0): a 2 MiB segment holding the 512 B gradient block and the 1 KiB parameter block after it;
    # large #0 (row 1): a 20 MiB segment whose only block is now cached (no coloured bar)
    assert sorted((y + 0.4, w * MiB) for _, y, w, _, c in drawn if c == white) == [(0, 2 * MiB), (1, 20 * MiB)]
    blocks = sorted((round(y + 0.4), x * MiB, w * MiB, c) for x, y, w, _, c in drawn if c != white)
    assert blocks == [
        (0, 0, 512, to_hex(CATEGORY_COLORS["gradients"])),
        (0, 512, 1024, to_hex(CATEGORY_COLORS["parameters"])),
    ]
    assert ax.get_title() == "Segments: 2 held, 22 MiB reserved, 0.0 MiB allocated"


def test_the_panels_draw_the_runs_they_print(capsys):
    """allocator_panel and budget_panel (notebook 04): the tracked line and the budget run's stack are the bytes of
    the same settings tracked here again, and the budget line is the budget asked for."""
    import numpy as np

    from anatomy_helpers import make_model, make_optimizer, track_steps
    from anatomy_helpers.training.budget import try_budget

    from .figure_data import assert_stack_is_the_trace, horizontal_lines, line, unit_bytes

    fig = allocator_panel(batch_size=2, steps=2, device="cpu", **SMALL)
    model = make_model(device="cpu", **SMALL)
    again = track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=2)
    ax = fig.axes[0]
    tracked = line(ax, "tracked tensor bytes (exact)")
    np.testing.assert_allclose(tracked.get_ydata() * unit_bytes(ax.get_ylabel()), again.timeline.bytes.sum(axis=1))
    fig = budget_panel(budget_mib=1, batch_size=2, steps=2, device="cpu", **SMALL)
    ax = fig.axes[0]
    assert_stack_is_the_trace(ax, try_budget(MiB, 2, "adamw", "none", 2, "cpu", **SMALL).trace)
    assert [y * unit_bytes(ax.get_ylabel()) for y in horizontal_lines(ax)] == [MiB]
    capsys.readouterr()
