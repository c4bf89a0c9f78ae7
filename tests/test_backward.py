"""Lesson 02: a trace split by model part, the backward profile, the training-loop mistakes, the plots and the panel.

Most tests read ``small_trace`` (three tracked AdamW steps of the SMALL model, batch 4; see conftest.py).
"""

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from anatomy_helpers import make_model, make_optimizer, track_steps
from anatomy_helpers.core.units import MiB
from anatomy_helpers.lessons.lesson02_backward import (
    KeepLoss,
    KeepValLoss,
    RetainGraph,
    allocation_parts,
    backward_peak_panel,
    backward_profile,
    live_by_part,
    plot_backward_parts,
    plot_category,
)
from anatomy_helpers.tracking.events import model_parts

from .conftest import SMALL, numel, phase_end, storage_bytes

BATCH = 4  # small_run's batch size
BLOCKS = [f"blocks.{i}" for i in range(SMALL["n_layer"])]


def part_of_parameter(name: str) -> str:
    """The model part that owns parameter ``name``, from the course GPT's layout (not from the package)."""
    first = name.split(".")[0]
    if first == "blocks":
        return ".".join(name.split(".")[:2])
    return "embeddings" if first in ("tok_emb", "pos_emb") else "head"


def param_bytes_by_part(model) -> dict[str, int]:
    """Parameter bytes per model part (the tied embedding / LM-head weight once, under the embeddings)."""
    out = dict.fromkeys(["embeddings", *BLOCKS, "head"], 0)
    for name, p in model.named_parameters():
        out[part_of_parameter(name)] += p.numel() * p.element_size()
    return out


@pytest.fixture(scope="module")
def forward_activations(small_trace):
    """Activation bytes saved by one forward pass of the SMALL model, batch 4."""
    return phase_end(small_trace, 1, "forward")["activations"]


def test_each_gradient_belongs_to_the_part_of_its_parameter(small_run):
    model, _, trace = small_run
    names = [n for n, _ in model.named_parameters()]
    assert sorted(trace.grad_param.values()) == sorted(names * 3)  # one fresh gradient per parameter per step
    parts = allocation_parts(trace)
    for aid, name in trace.grad_param.items():
        assert parts[aid] == part_of_parameter(name)
    assert set(parts.values()) == set(model_parts(SMALL["n_layer"]))


def test_parts_add_up_to_the_tracker_totals(small_trace):
    parts, live = live_by_part(small_trace)
    assert parts == ["embeddings", *BLOCKS, "head"]
    assert live.shape == (len(small_trace.timeline) + 1, 2, len(parts))
    assert not live[0].any()  # nothing of either category alive when tracking began
    assert np.array_equal(live[1:, 0].sum(axis=1), small_trace.timeline.category("activations"))
    assert np.array_equal(live[1:, 1].sum(axis=1), small_trace.timeline.category("gradients"))


def test_gradients_per_part_equal_parameter_bytes_per_part(small_run):
    model, _, trace = small_run
    expected = param_bytes_by_part(model)
    assert sum(expected.values()) == 4 * numel(model)  # fp32, every parameter once
    for step in (1, 2, 3):
        prof = backward_profile(trace, step)
        assert dict(zip(prof.parts, prof.gradients[-1].tolist())) == expected
        assert not prof.gradients_before.any()  # zero_grad(set_to_none=True) left none


def test_activations_are_released_in_reverse_order(small_trace, forward_activations):
    prof = backward_profile(small_trace, 1)
    assert prof.activations_before.sum() == forward_activations
    assert not prof.activations[-1].any()
    released = prof.released_at()
    assert sorted(released, key=released.get) == prof.parts[::-1]
    assert all(prof.samples[0] <= s <= prof.samples[-1] for s in released.values())
    assert len({prof.activations_before[prof.parts.index(b)] for b in BLOCKS}) == 1  # same bytes per block


def test_gradients_arrive_part_by_part_from_the_output(small_trace):
    prof = backward_profile(small_trace, 2)
    start, done, released = prof.gradients_from(), prof.gradients_complete_at(), prof.released_at()
    backward_order = prof.parts[::-1]
    assert sorted(start, key=start.get) == backward_order
    for later, earlier in zip(backward_order, backward_order[1:]):
        assert done[later] < start[earlier]  # a part's gradients are all there before the next part's begin
        assert start[later] < released[later] < start[earlier]


