"""Helpers for the Training Step Anatomy course: a toy GPT, its data, a memory tracker and plots."""

from .data import CharTokenizer, get_batch, get_tokenizer, load_text, seed_everything
from .exercises import check_prediction
from .model import GPT, ModelConfig
from .plots import CATEGORY_COLORS, plot_module_bars, plot_timeline
from .tracker import (
    CATEGORIES,
    PHASES,
    MemoryBudgetExceeded,
    StepTracker,
    Trace,
    optimizer_state_tensors,
    storage_bytes,
)
from .train import OPTIMIZERS, make_model, make_optimizer, pick_device, track_steps, train_step
from .widgets import progress, slider_panel, track_and_plot

__all__ = [
    "CATEGORIES",
    "CATEGORY_COLORS",
    "GPT",
    "OPTIMIZERS",
    "PHASES",
    "CharTokenizer",
    "MemoryBudgetExceeded",
    "ModelConfig",
    "StepTracker",
    "Trace",
    "check_prediction",
    "get_batch",
    "get_tokenizer",
    "load_text",
    "optimizer_state_tensors",
    "storage_bytes",
    "make_model",
    "make_optimizer",
    "pick_device",
    "plot_module_bars",
    "plot_timeline",
    "progress",
    "slider_panel",
    "track_and_plot",
    "seed_everything",
    "track_steps",
    "train_step",
]
