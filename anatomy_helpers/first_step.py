"""The first training step is different (notebook 04): optimizer state, the caching allocator, and OOM at step 2.

* step peaks and optimizer-state births: :func:`step_peak_table`, :func:`optimizer_state_births`;
* the caching allocator, replayed on any device: :func:`allocator_at`, :class:`LimitedAllocatorSim`,
  :func:`replay_with_limit`, :func:`min_limit_to_pass`, :func:`format_replay_summary`, :func:`plot_allocator`,
  :func:`plot_segment_map`, and :func:`snapshot_from_replay`, which writes the replay in the format of
  ``torch.cuda.memory._snapshot()`` so PyTorch's own viewers (``torch.cuda._memory_viz``) can draw it on CPU;
* a memory budget that step 1 fits and step 2 does not: :func:`budget_between`, :func:`run_under_budget`,
  :class:`StorageWatch` (which storages a failed step left alive), :func:`plot_budget_run`;
* the real thing on a GPU: :func:`cuda_step_stats`, :func:`cuda_vs_simulated`, :func:`record_cuda_snapshot`,
  :func:`choose_cuda_limit` and :func:`cuda_run_under_limit` (a real ``torch.cuda.OutOfMemoryError`` under
  ``torch.cuda.set_per_process_memory_fraction``);
* the notebook's slider panels: :func:`allocator_panel`, :func:`budget_panel`.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import gc
import pickle
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from matplotlib.patches import Patch
from torch.utils._python_dispatch import TorchDispatchMode

from .allocator import CachingAllocatorSim, apply_row, replay, summarize_replay
from .data import get_batch
from .plots import CATEGORY_COLORS, CATEGORY_LABELS, CourseFigure, pick_unit, plot_timeline
from .tracker import CATEGORIES, PHASES, MemoryBudgetExceeded, MiB, StepTracker, Trace, optimizer_state_tensors
from .train import make_model, make_optimizer, track_steps, train_step

SEGMENT_GRANULARITY = 2 * MiB  # every segment the allocator creates is a multiple of this

# The Ultra-Scale Playbook's profile of a ~1.24 B-parameter Llama, fp32, first four steps (REFERENCES.md, 1).
PLAYBOOK_GB = {
    "parameters": 4.60,
    "optimizer_state": 9.21,
    "activations": 45.6,
    "step1_peak": 50.3,
    "later_peak": 59.5,
    "reserved_max": 64.0,
    "step1_time_s": 2.4,
    "later_time_s": 1.6,
}


# ---- section 1: four steps side by side --------------------------------------------------------


def step_peak_table(trace: Trace) -> str:
    """One line per training step: its peak (MiB), where it happened, and the categories at that moment."""
    cols = ("parameters", "optimizer_state", "gradients", "activations", "temporaries", "inputs")
    head = f"{'step':>4} {'peak':>8}  {'where':<28}" + "".join(f"{c[:11]:>12}" for c in cols)
    lines = [head + "   (MiB)", "-" * len(head)]
    for s in trace.training_steps():
        pk = trace.peak(step=s)
        where = f"{pk.phase}, {pk.module}"
        cells = "".join(f"{pk.breakdown[c] / MiB:12.2f}" for c in cols)
        lines.append(f"{s:>4} {pk.bytes / MiB:8.2f}  {where:<28}{cells}")
    return "\n".join(lines)


def optimizer_state_births(trace: Trace, step: int = 1) -> tuple[int, int]:
    """(count, bytes) of optimizer-state storages allocated during ``step``'s optimizer phase."""
    rec = trace.allocation_record()
    mask = (
        (rec["step"] == step)
        & (rec["phase"] == PHASES.index("optimizer"))
        & (rec["category"] == CATEGORIES.index("optimizer_state"))
        & (rec["bytes"] > 0)
        & (rec["sample"] >= 0)
    )
    return int(mask.sum()), int(rec["bytes"][mask].sum())


# ---- section 2: the caching allocator, simulated ------------------------------------------------


def allocator_at(record: dict[str, np.ndarray], row: int, sim: CachingAllocatorSim | None = None):
    """The simulated allocator after rows ``0..row`` of ``record`` (``Trace.allocation_record()``).

    Returns the :class:`~anatomy_helpers.allocator.CachingAllocatorSim` (or ``sim``, replayed into),
    whose ``segments()`` show every segment and block at that moment.
    """
    sim = CachingAllocatorSim() if sim is None else sim
    live: dict[int, int] = {}
    for key, delta in zip(record["alloc_id"][: row + 1].tolist(), record["bytes"][: row + 1].tolist()):
        apply_row(sim, live, key, delta)
    return sim


class SimulatedOutOfMemory(RuntimeError):
    """The simulated allocator could not stay under its limit, even after emptying its cache."""

    def __init__(self, requested: int, segment: int, allocated: int, reserved: int, limit: int):
        self.requested, self.segment, self.allocated, self.reserved, self.limit = (
            requested,
            segment,
            allocated,
            reserved,
            limit,
        )
        super().__init__(
            f"simulated CUDA out of memory: a {requested / MiB:.2f} MiB block needs a new {segment / MiB:.0f} MiB "
            f"segment, but {reserved / MiB:.0f} MiB is reserved ({allocated / MiB:.2f} MiB allocated) "
            f"under a limit of {limit / MiB:.2f} MiB"
        )


