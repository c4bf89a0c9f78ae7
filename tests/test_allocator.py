"""The caching-allocator simulator, checked against cases worked out by hand from the rules in allocator.py's
docstring (every expected segment, block and counter below is written out, never computed by the simulator)."""

import numpy as np
import pytest

from anatomy_helpers.prediction.allocator import (
    BlockState,
    CachingAllocatorSim,
    LimitedAllocatorSim,
    LimitReplay,
    SegmentState,
    SimulatedOutOfMemory,
    StepReplay,
    allocator_at,
    min_limit_to_pass,
    replay,
    replay_rows,
    replay_with_limit,
    round_size,
    segment_size_for,
    summarize_replay,
)
from anatomy_helpers.tracking.events import AllocationRecord

from .conftest import make_record

KiB, MiB = 2**10, 2**20


def blocks(sim, segment=0):
    """(offset, size, key) of each block of one segment; key None = free."""
    return [(b.offset, b.size, b.key) for b in sim.segments()[segment].blocks]


# Step 1 makes and frees a 3 MiB tensor: one 20 MiB segment, then cached. Step 2 keeps a 3 MiB tensor (it reuses
# the cached segment, split: 17 MiB stay free) and asks for 21 MiB, which needs a segment of its own rounded up to
# 22 MiB; the 1 MiB left over is not split off (the large pool splits only remainders over 1 MiB).
TWO_STEPS = [(1, 0, 3 * MiB), (1, 0, -3 * MiB), (2, 1, 3 * MiB), (2, 2, 21 * MiB)]


# ---- sizes and pools ----------------------------------------------------------------


@pytest.mark.parametrize("nbytes, rounded", [(1, 512), (512, 512), (513, 1024), (0, 512), (MiB + 1, MiB + 512)])
def test_round_size(nbytes, rounded):
    assert round_size(nbytes) == rounded


def test_negative_request_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        round_size(-1)


@pytest.mark.parametrize(
    "nbytes, pool, segment",
    [
        (MiB, "small", 2 * MiB),
        (MiB + 1, "large", 20 * MiB),
        (3 * MiB, "large", 20 * MiB),
        (int(9.9 * MiB), "large", 20 * MiB),
        (10 * MiB, "large", 10 * MiB),
        (11 * MiB + 1, "large", 12 * MiB),
        (21 * MiB, "large", 22 * MiB),
    ],
)
def test_pool_and_segment_size(nbytes, pool, segment):
    assert segment_size_for(round_size(nbytes)) == segment
    sim = CachingAllocatorSim()
    sim.malloc(0, nbytes)
    (seg,) = sim.segments()
    assert (seg.pool, seg.size) == (pool, segment)
    assert sim.reserved == segment and sim.segments_created == sim.num_segments == 1


# ---- splitting ------------------------------------------------------------------------


def test_small_blocks_share_a_segment():
    sim = CachingAllocatorSim()
    sim.malloc(0, 512)
    sim.malloc(1, 100)
    assert sim.segments_created == 1 and sim.reserved == 2 * MiB and sim.allocated == 1024
    assert blocks(sim) == [(0, 512, 0), (512, 512, 1), (1024, 2 * MiB - 1024, None)]


def test_small_requests_are_packed_into_2mib_segments():
    sim = CachingAllocatorSim()
    for key in range(5):  # four 512 KiB blocks fill a 2 MiB segment exactly; the fifth opens a second one
        sim.malloc(key, 512 * KiB)
    assert [(s.pool, s.size) for s in sim.segments()] == [("small", 2 * MiB)] * 2
    assert blocks(sim, 0) == [
        (0, 512 * KiB, 0),
        (512 * KiB, 512 * KiB, 1),
        (MiB, 512 * KiB, 2),
        (1536 * KiB, 512 * KiB, 3),  # the last one takes the 512 KiB left exactly: nothing to split off
    ]
    assert blocks(sim, 1) == [(0, 512 * KiB, 4), (512 * KiB, 1536 * KiB, None)]
    assert (sim.allocated, sim.reserved, sim.segments_created) == (2560 * KiB, 4 * MiB, 2)


def test_large_remainder_of_a_new_segment():
    sim = CachingAllocatorSim()
    sim.malloc(0, MiB + 1)  # a 20 MiB segment: the rest, about 19 MiB, is split off
    assert blocks(sim) == [(0, MiB + 512, 0), (MiB + 512, 19 * MiB - 512, None)]
    assert sim.allocated == MiB + 512
    sim = CachingAllocatorSim()
    sim.malloc(0, 11 * MiB + 1)  # a 12 MiB segment: the 1 MiB - 512 B left is not split off
    assert blocks(sim) == [(0, 12 * MiB, 0)]
    assert sim.allocated == 12 * MiB


