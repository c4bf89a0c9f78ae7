"""Kernel scratch: memory a kernel allocates and frees inside one op, which no op output ever shows.

Examples on CPU: the packing buffers of a bfloat16 matmul, the work buffers of the flash-attention backward.
A ``TorchDispatchMode`` only sees what an op returns, so the tracker needs a second witness: the CPU allocator
itself. When a (Kineto) profiler session with ``profile_memory=True`` is active on the thread, the allocator
reports every allocation and free to it (``c10::reportMemoryUsage``). :class:`MemoryEvents` runs such a session
that records nothing else (no ops: only the ``USER_SCOPE`` record functions are enabled), and
:func:`op_excess` finds, for each op's time window, how far the op's own allocations peaked above what it
kept: that excess is the op's kernel scratch. ``torch.profiler``'s memory timeline cannot tie these bytes to
a tensor either; it shows them as "unknown".

On CUDA the caching allocator's own counters see this memory (and cuBLAS workspaces) directly, so this module
is for CPU only.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from collections.abc import Callable

import numpy as np
import torch
from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler, _profiler_enabled
from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope, _ExperimentalConfig

from .events import Event, OpWindow, PhaseMark

#: Ops whose scratch is below this many bytes are left out: a few hundred ops per step wrap a Python scalar
#: into a 4-12 byte tensor inside the op, which would add ~40 % more timeline samples for a few bytes.
SCRATCH_MIN_BYTES = 1024


@contextlib.contextmanager
def quiet_stderr():
    """Silence C-level stderr (fd 2) for the block: Kineto prints ``profiler_start``/``profiler_stop`` lines."""
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def _c10_log_level() -> ctypes.c_int | None:
    """c10's ``LOG()`` threshold (0 INFO, 1 WARNING, 2 ERROR), or None if libc10 does not export it."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        try:
            return ctypes.c_int.in_dll(ctypes.CDLL(os.path.join(lib_dir, name)), "FLAGS_caffe2_log_level")
        except (OSError, ValueError):
            continue
    return None


class MemoryEvents:
    """A memory-only profiler session on this thread: the CPU allocator's allocations and frees, nothing else."""

    def __init__(self) -> None:
        self._level: ctypes.c_int | None = None
        self._saved_level = 0
        self.running = False

    def start(self) -> bool:
        """Start recording; False (and nothing started) if a profiler already runs here or Kineto is missing."""
        if _profiler_enabled() or not torch.autograd.kineto_available():
            return False  # one profiler session per thread: the user's own torch.profiler comes first
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        activities = {ProfilerActivity.CPU}
        with quiet_stderr():
            _prepare_profiler(config, activities)  # torch 2.13 crashes in _enable_profiler without it
            _enable_profiler(config, activities, {RecordScope.USER_SCOPE})
        # The allocator LOG(WARNING)s "Memory block of unknown size was allocated before the profiling started"
        # when a block older than the session is freed (every 1000th time), mid-step: raise c10's log threshold
        # to ERROR while recording, and put it back after.
        self._level = _c10_log_level()
        if self._level is not None:
            self._saved_level, self._level.value = self._level.value, max(self._level.value, 2)
        self.running = True
        return True

    def stop(self) -> np.ndarray | None:
        """Stop; the events as an (n, 2) int64 array of (time ns, +/- bytes) in time order.

        None if the session was lost: a ``torch.profiler`` opened and closed inside the block takes over the
        thread's session and ends it (torch allows that silently), so the scratch of this block is unknown.
        The session is stopped first and whatever happens after (even a KeyboardInterrupt) cannot leave it on.
        """
        if not self.running:
            return None
        self.running = False
        try:
            if not _profiler_enabled():
                return None
            with quiet_stderr():
                result = _disable_profiler()
        finally:
            if self._level is not None:
                self._level.value = self._saved_level
        cpu = torch._C._autograd.DeviceType.CPU
        # memory events are the only ones with bytes; record_function ranges (optimizer.step ...) have 0
        events = [(e.start_ns(), n) for e in result.events() if (n := e.nbytes()) and e.device_type() == cpu]
        n_events = len(events)
        arr = np.array(events, dtype=np.int64).reshape(-1, 2)
        del result, events
        if n_events > TRIM_AFTER_EVENTS:
            release_freed_heap()
        return arr[np.argsort(arr[:, 0], kind="stable")]


