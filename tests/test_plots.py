import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from anatomy_helpers import CATEGORY_COLORS, make_model, make_optimizer, plot_module_bars, plot_timeline, track_steps
from anatomy_helpers.tracking.events import CATEGORIES

from .conftest import SMALL
from .figure_data import assert_stack_is_the_trace


@pytest.fixture(scope="module")
def trace():
    model = make_model(device="cpu", **SMALL)
    return track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=2)


def test_timeline_is_labelled_with_units_and_categories(trace):
    fig = plot_timeline(trace)
    ax = fig.axes[0]
    assert "MiB" in ax.get_ylabel() and ax.get_xlabel() and ax.get_title()
    shown = [c for c in CATEGORIES if trace.timeline.category(c).any()]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [c.replace("_", " ") for c in shown]
    assert {"parameters", "gradients", "activations", "optimizer_state"} <= set(shown)
    texts = {t.get_text().strip() for t in ax.texts}
    assert {"step 1", "step 2", "fwd", "bwd", "opt"} <= texts
    assert any(t.startswith("peak ") for t in texts)
    assert fig._repr_png_()[:4] == b"\x89PNG"


def test_time_axis_and_bad_axis(trace):
    assert "ms" in plot_timeline(trace, x="time").axes[0].get_xlabel()
    with pytest.raises(ValueError, match="x must be"):
        plot_timeline(trace, x="bytes")


def test_module_bars_use_category_colours(trace):
    fig = plot_module_bars(trace, step=1, phase="forward")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[:3] == ["tok_emb", "pos_emb", "blocks.0"]
    legend = {t.get_text().split(" (")[0] for t in ax.get_legend().get_texts()}
    assert {"parameters", "activations"} <= legend
    colours = {matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches}
    assert colours <= {c.lower() for c in CATEGORY_COLORS.values()}
    with pytest.raises(ValueError, match="no 'backward' phase"):
        plot_module_bars(trace, step=9, phase="backward")


def test_plots_leave_no_pyplot_figures_open(trace):
    plt.close("all")
    plot_timeline(trace)
    plot_module_bars(trace)
    assert plt.get_fignums() == []


def test_slider_panel_shows_the_returned_figure():
    import ipywidgets as w

    from anatomy_helpers.ui.widgets import slider_panel

    def fn(a: int = 2, b: str = "x", c: int = 5):
        return f"{a}{b}{c}"

    panel = slider_panel(fn, a=(1, 4, 1), b=["x", "y"])
    assert panel.auto_display  # the return value is displayed, not only what fn prints
    sliders = [c for c in panel.children if isinstance(c, w.IntSlider)]
    assert sliders[0].value == 2 and not sliders[0].continuous_update
    next(c for c in panel.children if isinstance(c, w.Dropdown)).value = "y"
    assert panel.result == "2y5"  # c keeps its default
    with pytest.raises(ValueError, match="not a parameter"):
        slider_panel(fn, d=(1, 2, 1))
    for bad in ((1, 4, 0), (4, 1, 1), (1.0, 4, 1)):
        with pytest.raises(ValueError, match="a slider is"):
            slider_panel(fn, a=bad)
    with pytest.raises(ValueError, match="at least one choice"):
        slider_panel(fn, b=[])


def test_slider_panel_labels_are_as_wide_as_their_text_and_controls_wrap():
    import ipywidgets as w

    from anatomy_helpers.ui.widgets import slider_panel

    def fn(micro_batches: int = 1, implementation: str = "x", n: int = 2):
        return None

    given = w.IntSlider(value=2, min=1, max=3, description="n")
    panel = slider_panel(fn, micro_batches=(1, 4, 1), implementation=["x", "y"], n=given)
    controls = panel.children[:-3]  # then the hint, the status line and the output
    assert [c.description for c in controls] == ["micro batches", "implementation", "n"]
    # "initial": the label takes its text's width; ipywidgets' default ("") is a fixed 80 px: "micro bat…"
    assert all(c.style.description_width == "initial" for c in controls)
    assert panel.layout.flex_flow == "row wrap" and panel.out.layout.width == "100%"
    own = w.Dropdown(options=["x", "y"], description="implementation", style={"description_width": "120px"})
    assert slider_panel(fn, implementation=own).children[0].style.description_width == "120px"  # the caller's


