"""Helpers for the Training Step Anatomy course: a toy GPT, its data, a memory tracker, its trace and plots.

The core lives in the top-level modules (model, data, train, tracker, trace, allocator, ...); what only one
notebook uses lives in ``anatomy_helpers.lessons``. The names below are the ones every notebook reaches for.
"""

from importlib import import_module

from .data import CharTokenizer, get_batch, get_tokenizer, load_text, seed_everything
from .exercises import check_prediction
from .model import GPT, ModelConfig
from .tensors import on_device, optimizer_state_tensors, storage_bytes
from .tracking.events import CATEGORIES, PHASES, Peak, PhaseSummary, Timeline
from .tracking.recorder import MemoryBudgetExceeded
from .tracking.trace import Trace
from .tracking.tracker import StepTracker
from .train import OPTIMIZERS, make_model, make_optimizer, pick_device, track_steps, train_step
from .units import GiB, MiB

# The figures and widgets load on first use (matplotlib and ipywidgets: about 0.8 s of CPU per process): each rank
# process of a distributed world imports this package and never draws.
_ON_FIRST_USE = {
    **dict.fromkeys(("CATEGORY_COLORS", "plot_module_bars", "plot_timeline", "plot_timelines"), ".plots"),
    **dict.fromkeys(("progress", "slider_panel", "track_and_plot"), ".widgets"),
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
    "seed_everything",
    "slider_panel",
    "storage_bytes",
    "track_and_plot",
    "track_steps",
    "train_step",
]
