"""A small simulator of PyTorch's CUDA caching allocator, to replay a recorded trace on CPU.

On a GPU, ``torch.cuda.memory_reserved()`` is usually larger than
``torch.cuda.memory_allocated()``: the caching allocator asks CUDA for big
*segments* (each one a cudaMalloc) and cuts them into *blocks* for tensors. A
freed block goes back to the cache, not to CUDA, so the next tensor can reuse
it without a slow cudaMalloc. This module replays the allocations and frees a
:class:`~anatomy_helpers.tracking.tracker.Trace` recorded (on any device) through the
same rules, so a learner on CPU can watch reserved vs allocated memory and the
gap between them (``reserved - allocated``: cached but unused, i.e. fragmentation).

The rules modelled (from c10/cuda/CUDACachingAllocator.cpp). All sizes are bytes.

* every request is rounded up to a multiple of 512 B (a 0 B request rounds to 512);
* two pools: requests <= 1 MiB (after rounding) use the *small* pool, bigger ones
  the *large* pool. A block never moves between pools;
* lookup is best fit: the smallest cached free block of the pool that is big
  enough (ties go to the lowest segment id, then the lowest offset);
* when nothing fits, a new segment is cudaMalloc'ed: 2 MiB for a small request,
  20 MiB for a large request under 10 MiB, else the request rounded up to 2 MiB;
* a block bigger than the request is split if the remainder is >= 512 B (small
  pool) or > 1 MiB (large pool); otherwise the whole block is handed out, and
  counts in ``allocated`` at its full size (as ``memory_allocated()`` does);
* a freed block merges with free neighbours in its segment. Entirely free segments
  are given back to CUDA by :meth:`CachingAllocatorSim.empty_cache`, and also when a
  cudaMalloc fails or would go over a memory-fraction cap: the allocator then frees
  its cached segments and retries (:class:`LimitedAllocatorSim` models the cap).

What it leaves out: streams and events (one stream, blocks are reusable at once),
expandable segments, ``max_split_size_mb`` (unlimited by default, so oversize
blocks never exist), ``roundup_power2_divisions``, the garbage collection
threshold, CUDA graph pools, and running out of device memory (cudaMalloc never
fails here for lack of memory; only :class:`LimitedAllocatorSim`'s cap stops it).

Replaying a CPU trace tells you what the allocator would do with *those*
tensors; on a GPU some kernels allocate different workspaces (cuBLAS, cuDNN) and
the baseline storages were allocated in some other order, so expect the same
shape of curve, not the same bytes.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

import numpy as np

from ..core.checks import int_in, whole_bytes
from ..core.units import MiB, round_up
from ..tracking.events import PHASES, AllocationRecord

MIN_BLOCK = 512  # every block size is a multiple of this
SMALL_REQUEST = 1 * MiB  # largest request served by the small pool
SMALL_SEGMENT = 2 * MiB  # small requests are packed into segments of this size
LARGE_SEGMENT = 20 * MiB  # requests between 1 and 10 MiB share segments of this size
MIN_LARGE_ALLOC = 10 * MiB  # from this size on, a request gets a segment of its own
ROUND_LARGE = 2 * MiB  # ... rounded up to a multiple of this


def round_size(nbytes: int) -> int:
    """The block size (bytes) the allocator hands out for a request of ``nbytes`` bytes.

    Rounded up to a multiple of 512 so blocks stay aligned; 0 becomes 512 too.
    """
    if nbytes < 0:
        raise ValueError(f"a request must be >= 0 bytes, got {nbytes}")
    return max(MIN_BLOCK, round_up(nbytes, MIN_BLOCK))


def segment_size_for(rounded: int) -> int:
    """Bytes the allocator cudaMallocs when no cached block fits a ``rounded``-byte request."""
    if rounded <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT  # a 20 MiB segment, to be split among several 1-10 MiB tensors
    return round_up(rounded, ROUND_LARGE)


@dataclass(eq=False)
class _Segment:
    id: int
    pool: str  # "small" or "large"
    size: int
    blocks: list[_Block] = field(default_factory=list)  # contiguous, in address order


class _Keyed:
    key: int | None

    @property
    def free(self) -> bool:
        """True while no allocation holds the block (it is cached, free)."""
        return self.key is None


@dataclass(eq=False)
class _Block(_Keyed):
    segment: _Segment
    offset: int  # bytes from the start of the segment
    size: int
    key: int | None = None  # the allocation holding it; None while it is free (cached)


@dataclass(frozen=True)
class BlockState(_Keyed):
    """A block of a segment (bytes): ``key`` is the allocation holding it, None while it is cached, free."""

    offset: int
    size: int
    key: int | None


@dataclass(frozen=True)
class SegmentState:
    """A segment (one cudaMalloc) of ``size`` bytes in the ``pool`` ("small" or "large"), and its blocks."""

    id: int
    pool: str
    size: int
    blocks: tuple[BlockState, ...]


class CachingAllocatorSim:
    """One device, one stream of PyTorch's CUDA caching allocator, in plain Python.

    Usage::

        sim = CachingAllocatorSim()
        sim.malloc(0, 3 * 2**20)  # allocation id 0 asks for 3 MiB: a 20 MiB segment is created
        sim.free(0)  # the block is cached: allocated drops, reserved stays
        sim.allocated, sim.reserved  # (0, 20971520)

    Counters, all in bytes except the counts: ``allocated`` (sum of the live blocks'
    sizes, like ``torch.cuda.memory_allocated()``), ``reserved`` (sum of the segment
    sizes, like ``memory_reserved()``), ``peak_allocated`` / ``peak_reserved`` (since
    the last :meth:`reset_peak`), ``num_segments`` (segments held now) and
    ``segments_created`` (cudaMalloc calls so far).
    """

    def __init__(self) -> None:
        self._segments: list[_Segment] = []
        self._live: dict[int, _Block] = {}  # allocation id -> its block
        # Each pool's free blocks sorted by (size, segment id, offset), as torch's BlockPool orders them, so a
        # best-fit lookup is a bisection (a scan of every block made long replays quadratic in their events).
        self._free: dict[str, list[tuple[int, int, int]]] = {"small": [], "large": []}
        self._free_blocks: dict[tuple[int, int, int], _Block] = {}
        self._next_segment_id = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments_created = 0

    @property
    def num_segments(self) -> int:
        """Segments currently held (each one a cudaMalloc not yet given back)."""
        return len(self._segments)

    def malloc(self, key: int, nbytes: int) -> None:
        """Allocate ``nbytes`` bytes for the allocation id ``key`` (chosen by the caller)."""
        if key in self._live:
            raise ValueError(f"allocation {key} is already live: free it first")
        if type(nbytes) is not int or nbytes < 0:  # the replay's plain ints skip the full check
            nbytes = whole_bytes("nbytes", nbytes, allow_zero=True)
        size = round_size(nbytes)
        pool = "small" if size <= SMALL_REQUEST else "large"
        block = self._best_fit(pool, size)
        if block is None:
            block = self._new_segment(pool, segment_size_for(size))
        else:
            self._unindex(block)
        remaining = block.size - size
        # In the large pool a remainder of 1 MiB or less stays attached to the block:
        # as a block of its own it could only serve small requests, which never come
        # to the large pool. (In the small pool any remainder is >= 512 B.)
        worth_splitting = (remaining >= MIN_BLOCK) if pool == "small" else (remaining > SMALL_REQUEST)
        if worth_splitting:
            self._split(block, size)
        block.key = key
        self._live[key] = block
        self.allocated += block.size  # the whole block, even if it was not split
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        """Free allocation ``key``: its block goes back to the cache (reserved does not change)."""
        block = self._live.pop(key, None)
        if block is None:
            raise KeyError(f"allocation {key} is not live")
        self.allocated -= block.size
        block.key = None
        self._merge_with_neighbours(block)  # leaves the merged free block indexed

    def empty_cache(self) -> None:
        """Give every entirely free segment back to CUDA, like ``torch.cuda.empty_cache()``.

        A segment with even one live block stays whole: segments are never shrunk.
        """
        keep = []
        for seg in self._segments:
            if len(seg.blocks) == 1 and seg.blocks[0].free:
                self.reserved -= seg.size
                self._unindex(seg.blocks[0])
            else:
                keep.append(seg)
        self._segments = keep

    def reset_peak(self) -> None:
        """Start the peaks again from the current values, like ``torch.cuda.reset_peak_memory_stats()``."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    def segments(self) -> list[SegmentState]:
        """Every segment as it is now, for looking at: id, pool, size (bytes), blocks in address order."""
        return [
            SegmentState(seg.id, seg.pool, seg.size, tuple(BlockState(b.offset, b.size, b.key) for b in seg.blocks))
            for seg in self._segments
        ]

    # ---- internals ------------------------------------------------------------------
    def _best_fit(self, pool: str, size: int) -> _Block | None:
        # torch keeps each pool's free blocks in a set sorted by (size, address) and takes the first one >= size:
        # the smallest that fits, ties to the lowest segment id, then the lowest offset.
        free = self._free[pool]
        i = bisect_left(free, (size, -1, -1))
        return self._free_blocks[free[i]] if i < len(free) else None

    def _index(self, block: _Block) -> None:
        """Enter a free block in its pool's sorted list (call after its size or offset last changed)."""
        where = (block.size, block.segment.id, block.offset)
        insort(self._free[block.segment.pool], where)
        self._free_blocks[where] = block

    def _unindex(self, block: _Block) -> None:
        """Take a free block out of its pool's sorted list (before it is handed out, resized or dropped)."""
        where = (block.size, block.segment.id, block.offset)
        free = self._free[block.segment.pool]
        del free[bisect_left(free, where)]
        del self._free_blocks[where]

    def _new_segment(self, pool: str, size: int) -> _Block:
        seg = _Segment(self._next_segment_id, pool, size)
        self._next_segment_id += 1
        block = _Block(seg, 0, size)
        seg.blocks.append(block)
        self._segments.append(seg)
        self.segments_created += 1
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _split(self, block: _Block, size: int) -> None:
        """Cut ``block`` down to ``size`` bytes; the rest becomes a free block right after it."""
        rest = _Block(block.segment, block.offset + size, block.size - size)
        blocks = block.segment.blocks
        blocks.insert(blocks.index(block) + 1, rest)
        block.size = size
        self._index(rest)

    def _merge_with_neighbours(self, block: _Block) -> None:
        # Merging keeps free memory in as few, as large blocks as possible, so a later
        # big request can still fit in a segment that held many small tensors.
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:
            nxt = blocks.pop(i + 1)
            self._unindex(nxt)
            block.size += nxt.size
        if i > 0 and blocks[i - 1].free:
            prev = blocks[i - 1]
            self._unindex(prev)
            prev.size += blocks.pop(i).size
            block = prev
        self._index(block)