@pytest.mark.parametrize(
    "nbytes, expected_blocks, allocated",
    [
        # 19 MiB gets a 20 MiB segment; the 1 MiB remainder is not more than 1 MiB: handed out whole
        (19 * MiB, [(0, 20 * MiB, 0)], 20 * MiB),
        # 18.5 MiB gets a 20 MiB segment too; the 1.5 MiB remainder is split off and stays free
        (18 * MiB + 512 * KiB, [(0, 18 * MiB + 512 * KiB, 0), (18 * MiB + 512 * KiB, 1536 * KiB, None)], 18.5 * MiB),
    ],
)
def test_a_1mib_remainder_is_not_split_in_the_large_pool_but_a_1_5mib_one_is(nbytes, expected_blocks, allocated):
    sim = CachingAllocatorSim()
    sim.malloc(0, nbytes)
    assert sim.segments()[0].size == 20 * MiB
    assert blocks(sim) == expected_blocks
    assert sim.allocated == allocated and sim.reserved == 20 * MiB


@pytest.mark.parametrize(
    "request_size, split",
    [(10 * MiB, False), (10 * MiB - 512, True)],  # remainders: exactly 1 MiB, and 1 MiB + 512 B
)
def test_large_pool_splits_only_remainders_over_1mib(request_size, split):
    sim = CachingAllocatorSim()
    sim.malloc(0, 9 * MiB)  # a 20 MiB segment: 9 MiB used, 11 MiB free after it
    sim.malloc(1, request_size)  # best fit is that 11 MiB block
    assert sim.segments_created == 1
    if split:
        assert blocks(sim) == [
            (0, 9 * MiB, 0),
            (9 * MiB, request_size, 1),
            (9 * MiB + request_size, 11 * MiB - request_size, None),
        ]
        assert sim.allocated == 9 * MiB + request_size
    else:  # the whole 11 MiB block is handed out and counted as allocated
        assert blocks(sim) == [(0, 9 * MiB, 0), (9 * MiB, 11 * MiB, 1)]
        assert sim.allocated == 20 * MiB


# ---- reuse and best fit ---------------------------------------------------------------


@pytest.mark.parametrize("second", [5 * MiB, 3 * MiB, 512 * KiB])
def test_freed_memory_is_reused_without_a_new_segment(second):
    sim = CachingAllocatorSim()
    first = 5 * MiB if second > MiB else 512 * KiB  # same pool as the second request
    sim.malloc(0, first)
    sim.free(0)
    assert sim.allocated == 0 and sim.reserved == (20 * MiB if first > MiB else 2 * MiB)  # cached, not returned
    sim.malloc(1, second)
    assert sim.segments_created == 1 and sim.allocated == second


def test_best_fit_takes_the_smallest_block_that_fits():
    sim = CachingAllocatorSim()
    for key, size in enumerate([4 * KiB, 512, KiB, 512]):  # the 512 B blocks keep the others apart
        sim.malloc(key, size)
    sim.free(0)  # a free 4 KiB block at offset 0
    sim.free(2)  # a free 1 KiB block at offset 4.5 KiB; the segment's tail is free too
    sim.malloc(9, KiB)
    assert sim.segments()[0].blocks[2] == BlockState(offset=4608, size=KiB, key=9)
    sim.malloc(10, 512)  # the 4 KiB block is now the smallest that fits: split at its start
    assert blocks(sim)[0] == (0, 512, 10)


def test_equal_blocks_go_to_the_lowest_address():
    sim = CachingAllocatorSim()
    for key in range(4):
        sim.malloc(key, KiB)
    sim.free(2)
    sim.free(0)
    sim.malloc(9, KiB)
    assert blocks(sim)[0] == (0, KiB, 9)


def test_a_small_request_never_uses_the_large_pool():
    sim = CachingAllocatorSim()
    sim.malloc(0, 5 * MiB)
    sim.free(0)  # 20 MiB cached in the large pool
    sim.malloc(1, 512)
    assert [s.pool for s in sim.segments()] == ["large", "small"] and sim.reserved == 22 * MiB


# ---- freeing, merging, empty_cache, peaks --------------------------------------------------


