"""Real per-phase times of a 2-rank gloo DDP step (distributed/timed_step.py), DDP's buckets priced one by one
(distributed/sync_model.py), and the model against the measurement.

One small world serves every test that needs ranks (starting processes is what costs time). Timing asserts are
bands wide enough for a loaded 2-core machine; what is exact (the buckets) is asserted exactly.
"""

import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

from anatomy_helpers.distributed.sync_model import (
    ddp_bucket_bytes,
    ddp_buckets,
    gradient_ready_order,
    ring_seconds,
)
from anatomy_helpers.distributed.timed_step import (
    TimedJob,
    fit_link,
    format_model_vs_measured,
    measure_timed_world,
    model_vs_measured,
    straggler_growth,
)

from .conftest import SMALL
from .test_world_runner import _gone

CAP_MB = 0.05  # small buckets, so that the SMALL model has several
DELAY = 0.1  # seconds the last rank sleeps at the start of backward in the straggler steps


@pytest.fixture(scope="module")
def ranks():
    job = TimedJob(
        steps=3, batch_size=4, model=SMALL, bucket_cap_mb=CAP_MB, straggler_s=DELAY, sweep_bytes=(4096, 1 << 22)
    )
    return measure_timed_world(job, 2, timeout_s=240)


def test_our_bucket_split_is_torchs_own():
    gen = torch.Generator().manual_seed(0)
    numels = [int(s) for s in torch.randint(1, 150_000, (40,), generator=gen)] + [1 << 18] * 4  # 1 MiB: a full cap
    order = [int(i) for i in torch.randperm(len(numels), generator=gen)]
    tensors = [torch.empty(n) for n in numels]
    sizes = [t.nbytes for t in tensors]
    for cap_mb in (None, 0.25, 1, 25):
        caps = [1 << 20, 25 << 20] if cap_mb is None else [int(cap_mb * (1 << 20))]
        theirs, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], caps, [], order)
        assert ddp_buckets(sizes, order, cap_mb) == theirs, cap_mb
    assert ddp_buckets([1 << 20] * 3, [2, 1, 0], 1) == [[2], [1], [0]]  # a bucket exactly at its cap closes
    with pytest.raises(ValueError, match="each of the 3 parameters once"):
        ddp_buckets([4, 4, 4], [0, 1, 1])
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ddp_buckets([4], [0], 0)


def test_the_buckets_are_the_ones_ddp_rebuilt_on_real_ranks(ranks):
    from anatomy_helpers import make_model

    model = make_model(device="cpu", **SMALL)
    x = torch.zeros(2, SMALL["seq_len"], dtype=torch.long)
    order = gradient_ready_order(model, (x, x))
    assert all(p.grad is None for p in model.parameters())  # nothing left behind
    for r in ranks:  # DDP's own report (its logger) against ours, from the model's shapes and one backward
        assert r.bucket_params == ddp_buckets(r.param_bytes, order, CAP_MB)
        assert r.bucket_sizes == ddp_bucket_bytes(SMALL, 2, CAP_MB) and len(r.bucket_sizes) > 2
        for s in r.of("synced"):  # every bucket all-reduced once per synced step, none in a compute step
            assert sorted(b for b, _, _ in s.buckets) == sorted(r.bucket_sizes)
        assert all(s.buckets == () and s.wait == 0 for s in r.of("compute"))


def test_phase_times_add_up_and_agree_with_ddps_logger(ranks):
    for r in ranks:
        for s in r.steps:
            assert 0 < s.forward + s.backward + s.optimizer <= s.step
            assert 0 <= s.backward_compute <= s.backward and s.wait >= 0
            assert all(0 <= issued <= done for _, issued, done in s.buckets)
            if s.kind != "compute":  # torch's own timing of the same backward, measured by DDP's reducer
                assert s.ddp, "no entry of DDP's logger stamped inside this step"
                assert 0 < s.ddp["backward_comm"] and 0 <= s.ddp["overlap"] <= s.ddp["backward_compute"]
                assert s.ddp["backward_compute"] <= s.backward + s.forward


def test_a_straggler_delays_every_rank_and_the_others_wait_for_it(ranks):
    growth = straggler_growth(ranks)
    for rank, step, _ in growth:
        assert 0.3 * DELAY < step < 2 * DELAY + 0.1, (rank, step)  # every rank's step, not only the slow one's
    assert growth[0][2] > 0.5 * DELAY  # rank 0 waits inside backward for rank 1's gradients


