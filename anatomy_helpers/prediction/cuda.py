"""Helpers for the real CUDA caching allocator (every one needs a GPU; each refuses a CPU device clearly).

* :func:`cuda_release`, :func:`cuda_warm_up`: start measurements from a known, warm state;
* :func:`cuda_stats`: the allocator's own counters as a :class:`CudaStats`;
* :func:`cuda_run_under_limit`, :func:`cuda_step_stats`, :func:`choose_cuda_limit`: tracked steps under
  ``torch.cuda.set_per_process_memory_fraction``, and a real ``OutOfMemoryError`` at step 2;
* :func:`cuda_vs_simulated`, :func:`cuda_reserved_check`: the allocator simulator against the real thing.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import numpy as np
import torch

from ..core.data import get_batch
from ..core.tables import Col, format_table
from ..core.units import MiB, round_up
from ..tracking.trace import Trace
from ..training.train import make_model, make_optimizer, track_steps, train_step
from .allocator import ROUND_LARGE, replay


def _cuda_device(device=None) -> torch.device:
    dev = torch.device("cuda" if device is None else device)
    if dev.type != "cuda":
        raise ValueError(f"this helper needs a CUDA device, got {dev}")
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available here")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def cuda_release(device=None) -> None:
    """Collect garbage, wait for the GPU, and give every entirely free cached segment back to CUDA."""
    dev = _cuda_device(device)
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()


def cuda_warm_up(device=None, batch_size: int = 2, **model_config) -> None:
    """One untracked training step on a throwaway model, then free it: creates the cuBLAS handles and their
    workspaces (one per thread and stream: forward's, and backward's on autograd's own thread; allocated through
    the caching allocator and kept for the life of the process), so later measurements start warm. The
    workspaces stay reserved; everything else is released."""
    dev = _cuda_device(device)
    model = make_model(device=dev, **model_config)
    opt = make_optimizer(model, "adamw")
    x, y = get_batch(batch_size, model.cfg.seq_len, device=dev)
    train_step(model, opt, x, y)
    del model, opt, x, y
    cuda_release(dev)


@dataclass(frozen=True)
class CudaStats:
    """The caching allocator's counters at one moment (``torch.cuda.memory_stats``), bytes and counts."""

    allocated: int  # memory_allocated()
    reserved: int  # memory_reserved()
    max_allocated: int  # peaks since the last reset_peak_memory_stats()
    max_reserved: int
    max_requested: int  # what tensors asked for, before rounding
    segments_created: int  # cudaMallocs so far (a running count)
    alloc_retries: int  # times the cache was emptied to retry a cudaMalloc
    step: int = 0  # the training step these were read after (0: not after a step)
    new_segments: int = 0  # cudaMallocs during that step


def cuda_stats(device=None, step: int = 0) -> CudaStats:
    """The allocator's counters on ``device`` now (``step``: the step they are read after, for tables)."""
    s = torch.cuda.memory_stats(_cuda_device(device))
    return CudaStats(
        allocated=s.get("allocated_bytes.all.current", 0),
        reserved=s.get("reserved_bytes.all.current", 0),
        max_allocated=s.get("allocated_bytes.all.peak", 0),
        max_reserved=s.get("reserved_bytes.all.peak", 0),
        max_requested=s.get("requested_bytes.all.peak", s.get("allocated_bytes.all.peak", 0)),
        segments_created=s.get("segment.all.allocated", 0),
        alloc_retries=s.get("num_alloc_retries", 0),
        step=step,
    )


@dataclass
class CudaRun:
    """Training steps of a fresh model on a GPU, optionally under a memory limit (bytes)."""

    limit: int | None  # the limit on reserved bytes the fraction allowed (None: no limit)
    fraction: float | None
    steps: int
    completed: list[int]
    step_stats: list[CudaStats]  # per completed step: peaks since the step began, counters at its end
    failed_step: int | None = None
    phase: str | None = None
    module: str | None = None  # the module of the last allocation the tracker saw before the failure
    message: str | None = None  # the OutOfMemoryError's text
    at_failure: CudaStats | None = None  # allocator counters right after the failure
    before: CudaStats | None = None  # counters before the model was built
    after: CudaStats | None = None  # counters after everything was released
    trace: Trace | None = None

    @property
    def passed(self) -> bool:
        return self.failed_step is None

    def summary(self) -> str:
        lim = "no limit" if self.limit is None else f"limit {self.limit / MiB:.1f} MiB (fraction {self.fraction:.3g})"
        parts = [f"step {r.step} ok (peak reserved {r.max_reserved / MiB:.1f} MiB)" for r in self.step_stats]
        if self.failed_step is not None:
            parts.append(f"step {self.failed_step} OUT OF MEMORY in {self.phase}, after {self.module}")
        return f"{lim}: " + "; ".join(parts)