def test_freed_neighbours_merge():
    sim = CachingAllocatorSim()
    for key in range(4):  # four 512 KiB blocks fill a 2 MiB segment exactly
        sim.malloc(key, 512 * KiB)
    sim.free(0)
    sim.free(2)
    sim.free(1)  # merges with the free blocks on both sides
    assert blocks(sim) == [(0, 3 * 512 * KiB, None), (3 * 512 * KiB, 512 * KiB, 3)]
    sim.malloc(4, MiB)  # fits only because the blocks merged
    assert sim.segments_created == 1 and blocks(sim)[0] == (0, MiB, 4)


def test_empty_cache_releases_only_entirely_free_segments():
    sim = CachingAllocatorSim()
    sim.malloc(0, 512)
    sim.malloc(1, 512)  # same small segment
    sim.malloc(2, 3 * MiB)  # a large segment
    sim.free(0)
    sim.free(2)
    sim.empty_cache()
    assert sim.reserved == 2 * MiB and [s.pool for s in sim.segments()] == ["small"]
    assert sim.allocated == 512
    sim.malloc(3, 3 * MiB)  # the large segment is gone: cudaMalloc again
    assert sim.segments_created == 3 and sim.reserved == 22 * MiB


def test_peaks_and_reset_peak():
    sim = CachingAllocatorSim()
    sim.malloc(0, 3 * MiB)  # a 20 MiB segment
    sim.malloc(1, 18 * MiB)  # too big for the 17 MiB left there: an 18 MiB segment
    sim.free(1)
    sim.free(0)
    sim.empty_cache()
    assert (sim.allocated, sim.reserved) == (0, 0)
    assert (sim.peak_allocated, sim.peak_reserved) == (21 * MiB, 38 * MiB)
    sim.reset_peak()
    assert (sim.peak_allocated, sim.peak_reserved) == (0, 0)
    sim.malloc(2, 1)
    assert (sim.peak_allocated, sim.peak_reserved) == (512, 2 * MiB)


def test_bad_keys_are_refused():
    sim = CachingAllocatorSim()
    sim.malloc(0, 512)
    with pytest.raises(ValueError, match="already live"):
        sim.malloc(0, 512)
    with pytest.raises(KeyError, match="not live"):
        sim.free(1)


# ---- allocation records --------------------------------------------------------------------


def test_an_allocation_record_refuses_columns_of_different_lengths():
    cols = dict(
        sample=np.arange(3),
        time_s=np.zeros(3),
        alloc_id=np.arange(3),
        bytes=np.full(3, 512),
        category=np.zeros(3, dtype=np.int64),
        step=np.ones(3, dtype=np.int64),
        phase=np.ones(2, dtype=np.int64),  # one short
    )
    with pytest.raises(ValueError, match="one length each") as info:
        AllocationRecord(**cols)
    assert "'phase': 2" in str(info.value) and "'bytes': 3" in str(info.value)


# ---- replaying a record -------------------------------------------------------------------


def test_replay_handles_growth_and_zero_byte_storages():
    rec = make_record(
        [
            (1, 0, 3 * MiB),  # a 20 MiB segment
            (1, 1, 0),  # a 0-byte storage: never reaches the allocator
            (1, 0, 2 * MiB),  # storage 0 grows to 5 MiB: free + malloc, same segment
            (2, 2, 16 * MiB),  # too big for the 15 MiB left: a 16 MiB segment
            (2, 2, -16 * MiB),
            (2, 1, 0),
            (2, 0, -5 * MiB),
        ]
    )
    res = replay(rec)
    assert res.allocated.tolist() == [m * MiB for m in (3, 3, 5, 21, 5, 5, 0)]
    assert res.reserved.tolist() == [m * MiB for m in (20, 20, 20, 36, 36, 36, 36)]
    assert res.segments.tolist() == res.segments_created.tolist() == [1, 1, 1, 2, 2, 2, 2]
    assert res.step.tolist() == [1, 1, 1, 2, 2, 2, 2] and res.sample.tolist() == list(range(7))
    assert summarize_replay(res) == [
        # step 1 peaks at 5 MiB allocated in its 20 MiB segment: 15 MiB cached, unused
        StepReplay(
            1,
            segments_created=1,
            reserved_end=20 * MiB,
            peak_allocated=5 * MiB,
            peak_reserved=20 * MiB,
            gap_at_peak=15 * MiB,
        ),
        # step 2 peaks at 5 + 16 MiB in 20 + 16 MiB of segments
        StepReplay(
            2,
            segments_created=1,
            reserved_end=36 * MiB,
            peak_allocated=21 * MiB,
            peak_reserved=36 * MiB,
            gap_at_peak=15 * MiB,
        ),
    ]


def test_replay_handles_a_shrink():
    res = replay(make_record([(1, 0, 4 * KiB), (1, 0, -KiB), (1, 0, -3 * KiB)]))  # 4 KiB, shrunk to 3 KiB, freed
    assert res.allocated.tolist() == [4 * KiB, 3 * KiB, 0]


