"""Helpers for the Training Step Anatomy course: a toy GPT, its data, a memory tracker, its trace and plots.

The core lives in the top-level modules (model, data, train, tracker, trace, allocator, ...); what only one
notebook uses lives in ``anatomy_helpers.lessons``. The names below are the ones every notebook reaches for.
"""

from .data import CharTokenizer, get_batch, get_tokenizer, load_text, seed_everything
from .exercises import check_prediction
from .model import GPT, ModelConfig
from .plots import CATEGORY_COLORS, plot_module_bars, plot_timeline, plot_timelines
from .tensors import on_device, optimizer_state_tensors, storage_bytes
from .tracking.events import CATEGORIES, PHASES, Peak, PhaseSummary, Timeline
from .tracking.recorder import MemoryBudgetExceeded
from .tracking.trace import Trace
from .tracking.tracker import StepTracker
from .train import OPTIMIZERS, make_model, make_optimizer, pick_device, track_steps, train_step
from .units import GiB, MiB
from .widgets import progress, slider_panel, track_and_plot

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
