"""The synchronization model (distributed/sync_model.py): ring alpha-beta costs, overlap, the straggler tail."""

import numpy as np
import pytest

from anatomy_helpers.distributed.ranks import Collective
from anatomy_helpers.distributed.sync_model import (
    LINKS,
    Link,
    expected_max,
    measure_jitter,
    ring_seconds,
    step_time,
)

LINK = Link("test", bandwidth=1e9, latency=1e-5)


def test_ring_costs_by_hand():
    s = 8e6
    assert ring_seconds("all-reduce", s, 2, LINK) == pytest.approx(2 * 1e-5 + s / 1e9)  # each sends half, twice
    assert ring_seconds("all-reduce", s, 4, LINK) == pytest.approx(
        ring_seconds("reduce-scatter", s, 4, LINK) + ring_seconds("all-gather", s, 4, LINK)
    )
    assert ring_seconds("all-gather", s, 1, LINK) == 0.0
    big = ring_seconds("all-reduce", s, 4096, Link("no latency", 1e9, 0.0))
    assert big == pytest.approx(2 * s / 1e9, rel=1e-3)  # bandwidth term tends to 2S/beta
    with pytest.raises(ValueError, match="op must be one of"):
        ring_seconds("all-to-all", s, 4, LINK)
    assert set(LINKS) and all(link.bandwidth > 0 for link in LINKS.values())


def test_expected_max_of_the_empirical_distribution():
    rng = np.random.default_rng(0)
    samples = rng.lognormal(0.0, 0.2, size=50)
    assert expected_max(samples, 1) == pytest.approx(samples.mean())
    assert expected_max([2.0] * 7, 1000) == pytest.approx(2.0)
    draws = rng.choice(samples, size=(20_000, 16)).max(axis=1).mean()  # Monte Carlo, independent of the formula
    assert expected_max(samples, 16) == pytest.approx(draws, rel=0.01)
    values = [expected_max(samples, n) for n in (1, 8, 64, 4096)]
    assert values == sorted(values) and values[-1] <= samples.max()
    with pytest.raises(ValueError):
        expected_max([], 4)


def _coll(phase, op, nbytes):
    return Collective(index=0, time_s=0.0, step=1, phase=phase, op=op, bytes=nbytes)


def test_backward_all_reduces_hide_behind_backward_but_the_last():
    colls = [_coll("backward", "allreduce_", 1_000_000), _coll("backward", "allreduce_", 2_000_000)]
    t = step_time(colls, 8, flops=3e12, peak_flops=1e13, utilisation=1.0, link=LINK)
    last = ring_seconds("all-reduce", 2_000_000, 8, LINK)
    assert t.backward == pytest.approx(0.2) and t.exposed == pytest.approx(last)  # the rest hides
    assert t.step == pytest.approx(t.forward + t.backward + t.exposed) and t.straggler == 0.0
    slow = step_time(colls, 8, flops=3e9, peak_flops=1e13, utilisation=1.0, link=LINK)  # too little to hide behind
    # the first bucket (1 of 3 MB) is ready a third into backward; from then on the link never idles
    assert slow.exposed == pytest.approx(slow.backward / 3 + slow.communication - slow.backward)
    assert 0 < slow.efficiency < t.efficiency <= 1


def test_the_straggler_tail_grows_with_n():
    jitter = [0.9, 1.0, 1.0, 1.1, 1.5]
    times = [step_time([], n, flops=3e12, peak_flops=1e13, jitter=jitter).straggler for n in (1, 8, 4096)]
    assert times[0] < times[1] < times[2]
    assert times[2] == pytest.approx(0.75 * 0.5, rel=1e-6)  # compute 0.75 s x (max 1.5 - median 1.0)
    with pytest.raises(ValueError, match="utilisation"):
        step_time([], 8, flops=1.0, peak_flops=1.0, utilisation=0.0)


def test_measure_jitter_is_relative_to_the_median():
    j = measure_jitter(5, n_layer=1, d_model=32, n_head=2, seq_len=16)
    assert j.shape == (5,) and np.median(j) == pytest.approx(1.0) and (j > 0).all()


def test_scaling_curve_prices_each_worlds_dry_run_collectives():
    from anatomy_helpers.distributed.sync_model import scaling_curve

    from .conftest import SMALL

    rows = scaling_curve(SMALL, "fsdp2_zero3", (2, 16), peak_flops=1e12, link=LINK)
    assert [r.n for r in rows] == [2, 16]
    assert rows[0].forward == rows[1].forward > 0  # weak scaling: the same rows per rank
    assert 0 < rows[0].communication < rows[1].communication  # more ring steps, padded shards


def test_the_scaling_plot_has_one_line_per_strategy_and_units():
    import matplotlib.pyplot as plt

    from anatomy_helpers.plots import plot_scaling

    colls = [_coll("backward", "allreduce_", 4_000_000)]
    curves = {
        s: [step_time(colls if s == "ddp" else colls * 3, n, flops=3e9, peak_flops=1e12, link=LINK) for n in (8, 64)]
        for s in ("ddp", "fsdp")
    }
    fig = plot_scaling(curves)
    left, right = fig.axes
    assert "ms" in left.get_ylabel() and "ranks" in left.get_xlabel() and len(left.lines) == 4
    assert [line.get_label() for line in right.lines] == ["ddp", "fsdp"]
    assert list(right.lines[0].get_ydata()) == [r.efficiency for r in curves["ddp"]]
    assert fig._repr_png_()[:4] == b"\x89PNG" and not plt.get_fignums()
