"""Memory snapshots in torch's format: replayed by the simulator on CPU, recorded on a GPU."""

import json
import pickle

import numpy as np
import pytest
import torch
from torch.cuda import _memory_viz

from anatomy_helpers import get_batch, make_model, make_optimizer
from anatomy_helpers.prediction.allocator import allocator_at
from anatomy_helpers.prediction.cuda import cuda_release
from anatomy_helpers.prediction.snapshot import record_cuda_snapshot, snapshot_from_replay, write_memory_viz

from .conftest import SMALL, make_record

MiB = 2**20


def test_snapshot_of_a_hand_made_replay_reads_in_memory_viz():
    # A 3 MiB tensor is made, freed and made again: one 20 MiB segment, cut into a 3 MiB block and 17 MiB free.
    rec = make_record([(1, 0, 3 * MiB), (1, 0, -3 * MiB), (2, 1, 3 * MiB)])
    snap = snapshot_from_replay(rec)
    (seg,) = snap["segments"]
    assert seg["total_size"] == 20 * MiB and seg["segment_type"] == "large"
    assert [b["state"] for b in seg["blocks"]] == ["active_allocated", "inactive"]
    assert [b["size"] for b in seg["blocks"]] == [3 * MiB, 17 * MiB]
    assert [b["address"] - seg["address"] for b in seg["blocks"]] == [0, 3 * MiB]
    assert seg["allocated_size"] == seg["requested_size"] == 3 * MiB
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions == ["segment_alloc", "alloc", "free_requested", "free_completed", "alloc"]
    summary = _memory_viz.segsum(snap)
    assert "segments: 1" in summary and "total_reserved: 20.0MiB" in summary and "total_allocated: 3.0MiB" in summary
    text = _memory_viz.trace(snap)
    assert text.count("cudaMalloc(") == 1 and "del " in text


def test_trace_events_address_each_block_in_its_segment():
    # 3 MiB then 2 MiB cut from one 20 MiB segment (the second block starts where the first ends), then the first
    # freed: memory_viz places every event by its address, so each must point at its own block
    snap = snapshot_from_replay(make_record([(1, 0, 3 * MiB), (1, 1, 2 * MiB), (1, 0, -3 * MiB)]))
    base = snap["segments"][0]["address"]
    assert [(e["action"], e["addr"] - base, e["size"]) for e in snap["device_traces"][0]] == [
        ("segment_alloc", 0, 20 * MiB),
        ("alloc", 0, 3 * MiB),
        ("alloc", 3 * MiB, 2 * MiB),
        ("free_requested", 0, 3 * MiB),
        ("free_completed", 0, 3 * MiB),
    ]


def test_snapshot_counts_an_unsplit_remainder_as_internal_free_memory():
    # 19 MiB in a 20 MiB segment: the 1 MiB left is not split off, so the block is 20 MiB for 19 MiB requested.
    snap = snapshot_from_replay(make_record([(1, 0, 19 * MiB)]))
    (seg,) = snap["segments"]
    assert [(b["size"], b["requested_size"]) for b in seg["blocks"]] == [(20 * MiB, 19 * MiB)]
    assert "total_free: 1.0MiB (100.0% internal)" in _memory_viz.segsum(snap)


def test_snapshot_without_trace_and_through_a_row():
    rec = make_record([(1, 0, 3 * MiB), (1, 0, -3 * MiB), (2, 1, 3 * MiB)])
    snap = snapshot_from_replay(rec, row=1, with_trace=False)  # after the free: the segment is cached, all free
    (seg,) = snap["segments"]
    assert [(b["state"], b["size"]) for b in seg["blocks"]] == [("inactive", 20 * MiB)]
    assert snap["device_traces"] == [[]]


def test_snapshot_of_a_real_trace(small_trace, tmp_path):
    rec = small_trace.allocation_record()
    row = int(np.flatnonzero(rec.step == 2)[-1])
    snap = snapshot_from_replay(rec, row, small_trace)
    alive = small_trace.alive_at(int(rec.sample[row]))  # bytes per allocation id, from the tracker
    active = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    # every live tensor has one block; what each asked for is what the tracker says it holds
    assert sorted(b["requested_size"] for b in active) == sorted(int(a) for a in alive[alive > 0])
    # this model's requests are all <= 1 MiB: small pool, 2 MiB segments, blocks rounded up to 512 B
    assert {s["segment_type"] for s in snap["segments"]} == {"small"}
    assert {s["total_size"] for s in snap["segments"]} == {2 * MiB}
    assert all(b["size"] == -(-max(b["requested_size"], 1) // 512) * 512 for b in active)
    assert all(len(b["frames"]) == 1 for b in active)  # each block names its module and category
    sim = allocator_at(rec, row)
    assert sum(s["total_size"] for s in snap["segments"]) == sim.reserved
    assert _memory_viz.trace(snap).count("cudaMalloc(") == sim.segments_created
    html_path = write_memory_viz(snap, tmp_path / "sim.html", tmp_path / "sim.pickle")
    html = html_path.read_text()
    assert "Active Memory Timeline" in html
    payload = json.loads(html.split("const local_files = ")[1].split("\n")[0])
    assert payload[0]["name"] == "snapshot.pickle"
    with open(tmp_path / "sim.pickle", "rb") as f:
        assert pickle.load(f) == snap


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_is_recorded_dumped_and_rendered(tmp_path):
    model = make_model(device="cuda", **SMALL)
    opt = make_optimizer(model, "adamw")

    def one_step():
        loss = model(*get_batch(4, SMALL["seq_len"], device="cuda"))[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    snap = record_cuda_snapshot(one_step, tmp_path / "snap.pickle", max_entries=10_000)
    actions = {e["action"] for e in snap["device_traces"][torch.cuda.current_device()]}
    assert {"alloc", "free_requested"} <= actions
    assert snap["segments"] and "total_reserved" in _memory_viz.segsum(snap)
    assert "Active Memory Timeline" in write_memory_viz(snap, tmp_path / "snap.html").read_text()
    n_before = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
    extra = torch.ones(1024, device="cuda")  # recording is off again: this is not logged
    n_after = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
    assert n_after == n_before
    del extra
    cuda_release()