def test_the_model_fed_measured_compute_prices_every_quantity_of_the_measured_step(ranks):
    checks = {c.name: c for c in model_vs_measured(ranks)}
    # How far the model misses is not asserted: it is a ratio of wall times on a shared machine (suite runs: 26 ms
    # measured against 37 ms modelled; 25 against 27; a loaded one 27 against 15, another 3.6x), so it moves with
    # the load. Lesson 11 prints it and explains why.
    assert set(checks) >= {"step"}
    assert all(c.measured > 0 and c.idle > 0 and c.busy > 0 for c in checks.values())
    table = format_model_vs_measured(list(checks.values()))
    assert "model idle" in table and "step" in table


def test_the_timeline_plot_draws_every_rank_and_bucket(ranks):
    from anatomy_helpers.lessons.lesson11_scale import plot_timed_step

    fig = plot_timed_step(ranks)
    synced, straggler = fig.axes[:2]
    assert [t.get_text() for t in synced.get_yticklabels()] == ["rank 0", "rank 1"]
    buckets = len(ranks[0].bucket_sizes)
    assert len(straggler.lines) == 2 * 2 * buckets  # each bucket: a span and its issue mark, on each rank
    assert "ms" in straggler.get_xlabel() and fig._repr_png_()[:4] == b"\x89PNG"


def test_no_process_or_port_is_left(ranks):
    assert all(_gone(r.pid) for r in ranks)
    with socket.socket() as s:  # no listener (the store's connections may linger in TIME_WAIT, which this allows)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", ranks[0].port))
        s.listen()


def test_fit_link_recovers_alpha_and_beta():
    from anatomy_helpers.distributed.sync_model import Link

    true = Link("x", bandwidth=2e9, latency=3e-5)
    sweep = {s: [ring_seconds("all-reduce", s, 4, true)] * 3 for s in (4096, 1 << 16, 1 << 20, 1 << 24)}
    fitted = fit_link(sweep, 4)
    assert fitted.bandwidth == pytest.approx(2e9, rel=1e-6) and fitted.latency == pytest.approx(3e-5, rel=1e-6)
    with pytest.raises(ValueError, match="two sizes"):
        fit_link({4096: [1.0]}, 2)
    flat = fit_link({4096: [2.0], 8192: [1.5], 16384: [1.0]}, 2)  # no growth with size: all latency
    assert flat.bandwidth == float("inf") and 0.5 < flat.latency < 1.0
    assert np.isfinite(fitted.bandwidth)


def test_bad_timed_jobs_are_refused():
    with pytest.raises(ValueError, match="warmup"):
        TimedJob(warmup=1)  # DDP rebuilds its buckets in the second step
    with pytest.raises(ValueError, match="straggler_s"):
        TimedJob(straggler_s=-1)
    with pytest.raises(ValueError, match="sweep_bytes"):
        TimedJob(sweep_bytes=(6,))


def test_the_timeline_plot_draws_each_ranks_median_step_and_its_buckets(ranks):
    """Each rank's bar row is its median step of the kind (by step time, found here): forward, backward until its
    last bucket was issued, the wait for the all-reduces, the rest; end to end they are the step. Under it, each
    bucket's all-reduce from issued to done, after the forward (ms)."""
    from anatomy_helpers.lessons.lesson11_scale import plot_timed_step

    from .figure_data import bars

    fig = plot_timed_step(ranks)
    for ax, kind in zip(fig.axes[:2], ("synced", "straggler"), strict=True):
        for r in ranks:
            steps = r.of(kind)
            middle = float(np.median([s.step for s in steps]))
            [s] = [s for s in steps if s.step == middle]
            y = 2 * (len(ranks) - 1 - r.rank)
            row = sorted((x, w) for x, yb, w, h, _ in bars(ax) if abs(yb + h / 2 - (y + 0.6)) < 1e-9)
            widths = [w / 1e3 for _, w in row]
            assert widths == pytest.approx([s.forward, s.backward_compute, s.wait, s.step - s.forward - s.backward])
            assert sum(widths) == pytest.approx(s.step) and s.backward_compute + s.wait == pytest.approx(s.backward)
            assert [x for x, _ in row] == pytest.approx(np.cumsum([0, *[w for _, w in row]])[:-1].tolist())
            spans = sorted(
                tuple(ln.get_xdata())
                for ln in ax.get_lines()
                if len(ln.get_xdata()) == 2 and list(ln.get_ydata()) == [y, y]
            )
            want = sorted(((s.forward + i) * 1e3, (s.forward + d) * 1e3) for _, i, d in s.buckets)
            np.testing.assert_allclose(np.array(spans), np.array(want))
