"""torch.profiler's view of a training step, in the course's terms.

Thin helpers for reading what ``torch.profiler.profile`` records next to a
:class:`~anatomy_helpers.tracking.trace.Trace`:

* :func:`load_memory_timeline` reads the JSON that ``prof.export_memory_timeline(path)`` writes
  (``[times, sizes]``) into a :class:`ProfilerTimeline`, its columns named by :data:`PROFILER_CATEGORIES`;
* :data:`COURSE_CATEGORY` says which course category each profiler category is drawn as;
* :func:`phase_spans` finds the ``record_function("forward" | "backward" | "optimizer")`` ranges of each step;
* :func:`profiler_trace` turns a ProfilerTimeline and those spans into a Trace, so ``plot_timeline``,
  ``plot_timelines`` and the Trace queries (``peak``, ``phase``...) work on the profiler's samples;
* :func:`quiet_profiler` keeps the profiler's own ``profiler_start`` / ``profiler_stop`` lines (written by its
  C++ side straight to file descriptor 2) out of a notebook's output, and lets every other line through.

Bytes everywhere; times in microseconds on the profiler's clock unless a name says otherwise.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch.autograd import DeviceType

from .events import CATEGORIES, PHASES, CategoryColumns, PhaseMark, Timeline
from .trace import Trace

# The columns of export_memory_timeline's "sizes", in torch's order (torch.profiler._memory_profiler's
# _CATEGORY_TO_INDEX; None, "unknown", is last). Each row of the JSON has one more column in front, always 0.
PROFILER_CATEGORIES = (
    "PARAMETER",
    "OPTIMIZER_STATE",
    "INPUT",
    "TEMPORARY",
    "ACTIVATION",
    "GRADIENT",
    "AUTOGRAD_DETAIL",
    "UNKNOWN",
)

# How each profiler category is drawn with the course's colours. The profiler's TEMPORARY is a tensor allocated
# and freed inside one op: the course's kernel scratch (temporaries, for a tracker without that category).
# AUTOGRAD_DETAIL (what autograd passes between backward ops: gradients of activations) is what the tracker calls
# temporaries. UNKNOWN mixes tensors the profiler could not classify and allocations that never became a tensor
# (memory a kernel takes for itself); it is drawn as temporaries, the course's "everything else". Lesson 07
# measures which is which.
_IN_ONE_OP = "kernel_scratch" if "kernel_scratch" in CATEGORIES else "temporaries"
COURSE_CATEGORY = {
    "PARAMETER": "parameters",
    "OPTIMIZER_STATE": "optimizer_state",
    "INPUT": "inputs",
    "TEMPORARY": _IN_ONE_OP,
    "ACTIVATION": "activations",
    "GRADIENT": "gradients",
    "AUTOGRAD_DETAIL": "temporaries",
    "UNKNOWN": "temporaries",
}

# The module name of every sample of a profiler_trace: the memory timeline does not record modules.
NO_PROFILER_MODULE = "(module unknown to the profiler)"

# The phases a profiled training loop labels with record_function, in the order a step runs them.
STEP_PHASES = tuple(p for p in PHASES if p != "idle")


@dataclass
class ProfilerTimeline(CategoryColumns):
    """What ``export_memory_timeline`` wrote: one sample per timestamp at which memory changed.

    ``bytes[i, c]`` is the number of live bytes of ``PROFILER_CATEGORIES[c]`` after sample ``i``; ``total`` is
    their sum. ``time_us`` is on the profiler's clock (microseconds), the clock of :func:`phase_spans`.
    The profiler merges every change within one microsecond into one sample.
    """

    category_names = PROFILER_CATEGORIES
    time_us: np.ndarray
    bytes: np.ndarray  # (n_samples, len(PROFILER_CATEGORIES))
    total: np.ndarray = field(init=False)

    def __post_init__(self):
        if self.bytes.ndim != 2 or self.bytes.shape != (len(self.time_us), len(PROFILER_CATEGORIES)):
            raise ValueError(
                f"bytes must be (n_samples, {len(PROFILER_CATEGORIES)}) for {len(self.time_us)} times, "
                f"got {self.bytes.shape}"
            )
        self.total = self.bytes.sum(axis=1)

    def __len__(self) -> int:
        return len(self.time_us)

    def at(self, index: int) -> dict[str, int]:
        """Bytes per profiler category after sample ``index``."""
        return {c: int(b) for c, b in zip(PROFILER_CATEGORIES, self.bytes[index])}

    def course_bytes(self) -> np.ndarray:
        """The samples in the course's categories: (n_samples, len(CATEGORIES)), summed by :data:`COURSE_CATEGORY`."""
        out = np.zeros((len(self), len(CATEGORIES)), dtype=np.int64)
        for j, name in enumerate(PROFILER_CATEGORIES):
            out[:, CATEGORIES.index(COURSE_CATEGORY[name])] += self.bytes[:, j]
        return out


