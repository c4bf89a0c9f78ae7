"""Memory snapshots in the format of ``torch.cuda.memory._snapshot()``: recorded on a GPU, or replayed on CPU.

PyTorch's own viewers read both: ``torch.cuda._memory_viz`` (``segsum``, ``trace``, ``trace_plot``) and
pytorch.org/memory_viz. A replayed snapshot comes from the course's allocator simulator
(:mod:`anatomy_helpers.prediction.allocator`), so a learner without a GPU can open the same views; it is labelled as
simulated in every frame.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from ..tracking.events import CATEGORIES, PHASES, AllocationRecord
from ..tracking.trace import Trace
from .allocator import ROUND_LARGE, CachingAllocatorSim, allocator_at, replay_rows

#: The file name of every frame of a simulated snapshot: no torch code made it.
SIMULATED = "anatomy_helpers/simulated"

#: The real CUDA snapshot the course ships (3 steps of the default model, recorded by
#: ``scripts/record_gpu_reference.py``; what was recorded is in the JSON file beside it): package data, so that
#: Colab's install has it too. Lesson 07 shows it; lesson 12 explains it.
GPU_REFERENCE = Path(__file__).resolve().parent.parent / "lessons" / "gpu_reference" / "first_steps.pickle"


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
        return [] if label is None else [{"filename": SIMULATED, "line": 0, "name": label}]

    def _new_segment(self, pool: str, size: int):
        block = super()._new_segment(pool, size)
        addr = self.address[block.segment.id] = self._next_address
        self._next_address += size + ROUND_LARGE  # a gap, so segments never touch
        self.events.append({"action": "segment_alloc", "addr": addr, "size": size, "stream": 0, "frames": []})
        return block

    def malloc(self, key: int, nbytes: int) -> None:
        super().malloc(key, nbytes)
        b = self._live[key]
        self.requested[key] = nbytes
        addr = self.address[b.segment.id] + b.offset
        # torch's trace records what was asked for (record_trace(ALLOC, ptr, orig_size) in CUDACachingAllocator.cpp)
        self.events.append({"action": "alloc", "addr": addr, "size": nbytes, "stream": 0, "frames": self._frames(key)})

    def free(self, key: int) -> None:
        b = self._live[key]
        addr, size = self.address[b.segment.id] + b.offset, self.requested[key]
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
    record: AllocationRecord,
    row: int | None = None,
    trace: Trace | None = None,
    with_trace: bool = True,
    phases: bool = False,
) -> dict:
    """Replay ``record`` (through ``row``; all of it by default) and return the simulated allocator's state
    and history in the format of ``torch.cuda.memory._snapshot()``.

    PyTorch's snapshot tools then work on it without a GPU: ``torch.cuda._memory_viz.segsum(snap)`` (text
    summary of the segments), ``_memory_viz.trace(snap)`` (the events as pseudo-code) and
    ``_memory_viz.trace_plot(snap)`` (the HTML viewer of pytorch.org/memory_viz). With ``trace``, each
    block's single "frame" names the module that allocated it and its category.

    ``phases``: as a recording started after the model was built would be: the rows alive when tracking began
    (the baseline) are blocks alive before the recording (no event), and every event's stack gets a second, outer
    frame naming the row's step and phase ("step 2 backward"), which ``explain`` reads (prediction/explain.py).
    """
    labels = None
    if trace is not None:
        names = trace.timeline.module_names
        labels = {
            aid: f"{names[trace.alloc_module[aid]]} ({CATEGORIES[trace.alloc_category[aid]]})"
            for aid in range(len(trace.alloc_category))
        }
    sim = _RecordingSim(labels)
    last = len(record) - 1 if row is None else row
    if not phases:
        allocator_at(record, last, sim)
        return sim.snapshot(with_trace)
    done = [0]

    def mark(i: int) -> None:  # the events row i made: before the recording (baseline), or in its step and phase
        new = sim.events[done[0] :]
        if record.sample[i] < 0:
            del sim.events[done[0] :]
            return
        where = {"filename": SIMULATED, "line": 0, "name": f"step {record.step[i]} {PHASES[record.phase[i]]}"}
        for e in new:
            e["frames"] = [*e["frames"], where]
            e["time_us"] = float(record.time_s[i]) * 1e6
        done[0] = len(sim.events)

    replay_rows(sim, record, last + 1, on_row=mark)
    return sim.snapshot(with_trace)


def write_memory_viz(snapshot: dict, html_path: str | Path, pickle_path: str | Path | None = None) -> Path:
    """Write ``torch.cuda._memory_viz.trace_plot(snapshot)`` (an HTML page that draws the memory timeline;
    it loads PyTorch's viewer script from a CDN when opened) and, optionally, the snapshot pickle that
    pytorch.org/memory_viz opens. Works for real and simulated snapshots. Returns the HTML path."""
    from torch.cuda import _memory_viz  # loaded when a snapshot is drawn

    html_path = Path(html_path)
    html_path.write_text(_memory_viz.trace_plot(snapshot))
    if pickle_path is not None:
        with open(pickle_path, "wb") as f:
            pickle.dump(snapshot, f)
    return html_path


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
