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


def test_scaling_curve_prices_fsdp2_by_the_rule_as_it_would_price_the_dry_run():
    from anatomy_helpers.distributed.fake_world import dry_run_rank
    from anatomy_helpers.distributed.ranks import RankJob
    from anatomy_helpers.distributed.sync_model import scaling_curve

    from .conftest import SMALL

    rows = scaling_curve(SMALL, "fsdp2_zero3", (2, 16), peak_flops=1e12, link=LINK)
    assert [r.n for r in rows] == [2, 16]
    assert rows[0].forward == rows[1].forward > 0  # weak scaling: the same rows per rank
    assert 0 < rows[0].communication < rows[1].communication  # more ring steps, padded shards
    traced = dry_run_rank(RankJob("fsdp2_zero3", steps=1, warmup=0, batch_size=16, model=dict(SMALL)), 16).result
    dry = step_time(traced.collectives, 16, flops=1.0, peak_flops=1e12, link=LINK)
    assert rows[1].priced == dry.priced and rows[1].communication == dry.communication


def test_the_scaling_plot_has_one_line_per_strategy_and_units():
    import matplotlib.pyplot as plt

    from anatomy_helpers.ui.plots import OKABE_ITO, STRATEGY_COLORS, plot_scaling

    colls = [_coll("backward", "allreduce_", 4_000_000)]
    curves = {
        s: [step_time(colls if s == "ddp" else colls * 3, n, flops=3e9, peak_flops=1e12, link=LINK) for n in (8, 64)]
        for s in ("ddp", "fsdp", "tp_fsdp")
    }
    fig = plot_scaling(curves)
    left, right = fig.axes
    assert "ms" in left.get_ylabel() and "ranks" in left.get_xlabel() and len(left.lines) == 6
    assert [line.get_label() for line in right.lines] == ["ddp", "fsdp", "tp_fsdp"]
    colours = [line.get_color() for line in right.lines]  # the course's palette, each strategy its own colour
    assert colours[0] == STRATEGY_COLORS["ddp"] and colours[2] == STRATEGY_COLORS["tp_fsdp"]
    assert set(colours) <= set(OKABE_ITO) and len(set(colours)) == 3
    assert list(right.lines[0].get_ydata()) == [r.efficiency for r in curves["ddp"]]
    # the plotted data is what the labels claim: per strategy the step, then its compute (forward + backward, the
    # backward twice the forward), in ms, at each N
    for (name, rows), step, compute in zip(curves.items(), left.lines[::2], left.lines[1::2], strict=True):
        assert step.get_label() == f"{name}: step" and compute.get_label() == f"{name}: compute"
        assert list(step.get_xdata()) == list(compute.get_xdata()) == [8, 64]
        assert list(step.get_ydata()) == pytest.approx([r.step * 1e3 for r in rows])
        assert list(compute.get_ydata()) == pytest.approx([3 * r.forward * 1e3 for r in rows])
        assert all(r.backward == pytest.approx(2 * r.forward) and r.forward > 0 for r in rows)
    assert fig._repr_png_()[:4] == b"\x89PNG" and not plt.get_fignums()


# ---- tensor parallelism x FSDP: each collective on its own group and link ------------------------------------

NVLINK = Link("test nvlink", bandwidth=4e11, latency=2e-6)  # inside a node
IB = Link("test ib", bandwidth=5e10, latency=5e-6)  # across nodes
MESH_MODEL = dict(n_layer=1, d_model=32, n_head=4, seq_len=8)


@pytest.mark.parametrize(
    "op, name",
    [
        ("allreduce_", "all-reduce"),
        ("all_reduce", "all-reduce"),
        ("_allgather_base_", "all-gather"),
        ("all_gather_into_tensor", "all-gather"),
        ("_reduce_scatter_base_", "reduce-scatter"),
        ("reduce_scatter_tensor", "reduce-scatter"),
        ("broadcast_", "broadcast"),
        ("all_to_all_single", "all-to-all"),
    ],
)
def test_collective_name_knows_c10d_and_functional_ops(op, name):
    from anatomy_helpers.distributed.sync_model import collective_name, is_tensor_parallel

    assert collective_name(op) == name
    assert is_tensor_parallel(op) == (op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                             "all_to_all_single"))  # fmt: skip