def test_timelines_share_one_y_scale(trace):
    from anatomy_helpers import plot_timelines

    fig = plot_timelines({"first": trace, "again": trace}, title="two")
    tops = {ax.get_ylim()[1] for ax in fig.axes}
    assert len(fig.axes) == 2 and len(tops) == 1
    assert [ax.get_title() for ax in fig.axes] == ["first", "again"]


def test_multi_panel_legend_lists_every_category_any_panel_draws(trace):
    from anatomy_helpers import plot_timelines

    model = make_model(device="cpu", checkpoint="full", **SMALL)
    checkpointed = track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=2)
    fig = plot_timelines({"none": trace, "full": checkpointed})
    drawn = [set(ax.get_legend_handles_labels()[1]) for ax in fig.axes]
    assert "recomputed" in drawn[1] - drawn[0]  # a category only the second panel draws
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1
    listed = [t.get_text() for t in legends[0].get_texts()]
    assert sorted(listed) == sorted(set.union(*drawn))  # each drawn category once, nothing else
    assert listed == [c.replace("_", " ") for c in CATEGORIES if c.replace("_", " ") in listed]  # in CATEGORIES order


def test_phases_too_narrow_to_name_are_shaded_and_the_legend_names_the_shading(trace):
    """The optimizer step in backward cuts backward into many narrow phases: their names would run together, so
    only phases wide enough are named, and the legend says what each shade is; the peak's label turns left near the
    right edge, where the legend sits."""
    from anatomy_helpers import plot_timelines
    from anatomy_helpers.ui.plots import MIN_NAMED_SHARE, PHASE_SHORT

    model = make_model(device="cpu", **SMALL)
    fused = track_steps(model, make_optimizer(model, "adamw", in_backward=True), steps=2, batch_size=2)
    ax = plot_timeline(fused).axes[0]
    lo, hi = ax.get_xlim()
    names = sorted(t.get_position()[0] for t in ax.texts if t.get_text() in PHASE_SHORT.values())
    narrow = [ph for ph in fused.phases() if ph.phase != "idle" and ph.end - ph.start + 1 < MIN_NAMED_SHARE * (hi - lo)]
    assert narrow and len(names) < len([ph for ph in fused.phases() if ph.phase != "idle"])  # some left unnamed
    assert all(b - a >= MIN_NAMED_SHARE * (hi - lo) / 2 for a, b in zip(names, names[1:]))  # no two run together
    assert "shading: backward" in [t.get_text() for t in ax.get_legend().get_texts()]
    both = plot_timelines({"plain": trace, "in backward": fused})
    legend = [a.get_legend() for a in both.axes if a.get_legend() is not None][0]
    assert "shading: optimizer" in [t.get_text() for t in legend.get_texts()]
    for a in both.axes:
        peak = [t for t in a.texts if t.get_text().startswith("peak ")][0]
        right = peak.xy[0] > lo + 0.7 * (a.get_xlim()[1] - lo)
        assert (peak.get_horizontalalignment() == "right") == right and (peak.xyann[0] < 0) == right


def test_optimizer_phase_panels_one_per_step(trace):
    from anatomy_helpers.ui.plots import plot_optimizer_phase

    fig = plot_optimizer_phase({"adamw": trace}, steps=(1, 2))
    assert [ax.get_title() for ax in fig.axes] == ["adamw: step 1", "adamw: step 2"]
    assert "MiB" in fig.axes[0].get_ylabel()
    # one x label under the panels (each panel's own ran into its neighbour's); a single panel keeps its own
    assert [ax.get_xlabel() for ax in fig.axes] == ["", ""] and "memory event" in fig.get_supxlabel()
    single = plot_optimizer_phase(trace, steps=(2,))
    assert "memory event" in single.axes[0].get_xlabel()


