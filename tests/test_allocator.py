import numpy as np
import pytest
import torch

from anatomy_helpers import make_model, make_optimizer, track_steps
from anatomy_helpers.allocator import CachingAllocatorSim, replay, round_size, segment_size_for, summarize_replay

from .conftest import SMALL, make_record

KiB, MiB = 2**10, 2**20


def blocks(sim, segment=0):
    """(offset, size, key) of each block of one segment; key None = free."""
    return [(b["offset"], b["size"], b["key"]) for b in sim.segments()[segment]["blocks"]]


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
        (int(9.9 * MiB), "large", 20 * MiB),
        (10 * MiB, "large", 10 * MiB),
        (11 * MiB + 1, "large", 12 * MiB),
    ],
)
def test_pool_and_segment_size(nbytes, pool, segment):
    assert segment_size_for(round_size(nbytes)) == segment
    sim = CachingAllocatorSim()
    sim.malloc(0, nbytes)
    (seg,) = sim.segments()
    assert (seg["pool"], seg["size"]) == (pool, segment)
    assert sim.reserved == segment and sim.segments_created == sim.num_segments == 1


# ---- splitting ------------------------------------------------------------------------


def test_small_blocks_share_a_segment():
    sim = CachingAllocatorSim()
    sim.malloc(0, 512)
    sim.malloc(1, 100)
    assert sim.segments_created == 1 and sim.reserved == 2 * MiB and sim.allocated == 1024
    assert blocks(sim) == [(0, 512, 0), (512, 512, 1), (1024, 2 * MiB - 1024, None)]


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
    assert sim.allocated == 0 and sim.reserved == segment_size_for(first)  # cached, not returned
    sim.malloc(1, second)
    assert sim.segments_created == 1 and sim.allocated == second


def test_best_fit_takes_the_smallest_block_that_fits():
    sim = CachingAllocatorSim()
    for key, size in enumerate([4 * KiB, 512, KiB, 512]):  # the 512 B blocks keep the others apart
        sim.malloc(key, size)
    sim.free(0)  # a free 4 KiB block at offset 0
    sim.free(2)  # a free 1 KiB block at offset 4.5 KiB; the segment's tail is free too
    sim.malloc(9, KiB)
    assert sim.segments()[0]["blocks"][2] == {"offset": 4608, "size": KiB, "free": False, "key": 9}
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
    assert [s["pool"] for s in sim.segments()] == ["large", "small"] and sim.reserved == 22 * MiB


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
    assert sim.reserved == 2 * MiB and [s["pool"] for s in sim.segments()] == ["small"]
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
    assert res["allocated"].tolist() == [m * MiB for m in (3, 3, 5, 21, 5, 5, 0)]
    assert res["reserved"].tolist() == [m * MiB for m in (20, 20, 20, 36, 36, 36, 36)]
    assert res["segments"].tolist() == res["segments_created"].tolist() == [1, 1, 1, 2, 2, 2, 2]
    assert res["step"].tolist() == rec["step"].tolist() and res["sample"].tolist() == list(range(7))
    assert summarize_replay(res) == [
        {
            "step": 1,
            "segments_created": 1,
            "reserved_end": 20 * MiB,
            "peak_allocated": 5 * MiB,
            "peak_reserved": 20 * MiB,
        },
        {
            "step": 2,
            "segments_created": 1,
            "reserved_end": 36 * MiB,
            "peak_allocated": 21 * MiB,
            "peak_reserved": 36 * MiB,
        },
    ]


def test_replay_handles_a_shrink():
    res = replay(make_record([(1, 0, 4 * KiB), (1, 0, -KiB), (1, 0, -3 * KiB)]))  # 4 KiB, shrunk to 3 KiB, freed
    assert res["allocated"].tolist() == [4 * KiB, 3 * KiB, 0]


def test_replay_refuses_a_free_of_what_is_not_live():
    with pytest.raises(ValueError, match="frees 512 bytes but holds 0"):
        replay(make_record([(1, 0, 512), (1, 1, -512)]))


# ---- replaying a real trace -------------------------------------------------------------


@pytest.fixture(scope="module")
def small_trace():
    torch.set_num_threads(2)  # as conftest does per test; this fixture runs before it
    model = make_model(device="cpu", **SMALL)
    return track_steps(model, make_optimizer(model, "adamw"), steps=3, batch_size=4)


def test_replay_allocated_equals_rounded_totals(small_trace):
    rec = small_trace.allocation_record()
    # Every request of this model is <= 1 MiB, so it lands in the small pool, where any
    # remainder (a multiple of 512 B) is split off: each block is exactly the rounded size.
    assert rec["bytes"].max() <= MiB
    res = replay(rec)
    on_timeline = res["sample"] >= 0
    np.testing.assert_array_equal(res["allocated"][on_timeline], small_trace.replay_totals(round_to=512))
    assert np.all(res["reserved"] >= res["allocated"])


def test_replay_reserved_plateaus_after_warm_up(small_trace):
    res = replay(small_trace.allocation_record())
    per_step = {row["step"]: row for row in summarize_replay(res)}
    assert per_step[0]["segments_created"] > 0  # the parameters already open a segment
    # The cache grows while it warms up. Step 1 alone fits in the parameters' 2 MiB
    # segment for this tiny model; step 2 needs more because AdamW's state, created at
    # the end of step 1, now stays alive under the forward and backward.
    assert per_step[1]["segments_created"] + per_step[2]["segments_created"] > 0
    # ...then step 3 reuses the cached blocks: no cudaMalloc, reserved flat.
    assert per_step[3]["segments_created"] == 0
    assert per_step[3]["reserved_end"] == per_step[2]["reserved_end"]