#: After reading this many allocator events (about 40 steps of the default model), hand the freed heap back.
TRIM_AFTER_EVENTS = 100_000


def release_freed_heap() -> bool:
    """Ask glibc to return freed heap memory to the system (``malloc_trim(0)``); False where there is no glibc.

    Reading a long session's events makes millions of small Python and C++ objects; once freed, glibc keeps
    their pages, so a learner's kernel would stay 1.5 GB larger after 1,000 tracked steps in one block
    (benchmarks/tracking_memory.py measures it).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def op_excess(mem: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """Per op window, the peak of the op's own running allocation total minus what it ended with (bytes).

    ``mem``: (n, 2) time-sorted (ns, +/- bytes) allocator events; ``windows``: (m, 2) sorted, disjoint
    (start ns, end ns). An op that allocates its output, then a 160 KiB packing buffer and frees it, has an
    excess of 160 KiB: the live total peaked that far above where the op left it.
    """
    excess = np.zeros(len(windows), dtype=np.int64)
    if not len(mem) or not len(windows):
        return excess
    times, deltas = mem[:, 0], mem[:, 1]
    lo = np.searchsorted(times, windows[:, 0], side="left")
    hi = np.searchsorted(times, windows[:, 1], side="right")
    some = np.flatnonzero(hi - lo >= 2)  # one event alone is the op's output (or a free): nothing transient
    if not len(some):
        return excess
    lengths = hi[some] - lo[some]
    idx = np.concatenate([np.arange(a, b) for a, b in zip(lo[some].tolist(), hi[some].tolist())])
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    running = np.cumsum(deltas[idx])
    before = np.r_[0, running][starts]  # the running total just before each window
    local = running - np.repeat(before, lengths)
    peak = np.maximum.reduceat(local, starts)
    net = local[starts + lengths - 1]
    excess[some] = np.maximum(peak - net, 0)
    return excess


def splice_scratch(
    events: list[Event],
    windows: list[OpWindow],
    memory_events: np.ndarray,
    phase_marks: list[PhaseMark],
    new_allocation: Callable[[int, int], int],
) -> tuple[list[Event], list[PhaseMark]]:
    """Insert one (allocate, free) pair of events after every op whose kernel scratch is >= SCRATCH_MIN_BYTES.

    ``events``: the recorder's events in order; ``windows``: one per op that may allocate, in order;
    ``memory_events``: the allocator's (time ns, +/- bytes) events (:meth:`MemoryEvents.stop`); ``phase_marks``:
    indexed by event; ``new_allocation(nbytes, module)`` registers a scratch allocation and returns its id. The pair
    is stamped like the op's last event and goes at the op's ``event_index`` (right after its outputs), in its step,
    phase and module: the live total at the inserted allocation is exactly the peak during that op. Returns the new
    (events, phase_marks).
    """
    if not windows or not len(memory_events):
        return events, phase_marks
    excess = op_excess(memory_events, np.array([(w.start_ns, w.end_ns) for w in windows], dtype=np.int64))
    hit = np.flatnonzero(excess >= SCRATCH_MIN_BYTES).tolist()
    spliced, done = [], 0
    for k in hit:
        op = windows[k]
        spliced.extend(events[done : op.event_index])
        done = op.event_index
        when = spliced[-1].time_ns if spliced else events[0].time_ns  # stamped like the op's last sample
        nbytes = int(excess[k])
        alloc_id = new_allocation(nbytes, op.module)
        spliced.append(Event(when, alloc_id, nbytes, op.step, op.phase, op.module))
        spliced.append(Event(when, alloc_id, -nbytes, op.step, op.phase, op.module))
    spliced.extend(events[done:])
    inserted_at = np.array([windows[k].event_index for k in hit], dtype=np.int64)
    # a mark made before event i moves past every pair inserted at or before i (they belong to earlier ops)
    marks = [
        dataclasses.replace(m, index=m.index + 2 * int(np.searchsorted(inserted_at, m.index, side="right")))
        for m in phase_marks
    ]
    return spliced, marks