def test_budget_plot_marks_the_failure_and_the_model_that_does_not_fit():
    from anatomy_helpers.training.budget import try_budget
    from anatomy_helpers.ui.plots import plot_budget_run

    failed = try_budget(2**20, batch_size=2, steps=2, **SMALL)  # SMALL's step 2 needs more than 1 MiB
    assert not failed.passed
    ax = plot_budget_run(failed.trace, failed.budget).axes[0]
    assert any(t.get_text().startswith("out of budget") for t in ax.texts)
    too_small = try_budget(1024, batch_size=2, steps=2, **SMALL)
    assert too_small.failed_step == 0 and "does not fit before step 1" in too_small.summary()
    ax = plot_budget_run(too_small.trace, too_small.budget).axes[0]
    assert "budget" in " ".join(t.get_text() for t in ax.texts) and "MiB" in ax.get_xlabel()


def test_progress_yields_everything_and_reports_on_stderr(capsys):
    from anatomy_helpers import progress

    assert list(progress(range(3), desc="runs")) == [0, 1, 2]
    assert capsys.readouterr().err.strip().endswith("runs 3/3")


def test_track_and_plot_prints_the_peak_and_returns_its_timeline(capsys):
    from anatomy_helpers import track_and_plot

    fig = track_and_plot(batch_size=2, seq_len=16, n_layer=1, optimizer="sgd", steps=1)
    out = capsys.readouterr().out
    assert out.startswith("batch 2 x seq 16, 1 layers, sgd: peak ") and "MiB" in out
    assert fig.axes[0].get_title() == "batch 2, seq_len 16, 1 layers, sgd"


def test_package_storage_bytes_counts_each_storage_once_and_filters_by_device():
    import torch

    from anatomy_helpers import storage_bytes

    base = torch.ones(100)
    other = torch.zeros(10, dtype=torch.float64)
    tensors = [base, base[:10], base.view(10, 10), other]
    assert storage_bytes(tensors) == 100 * 4 + 10 * 8
    assert storage_bytes(tensors, "cpu") == 100 * 4 + 10 * 8
    assert storage_bytes(tensors, "cuda") == 0


def test_module_bars_label_both_axes_name_the_no_module_row_and_total_every_category(small_trace):
    from anatomy_helpers.ui.plots import OUTSIDE_MODULES, plot_module_bars

    fig = plot_module_bars(small_trace, step=1, phase="forward")
    ax = fig.axes[0]
    assert ax.get_xlabel() and ax.get_ylabel()
    rows = small_trace.live_by_module(small_trace.phase(1, "forward").end)
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert "-" not in ticks and (OUTSIDE_MODULES in ticks) == ("-" in rows)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    for category in ("parameters", "activations"):
        total = sum(r[category] for r in rows.values())  # the SMALL model: hundreds of KiB to a few MiB
        spelled = f"{total / 2**20:.2f} MiB" if total >= 2**20 else f"{total / 2**10:.2f} KiB"
        assert f"{category} ({spelled})" in labels, labels
    bars_end = max(p.get_x() + p.get_width() for p in ax.patches)
    assert ax.get_xlim()[1] >= bars_end  # no bar runs past the axis


def test_format_bytes_picks_the_unit():
    from anatomy_helpers.core.units import format_bytes

    assert [format_bytes(n) for n in (512, 1536, 3 * 2**20, 5 * 2**30)] == ["512 B", "1.50 KiB", "3.00 MiB", "5.00 GiB"]


def test_figure_digest_sees_the_data_not_the_text():
    from anatomy_helpers.ui.plots import CourseFigure
    from anatomy_helpers.ui.widgets import figure_digest

    def figure(values, title):
        fig = CourseFigure()
        ax = fig.add_subplot()
        ax.bar(range(len(values)), values)
        ax.plot(values)
        ax.set_title(title)
        return fig

    same = figure([1, 2, 3], "batch 8")
    assert figure_digest(same) == figure_digest(figure([1, 2, 3], "batch 9"))  # an echo of the control: same data
    assert figure_digest(same) != figure_digest(figure([1, 2, 4], "batch 8"))  # a new measurement


