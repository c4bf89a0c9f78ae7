"""Notebook 11's panel: one setting's rank memory and modelled step (model, strategy, world size), from
:mod:`~anatomy_helpers.lessons.lesson11_scale`'s models, links and step model. A module of its own so that each stays
readable (as lesson 05's ``lesson05_kept``). Bytes unless a name says otherwise; seconds for times.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap

import numpy as np
import torch

from ..core.model import GPT, ModelConfig
from ..core.units import GiB, pick_unit
from ..distributed.fake_world import dry_run_rank
from ..distributed.fit import FIGURES, RankMemory, format_fit_table, memory_of, rank_job
from ..distributed.sync_model import StepTime, scaling_curve
from ..tracking.events import CATEGORIES as TRACKED_CATEGORIES
from ..tracking.events import Peak
from ..ui.plots import CATEGORY_COLORS, CATEGORY_LABELS, FIGURE_WIDTH_IN, PHASE_SHADES, CourseFigure, legend_of_all
from .lesson11_scale import (
    CONFIG,
    LINK,
    MESH_TP,
    PEAK_FLOPS,
    SYNC_CONFIG,
    SYNC_ROWS,
    SYNC_TP,
    TP_LINK,
    UTILISATION,
    format_step_times,
)


@dataclasses.dataclass(frozen=True)
class PanelModel:
    """A model the panel offers: its shape, the rows each GPU trains (the same global batch, rows x N, under every
    strategy) and the TP degree of its 2-D mesh (t must divide its heads)."""

    config: dict
    rows_per_rank: int
    tp: int
    short: str  # its name in the printed table

    def describe(self) -> str:
        c = self.config
        rows = f"{self.rows_per_rank} row{'s' if self.rows_per_rank > 1 else ''} per GPU"
        return f"{c['n_layer']} blocks, {c['n_head']} heads, {c['seq_len']} tokens; {rows}; TP degree {self.tp}"


#: The lesson's two models: section 1's (lesson 08's, one row per rank, t = 2 as in its 2-D mesh) and section 3's
#: wider one (32 rows per GPU, t = 8 over a node).
PANEL_MODELS = {
    "lesson 08's GPT (d_model 128)": PanelModel(CONFIG, 1, MESH_TP, "d128"),
    "section 3's GPT (d_model 1024)": PanelModel(SYNC_CONFIG, SYNC_ROWS, SYNC_TP, "d1024"),
}
PANEL_STRATEGIES = ("ddp", "zero1", "fsdp2_zero3", "tp_fsdp")
#: FSDP2's dry run grows with N (section 1 stops it at 64 for that): up to 64 a new setting answers in seconds.
PANEL_WORLD_SIZES = (8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class ScaleSetting:
    """One setting of :func:`scale_panel`: rank 0's memory (a dry run, :func:`~anatomy_helpers.distributed.fit.
    memory_of`), what made up its peak, and the modelled step (:func:`~anatomy_helpers.distributed.sync_model.
    scaling_curve`, no stragglers). ``model``: the name in :data:`PANEL_MODELS` of the model the dry run built (found
    by its parameter count)."""

    model: str
    rows_per_rank: int
    memory: RankMemory
    peak: Peak
    step: StepTime


def _n_params(config: dict) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(ModelConfig(**config)).parameters())


def _check_panel_args(model: str, strategy: str, world_size: int) -> None:
    if model not in PANEL_MODELS:
        raise ValueError(f"model must be one of {list(PANEL_MODELS)}, got {model!r}")
    if strategy not in PANEL_STRATEGIES:
        raise ValueError(f"strategy must be one of {PANEL_STRATEGIES}, got {strategy!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size not in PANEL_WORLD_SIZES:
        raise ValueError(
            f"world_size must be one of {PANEL_WORLD_SIZES} (FSDP2's dry run grows with N), got {world_size!r}"
        )


@functools.lru_cache(maxsize=64, typed=True)
def scale_setting(
    model: str = "lesson 08's GPT (d_model 128)", strategy: str = "fsdp2_zero3", world_size: int = 8
) -> ScaleSetting:
    """Rank 0 of ``model`` under ``strategy`` on ``world_size`` ranks: one dry run for its memory (a tracked step
    after the warm-up, as section 1's table) and :func:`~anatomy_helpers.distributed.sync_model.scaling_curve` at
    that N for its modelled step (section 3's device and links). Each setting is computed once (cached)."""
    _check_panel_args(model, strategy, world_size)
    spec = PANEL_MODELS[model]
    tp = spec.tp if strategy == "tp_fsdp" else 1
    # fit's rows are a data-parallel rank's (a node's, under TP); the step model's a GPU's: the same global batch
    run = dry_run_rank(rank_job(spec.config, strategy, world_size, tp, spec.rows_per_rank * tp), world_size).result
    network = dict(tp=tp, tp_link=TP_LINK) if tp > 1 else {}
    (step,) = scaling_curve(
        spec.config, strategy, [world_size], rows_per_rank=spec.rows_per_rank, peak_flops=PEAK_FLOPS,
        utilisation=UTILISATION, link=LINK, **network,
    )  # fmt: skip
    built = next(name for name, m in PANEL_MODELS.items() if _n_params(m.config) == run.n_params)
    return ScaleSetting(built, spec.rows_per_rank, memory_of(PANEL_MODELS[built].short, run, tp), run.peak, step)


#: What the panel's memory bars show, top to bottom: (RankMemory field, category colour, label).
PANEL_BARS = (
    ("parameters", "parameters", "parameters"),
    ("gradients", "gradients", "gradients"),
    ("optimizer_state", "optimizer_state", "optimizer state"),
    ("activations", "activations", "activations, most at once"),
    ("communication_peak", "communication", "comm. buffers, most at once"),
)


def plot_scale_setting(setting: ScaleSetting, title: str | None = None):
    """Left: rank 0's model states (just before the optimizer step), the most activation and communication bytes
    alive at once, and its peak by category; right: the modelled step (forward, backward, the exposed part of its
    collectives, TP's all-reduces among them) and all its collectives back to back, the part hidden behind compute
    hatched. Colours: the course's categories and phase shades. Returns the Figure."""
    from matplotlib.patches import Patch  # drawn on first use: rank processes never draw

    m, s = setting.memory, setting.step
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.25, 1))
    unit, scale = pick_unit(m.peak)
    ys = np.arange(len(PANEL_BARS) + 1)[::-1]
    for y, (field, category, _) in zip(ys, PANEL_BARS):
        left.barh(y, getattr(m, field) / scale, color=CATEGORY_COLORS[category], label=CATEGORY_LABELS[category])
    x = 0.0
    for category in TRACKED_CATEGORIES:  # the peak, stacked by what made it up
        part = setting.peak.breakdown.get(category, 0) / scale
        if part:
            left.barh(ys[-1], part, left=x, color=CATEGORY_COLORS[category], label=CATEGORY_LABELS[category])
            x += part
    left.text(x, ys[-1], f" {m.peak / scale:,.1f}", va="center", fontsize=8)
    left.set_yticks(ys, [label for _, _, label in PANEL_BARS] + [f"peak ({setting.peak.phase})"], fontsize=8)
    left.set_xlim(0, m.peak / scale * 1.2)
    left.set_xlabel(f"bytes on rank 0 ({unit})")
    left.set_title("rank 0's memory (dry run)", fontsize=9)

    ms = 1e3
    exposed_dp = s.exposed - s.tensor_parallel
    hidden = s.communication - s.exposed
    parts = [  # (bar, seconds, colour, hatch, legend label)
        (1, s.forward, PHASE_SHADES["forward"], None, "forward"),
        (1, s.backward, PHASE_SHADES["backward"], None, "backward"),
        (1, exposed_dp, CATEGORY_COLORS["communication"], None, "collectives, exposed"),
        (1, s.tensor_parallel, CATEGORY_COLORS["communication"], "xx", "TP all-reduces (exposed)"),
        (0, exposed_dp, CATEGORY_COLORS["communication"], None, "collectives, exposed"),
        (0, s.tensor_parallel, CATEGORY_COLORS["communication"], "xx", "TP all-reduces (exposed)"),
        (0, hidden, "white", "//", "collectives, hidden behind compute"),
    ]
    ends, extra = {0: 0.0, 1: 0.0}, {}
    for bar, seconds, colour, hatch, label in parts:
        if seconds > 0:
            right.barh(bar, seconds * ms, left=ends[bar] * ms, color=colour, hatch=hatch, edgecolor="#999")
            ends[bar] += seconds
            extra.setdefault(label, Patch(facecolor=colour, hatch=hatch, edgecolor="#999"))
    for bar, total in ((1, s.step), (0, s.communication)):
        right.text(total * ms, bar, f" {total * ms:,.3f}", va="center", fontsize=8)
    right.set_yticks([1, 0], ["step", "collectives"], fontsize=8)
    right.set_xlim(0, max(s.step, s.communication) * ms * 1.3)
    right.set_xlabel("modelled time per step (ms)")
    right.set_title(f"modelled step: {s.efficiency:.1%} compute", fontsize=9)
    legend_of_all([left], fig, extra=[(h, label) for label, h in extra.items()], columns=4)
    rows = f"{setting.rows_per_rank} row{'s' if setting.rows_per_rank > 1 else ''} per GPU"
    title = title or f"{m.label}, rank 0 of N = {m.world_size}: {setting.model}, {rows}"
    fig.suptitle(textwrap.fill(title, 100), fontsize=10)  # wrapped: the figure stays within its column
    return fig


def scale_panel(model: str = "lesson 08's GPT (d_model 128)", strategy: str = "fsdp2_zero3", world_size: int = 8):
    """The notebook's panel (:func:`scale_setting`): prints rank 0's memory and the modelled step as tables, returns
    :func:`plot_scale_setting`'s figure, its ``panel_used`` read from the dry run (the model it built, the strategy
    and N it ran) for the browser test to check against the controls."""
    setting = scale_setting(model, strategy, world_size)
    m, s = setting.memory, setting.step
    print(f"{setting.model}: {PANEL_MODELS[setting.model].describe()}")  # under 100 characters: the panel's width
    print(format_fit_table([m], device_bytes=None, unit="GiB" if m.peak >= 2 * GiB else "KiB"))
    print(format_step_times({m.label: [s]}, note_below=True))
    fig = plot_scale_setting(setting)
    fig.panel_numbers = tuple(getattr(m, f) for f in FIGURES) + (s.step, s.communication, s.exposed)
    fig.panel_used = {"model": setting.model, "strategy": m.strategy, "world_size": m.world_size}
    return fig