@dataclass
class Replay:
    """One value per row of the replayed record, after that row (numpy arrays; bytes and counts).

    ``allocated`` / ``reserved``: the simulated ``memory_allocated()`` / ``memory_reserved()``;
    ``segments``: held now; ``segments_created``: cudaMallocs so far. ``sample``, ``step`` and ``phase``
    are copied from the record. Fragmentation (cached but unused) is ``reserved - allocated``.
    """

    allocated: np.ndarray
    reserved: np.ndarray
    segments: np.ndarray
    segments_created: np.ndarray
    sample: np.ndarray
    step: np.ndarray
    phase: np.ndarray


@dataclass(frozen=True)
class StepReplay:
    """One step of a :class:`Replay` (bytes): step 0 holds the storages alive when tracking began."""

    step: int
    segments_created: int  # cudaMallocs during the step
    reserved_end: int  # reserved after the step's last event
    peak_allocated: int
    peak_reserved: int
    gap_at_peak: int  # reserved - allocated at the step's allocated peak: cached, unused


def replay_rows(sim: CachingAllocatorSim, record: AllocationRecord, rows: int | None = None, on_row=None):
    """Apply the first ``rows`` rows of ``record`` (all by default) to ``sim``; returns ``sim``.

    A row's ``bytes`` are positive for an allocation and negative for a free; a positive row for a live
    allocation (a storage resized in place) is replayed as a free and a malloc of the new size. 0-byte
    storages are skipped: torch never passes them to the caching allocator. ``on_row(i)`` is called after
    row ``i`` is applied.
    """
    if not isinstance(record, AllocationRecord):
        raise ValueError(f"record must be an AllocationRecord (Trace.allocation_record()), got {type(record).__name__}")
    live: dict[int, int] = {}  # allocation id -> its current size in bytes, as the record says
    n = len(record) if rows is None else rows
    for i, (key, delta) in enumerate(zip(record.alloc_id[:n].tolist(), record.bytes[:n].tolist())):
        old = live.get(key, 0)
        new = old + delta  # a free names the whole size, so it brings the allocation to 0
        if new < 0:
            raise ValueError(f"row {i}: allocation {key} frees {-delta} bytes but holds {old}")
        if new != old:
            if old:
                sim.free(key)
                del live[key]
            if new:
                sim.malloc(key, new)
                live[key] = new
        if on_row is not None:
            on_row(i)
    return sim