def test_figure_digest_counts_the_numbers_a_panel_computed():
    """fit_panel's device line may be off the scale: the device's memory still changes the panel's digest."""
    from anatomy_helpers.ui.plots import CourseFigure
    from anatomy_helpers.ui.widgets import figure_digest

    def figure(numbers):
        fig = CourseFigure()
        fig.add_subplot().bar([0, 1], [1, 2])
        fig.panel_numbers = numbers
        return fig

    assert figure_digest(figure((15 * 2**30, True))) == figure_digest(figure((15 * 2**30, True)))
    assert figure_digest(figure((15 * 2**30, True))) != figure_digest(figure((80 * 2**30, True)))


def test_the_digest_element_carries_the_values_the_panel_used_under_its_controls_labels():
    """A panel's figure may say what it computed with (``panel_used``); the hidden element the browser test reads
    carries them under the labels the controls show, as text (a dropdown's option, a slider's position)."""
    import html
    import json
    import re

    from anatomy_helpers.ui.plots import CourseFigure
    from anatomy_helpers.ui.widgets import DIGEST_CLASS, digest_html, figure_digest

    fig = CourseFigure()
    fig.add_subplot().bar([0], [1])
    text = digest_html("panel", fig, {"seq len": 2048, "model": 'a "quoted" name'})
    assert f'class="{DIGEST_CLASS}"' in text and f'data-digest="{figure_digest(fig)}"' in text
    used = json.loads(html.unescape(re.search(r'data-used="([^"]*)"', text).group(1)))
    assert used == {"seq len": "2048", "model": 'a "quoted" name'}
    assert 'data-used="{}"' in digest_html("panel", fig)  # a panel that reports nothing


def test_a_panel_says_it_is_measuring_while_it_runs_and_takes_no_room_after():
    """A new setting's dry run can take seconds (lesson 09's 15-25 s): the status line is shown while the panel's
    function runs, hidden (display none: no room under the controls) before and after."""
    import ipywidgets as w

    from anatomy_helpers.ui.widgets import STATUS_CLASS, slider_panel

    seen = []
    panel = None

    def watched(a: int = 2):
        if panel is not None:
            [status] = [c for c in panel.children if STATUS_CLASS in c._dom_classes]
            seen.append((a, status.layout.display, "measuring" in status.value))
        return a

    panel = slider_panel(watched, a=(1, 4, 1))
    [status] = [c for c in panel.children if STATUS_CLASS in c._dom_classes]
    assert status.layout.display == "none" and panel.children[-1] is panel.out  # under the controls, above the output
    assert panel.children[-2] is status
    next(c for c in panel.children if isinstance(c, w.IntSlider)).value = 3
    assert seen == [(3, "", True)] and status.layout.display == "none" and panel.result == 3


def test_a_panel_opens_with_a_hint_and_measures_only_when_a_control_moves(monkeypatch):
    """The plain call in the cell above shows the figure at the defaults: the panel opens without calling its
    function (no second copy of that figure) and with a one-line hint; a control's move calls it once, hides the
    hint and shows the figure it returned (auto_display), and so does every later move."""
    import ipywidgets as w
    from matplotlib.figure import Figure

    from anatomy_helpers.ui.widgets import HINT_CLASS, HINT_TEXT, slider_panel

    calls = []

    def counted(a: int = 2, b: str = "x"):
        calls.append((a, b))
        return Figure()

    from ipywidgets.widgets import interaction

    shown = []
    monkeypatch.setattr(interaction, "display", shown.append)  # what interactive displays in its output area
    panel = slider_panel(counted, a=(1, 4, 1), b=["x", "y"])
    [hint] = [c for c in panel.children if HINT_CLASS in c._dom_classes]
    assert calls == [] and panel.result is None and shown == []  # nothing measured, nothing displayed
    assert hint.value == HINT_TEXT and "move a control" in hint.value and hint.layout.display != "none"
    assert panel.children.index(hint) < panel.children.index(panel.out)  # above where the figure will be
    next(c for c in panel.children if isinstance(c, w.IntSlider)).value = 3
    assert calls == [(3, "x")] and shown == [panel.result] and isinstance(panel.result, Figure)
    assert hint.layout.display == "none"
    next(c for c in panel.children if isinstance(c, w.Dropdown)).value = "y"
    assert calls == [(3, "x"), (3, "y")] and hint.layout.display == "none"  # the hint does not come back
    next(c for c in panel.children if isinstance(c, w.IntSlider)).value = 2
    assert calls[-1] == (2, "y") and len(calls) == 3  # back at a default: measured like any other setting