def test_profile_of_a_step_without_backward_raises(small_trace):
    with pytest.raises(ValueError, match="no backward samples"):
        backward_profile(small_trace, 7)


def test_largest_temporaries_are_gradients_of_the_widest_activations(small_trace):
    B, T, h = BATCH, SMALL["seq_len"], SMALL["d_model"]
    fp32 = torch.finfo(torch.float32).bits // 8
    # backward: the gradient with respect to the MLP's hidden activation (B, T, 4h)
    assert small_trace.largest_allocation("temporaries", 2, "backward") == B * T * 4 * h * fp32
    # forward: the qkv projection's output (B, T, 3h), split into views that matmul copies
    assert small_trace.largest_allocation("temporaries", 2, "forward") == B * T * 3 * h * fp32
    temps = small_trace.timeline.category("temporaries")
    assert temps[small_trace.window(2, "backward")].max() > temps[small_trace.window(2, "forward")].max()
    # at the step's peak (early in backward), the largest live temporary is that same (B, T, 4h) gradient
    peak = small_trace.peak(step=2)
    live = small_trace.live_allocations(peak.index, "temporaries")
    assert peak.phase == "backward" and live[0].bytes == B * T * 4 * h * fp32
    assert [r.bytes for r in live] == sorted((r.bytes for r in live), reverse=True)


def test_set_to_none_false_keeps_gradients_and_reuses_them(small):
    model, opt = small
    trace = track_steps(model, opt, steps=2, batch_size=BATCH, set_to_none=False)
    params = storage_bytes(model.parameters())
    assert phase_end(trace, 1, "optimizer")["gradients"] == params
    assert (trace.timeline.category("gradients")[trace.window(step=2)] == params).all()
    rec = trace.allocation_record()
    assert not rec.where(step=2, category="gradients", allocations=True).any()  # accumulated into step 1's


def test_retain_graph_keeps_activations_until_the_loss_dies(small, forward_activations):
    model, opt = small
    trace = track_steps(model, opt, steps=2, batch_size=BATCH, hooks=RetainGraph())
    for step in (1, 2):
        assert phase_end(trace, step, "backward")["activations"] == forward_activations
    assert set(backward_profile(trace, 1).released_at().values()) == {None}  # no part released anything
    # the loop drops `loss` at the end of step 1: its graph dies then, not at the end of training
    assert trace.phase(2, "idle").at_end["activations"] == 0


def test_keeping_the_loss_after_backward_costs_only_the_loss_itself(small, small_trace):
    model, opt = small
    trace = track_steps(model, opt, steps=2, batch_size=BATCH, hooks=KeepLoss())
    scalar = torch.zeros((), dtype=torch.float32).element_size()  # step 1's loss, still referenced
    assert trace.peak(step=2).bytes == small_trace.peak(step=2).bytes + scalar
    assert phase_end(trace, 2, "backward")["activations"] == 0


def test_keeping_a_validation_loss_keeps_its_graph(small, forward_activations):
    model, opt = small
    trace = track_steps(model, opt, steps=2, batch_size=BATCH, hooks=KeepValLoss())
    for step in (1, 2):
        assert phase_end(trace, step, "backward")["activations"] == step * forward_activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_take_the_parameters_bytes_in_their_dtype(dtype):
    model = make_model(device="cpu", dtype=str(dtype).removeprefix("torch."), **SMALL)
    trace = track_steps(model, make_optimizer(model, "sgd"), steps=1, batch_size=2, optimizer_step=False)
    expected = numel(model) * torch.empty((), dtype=dtype).element_size()
    assert trace.timeline.category("gradients")[-1] == storage_bytes(p.grad for p in model.parameters()) == expected


