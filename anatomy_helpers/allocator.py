"""A small simulator of PyTorch's CUDA caching allocator, to replay a recorded trace on CPU.

On a GPU, ``torch.cuda.memory_reserved()`` is usually larger than
``torch.cuda.memory_allocated()``: the caching allocator asks CUDA for big
*segments* (each one a cudaMalloc) and cuts them into *blocks* for tensors. A
freed block goes back to the cache, not to CUDA, so the next tensor can reuse
it without a slow cudaMalloc. This module replays the allocations and frees a
:class:`~anatomy_helpers.tracker.Trace` recorded (on any device) through the
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
* a freed block merges with free neighbours in its segment. Segments are only
  given back to CUDA by :meth:`CachingAllocatorSim.empty_cache`, and only the
  ones that are entirely free.

What it leaves out: streams and events (one stream, blocks are reusable at once),
expandable segments, ``max_split_size_mb`` (unlimited by default, so oversize
blocks never exist), ``roundup_power2_divisions``, the garbage collection
threshold, CUDA graph pools, and running out of memory (cudaMalloc always
succeeds here, so the free-cached-blocks-and-retry path never runs).

Replaying a CPU trace tells you what the allocator would do with *those*
tensors; on a GPU some kernels allocate different workspaces (cuBLAS, cuDNN) and
the baseline storages were allocated in some other order, so expect the same
shape of curve, not the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

KiB, MiB = 2**10, 2**20
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
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size_for(rounded: int) -> int:
    """Bytes the allocator cudaMallocs when no cached block fits a ``rounded``-byte request."""
    if rounded <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT  # a 20 MiB segment, to be split among several 1-10 MiB tensors
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Segment:
    id: int
    pool: str  # "small" or "large"
    size: int
    blocks: list[_Block] = field(default_factory=list)  # contiguous, in address order


@dataclass(eq=False)
class _Block:
    segment: _Segment
    offset: int  # bytes from the start of the segment
    size: int
    key: int | None = None  # the allocation holding it; None while it is free (cached)

    @property
    def free(self) -> bool:
        return self.key is None


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
        size = round_size(nbytes)
        pool = "small" if size <= SMALL_REQUEST else "large"
        block = self._best_fit(pool, size)
        if block is None:
            block = self._new_segment(pool, segment_size_for(size))
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
        self._merge_with_neighbours(block)

    def empty_cache(self) -> None:
        """Give every entirely free segment back to CUDA, like ``torch.cuda.empty_cache()``.

        A segment with even one live block stays whole: segments are never shrunk.
        """
        keep = []
        for seg in self._segments:
            if len(seg.blocks) == 1 and seg.blocks[0].free:
                self.reserved -= seg.size
            else:
                keep.append(seg)
        self._segments = keep

    def reset_peak(self) -> None:
        """Start the peaks again from the current values, like ``torch.cuda.reset_peak_memory_stats()``."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    def segments(self) -> list[dict]:
        """Every segment, for looking at: its id, pool, size (bytes) and its blocks in address order.

        Each block is ``{"offset", "size", "free", "key"}`` (bytes; ``key`` is the
        allocation holding it, None when it is free).
        """
        return [
            {
                "id": seg.id,
                "pool": seg.pool,
                "size": seg.size,
                "blocks": [{"offset": b.offset, "size": b.size, "free": b.free, "key": b.key} for b in seg.blocks],
            }
            for seg in self._segments
        ]

    # ---- internals ------------------------------------------------------------------
    def _best_fit(self, pool: str, size: int) -> _Block | None:
        # torch keeps each pool's free blocks in a set sorted by (size, address) and
        # takes the first one >= size; a linear scan finds the same block.
        fits = [b for seg in self._segments if seg.pool == pool for b in seg.blocks if b.free and b.size >= size]
        return min(fits, key=lambda b: (b.size, b.segment.id, b.offset), default=None)

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

    def _merge_with_neighbours(self, block: _Block) -> None:
        # Merging keeps free memory in as few, as large blocks as possible, so a later
        # big request can still fit in a segment that held many small tensors.
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:
            block.size += blocks.pop(i + 1).size
        if i > 0 and blocks[i - 1].free:
            blocks[i - 1].size += blocks.pop(i).size


def apply_row(sim: CachingAllocatorSim, live: dict[int, int], key: int, delta: int) -> None:
    """Apply one row of an allocation record to ``sim``; ``live`` maps allocation id -> current bytes.

    A positive ``delta`` for a live id (the storage grew) is replayed as a free and a malloc of the new size.
    """
    old = live.get(key, 0)
    new = old + delta  # a free names the whole size, so it brings the allocation to 0
    if new < 0:
        raise ValueError(f"allocation {key} frees {-delta} bytes but holds {old}")
    if new != old:
        if old:
            sim.free(key)
            del live[key]
        if new:
            sim.malloc(key, new)
            live[key] = new


def replay(record: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a trace's allocations and frees through a fresh :class:`CachingAllocatorSim`.

    ``record`` is what ``Trace.allocation_record()`` returns. Each row's ``bytes`` is
    positive for an allocation and negative for a free; a row that changes the size
    of a live allocation (a storage resized in place) is replayed as a free of the
    old block and a malloc of the new size. 0-byte storages are skipped: torch never
    passes them to the caching allocator (they hold no memory at all).

    Returns one value per row, after that row: ``allocated`` and ``reserved`` (bytes),
    ``segments`` (held now) and ``segments_created`` (cudaMallocs so far), with
    ``sample``, ``step`` and ``phase`` copied through. Fragmentation (bytes cached but
    not in use) is ``reserved - allocated``.
    """
    sim = CachingAllocatorSim()
    live: dict[int, int] = {}  # allocation id -> its current size in bytes, as the trace says
    n = len(record["bytes"])
    out = {name: np.zeros(n, dtype=np.int64) for name in ("allocated", "reserved", "segments", "segments_created")}
    for i, (key, delta) in enumerate(zip(record["alloc_id"].tolist(), record["bytes"].tolist())):
        try:
            apply_row(sim, live, key, delta)
        except ValueError as e:
            raise ValueError(f"row {i}: {e}") from None
        out["allocated"][i] = sim.allocated
        out["reserved"][i] = sim.reserved
        out["segments"][i] = sim.num_segments
        out["segments_created"][i] = sim.segments_created
    for name in ("sample", "step", "phase"):
        out[name] = np.asarray(record[name]).copy()
    return out


def summarize_replay(result: dict[str, np.ndarray]) -> list[dict]:
    """One dict per step of a :func:`replay` result, in order (bytes and counts).

    Keys: ``step``, ``segments_created`` (cudaMallocs during the step),
    ``reserved_end`` (reserved after the step's last event), ``peak_allocated`` and
    ``peak_reserved`` (highest values within the step). Step 0 holds the storages
    that were alive when tracking began.
    """
    step, created = result["step"], result["segments_created"]
    rows = []
    for s in dict.fromkeys(step.tolist()):  # steps in order of appearance
        idx = np.flatnonzero(step == s)
        first, last = int(idx[0]), int(idx[-1])
        before = int(created[first - 1]) if first > 0 else 0
        rows.append(
            {
                "step": int(s),
                "segments_created": int(created[last]) - before,
                "reserved_end": int(result["reserved"][last]),
                "peak_allocated": int(result["allocated"][idx].max()),
                "peak_reserved": int(result["reserved"][idx].max()),
            }
        )
    return rows