def cuda_run_under_limit(
    limit: int | None,
    steps: int = 4,
    batch_size: int = 8,
    optimizer: str = "adamw",
    device=None,
    seed: int = 0,
    **model_config,
) -> CudaRun:
    """Train a fresh model for ``steps`` tracked steps on the GPU with ``memory_reserved()`` capped at
    ``limit`` bytes, through ``torch.cuda.set_per_process_memory_fraction(limit / total_memory)``.

    The cap counts every segment this process's caching allocator holds (the model's and anything else
    alive), not the CUDA context. A ``torch.cuda.OutOfMemoryError`` is caught and reported (the exception
    is not kept: its traceback holds the failed step's tensors). Whatever happens, the fraction is set back
    to 1.0 and the model, its optimizer and the cache are released. ``limit=None`` runs without a cap
    (a dry run that measures the peaks of each step).
    """
    dev = _cuda_device(device)
    cuda_release(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = None if limit is None else limit / total
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ValueError(f"limit {limit:,} bytes is not within the device's {total:,} bytes")
    run = CudaRun(limit, fraction, steps, [], [], before=cuda_stats(dev))
    model = make_model(device=dev, **model_config)
    opt = make_optimizer(model, optimizer)

    def after_step(step: int) -> None:
        torch.cuda.synchronize(dev)
        run.completed.append(step)
        run.step_stats.append(cuda_stats(dev, step))
        torch.cuda.reset_peak_memory_stats(dev)  # the next step's peaks start here

    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, dev)
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        run.trace = track_steps(model, opt, steps=steps, batch_size=batch_size, seed=seed, after_step=after_step)
    except torch.cuda.OutOfMemoryError as err:
        run.message = str(err)
        run.at_failure = cuda_stats(dev)
        run.trace = err.trace
        del err  # its traceback holds the failed step's tensors
    finally:
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
    if run.message is not None:
        last = run.trace.phase_marks[-1]
        run.failed_step, run.phase = last.step, last.phase
        tl = run.trace.timeline
        run.module = tl.module_names[int(tl.module[-1])] if len(tl) else "-"
    del model, opt
    cuda_release(dev)
    run.after = cuda_stats(dev)
    return run


def cuda_step_stats(
    steps: int = 4, batch_size: int = 8, optimizer: str = "adamw", device=None, **model_config
) -> list[CudaStats]:
    """Per step of a fresh model on the GPU (no limit): ``max_memory_allocated`` / ``max_memory_reserved``
    since the step began (``reset_peak_memory_stats`` before each), the counters at its end and the
    cudaMallocs it made. Absolute bytes, as the allocator reports them. Returns one :class:`CudaStats` per step."""
    run = cuda_run_under_limit(
        None, steps=steps, batch_size=batch_size, optimizer=optimizer, device=device, **model_config
    )
    rows, prev = [], run.before.segments_created
    for r in run.step_stats:
        rows.append(dataclasses.replace(r, new_segments=r.segments_created - prev))
        prev = r.segments_created
    return rows


def format_cuda_step_stats(rows: list[CudaStats]) -> str:
    """The rows of :func:`cuda_step_stats` as a table in MiB."""
    cols = [Col("step", 4), Col("max allocated", 14, ".2f"), Col("max reserved", 13, ".2f")]
    cols += [Col("allocated end", 14, ".2f"), Col("reserved end", 13, ".2f"), Col("cudaMallocs", 12)]
    table = [
        (r.step, r.max_allocated / MiB, r.max_reserved / MiB, r.allocated / MiB, r.reserved / MiB, r.new_segments)
        for r in rows
    ]
    return format_table(cols, table, note="(MiB)")


@dataclass
class LimitChoice:
    """A limit on reserved bytes that step 1 fits under and step 2 cannot (bytes, absolute)."""

    limit: int | None  # None when no such limit was found
    low: int  # step 1 passes at this limit or above
    high: int  # step 2 cannot pass below this (its peak of requested bytes)
    how: str
    dry_run: list[CudaStats]


def choose_cuda_limit(batch_size: int = 8, optimizer: str = "adamw", device=None, **model_config) -> LimitChoice:
    """Find a cap on ``memory_reserved()`` that lets step 1 through and stops step 2, from measured runs.

    A dry run (after a warm-up, so the cuBLAS workspace already exists) gives step 1's peak reserved
    bytes R1 and step 2's peak requested bytes Q2. A capped run repeats the dry run's allocations exactly
    until it first hits the cap, so with a cap >= R1 step 1 never notices it; and since requested <=
    allocated <= reserved <= cap, any cap < Q2 must fail before step 2's peak. If R1 < Q2 the midpoint
    is chosen. Otherwise (step 1's fragmentation is larger than the optimizer state), the smallest cap,
    in steps of 2 MiB, under which step 1 still passes (the allocator empties its cache and retries when
    it reaches the cap) is searched for, and the midpoint between it and Q2 is used if it is below Q2.
    """
    dev = _cuda_device(device)
    cuda_warm_up(dev, **model_config)
    kw = dict(batch_size=batch_size, optimizer=optimizer, device=dev, **model_config)
    dry = cuda_step_stats(steps=2, **kw)
    r1, q1, q2 = dry[0].max_reserved, dry[0].max_requested, dry[1].max_requested
    if r1 < q2:
        return LimitChoice(
            (r1 + q2) // 2, r1, q2, "midway between step 1's peak reserved and step 2's peak requested", dry
        )
    low = round_up(q1, ROUND_LARGE)
    while low < r1 and not cuda_run_under_limit(low, steps=1, **kw).passed:
        low += ROUND_LARGE
    low = min(low, r1)
    if low < q2:
        return LimitChoice(
            (low + q2) // 2, low, q2, "midway between step 1's smallest passing cap and step 2's peak requested", dry
        )
    return LimitChoice(None, low, q2, "none: step 1 needs as much reserved memory as step 2 requests", dry)