def test_plots_return_labelled_figures(small_trace):
    fig = plot_backward_parts(backward_profile(small_trace, 2), mark=small_trace.peak().index)
    assert isinstance(fig, Figure) and fig.axes[0].get_title()
    assert "MiB" in fig.axes[0].get_ylabel() and "MiB" in fig.axes[1].get_ylabel()
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert set(legend) <= {"embeddings", *BLOCKS, "head"} and set(BLOCKS) <= set(legend)
    fig = plot_category(small_trace, "temporaries", 2)
    assert "MiB" in fig.axes[0].get_ylabel() and fig.axes[0].get_title()
    with pytest.raises(ValueError):
        plot_category(small_trace, "temporaries", 9)
    assert plt.get_fignums() == []  # no pyplot figure left open


def test_backward_peak_panel_prints_the_peak_it_plots(capsys):
    fig = backward_peak_panel(n_layer=1, batch_size=2, device="cpu")
    printed = capsys.readouterr().out
    assert isinstance(fig, Figure) and "1 layers, batch 2" in fig.axes[0].get_title()
    # the same run, tracked here: one forward and backward of a fresh default-width model, no optimizer step
    model = make_model(device="cpu", n_layer=1)
    trace = track_steps(model, make_optimizer(model, "sgd"), steps=1, batch_size=2, optimizer_step=False)
    pk = trace.peak()
    window = trace.window(1, pk.phase)
    assert printed.startswith(f"1 layers, batch 2: peak {pk.bytes / MiB:.2f} MiB in {pk.phase} ")
    assert f"(event {pk.index - window[0] + 1} of {len(window)}), in {pk.module}:" in printed
    assert f"gradients {pk.breakdown['gradients'] / MiB:.2f}" in printed
    assert plt.get_fignums() == []


# ---- the plotted data against what each figure claims (tests/figure_data.py reads a figure back) ----


def test_the_backward_parts_stack_to_the_steps_live_activations_and_gradients(small_trace):
    """Each panel's layers are the parts' bytes through step 2's backward; stacked, they are all the activations
    (gradients) alive at each event, read here from the trace's own timeline."""
    from .figure_data import areas, bands, unit_bytes

    profile = backward_profile(small_trace, 2)
    fig = plot_backward_parts(profile)
    idx = small_trace.window(2, "backward")
    assert list(profile.samples) == list(idx)
    mid = np.arange(len(idx) - 1) + 0.5
    for ax, category, data in zip(fig.axes, ("activations", "gradients"), (profile.activations, profile.gradients)):
        scale = unit_bytes(ax.get_ylabel())
        layers = areas(ax)
        tops = np.max([bands(c, mid)[1] for c in layers.values()], axis=0) * scale
        np.testing.assert_allclose(tops, small_trace.timeline.category(category)[idx][:-1], atol=1e-6)
        for label, collection in layers.items():
            bottom, top = bands(collection, mid)
            np.testing.assert_allclose((top - bottom) * scale, data[:-1, profile.parts.index(label)], atol=1e-6)


def test_the_category_plot_draws_its_bytes_and_states_each_phases_maximum(small_trace):
    from .figure_data import numbers_in, step_heights, unit_bytes

    ax = plot_category(small_trace, "temporaries", 2).axes[0]
    scale = unit_bytes(ax.get_ylabel())
    idx = np.flatnonzero(small_trace.timeline.step == 2)
    values = small_trace.timeline.category("temporaries")[idx]
    [area] = ax.collections  # the one filled area (the phases are shaded with patches)
    np.testing.assert_allclose(step_heights(area, np.arange(len(idx))) * scale, values[:-1], atol=1e-6)
    notes = {t.get_text().split(":")[0]: t for t in ax.texts}
    for phase in ("forward", "backward", "optimizer"):
        most = small_trace.timeline.category("temporaries")[small_trace.window(2, phase)].max()
        assert numbers_in(notes[phase].get_text()) == [round(most / scale, 2)]
        assert notes[phase].xy[1] * scale == pytest.approx(most)


def test_the_backward_peak_panel_draws_the_run_it_prints():
    from .figure_data import assert_stack_is_the_trace

    fig = backward_peak_panel(n_layer=1, batch_size=2, device="cpu")
    model = make_model(device="cpu", n_layer=1)
    again = track_steps(model, make_optimizer(model, "sgd"), steps=1, batch_size=2, optimizer_step=False)
    assert_stack_is_the_trace(fig.axes[0], again)