def ring_by_hand(steps: int, ranks: int, nbytes: float, link: Link) -> float:
    """``steps`` ring steps, each one message of ``nbytes / ranks`` (Thakur et al.), written out here."""
    return steps * (link.latency + nbytes / ranks / link.bandwidth)


def test_tp_collectives_are_priced_on_the_node_over_nvlink_and_all_exposed():
    """N = 64 as 8 nodes of t = 8: TP's all-reduces on 8 ranks over NVLink, none hidden; FSDP2's collectives on the
    N / t = 8 nodes over the inter-node link, overlapped with compute (here: plenty of it)."""
    n, t, act, gathered, shard = 64, 8, 3_000_000, 8_000_000, 125_000  # a reduce-scatter's output: one shard
    colls = [
        _coll("forward", "_allgather_base_", gathered),
        _coll("forward", "all_reduce", act),
        _coll("forward", "all_reduce", act),
        _coll("backward", "all_reduce", act),
        _coll("backward", "all_reduce", act),
        _coll("backward", "_reduce_scatter_base_", shard),
    ]
    s = step_time(colls, n, flops=3e12, peak_flops=1e12, utilisation=1.0, link=IB, tp=t, tp_link=NVLINK)
    tp_time = 4 * ring_by_hand(2 * (t - 1), t, act, NVLINK)
    first_gather = ring_by_hand(n // t - 1, n // t, gathered, IB)
    scatter = ring_by_hand(n // t - 1, n // t, shard * (n // t), IB)  # the ring reduces every node's shard
    assert s.tensor_parallel == pytest.approx(tp_time, rel=1e-12)
    assert s.communication == pytest.approx(tp_time + first_gather + scatter, rel=1e-12)
    # exposed: TP's all-reduces, the first all-gather (nothing to hide behind) and backward's last collective (ready
    # only as backward ends: its gradients are the last ones made)
    assert s.exposed == pytest.approx(tp_time + first_gather + scatter, rel=1e-12)
    assert s.step == pytest.approx(3.0 + tp_time + first_gather + scatter, rel=1e-12)
    assert [(p.ranks, p.link, p.tensor_parallel) for p in s.priced] == [(8, "test ib", False)] + [
        (8, "test nvlink", True)
    ] * 4 + [(8, "test ib", False)]
    assert s.latency == pytest.approx(4 * 14 * NVLINK.latency + 2 * 7 * IB.latency, rel=1e-12)
    # the same trace on N = 512: TP's group is still one node, FSDP2's ring grows to 64 nodes
    big = step_time(colls, 512, flops=3e12, peak_flops=1e12, utilisation=1.0, link=IB, tp=t, tp_link=NVLINK)
    assert big.tensor_parallel == s.tensor_parallel
    assert {p.ranks for p in big.priced if not p.tensor_parallel} == {64}


def test_tp_pricing_refuses_what_it_cannot_price():
    colls = [_coll("forward", "all_reduce", 1000)]
    with pytest.raises(ValueError, match="pass tp"):
        step_time(colls, 8, flops=1e9, peak_flops=1e12)  # TP's collectives priced on a group of one: free
    with pytest.raises(ValueError, match="must divide the world size"):
        step_time(colls, 12, flops=1e9, peak_flops=1e12, tp=8)
    from anatomy_helpers.distributed.sync_model import scaling_curve

    with pytest.raises(ValueError, match="tp is the TP degree"):
        scaling_curve(MESH_MODEL, "ddp", (8,), peak_flops=1e12, tp=4)


def test_a_tp_ranks_flops_are_its_share_of_the_blocks_and_the_whole_head():
    """FlopCounterMode on one rank's GEMM widths against the closed form: forward 2 x (rows s) x (12 h^2 / t) per
    block for the four GEMMs, plus 4 rows s^2 h / t for attention's two products; backward twice forward; the head
    2 rows s h V, whole on every rank."""
    from anatomy_helpers.core.model import ModelConfig
    from anatomy_helpers.distributed.sync_model import tp_rank_flops

    cfg = ModelConfig(**MESH_MODEL)
    r, s, h, v, layers = 3, cfg.seq_len, cfg.d_model, cfg.vocab_size, cfg.n_layer
    for t in (1, 2, 4):
        block = 2 * r * s * 12 * h * h // t + 4 * r * s * s * h // t
        assert tp_rank_flops(MESH_MODEL, r, t) == 3 * (layers * block + 2 * r * s * h * v), t
    with pytest.raises(ValueError, match="divide n_head"):
        tp_rank_flops(MESH_MODEL, 1, 3)


def group_size(func, args) -> int | None:
    """The size of the process group a collective ran on, read from its own arguments: c10d's ``process_group``
    (a ProcessGroup script object) or a functional collective's ``group_name``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg, value in zip(func._schema.arguments, args):
        if arg.name == "process_group":
            return dist.ProcessGroup.unbox(value).size()
        if arg.name == "group_name":
            return _resolve_process_group(value).size()
    return None


MESH_ROWS, MESH_TP = 2, 4


@pytest.fixture(scope="module")
def mesh_curve():
    """The TP x FSDP curve of MESH_MODEL at N = 4 (one node) and 32 (8 nodes) of t = 4, on the test links."""
    from anatomy_helpers.distributed.sync_model import scaling_curve

    return scaling_curve(MESH_MODEL, "tp_fsdp", (4, 32), rows_per_rank=MESH_ROWS, peak_flops=1e12, utilisation=1.0,
                         link=IB, tp=MESH_TP, tp_link=NVLINK)  # fmt: skip


def test_the_tp_fsdp_curve_prices_tps_all_reduces_of_a_nodes_rows(mesh_curve):
    """Weak scaling: a node of t ranks trains t x rows_per_rank rows; each of TP's 4 all-reduces per block carries
    their residual stream (rows x s x h x 4 bytes), on t ranks over the TP link, the same at every N."""
    from anatomy_helpers.distributed.sync_model import tp_rank_flops

    t = MESH_TP
    stream = MESH_ROWS * t * MESH_MODEL["seq_len"] * MESH_MODEL["d_model"] * 4
    per_step = 4 * MESH_MODEL["n_layer"] * ring_by_hand(2 * (t - 1), t, stream, NVLINK)
    for s in mesh_curve:
        tp_parts = [p for p in s.priced if p.tensor_parallel]
        assert [(p.op, p.bytes, p.ranks) for p in tp_parts] == [("all-reduce", stream, t)] * 4
        assert s.tensor_parallel == pytest.approx(per_step, rel=1e-12)
        flops = tp_rank_flops(MESH_MODEL, MESH_ROWS * t, t)
        assert s.forward + s.backward == pytest.approx(flops / 1e12, rel=1e-12)
    one_node, eight = ([p for p in s.priced if not p.tensor_parallel] for s in mesh_curve)
    assert not one_node  # N = t: FSDP2 has no other node to talk to
    assert eight and {p.ranks for p in eight} == {32 // t} and {p.link for p in eight} == {IB.name}


def test_each_collective_of_a_2d_rank_is_priced_on_the_group_it_ran_on(monkeypatch, mesh_curve):
    """A dry-run rank of 32 = 8 nodes x t = 4, warmed up as a real rank is: the group each collective really ran on
    (its process group's size, read from its arguments) is the group the model prices it on, collective by
    collective; and the curve (whose dry runs skip the warm-up) priced exactly these collectives."""
    from anatomy_helpers.distributed import ranks
    from anatomy_helpers.distributed.fake_world import dry_run_rank
    from anatomy_helpers.distributed.ranks import RankJob
    from anatomy_helpers.distributed.sync_model import price_step

    groups: dict[int, list] = {}
    original = ranks.RankTracker._on_collective

    def noting(self, func, args, out, mark=True):
        if self.recording:
            groups.setdefault(id(self.collectives), []).append(group_size(func, args))
        return original(self, func, args, out, mark)

    monkeypatch.setattr(ranks.RankTracker, "_on_collective", noting)
    n, t = 32, MESH_TP
    job = RankJob("tp_fsdp", steps=1, batch_size=MESH_ROWS * n, model=MESH_MODEL, tp=t)
    assert job.warmup > 0
    result = dry_run_rank(job, n).result
    ran_on = groups[id(result.collectives)]
    s = mesh_curve[1]
    priced = price_step(result.collectives, n, forward=s.forward, backward=s.backward, link=IB, tp=t, tp_link=NVLINK)
    assert [p.ranks for p in priced.priced] == ran_on and set(ran_on) == {t, n // t}
    assert priced.priced == s.priced  # the curve's dry run (no warm-up) issued the same collectives