@dataclass(frozen=True)
class SimVsReal:
    """At the end of one step: the real allocator's counters and the simulator's, as growth (bytes)."""

    step: int
    real_reserved: int
    sim_reserved: int
    real_allocated: int | None = None
    sim_allocated: int | None = None

    @property
    def relative_difference(self) -> float:
        """(simulated - real) / real reserved bytes."""
        return (self.sim_reserved - self.real_reserved) / self.real_reserved


def _step_ends(trace: Trace) -> list[tuple[int, int]]:
    """(step, index of its last timeline sample) for each training step."""
    return [(s, int(trace.window(step=s)[-1])) for s in trace.training_steps()]


def cuda_vs_simulated(trace: Trace) -> list[SimVsReal]:
    """For a trace recorded on CUDA: at the end of each step, the real allocator's counters and the
    simulator's (replaying the trace's allocation record), both as growth since tracking began (bytes)."""
    tl = trace.timeline
    if tl.cuda_reserved is None or trace.cuda_at_entry is None:
        raise ValueError("this trace was not recorded on CUDA: it has no allocator counters")
    result = replay(trace.allocation_record())
    on = np.flatnonzero(result.sample >= 0)
    start = on[0] - 1  # the last baseline row: the parameters (and any state) before tracking
    sim_res0 = int(result.reserved[start]) if start >= 0 else 0
    sim_alloc0 = int(result.allocated[start]) if start >= 0 else 0
    entry = trace.cuda_at_entry
    return [
        SimVsReal(
            step=s,
            real_reserved=int(tl.cuda_reserved[last]) - entry.reserved,
            sim_reserved=int(result.reserved[on[last]]) - sim_res0,
            real_allocated=int(tl.cuda_allocated[last]) - entry.allocated,
            sim_allocated=int(result.allocated[on[last]]) - sim_alloc0,
        )
        for s, last in _step_ends(trace)
    ]


def cuda_reserved_check(
    steps: int = 4, batch_size: int = 8, optimizer: str = "adamw", device=None, **model_config
) -> list[SimVsReal]:
    """The simulator against the real caching allocator on a warm GPU, at the end of each step (bytes).

    First a warm-up step on a throwaway model: the first matmuls create the cuBLAS handles and their workspaces
    (one per thread and stream, so forward and backward each get one), allocated through the caching allocator
    and kept for good, which the tracker cannot see (it is no
    tensor) and the simulator therefore cannot replay. Then ``gc`` + ``empty_cache`` and ``memory_reserved()``
    is read: what the process holds before the model exists (the workspace, anything else alive). A fresh
    model is built (its parameters are the replay's first rows) and ``steps`` steps are tracked. Per step:
    ``real_reserved`` (``memory_reserved()`` at the step's last event minus that baseline) and
    ``sim_reserved`` (the simulator after the same event).
    """
    dev = _cuda_device(device)
    cuda_warm_up(dev, **model_config)
    cuda_release(dev)
    reserved0 = torch.cuda.memory_reserved(dev)
    model = make_model(device=dev, **model_config)
    opt = make_optimizer(model, optimizer)
    trace = track_steps(model, opt, steps=steps, batch_size=batch_size)
    result = replay(trace.allocation_record())
    on = np.flatnonzero(result.sample >= 0)
    rows = [
        SimVsReal(s, int(trace.timeline.cuda_reserved[last]) - reserved0, int(result.reserved[on[last]]))
        for s, last in _step_ends(trace)
    ]
    del model, opt, trace
    cuda_release(dev)
    return rows


def format_cuda_vs_simulated(rows: list[SimVsReal]) -> str:
    """The rows of :func:`cuda_vs_simulated` as a table in MiB."""
    cols = [Col("step end", 8), Col("real reserved", 14, ".2f"), Col("simulated", 10, ".2f")]
    cols += [Col("difference", 11, ".2f"), Col("real allocated", 15, ".2f"), Col("simulated", 10, ".2f")]
    table = [
        (
            r.step,
            r.real_reserved / MiB,
            r.sim_reserved / MiB,
            (r.real_reserved - r.sim_reserved) / MiB,
            None if r.real_allocated is None else r.real_allocated / MiB,
            None if r.sim_allocated is None else r.sim_allocated / MiB,
        )
        for r in rows
    ]
    return format_table(cols, table, note="(MiB, growth since tracking began)")