# ---- the plotted data against the numbers each figure claims to draw (tests/figure_data.py reads a figure back) ----


def test_the_timeline_draws_each_categorys_bytes_and_marks_the_peak_where_it_is(trace):
    from .figure_data import numbers_in, unit_bytes, vertical_lines

    ax = plot_timeline(trace).axes[0]
    assert_stack_is_the_trace(ax, trace)
    scale = unit_bytes(ax.get_ylabel())
    totals = trace.timeline.bytes.sum(axis=1)  # the peak: the most bytes alive at one event, found here
    i = int(np.argmax(totals))
    [marker] = [ln for ln in ax.get_lines() if ln.get_marker() == "v"]
    assert (marker.get_xdata()[0], marker.get_ydata()[0] * scale) == (i, pytest.approx(totals[i]))
    [label] = [t.get_text() for t in ax.texts if t.get_text().startswith("peak ")]
    assert numbers_in(label.splitlines()[0]) == [round(totals[i] / scale, 1)]
    # a dashed line where each training step's first phase begins
    starts = sorted({min(ph.start for ph in trace.phases() if ph.step == s and ph.phase != "idle") for s in (1, 2)})
    assert sorted(vertical_lines(ax)) == starts


def test_each_of_several_timelines_draws_its_own_trace(trace):
    from anatomy_helpers import plot_timelines

    model = make_model(device="cpu", checkpoint="full", **SMALL)
    checkpointed = track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=2)
    fig = plot_timelines({"none": trace, "full": checkpointed})
    for ax, tr in zip(fig.axes, (trace, checkpointed), strict=True):
        assert_stack_is_the_trace(ax, tr)


def test_module_bars_draw_each_modules_live_bytes_per_category(trace):
    """Each bar segment is one module's live bytes of one category at the end of step 1's forward, summed here
    from the storages alive then (the trace's live_allocations; the legend's totals have their own test)."""
    from anatomy_helpers.ui.plots import OUTSIDE_MODULES

    from .figure_data import unit_bytes

    end = trace.window(1, "forward")[-1]
    want: dict[tuple[str, str], int] = {}
    for a in trace.live_allocations(end):
        module = ".".join(a.module.split(".")[:2])
        want[module, a.category] = want.get((module, a.category), 0) + a.bytes
    ax = plot_module_bars(trace, step=1, phase="forward").axes[0]
    scale = unit_bytes(ax.get_xlabel())
    rows = [t.get_text() for t in ax.get_yticklabels()]
    drawn = {}
    for container in ax.containers:
        category = container.get_label().split(" (")[0].replace(" ", "_")
        for row, bar in zip(rows, container.patches, strict=True):
            if bar.get_width():
                drawn["-" if row == OUTSIDE_MODULES else row, category] = bar.get_width() * scale
    assert drawn == pytest.approx({k: v for k, v in want.items() if v})