def replay(record: AllocationRecord) -> Replay:
    """Run a trace's allocations and frees (``Trace.allocation_record()``) through a fresh
    :class:`CachingAllocatorSim`; the counters after every row."""
    sim = CachingAllocatorSim()
    n = len(record)
    cols = {name: np.zeros(n, dtype=np.int64) for name in ("allocated", "reserved", "segments", "segments_created")}

    def on_row(i: int) -> None:
        cols["allocated"][i] = sim.allocated
        cols["reserved"][i] = sim.reserved
        cols["segments"][i] = sim.num_segments
        cols["segments_created"][i] = sim.segments_created

    replay_rows(sim, record, on_row=on_row)
    return Replay(**cols, sample=record.sample.copy(), step=record.step.copy(), phase=record.phase.copy())


def summarize_replay(result: Replay) -> list[StepReplay]:
    """One :class:`StepReplay` per step of a :func:`replay` result, in order."""
    step, created = result.step, result.segments_created
    rows = []
    for s in dict.fromkeys(step.tolist()):  # steps in order of appearance
        idx = np.flatnonzero(step == s)
        first, last = int(idx[0]), int(idx[-1])
        before = int(created[first - 1]) if first > 0 else 0
        at = idx[int(np.argmax(result.allocated[idx]))]
        rows.append(
            StepReplay(
                step=int(s),
                segments_created=int(created[last]) - before,
                reserved_end=int(result.reserved[last]),
                peak_allocated=int(result.allocated[idx].max()),
                peak_reserved=int(result.reserved[idx].max()),
                gap_at_peak=int(result.reserved[at] - result.allocated[at]),
            )
        )
    return rows