class LimitedAllocatorSim(CachingAllocatorSim):
    """The caching allocator with a cap on reserved bytes, as ``set_per_process_memory_fraction`` sets.

    When a new segment would take ``reserved`` over ``limit``, the allocator first gives every entirely
    free segment back (``empty_cache``, what c10 calls ``release_cached_blocks``) and tries again; if it
    still does not fit, it raises :class:`SimulatedOutOfMemory`. ``cache_flushes`` counts the retries.
    """

    def __init__(self, limit: int):
        super().__init__()
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        self.limit = limit
        self.cache_flushes = 0
        self._requested = 0

    def malloc(self, key: int, nbytes: int) -> None:
        self._requested = nbytes
        super().malloc(key, nbytes)

    def _new_segment(self, pool: str, size: int):
        if self.reserved + size > self.limit:
            self.empty_cache()
            self.cache_flushes += 1
            if self.reserved + size > self.limit:
                raise SimulatedOutOfMemory(self._requested, size, self.allocated, self.reserved, self.limit)
        return super()._new_segment(pool, size)


@dataclass
class LimitReplay:
    """What happened when a record was replayed under a reserved-bytes limit (bytes)."""

    limit: int
    passed: bool
    rows: int  # rows replayed (all of them when passed)
    step: int | None  # where it failed (None when it passed)
    phase: str | None
    requested: int | None  # the request that did not fit
    allocated: int  # simulated allocated / reserved at the end (or at the failure)
    reserved: int
    cache_flushes: int


def replay_with_limit(record: dict[str, np.ndarray], limit: int, through_step: int | None = None) -> LimitReplay:
    """Replay ``record`` through a :class:`LimitedAllocatorSim` capped at ``limit`` reserved bytes.

    With ``through_step``, only the rows of steps up to it (step 0 = what was alive at the start).
    """
    rows = len(record["bytes"]) if through_step is None else int(np.searchsorted(record["step"], through_step + 1))
    sim = LimitedAllocatorSim(limit)
    live: dict[int, int] = {}
    keys, deltas = record["alloc_id"].tolist(), record["bytes"].tolist()
    for i in range(rows):
        try:
            apply_row(sim, live, keys[i], deltas[i])
        except SimulatedOutOfMemory as err:
            return LimitReplay(
                limit,
                False,
                i,
                int(record["step"][i]),
                PHASES[int(record["phase"][i])],
                err.requested,
                sim.allocated,
                sim.reserved,
                sim.cache_flushes,
            )
    return LimitReplay(limit, True, rows, None, None, None, sim.allocated, sim.reserved, sim.cache_flushes)