def test_replay_refuses_a_free_of_what_is_not_live():
    with pytest.raises(ValueError, match="row 1: allocation 1 frees 512 bytes but holds 0"):
        replay(make_record([(1, 0, 512), (1, 1, -512)]))


# ---- the allocator at one moment ------------------------------------------------------------------


def large(seg_id, size, *blocks_):
    return SegmentState(seg_id, "large", size, tuple(BlockState(*b) for b in blocks_))


@pytest.mark.parametrize(
    "row, segments, allocated, reserved",
    [
        (-1, [], 0, 0),  # nothing replayed yet
        (0, [large(0, 20 * MiB, (0, 3 * MiB, 0), (3 * MiB, 17 * MiB, None))], 3 * MiB, 20 * MiB),
        (1, [large(0, 20 * MiB, (0, 20 * MiB, None))], 0, 20 * MiB),  # freed and merged back: cached
        (2, [large(0, 20 * MiB, (0, 3 * MiB, 1), (3 * MiB, 17 * MiB, None))], 3 * MiB, 20 * MiB),  # reused
        (
            3,
            [
                large(0, 20 * MiB, (0, 3 * MiB, 1), (3 * MiB, 17 * MiB, None)),
                large(1, 22 * MiB, (0, 22 * MiB, 2)),  # 21 MiB in a 22 MiB segment, the 1 MiB left not split off
            ],
            25 * MiB,
            42 * MiB,
        ),
    ],
)
def test_allocator_at_hand_worked(row, segments, allocated, reserved):
    sim = allocator_at(make_record(TWO_STEPS), row)
    assert sim.segments() == segments
    assert (sim.allocated, sim.reserved) == (allocated, reserved)


def test_allocator_at_replays_into_a_given_simulator():
    mine = LimitedAllocatorSim(limit=40 * MiB)
    assert allocator_at(make_record(TWO_STEPS), 2, mine) is mine
    assert (mine.allocated, mine.reserved, mine.cache_flushes) == (3 * MiB, 20 * MiB, 0)


@pytest.mark.parametrize("row", [-2, 4, 100])
def test_allocator_at_refuses_a_row_out_of_range(row):
    with pytest.raises(ValueError, match=rf"row must be an integer in \[-1, 4\), got {row}"):
        allocator_at(make_record(TWO_STEPS), row)


# ---- the simulator under a limit -------------------------------------------------------------


def test_limited_sim_empties_its_cache_before_giving_up():
    sim = LimitedAllocatorSim(limit=30 * MiB)
    sim.malloc(0, 3 * MiB)  # a 20 MiB segment
    sim.free(0)  # cached: reserved stays 20 MiB
    sim.malloc(1, 11 * MiB)  # fits in the cached block: no new segment, no flush
    sim.free(1)
    assert sim.cache_flushes == 0 and sim.reserved == 20 * MiB
    sim.malloc(2, 21 * MiB)  # needs a 22 MiB segment: 42 > 30, so the free segment goes back first
    assert sim.cache_flushes == 1
    assert sim.reserved == 22 * MiB and sim.num_segments == 1


def test_limited_sim_raises_when_live_blocks_pin_the_segments():
    sim = LimitedAllocatorSim(limit=30 * MiB)
    sim.malloc(0, 3 * MiB)
    with pytest.raises(SimulatedOutOfMemory) as info:
        sim.malloc(1, 21 * MiB)
    err = info.value
    assert (err.requested, err.segment, err.reserved, err.limit) == (21 * MiB, 22 * MiB, 20 * MiB, 30 * MiB)
    assert err.allocated == 3 * MiB


def test_limited_sim_refuses_a_non_positive_limit():
    with pytest.raises(ValueError, match="positive"):
        LimitedAllocatorSim(0)


def test_the_simulated_out_of_memory_message_reads_like_torchs():
    # TWO_STEPS under 40 MiB: the 21 MiB request needs a 22 MiB segment; 20 + 22 > 40 even after the cache is
    # emptied, because the 3 MiB tensor pins the first segment (17 MiB of it cached, unused).
    sim = LimitedAllocatorSim(limit=40 * MiB)
    with pytest.raises(SimulatedOutOfMemory) as info:
        replay_rows(sim, make_record(TWO_STEPS))
    assert str(info.value) == (
        "(simulated) CUDA out of memory. Tried to allocate 22.00 MiB (a new segment for a 21.00 MiB tensor). "
        "The process is limited to 40.00 MiB. Of the allocated memory 3.00 MiB is allocated by PyTorch, and "
        "17.00 MiB is reserved by PyTorch but unallocated."
    )


