"""Helpers for the Training Step Anatomy course: a toy GPT, its data, a memory tracker, its trace and plots.

The parts live in subpackages, one layer each: ``core`` (the model, data, checks), ``tracking`` (the tracker and
its trace), ``training`` (the one step, optimizers, loops), ``prediction`` (dry runs, closed forms, the allocator
simulator, fit and fixes), ``distributed`` (ranks), ``ui`` (figures, panels, exercises), ``cli``; what only one
notebook uses lives in ``anatomy_helpers.lessons`` (``lesson08_scaling`` is notebook 08's). The names below are the
ones every notebook reaches for.
"""

from importlib import import_module

from .core.data import CharTokenizer, get_batch, get_tokenizer, load_text, seed_everything
from .core.model import GPT, ModelConfig
from .core.tensors import on_device, optimizer_state_tensors, storage_bytes
from .core.units import GiB, MiB
from .tracking.events import CATEGORIES, PHASES, Peak, PhaseSummary, Timeline
from .tracking.recorder import MemoryBudgetExceeded
from .tracking.trace import Trace
from .tracking.tracker import StepTracker
from .training.train import OPTIMIZERS, make_model, make_optimizer, pick_device, track_steps, train_step
from .ui.exercises import check_prediction, require_prediction

# The figures and widgets load on first use (matplotlib and ipywidgets: about 0.8 s of CPU per process): each rank
# process of a distributed world imports this package and never draws.
_ON_FIRST_USE = {
    **dict.fromkeys(("CATEGORY_COLORS", "plot_module_bars", "plot_timeline", "plot_timelines"), ".ui.plots"),
    **dict.fromkeys(("progress", "slider_panel", "track_and_plot"), ".ui.widgets"),
}


def __getattr__(name: str):
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(import_module(_ON_FIRST_USE[name], __name__), name)
    return value


__all__ = [
    "CATEGORIES",
    "CATEGORY_COLORS",
    "GPT",
    "OPTIMIZERS",
    "PHASES",
    "CharTokenizer",
    "GiB",
    "MemoryBudgetExceeded",
    "MiB",
    "ModelConfig",
    "Peak",
    "PhaseSummary",
    "StepTracker",
    "Timeline",
    "Trace",
    "check_prediction",
    "get_batch",
    "get_tokenizer",
    "load_text",
    "make_model",
    "make_optimizer",
    "on_device",
    "optimizer_state_tensors",
    "pick_device",
    "plot_module_bars",
    "plot_timeline",
    "plot_timelines",
    "progress",
    "require_prediction",
    "seed_everything",
    "slider_panel",
    "storage_bytes",
    "track_and_plot",
    "track_steps",
    "train_step",
]