def load_memory_timeline(path: str | Path) -> ProfilerTimeline:
    """Read the ``[times, sizes]`` JSON of ``prof.export_memory_timeline(path)`` (a path ending in ``.json``)."""
    times, sizes = json.loads(Path(path).read_text())
    sizes = np.asarray(sizes, dtype=np.int64).reshape(len(times), -1)
    if sizes.shape[1] != len(PROFILER_CATEGORIES) + 1 or sizes[:, 0].any():
        raise ValueError(
            f"{path}: expected rows of 0 followed by {len(PROFILER_CATEGORIES)} categories {PROFILER_CATEGORIES}, "
            f"got {sizes.shape[1]} columns; was it written by another torch version's export_memory_timeline?"
        )
    return ProfilerTimeline(np.asarray(times, dtype=np.int64), sizes[:, 1:])


@dataclass(frozen=True)
class PhaseSpan:
    """One ``record_function`` range of a profiled step, on the profiler's clock (microseconds)."""

    step: int
    phase: str
    start_us: float
    end_us: float

    @property
    def duration_ms(self) -> float:
        return (self.end_us - self.start_us) / 1e3


def phase_spans(prof, first_step: int = 1, phases: Sequence[str] = STEP_PHASES) -> list[PhaseSpan]:
    """The ``record_function`` ranges named ``phases`` in a finished profile, in time order.

    Steps are numbered from ``first_step`` by the order of the ``phases[0]`` ranges (each step starts with its
    forward pass). Times are absolute, on the clock of ``export_memory_timeline``'s samples.
    """

    origin_us = prof.profiler.kineto_results.trace_start_ns() / 1e3
    events = sorted(
        (e for e in prof.events() if e.name in phases and e.device_type == DeviceType.CPU),
        key=lambda e: e.time_range.start,
    )
    spans, step = [], first_step - 1
    for e in events:
        step += e.name == phases[0]
        spans.append(PhaseSpan(step, e.name, origin_us + e.time_range.start, origin_us + e.time_range.end))
    return spans


def sample_phases(time_us: np.ndarray, spans: Sequence[PhaseSpan]) -> tuple[np.ndarray, np.ndarray]:
    """(step, phase index into PHASES) of each time: the span it falls in, else "idle" of the span before it
    (of the first span, before the first)."""
    if not spans:
        raise ValueError("no phase spans: label the loop with record_function('forward' / 'backward' / 'optimizer')")
    starts = np.array([s.start_us for s in spans])
    ends = np.array([s.end_us for s in spans])
    k = np.maximum(np.searchsorted(starts, time_us, side="right") - 1, 0)
    inside = (time_us >= starts[k]) & (time_us <= ends[k])
    step = np.array([s.step for s in spans])[k]
    phase = np.where(inside, np.array([PHASES.index(s.phase) for s in spans])[k], PHASES.index("idle"))
    return step.astype(np.int64), phase.astype(np.int64)


def profiler_trace(timeline: ProfilerTimeline, spans: Sequence[PhaseSpan], device: str = "cpu") -> Trace:
    """A :class:`Trace` of the profiler's samples in the course's categories, phases and steps from ``spans``.

    Enough for ``plot_timeline`` / ``plot_timelines`` and the window queries (``peak``, ``phase``, ``phases``,
    ``training_steps``). The JSON holds totals per category only: no modules (every sample is in module
    :data:`NO_PROFILER_MODULE`) and no single allocations, so the allocation queries (``alive_at``,
    ``allocation_record``...) have nothing to say.
    """
    step, phase = sample_phases(timeline.time_us, spans)
    t0 = float(timeline.time_us[0]) if len(timeline) else 0.0
    time_s = (timeline.time_us - t0) / 1e6
    tl = Timeline(
        time_s=time_s,
        step=step,
        phase=phase,
        module=np.zeros(len(timeline), dtype=np.int64),
        bytes=timeline.course_bytes(),
        module_names=[NO_PROFILER_MODULE],
    )
    key = step * len(PHASES) + phase
    changes = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else []
    marks = [PhaseMark(int(i), float(time_s[i]), int(step[i]), PHASES[phase[i]]) for i in changes]
    return Trace.from_samples(tl, marks, device=device)


# kineto (torch 2.13) writes lines such as
# "USDT:2026-12-02 14:41:59 15375:15375 SyncActivityProfilerHandler.cpp:52] profiler_start"; a CUDA build of torch on a
# machine without a GPU (Colab's CPU runtime) adds "ERROR:... DeviceProperties.cpp:48] gpuGetDeviceCount failed with
# code 35" (no driver: nothing to profile on a GPU there, as expected).
PROFILER_CHATTER = re.compile(rb"^.*\] (profiler_(start|stop)|gpuGetDeviceCount failed with code 35)\s*$")


@contextmanager
def quiet_profiler(chatter: re.Pattern = PROFILER_CHATTER) -> Iterator[None]:
    """Keep the profiler's own console lines out of the output.

    The profiler's C++ side writes them to file descriptor 2 (not to ``sys.stderr``), so this swaps that
    descriptor for a temporary file while the block runs, then writes back every line that does not match
    ``chatter``: real warnings and errors still show. Also hides the warning torch 2.11 gives on every scheduled
    profile, that a new cycle clears the events of the last one (this course profiles one cycle).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
        yield from _quiet_descriptor(chatter)


def _quiet_descriptor(chatter: re.Pattern) -> Iterator[None]:
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 to silence
        yield
        return
    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if not chatter.match(line)]
            if kept:
                os.write(2, b"".join(kept))