def min_limit_to_pass(
    record: dict[str, np.ndarray], through_step: int | None = None, granularity: int = SEGMENT_GRANULARITY
) -> int:
    """The smallest multiple of ``granularity`` bytes under which the replay of ``record`` (through
    ``through_step``) completes: the least GPU memory the simulated allocator needs, fragmentation included.

    Scans upwards from the simulated peak of allocated bytes (below it nothing can fit) to the unlimited
    run's peak of reserved bytes (which always fits), so the answer needs no assumption of monotonicity.
    """
    rows = len(record["bytes"]) if through_step is None else int(np.searchsorted(record["step"], through_step + 1))
    part = {k: v[:rows] for k, v in record.items()}
    free_run = replay(part)
    low = int(free_run["allocated"].max()) // granularity * granularity
    high = -(-int(free_run["reserved"].max()) // granularity) * granularity
    for limit in range(max(low, granularity), high + granularity, granularity):
        if replay_with_limit(part, limit).passed:
            return limit
    return high  # not reached: the unlimited run's own reserved peak always fits


def format_replay_summary(result: dict[str, np.ndarray]) -> str:
    """Per step of a replay: segments created, reserved at the end and at the peak, allocated peak,
    and the gap between reserved and allocated at the step's allocated peak (cached but unused), in MiB."""
    head = (
        f"{'step':>9} {'new segments':>13} {'reserved end':>13} {'peak alloc.':>12} "
        f"{'peak reserved':>14} {'gap at peak':>12}"
    )
    lines = [head + "   (MiB)", "-" * len(head)]
    for row in summarize_replay(result):
        idx = np.flatnonzero(result["step"] == row["step"])
        at = idx[int(np.argmax(result["allocated"][idx]))]
        gap = int(result["reserved"][at] - result["allocated"][at])
        name = "0 (start)" if row["step"] == 0 else str(row["step"])
        lines.append(
            f"{name:>9} {row['segments_created']:>13} {row['reserved_end'] / MiB:13.2f} "
            f"{row['peak_allocated'] / MiB:12.2f} {row['peak_reserved'] / MiB:14.2f} {gap / MiB:12.2f}"
        )
    return "\n".join(lines)


def _step_starts(steps: np.ndarray) -> list[tuple[int, int]]:
    """(index, step) where each run of equal step numbers begins."""
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    return [(int(i), int(steps[i])) for i in starts]


def _mark_steps(ax, xs, steps, top, phases=None) -> None:
    """Dashed lines where each step begins (steps without a forward phase, e.g. a trailing idle one, skipped)."""
    for i, s in _step_starts(steps):
        if s == 0 or (phases is not None and not np.any(phases[steps == s] == PHASES.index("forward"))):
            continue
        ax.axvline(xs[i], color="#333", linestyle="--", linewidth=0.8)
        ax.text(xs[i], top * 0.97, f" step {s}", ha="left", va="top", fontsize=9)


def plot_allocator(result: dict[str, np.ndarray], trace: Trace | None = None, *, title: str | None = None):
    """Simulated ``memory_allocated`` and ``memory_reserved`` over the memory events of a :func:`replay`.

    The gap between them (cached in segments but holding no tensor) is shaded. With ``trace``, its exact
    tracked total is drawn too, and when the trace was recorded on CUDA a second panel shows the real
    allocator's counters, sample by sample, measured from the start of tracking. Returns the Figure.
    """
    on = result["sample"] >= 0
    xs = result["sample"][on]
    steps = result["step"][on]
    alloc, res = result["allocated"][on], result["reserved"][on]
    cuda = trace is not None and trace.timeline.cuda_reserved is not None
    panels = 2 if cuda else 1
    unit, scale = pick_unit(max(int(res.max()), 1))
    fig = CourseFigure(figsize=(10, 3.6 * panels + 0.4), layout="constrained")
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    ax.fill_between(
        xs, alloc / scale, res / scale, step="post", color="#dddddd", label="cached, unused (reserved - allocated)"
    )
    ax.step(xs, res / scale, where="post", color="#333333", linewidth=1.4, label="reserved (segments)")
    ax.step(
        xs, alloc / scale, where="post", color=CATEGORY_COLORS["parameters"], linewidth=1.0, label="allocated (blocks)"
    )
    if trace is not None:
        ax.step(
            np.arange(len(trace.timeline)),
            trace.timeline.total / scale,
            where="post",
            color=CATEGORY_COLORS["activations"],
            linewidth=0.7,
            label="tracked tensor bytes (exact)",
        )
    top = res.max() / scale * 1.15
    ax.set_ylim(0, top)
    _mark_steps(ax, xs, steps, top, result["phase"][on])
    ax.set_ylabel(f"simulated allocator ({unit})")
    ax.set_title(title or "The caching allocator, simulated from the tracker's allocations and frees")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if cuda:
        ax2 = axes[1]
        tl = trace.timeline
        entry_alloc, entry_res = (int(v) for v in trace.meta["cuda_at_entry"][:2])
        r = (tl.cuda_reserved - entry_res) / scale
        a = (tl.cuda_allocated - entry_alloc) / scale
        x2 = np.arange(len(tl))
        ax2.fill_between(x2, a, r, step="post", color="#dddddd", label="cached, unused")
        ax2.step(x2, r, where="post", color="#333333", linewidth=1.4, label="memory_reserved()")
        ax2.step(x2, a, where="post", color=CATEGORY_COLORS["parameters"], linewidth=1.0, label="memory_allocated()")
        top2 = max(float(r.max()), 1e-9) * 1.15
        ax2.set_ylim(min(0.0, float(a.min())), top2)
        _mark_steps(ax2, x2, tl.step, top2, tl.phase)
        ax2.set_ylabel(f"real, since tracking began ({unit})")
        ax2.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes[-1].set_xlabel("memory event (allocation or free)")
    axes[-1].set_xlim(xs[0], xs[-1])
    return fig


def plot_segment_map(sim: CachingAllocatorSim, categories: Iterable[int] | None = None, *, title: str | None = None):
    """Every segment of a simulated allocator as a bar, its blocks coloured by the category of the tensor
    in them (``categories[alloc_id]``, indices into CATEGORIES); free (cached) blocks are left white.

    Small-pool segments (2 MiB) come first, then the large pool. Returns the Figure.
    """
    cats = None if categories is None else np.asarray(categories)
    segs = sorted(sim.segments(), key=lambda s: (s["pool"] != "small", s["id"]))
    fig = CourseFigure(figsize=(10, 0.17 * len(segs) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    used: set[str] = set()
    for y, seg in enumerate(segs):
        ax.barh(y, seg["size"] / MiB, left=0, color="white", edgecolor="#999999", linewidth=0.6, height=0.8)
        for b in seg["blocks"]:
            if b["free"]:
                continue
            cat = "temporaries" if cats is None else CATEGORIES[int(cats[b["key"]])]
            used.add(cat)
            ax.barh(
                y,
                b["size"] / MiB,
                left=b["offset"] / MiB,
                color=CATEGORY_COLORS[cat],
                edgecolor="white",
                linewidth=0.3,
                height=0.8,
            )
    handles = [Patch(color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c]) for c in CATEGORIES if c in used]
    ax.set_yticks(range(len(segs)), [f"{s['pool']} #{s['id']}" for s in segs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("offset in the segment (MiB); white = cached, free")
    reserved, allocated = sim.reserved, sim.allocated
    ax.set_title(
        title or f"Segments: {len(segs)} held, {reserved / MiB:.0f} MiB reserved, {allocated / MiB:.1f} MiB allocated"
    )
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="cached, free"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="block", title_fontsize=8)
    return fig


class _RecordingSim(CachingAllocatorSim):
    """A CachingAllocatorSim that gives its segments addresses and logs what it does, as
    ``torch.cuda.memory._record_memory_history`` would."""

    BASE = 0x7F0000000000  # a made-up device address for the first segment

    def __init__(self, labels: dict[int, str] | None = None):
        super().__init__()
        self.events: list[dict] = []
        self.address: dict[int, int] = {}  # segment id -> address
        self.requested: dict[int, int] = {}  # allocation id -> bytes asked for
        self.labels = labels or {}
        self._next_address = self.BASE

    def _frames(self, key: int) -> list[dict]:
        label = self.labels.get(key)
        return [] if label is None else [{"filename": "anatomy_helpers/simulated", "line": 0, "name": label}]

    def _new_segment(self, pool: str, size: int):
        block = super()._new_segment(pool, size)
        addr = self.address[block.segment.id] = self._next_address
        self._next_address += size + SEGMENT_GRANULARITY  # a gap, so segments never touch
        self.events.append({"action": "segment_alloc", "addr": addr, "size": size, "stream": 0, "frames": []})
        return block

    def malloc(self, key: int, nbytes: int) -> None:
        super().malloc(key, nbytes)
        b = self._live[key]
        self.requested[key] = nbytes
        addr = self.address[b.segment.id] + b.offset
        self.events.append({"action": "alloc", "addr": addr, "size": b.size, "stream": 0, "frames": self._frames(key)})

    def free(self, key: int) -> None:
        b = self._live[key]
        addr, size = self.address[b.segment.id] + b.offset, b.size
        super().free(key)
        for action in ("free_requested", "free_completed"):
            self.events.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": self._frames(key)})

    def empty_cache(self) -> None:
        gone = [s for s in self._segments if len(s.blocks) == 1 and s.blocks[0].free]
        super().empty_cache()
        for s in gone:
            self.events.append(
                {"action": "segment_free", "addr": self.address[s.id], "size": s.size, "stream": 0, "frames": []}
            )

    def snapshot(self, with_trace: bool = True) -> dict:
        """The state in the format of ``torch.cuda.memory._snapshot()`` (one device, stream 0)."""
        segments = []
        for seg in self._segments:
            base = self.address[seg.id]
            blocks = []
            for b in seg.blocks:
                blocks.append(
                    {
                        "address": base + b.offset,
                        "size": b.size,
                        "requested_size": 0 if b.free else self.requested[b.key],
                        "state": "inactive" if b.free else "active_allocated",
                        "frames": [] if b.free else self._frames(b.key),
                    }
                )
            live = [b for b in blocks if b["state"] == "active_allocated"]
            segments.append(
                {
                    "device": 0,
                    "address": base,
                    "total_size": seg.size,
                    "stream": 0,
                    "segment_type": seg.pool,
                    "segment_pool_id": (0, 0),
                    "allocated_size": sum(b["size"] for b in live),
                    "active_size": sum(b["size"] for b in live),
                    "requested_size": sum(b["requested_size"] for b in live),
                    "blocks": blocks,
                }
            )
        return {"segments": segments, "device_traces": [list(self.events) if with_trace else []]}


def snapshot_from_replay(
    record: dict[str, np.ndarray], row: int | None = None, trace: Trace | None = None, with_trace: bool = True
) -> dict:
    """Replay ``record`` (through ``row``; all of it by default) and return the simulated allocator's state
    and history in the format of ``torch.cuda.memory._snapshot()``.

    PyTorch's snapshot tools then work on it without a GPU: ``torch.cuda._memory_viz.segsum(snap)`` (text
    summary of the segments), ``_memory_viz.trace(snap)`` (the events as pseudo-code) and
    ``_memory_viz.trace_plot(snap)`` (the HTML viewer of pytorch.org/memory_viz). With ``trace``, each
    block's single "frame" names the module that allocated it and its category.
    """
    labels = None
    if trace is not None:
        names = trace.timeline.module_names
        labels = {
            aid: f"{names[trace.alloc_module[aid]]} ({CATEGORIES[trace.alloc_category[aid]]})"
            for aid in range(len(trace.alloc_category))
        }
    sim = _RecordingSim(labels)
    allocator_at(record, len(record["bytes"]) - 1 if row is None else row, sim)
    return sim.snapshot(with_trace)


def write_memory_viz(snapshot: dict, html_path: str | Path, pickle_path: str | Path | None = None) -> Path:
    """Write ``torch.cuda._memory_viz.trace_plot(snapshot)`` (an HTML page that draws the memory timeline;
    it loads PyTorch's viewer script from a CDN when opened) and, optionally, the snapshot pickle that
    pytorch.org/memory_viz opens. Works for real and simulated snapshots. Returns the HTML path."""
    from torch.cuda import _memory_viz

    html_path = Path(html_path)
    html_path.write_text(_memory_viz.trace_plot(snapshot))
    if pickle_path is not None:
        with open(pickle_path, "wb") as f:
            pickle.dump(snapshot, f)
    return html_path


# ---- section 3: a budget that step 1 fits and step 2 does not -----------------------------------


def budget_between(trace: Trace, step_a: int = 1, step_b: int = 2, round_to: int = MiB) -> int:
    """A budget halfway between the tracked peaks of ``step_a`` and ``step_b``, rounded down to a multiple
    of ``round_to`` bytes. Raises ValueError if no such multiple lies strictly between the two peaks."""
    a, b = trace.peak(step=step_a).bytes, trace.peak(step=step_b).bytes
    budget = (a + b) // 2 // round_to * round_to
    if not a < budget < b:
        raise ValueError(
            f"no budget between step {step_a}'s peak ({a:,} bytes) and step {step_b}'s ({b:,} bytes) "
            f"in multiples of {round_to:,} bytes"
        )
    return budget


def model_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a training run keeps on purpose between steps: parameters, buffers, gradients, optimizer state."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *model.buffers(), *grads, *optimizer_state_tensors(optimizer)]


class StorageWatch(TorchDispatchMode):
    """Keeps a weak reference to every storage that ops create inside it, to ask later which are still alive.

    Usage::

        with StorageWatch() as watch:
            ...  # run something, maybe fail
        watch.alive_bytes(exclude=model_state_tensors(model, optimizer))  # 0 if nothing leaked

    Outputs of view and in-place ops (which return memory that already existed) are not new storages
    and are ignored, as the step tracker does.
    """

    def __init__(self):
        super().__init__()
        self._refs: list[weakref.ref] = []
        self._aliasing: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = self._aliasing.get(func)
        if aliases is None:
            aliases = self._aliasing[func] = any(r.alias_info is not None for r in func._schema.returns)
        if not aliases:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta:
                    self._refs.append(weakref.ref(t.untyped_storage()))
        return out

    def alive(self, exclude: Iterable[torch.Tensor] = (), device=None) -> list[torch.UntypedStorage]:
        """Storages created inside the watch that are still alive, each once, minus those behind ``exclude``
        (and, with ``device``, only those on it)."""
        skip = {t.untyped_storage()._cdata for t in exclude}
        dev = None if device is None else torch.device(device)
        seen: dict[int, torch.UntypedStorage] = {}
        for ref in self._refs:
            st = ref()
            if st is None or st._cdata in skip:
                continue
            if dev is not None and (
                st.device.type != dev.type or (dev.index is not None and st.device.index != dev.index)
            ):
                continue
            seen.setdefault(st._cdata, st)
        return list(seen.values())

    def alive_bytes(self, exclude: Iterable[torch.Tensor] = (), device=None) -> int:
        """Bytes of :meth:`alive`."""
        return sum(st.nbytes() for st in self.alive(exclude, device))


@dataclass
class BudgetRun:
    """Tracked training steps under a budget of live tensor bytes (``track_steps(..., budget_bytes=)``)."""

    budget: int
    steps: int  # steps asked for
    completed: list[int]  # steps that finished
    trace: Trace  # what was recorded (up to the failure)
    failed_step: int | None = None
    phase: str | None = None
    module: str | None = None
    requested: int | None = None  # bytes of the allocation that went over
    breakdown: dict[str, int] | None = None  # live bytes per category at that moment
    message: str | None = None

    @property
    def passed(self) -> bool:
        return self.failed_step is None

    def step_peaks(self) -> dict[int, int]:
        """Peak tracked bytes of every step that started (the failed one up to its failure)."""
        return {s: self.trace.peak(step=s).bytes for s in self.trace.training_steps()}

    def summary(self) -> str:
        peaks = self.step_peaks()
        parts = []
        for s in range(1, self.steps + 1):
            if s in self.completed:
                parts.append(f"step {s} ok (peak {peaks[s] / MiB:.2f} MiB)")
            elif s == self.failed_step:
                parts.append(f"step {s} FAILED in {self.phase}, {self.module}")
                break
        return f"budget {self.budget / MiB:.2f} MiB: " + "; ".join(parts)


def run_under_budget(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    budget_bytes: int,
    steps: int = 3,
    batch_size: int = 8,
    seed: int = 0,
) -> BudgetRun:
    """Train ``steps`` tracked steps under ``budget_bytes`` of live tensor memory and report what happened.

    A :class:`~anatomy_helpers.tracker.MemoryBudgetExceeded` is caught and turned into plain fields; the
    exception itself is not kept (its traceback holds the failed step's tensors). After a failure, the
    half-made gradients are dropped with ``zero_grad`` and the garbage collector runs, as a training loop
    that survives an out-of-memory error must.
    """
    try:
        trace = track_steps(model, optimizer, steps=steps, batch_size=batch_size, seed=seed, budget_bytes=budget_bytes)
    except MemoryBudgetExceeded as err:
        run = BudgetRun(
            budget_bytes,
            steps,
            list(range(1, err.step)),
            err.trace,
            err.step,
            err.phase,
            err.module,
            err.requested,
            dict(err.breakdown),
            str(err),
        )
    else:
        return BudgetRun(budget_bytes, steps, list(range(1, steps + 1)), trace)
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    return run


def try_budget(
    budget_bytes: int,
    batch_size: int = 8,
    optimizer: str = "adamw",
    checkpoint: str = "none",
    steps: int = 3,
    device=None,
    **model_config,
) -> BudgetRun:
    """:func:`run_under_budget` on a fresh model (``checkpoint`` and ``model_config`` go to make_model)."""
    model = make_model(device=device, checkpoint=checkpoint, **model_config)
    return run_under_budget(model, make_optimizer(model, optimizer), budget_bytes, steps=steps, batch_size=batch_size)


def plot_budget_run(trace: Trace, budget: int, *, failed: bool | None = None, title: str | None = None):
    """The timeline of ``trace`` with the budget drawn across it; if the run ``failed`` (by default: if its
    last sample is over the budget), the allocation that went over is marked. Returns the Figure."""
    tl = trace.timeline
    fig = plot_timeline(trace, title=title, annotate_peak=False)
    ax = fig.axes[0]
    unit, scale = pick_unit(tl.total.max())
    top = max(ax.get_ylim()[1], budget / scale * 1.15)
    ax.set_ylim(0, top)
    ax.axhline(budget / scale, color="#B00020", linewidth=1.2)
    x0, x1 = ax.get_xlim()
    ax.text(
        x0 + 0.3 * (x1 - x0),
        budget / scale,
        f"budget {budget / scale:.1f} {unit}",
        color="#B00020",
        va="bottom",
        fontsize=8,
    )
    if failed is None:
        failed = bool(len(tl)) and int(tl.total[-1]) > budget
    if failed:
        i = len(tl) - 1
        ax.plot([i], [tl.total[i] / scale], marker="X", color="#B00020", markersize=9)
        ax.annotate(
            f"out of budget: step {int(tl.step[i])}, {PHASES[int(tl.phase[i])]},\n"
            f"{tl.module_names[int(tl.module[i])]} asks for {int(trace.meta['alloc_deltas'][i]) / scale:.2f} {unit}",
            (i, tl.total[i] / scale),
            xytext=(-12, -34),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            bbox={"boxstyle": "round", "fc": "white", "ec": "#B00020"},
        )
    return fig


# ---- on a GPU: the real caching allocator --------------------------------------------------------


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
    """One untracked training step on a throwaway model, then free it: creates the cuBLAS handle and its
    workspace (allocated through the caching allocator and kept for the life of the process), so later
    measurements start warm. The workspace stays reserved; everything else is released."""
    dev = _cuda_device(device)
    model = make_model(device=dev, **model_config)
    opt = make_optimizer(model, "adamw")
    x, y = get_batch(batch_size, model.cfg.seq_len, device=dev)
    train_step(model, opt, x, y)
    del model, opt, x, y
    cuda_release(dev)


def _stats(dev) -> dict[str, int]:
    s = torch.cuda.memory_stats(dev)
    return {
        "allocated": s.get("allocated_bytes.all.current", 0),
        "reserved": s.get("reserved_bytes.all.current", 0),
        "max_allocated": s.get("allocated_bytes.all.peak", 0),
        "max_reserved": s.get("reserved_bytes.all.peak", 0),
        "max_requested": s.get("requested_bytes.all.peak", s.get("allocated_bytes.all.peak", 0)),
        "segments_created": s.get("segment.all.allocated", 0),  # cudaMallocs so far (a running count)
        "alloc_retries": s.get("num_alloc_retries", 0),  # times the cache was emptied to retry
    }


@dataclass
class CudaRun:
    """Training steps of a fresh model on a GPU, optionally under a memory limit (bytes)."""

    limit: int | None  # the limit on reserved bytes the fraction allowed (None: no limit)
    fraction: float | None
    steps: int
    completed: list[int]
    step_stats: list[dict[str, int]]  # per completed step: peaks since the step began, counters at its end
    failed_step: int | None = None
    phase: str | None = None
    module: str | None = None  # the module of the last allocation the tracker saw before the failure
    message: str | None = None  # the OutOfMemoryError's text
    at_failure: dict[str, int] = field(default_factory=dict)  # allocator counters right after the failure
    before: dict[str, int] = field(default_factory=dict)  # counters before the model was built
    after: dict[str, int] = field(default_factory=dict)  # counters after everything was released
    trace: Trace | None = None

    @property
    def passed(self) -> bool:
        return self.failed_step is None

    def summary(self) -> str:
        lim = "no limit" if self.limit is None else f"limit {self.limit / MiB:.1f} MiB (fraction {self.fraction:.3g})"
        parts = [f"step {r['step']} ok (peak reserved {r['max_reserved'] / MiB:.1f} MiB)" for r in self.step_stats]
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
    run = CudaRun(limit, fraction, steps, [], [], before=_stats(dev))
    model = make_model(device=dev, **model_config)
    opt = make_optimizer(model, optimizer)
    tracker = StepTracker(model, opt)
    x = y = None
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, dev)
    try:
        with tracker:
            for i in range(steps):
                torch.cuda.reset_peak_memory_stats(dev)
                x, y = get_batch(batch_size, model.cfg.seq_len, step=i, seed=seed, device=dev)
                train_step(model, opt, x, y)
                x = y = None
                torch.cuda.synchronize(dev)
                run.completed.append(i + 1)
                run.step_stats.append({"step": i + 1, **_stats(dev)})
    except torch.cuda.OutOfMemoryError as err:
        run.message = str(err)
        run.at_failure = _stats(dev)
    finally:
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
    x = y = None
    run.trace = tracker.trace
    if run.message is not None:
        _, _, step, phase = run.trace.phase_marks[-1]
        run.failed_step, run.phase = int(step), PHASES[phase]
        tl = run.trace.timeline
        run.module = tl.module_names[int(tl.module[-1])] if len(tl) else "-"
    del model, opt, tracker
    cuda_release(dev)
    run.after = _stats(dev)
    return run


def cuda_step_stats(steps: int = 4, batch_size: int = 8, optimizer: str = "adamw", device=None, **model_config):
    """Per step of a fresh model on the GPU (no limit): ``max_memory_allocated`` / ``max_memory_reserved``
    since the step began (``reset_peak_memory_stats`` before each), the counters at its end and the
    cudaMallocs it made. Absolute bytes, as the allocator reports them. Returns a list of dicts."""
    run = cuda_run_under_limit(
        None, steps=steps, batch_size=batch_size, optimizer=optimizer, device=device, **model_config
    )
    rows, prev = [], run.before["segments_created"]
    for r in run.step_stats:
        rows.append({**r, "new_segments": r["segments_created"] - prev})
        prev = r["segments_created"]
    return rows


def format_cuda_step_stats(rows: list[dict]) -> str:
    """The rows of :func:`cuda_step_stats` as a table in MiB."""
    head = (
        f"{'step':>4} {'max allocated':>14} {'max reserved':>13} {'allocated end':>14} "
        f"{'reserved end':>13} {'cudaMallocs':>12}"
    )
    lines = [head + "   (MiB)", "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['step']:>4} {r['max_allocated'] / MiB:14.2f} {r['max_reserved'] / MiB:13.2f} "
            f"{r['allocated'] / MiB:14.2f} {r['reserved'] / MiB:13.2f} {r['new_segments']:>12}"
        )
    return "\n".join(lines)


@dataclass
class LimitChoice:
    """A limit on reserved bytes that step 1 fits under and step 2 cannot (bytes, absolute)."""

    limit: int | None  # None when no such limit was found
    low: int  # step 1 passes at this limit or above
    high: int  # step 2 cannot pass below this (its peak of requested bytes)
    how: str
    dry_run: list[dict]


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
    r1, q1, q2 = dry[0]["max_reserved"], dry[0]["max_requested"], dry[1]["max_requested"]
    if r1 < q2:
        return LimitChoice(
            (r1 + q2) // 2, r1, q2, "midway between step 1's peak reserved and step 2's peak requested", dry
        )
    low = -(-q1 // SEGMENT_GRANULARITY) * SEGMENT_GRANULARITY
    while low < r1 and not cuda_run_under_limit(low, steps=1, **kw).passed:
        low += SEGMENT_GRANULARITY
    low = min(low, r1)
    if low < q2:
        return LimitChoice(
            (low + q2) // 2, low, q2, "midway between step 1's smallest passing cap and step 2's peak requested", dry
        )
    return LimitChoice(None, low, q2, "none: step 1 needs as much reserved memory as step 2 requests", dry)


def cuda_vs_simulated(trace: Trace) -> list[dict[str, int]]:
    """For a trace recorded on CUDA: at the end of each step, the real allocator's counters and the
    simulator's (replaying the trace's allocation record), both as growth since tracking began (bytes).

    Keys: ``step``, ``real_reserved``, ``sim_reserved``, ``real_allocated``, ``sim_allocated``.
    """
    tl = trace.timeline
    if tl.cuda_reserved is None:
        raise ValueError("this trace was not recorded on CUDA: it has no allocator counters")
    result = replay(trace.allocation_record())
    on = np.flatnonzero(result["sample"] >= 0)
    start = on[0] - 1  # the last baseline row: the parameters (and any state) before tracking
    sim_res0 = int(result["reserved"][start]) if start >= 0 else 0
    sim_alloc0 = int(result["allocated"][start]) if start >= 0 else 0
    entry_alloc, entry_res = (int(v) for v in trace.meta["cuda_at_entry"][:2])
    rows = []
    for s in trace.training_steps():
        last = int(np.flatnonzero(tl.step == s)[-1])
        row = on[last]
        rows.append(
            {
                "step": s,
                "real_reserved": int(tl.cuda_reserved[last]) - entry_res,
                "sim_reserved": int(result["reserved"][row]) - sim_res0,
                "real_allocated": int(tl.cuda_allocated[last]) - entry_alloc,
                "sim_allocated": int(result["allocated"][row]) - sim_alloc0,
            }
        )
    return rows


def cuda_reserved_check(
    steps: int = 4, batch_size: int = 8, optimizer: str = "adamw", device=None, **model_config
) -> list[dict]:
    """The simulator against the real caching allocator on a warm GPU, at the end of each step (bytes).

    First a warm-up step on a throwaway model: the first matmul creates the cuBLAS handle and its workspace,
    allocated through the caching allocator and kept for good, which the tracker cannot see (it is no
    tensor) and the simulator therefore cannot replay. Then ``gc`` + ``empty_cache`` and ``memory_reserved()``
    is read: what the process holds before the model exists (the workspace, anything else alive). A fresh
    model is built (its parameters are the replay's first rows) and ``steps`` steps are tracked. Per step:
    ``real_reserved`` (``memory_reserved()`` at the step's last event minus that baseline),
    ``sim_reserved`` (the simulator after the same event) and ``relative_difference`` ((sim - real) / real).
    """
    dev = _cuda_device(device)
    cuda_warm_up(dev, **model_config)
    cuda_release(dev)
    reserved0 = torch.cuda.memory_reserved(dev)
    model = make_model(device=dev, **model_config)
    opt = make_optimizer(model, optimizer)
    trace = track_steps(model, opt, steps=steps, batch_size=batch_size)
    result = replay(trace.allocation_record())
    on = np.flatnonzero(result["sample"] >= 0)
    rows = []
    for s in trace.training_steps():
        last = int(np.flatnonzero(trace.timeline.step == s)[-1])
        real = int(trace.timeline.cuda_reserved[last]) - reserved0
        sim = int(result["reserved"][on[last]])
        rows.append({"step": s, "real_reserved": real, "sim_reserved": sim, "relative_difference": (sim - real) / real})
    del model, opt, trace
    cuda_release(dev)
    return rows


def format_cuda_vs_simulated(rows: list[dict[str, int]]) -> str:
    """The rows of :func:`cuda_vs_simulated` as a table in MiB."""
    head = (
        f"{'step end':>8} {'real reserved':>14} {'simulated':>10} {'difference':>11} "
        f"{'real allocated':>15} {'simulated':>10}"
    )
    lines = [head + "   (MiB, growth since tracking began)", "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['step']:>8} {r['real_reserved'] / MiB:14.2f} {r['sim_reserved'] / MiB:10.2f} "
            f"{(r['real_reserved'] - r['sim_reserved']) / MiB:11.2f} {r['real_allocated'] / MiB:15.2f} "
            f"{r['sim_allocated'] / MiB:10.2f}"
        )
    return "\n".join(lines)


def record_cuda_snapshot(fn: Callable[[], object], pickle_path: str | Path, max_entries: int = 200_000) -> dict:
    """Run ``fn()`` with ``torch.cuda.memory._record_memory_history`` on, dump the snapshot to
    ``pickle_path`` (``_dump_snapshot``), switch recording off again whatever happens, and return the
    snapshot read back from the file (as the offline tools would). Python stacks only, which keeps the
    dump fast."""
    torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=max_entries)
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(pickle_path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with open(pickle_path, "rb") as f:
        return pickle.load(f)


# ---- slider panels ----------------------------------------------------------------------------------


def allocator_panel(batch_size: int = 8, steps: int = 3, device=None, **model_config):
    """Track ``steps`` steps of a fresh default model with AdamW, replay them through the allocator
    simulator, print the tracked and simulated peaks, and plot reserved vs allocated. Returns the Figure."""
    model = make_model(device=device, **model_config)
    trace = track_steps(model, make_optimizer(model, "adamw"), steps=steps, batch_size=batch_size)
    result = replay(trace.allocation_record())
    rows = summarize_replay(result)
    tracked = trace.peak().bytes
    peak_res = max(r["peak_reserved"] for r in rows)
    peak_alloc = max(r["peak_allocated"] for r in rows)
    print(
        f"batch {batch_size}: tracked peak {tracked / MiB:.2f} MiB, "
        f"simulated allocated peak {peak_alloc / MiB:.2f} MiB, "
        f"reserved peak {peak_res / MiB:.0f} MiB ({peak_res / tracked:.2f}x the tracked peak)"
    )
    print("segments created per step: " + ", ".join(f"{r['step']}: {r['segments_created']}" for r in rows if r["step"]))
    return plot_allocator(result, trace, title=f"batch {batch_size}: simulated reserved vs allocated")


def budget_panel(
    budget_mib: int = 100,
    batch_size: int = 8,
    optimizer: str = "adamw",
    checkpoint: str = "none",
    steps: int = 3,
    device=None,
    **model_config,
):
    """Train a fresh model for ``steps`` tracked steps under ``budget_mib`` MiB of live tensor memory;
    print which steps passed and where it failed; plot the timeline with the budget. Returns the Figure."""
    run = try_budget(budget_mib * MiB, batch_size, optimizer, checkpoint, steps, device, **model_config)
    print(run.summary())
    title = f"{optimizer}, batch {batch_size}, checkpoint {checkpoint}: " + (
        "every step fits" if run.passed else f"out of budget in step {run.failed_step}"
    )
    return plot_budget_run(run.trace, run.budget, title=title)