# ---- a cap on reserved memory, as set_per_process_memory_fraction sets ------------------------------------


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
        # Worded like torch's own message, which names the segment it tried to cudaMalloc (e.g. 20 MiB for
        # a 1-10 MiB tensor), not the tensor's size.
        super().__init__(
            f"(simulated) CUDA out of memory. Tried to allocate {segment / MiB:.2f} MiB (a new segment for a "
            f"{requested / MiB:.2f} MiB tensor). The process is limited to {limit / MiB:.2f} MiB. Of the allocated "
            f"memory {allocated / MiB:.2f} MiB is allocated by PyTorch, and {(reserved - allocated) / MiB:.2f} MiB "
            "is reserved by PyTorch but unallocated."
        )


class LimitedAllocatorSim(CachingAllocatorSim):
    """The caching allocator with a cap on reserved bytes, as ``set_per_process_memory_fraction`` sets.

    When a new segment would take ``reserved`` over ``limit``, the allocator first gives every entirely
    free segment back (``empty_cache``, what c10 calls ``release_cached_blocks``) and tries again; if it
    still does not fit, it raises :class:`SimulatedOutOfMemory`. ``cache_flushes`` counts the retries.
    """

    def __init__(self, limit: int):
        super().__init__()
        self.limit = whole_bytes("limit", limit)
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
    segment: int | None = None  # the segment it tried to cudaMalloc for the request that did not fit


def replay_with_limit(record: AllocationRecord, limit: int, through_step: int | None = None) -> LimitReplay:
    """Replay ``record`` through a :class:`LimitedAllocatorSim` capped at ``limit`` reserved bytes.

    With ``through_step``, only the rows of steps up to it (step 0 = what was alive at the start).
    """
    sim = LimitedAllocatorSim(limit)
    rows = record.rows_through(through_step)
    done = [-1]  # the last row applied
    try:
        replay_rows(sim, record, rows, on_row=lambda i: done.__setitem__(0, i))
    except SimulatedOutOfMemory as err:
        i = done[0] + 1
        step, phase = int(record.step[i]), PHASES[int(record.phase[i])]
        flushes = sim.cache_flushes
        return LimitReplay(
            limit, False, i, step, phase, err.requested, sim.allocated, sim.reserved, flushes, err.segment
        )
    return LimitReplay(limit, True, rows, None, None, None, sim.allocated, sim.reserved, sim.cache_flushes)


def min_limit_to_pass(record: AllocationRecord, through_step: int | None = None, granularity: int = ROUND_LARGE) -> int:
    """The smallest multiple of ``granularity`` bytes under which the replay of ``record`` (through
    ``through_step``) completes: the least GPU memory the simulated allocator needs, fragmentation included.

    Scans upwards from the simulated peak of allocated bytes (below it nothing can fit) to the unlimited
    run's peak of reserved bytes (which always fits), so the answer needs no assumption of monotonicity.
    """
    if not isinstance(granularity, int) or granularity < MIN_BLOCK:
        raise ValueError(f"granularity must be a whole number of bytes >= {MIN_BLOCK}, got {granularity!r}")
    part = record.head(record.rows_through(through_step))
    free_run = replay(part)
    low = int(free_run.allocated.max()) // granularity * granularity
    high = round_up(int(free_run.reserved.max()), granularity)
    for limit in range(max(low, granularity), high + granularity, granularity):
        if replay_with_limit(part, limit).passed:
            return limit
    return high  # not reached: the unlimited run's own reserved peak always fits


def allocator_at(record: AllocationRecord, row: int, sim: CachingAllocatorSim | None = None) -> CachingAllocatorSim:
    """The simulated allocator after rows ``0..row`` of ``record`` (or ``sim``, replayed into), whose
    ``segments()`` show every segment and block at that moment."""
    row = int_in("row", row, -1, len(record))
    return replay_rows(CachingAllocatorSim() if sim is None else sim, record, row + 1)