def test_optimizer_phase_panels_draw_the_moment_before_and_every_event_of_the_phase(trace):
    from anatomy_helpers.ui.plots import plot_optimizer_phase

    from .figure_data import areas, numbers_in, step_heights, unit_bytes

    fig = plot_optimizer_phase({"adamw": trace}, steps=(1, 2))
    for ax, step in zip(fig.axes, (1, 2), strict=True):
        idx = trace.window(step, "optimizer")
        rows = np.vstack([trace.timeline.bytes[idx[0] - 1], trace.timeline.bytes[idx]])  # just before, then the phase
        scale = unit_bytes(fig.axes[0].get_ylabel())  # the panels share the first one's y axis
        layers = {label: step_heights(c, np.arange(len(rows))) * scale for label, c in areas(ax).items()}
        expected = {c.replace("_", " "): rows[:-1, j] for j, c in enumerate(CATEGORIES) if rows[:, j].any()}
        assert set(layers) == set(expected)
        for label, values in expected.items():
            np.testing.assert_allclose(layers[label], values, atol=1e-6, err_msg=label)
        [box] = [t.get_text() for t in ax.texts if t.get_text().startswith("state ")]
        state = trace.timeline.category("optimizer_state")
        temps = trace.timeline.category("temporaries")
        before, after = state[idx[0] - 1], state[idx[-1]]
        peak = idx[0] - 1 + int(np.argmax(trace.timeline.bytes[np.r_[idx[0] - 1, idx]].sum(axis=1)))
        assert numbers_in(box) == pytest.approx(
            [before / scale, after / scale, (temps[peak] - temps[idx[0] - 1]) / scale], abs=0.05
        )


def test_the_budget_line_and_the_failing_allocation_are_drawn_where_the_run_says():
    from anatomy_helpers.training.budget import try_budget
    from anatomy_helpers.ui.plots import plot_budget_run

    from .figure_data import horizontal_lines, numbers_in, unit_bytes

    failed = try_budget(2**20, batch_size=2, steps=2, **SMALL)
    ax = plot_budget_run(failed.trace, failed.budget).axes[0]
    scale = unit_bytes(ax.get_ylabel())
    assert [y * scale for y in horizontal_lines(ax)] == [pytest.approx(2**20)]
    assert_stack_is_the_trace(ax, failed.trace)
    tl = failed.trace.timeline
    [cross] = [ln for ln in ax.get_lines() if ln.get_marker() == "X"]
    last = len(tl) - 1  # the allocation that went over is the trace's last event
    assert (cross.get_xdata()[0], cross.get_ydata()[0] * scale) == (last, pytest.approx(tl.bytes[last].sum()))
    [note] = [t.get_text() for t in ax.texts if t.get_text().startswith("out of budget")]
    asked = tl.bytes[last].sum() - tl.bytes[last - 1].sum()
    assert numbers_in(note)[-1] == pytest.approx(asked / scale, abs=0.005)


def test_the_tours_panel_draws_the_run_it_describes(capsys):
    """track_and_plot (notebook 00's panel): the timeline is of the run the line above it describes (the same
    settings tracked here again give the same bytes, event by event)."""
    from anatomy_helpers import track_and_plot

    fig = track_and_plot(batch_size=2, seq_len=16, n_layer=1, optimizer="sgd", steps=1)
    model = make_model(device="cpu", seq_len=16, n_layer=1)
    again = track_steps(model, make_optimizer(model, "sgd"), steps=1, batch_size=2)
    assert_stack_is_the_trace(fig.axes[0], again)
    assert f"peak {again.timeline.bytes.sum(axis=1).max() / 2**20:.2f} MiB" in capsys.readouterr().out


def test_every_category_has_a_colour_of_its_own_that_no_shading_uses():
    """Two categories in one colour would read as one in every figure and legend (a copy-paste of a hex code)."""
    from anatomy_helpers.ui.plots import PHASE_SHADES, STEP_LINE

    colours = [matplotlib.colors.to_hex(CATEGORY_COLORS[c]) for c in CATEGORIES]
    assert len(set(colours)) == len(CATEGORIES), dict(zip(CATEGORIES, colours))
    background = {matplotlib.colors.to_hex(c) for c in [*PHASE_SHADES.values(), STEP_LINE, "white"]}
    assert not set(colours) & background