def test_replay_with_limit_reports_where_and_what_failed():
    rec = make_record(TWO_STEPS)  # make_record puts every row in the forward phase
    assert replay_with_limit(rec, 40 * MiB) == LimitReplay(
        limit=40 * MiB,
        passed=False,
        rows=3,  # rows 0-2 went through; row 3 (the 21 MiB request) did not
        step=2,
        phase="forward",
        requested=21 * MiB,
        allocated=3 * MiB,
        reserved=20 * MiB,
        cache_flushes=1,
        segment=22 * MiB,  # 21 MiB rounded up to the 2 MiB a large segment comes in
    )
    assert replay_with_limit(rec, 42 * MiB) == LimitReplay(42 * MiB, True, 4, None, None, None, 25 * MiB, 42 * MiB, 0)
    # step 1 alone needs one 20 MiB segment
    assert replay_with_limit(rec, 20 * MiB, through_step=1) == LimitReplay(
        20 * MiB, True, 2, None, None, None, 0, 20 * MiB, 0
    )


def test_replay_with_limit_frees_the_cache_and_carries_on():
    # Step 2 frees its 3 MiB tensor before asking for 21 MiB: under 30 MiB the cached 20 MiB segment goes back.
    rec = make_record([(1, 0, 3 * MiB), (1, 0, -3 * MiB), (2, 1, 21 * MiB)])
    assert replay_with_limit(rec, 30 * MiB) == LimitReplay(30 * MiB, True, 3, None, None, None, 22 * MiB, 22 * MiB, 1)


def test_min_limit_to_pass_hand_computed():
    rec = make_record(TWO_STEPS)
    assert min_limit_to_pass(rec, through_step=1) == 20 * MiB
    assert min_limit_to_pass(rec) == 42 * MiB
    # in whole MiB the answer is the same: below 42 MiB the two segments cannot both be held
    assert min_limit_to_pass(rec, granularity=MiB) == 42 * MiB


@pytest.mark.parametrize("granularity", [0, -MiB, 511, 2.0 * MiB])
def test_min_limit_to_pass_refuses_a_bad_granularity(granularity):
    with pytest.raises(ValueError, match="granularity must be a whole number of bytes >= 512"):
        min_limit_to_pass(make_record(TWO_STEPS), granularity=granularity)


# ---- replaying a real trace -------------------------------------------------------------


def test_replay_allocated_equals_rounded_totals(small_trace):
    rec = small_trace.allocation_record()
    # Every request of this model is <= 1 MiB, so it lands in the small pool, where any
    # remainder (a multiple of 512 B) is split off: each block is exactly the rounded size.
    assert rec.bytes.max() <= MiB
    res = replay(rec)
    on_timeline = res.sample >= 0
    np.testing.assert_array_equal(res.allocated[on_timeline], small_trace.replay_totals(round_to=512))
    assert np.all(res.reserved >= res.allocated)


def test_replay_reserved_plateaus_after_warm_up(small_trace):
    per_step = {row.step: row for row in summarize_replay(replay(small_trace.allocation_record()))}
    assert per_step[0].segments_created > 0  # the parameters already open a segment
    # The cache grows while it warms up. Step 1 alone fits in the parameters' 2 MiB
    # segment for this tiny model; step 2 needs more because AdamW's state, created at
    # the end of step 1, now stays alive under the forward and backward.
    assert per_step[1].segments_created + per_step[2].segments_created > 0
    # ...then step 3 reuses the cached blocks: no cudaMalloc, reserved flat.
    assert per_step[3].segments_created == 0
    assert per_step[3].reserved_end == per_step[2].reserved_end


def test_min_limit_to_pass_is_the_first_passing_limit_on_a_real_trace(small_trace):
    rec = small_trace.allocation_record()
    found = min_limit_to_pass(rec)
    assert found % (2 * MiB) == 0
    assert replay_with_limit(rec, found).passed
    assert not replay_with_limit(rec, found - 2 * MiB).passed


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "100", 1.5, -3])
def test_malloc_refuses_what_is_not_a_whole_number_of_bytes(bad):
    with pytest.raises(ValueError, match="nbytes must be a whole number of bytes"):
        CachingAllocatorSim().malloc(1, bad)


@pytest.mark.parametrize("bad", [float("nan"), "1GiB", 0, True])
def test_a_limit_that_is_not_a_positive_whole_number_of_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="limit must be a positive whole number of bytes"):
        LimitedAllocatorSim(bad)
