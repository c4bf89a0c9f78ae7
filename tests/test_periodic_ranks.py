"""periodic_rank: one rank of a parallel job at its model's full depth, built from dry runs of that rank with 3, 4
and 5 blocks, equals the full-depth dry run of the rank byte for byte (DDP, ZeRO-1, FSDP2 with and without padding,
TP x FSDP2, first and last ranks); the model states equal the rules; where the rows do not repeat block by block it
runs the full dry run and says why."""

import dataclasses

import pytest

from anatomy_helpers.distributed.fake_world import dry_run_rank
from anatomy_helpers.distributed.fit import memory_of, periodic_rank, rank_job, states_rule
from anatomy_helpers.distributed.ranks import RankJob
from anatomy_helpers.prediction.periodic import trace_differences

# tiny widths: every dry run here takes a fraction of a second
MODEL = dict(d_model=16, n_head=2, seq_len=8, vocab_size=64, attn_impl="sdpa")

# (strategy, TP degree, N, rank, depth). ZeRO-1 at N = 128: more ranks than the model has parameters (7 blocks x 12
# + 4 = 88), so each rank holds the same ones at every depth (rank 0 the largest; rank 127 none). FSDP2 at N = 3:
# d_model 16 and the vocabulary's 64 rows are not divisible by 3, so every chunk is padded. The FSDP2 and TP x FSDP2
# rows at N = 4, depth 6, are also the fit table's rows (test_fit_table_is_the_periodic_rank_of_every_row).
CASES = [
    ("ddp", 1, 4, 0, 7),
    ("ddp", 1, 2, 1, 6),
    ("zero1", 1, 128, 0, 7),
    ("zero1", 1, 128, 127, 6),
    ("fsdp2_zero3", 1, 4, 0, 6),
    ("fsdp2_zero3", 1, 3, 2, 7),
    ("tp_fsdp", 2, 4, 0, 6),  # 2 nodes of 2
    ("tp_fsdp", 2, 6, 5, 8),  # 3 nodes of 2: the FSDP2 chunks of each TP shard are padded too
]


_PERIODIC = {}


def periodic(job, world_size, rank=0):
    """:func:`periodic_rank`, run once per (job, N, rank) in this module (it is deterministic: wall and CPU times
    aside, which nothing here reads): the fit table's test reads the rows the cases below have built."""
    key = (repr(job), world_size, rank)
    if key not in _PERIODIC:
        _PERIODIC[key] = periodic_rank(job, world_size, rank)
    return _PERIODIC[key]


@pytest.mark.parametrize("strategy, tp, world_size, rank, depth", CASES, ids=lambda x: str(x))
def test_periodic_rank_equals_the_full_dry_run(strategy, tp, world_size, rank, depth):
    job = rank_job({**MODEL, "n_layer": depth}, strategy, world_size, tp, 1)
    fast = periodic(job, world_size, rank)
    full = dry_run_rank(job, world_size, rank).result
    assert fast.why is None  # built from the three shallow runs, not the full one
    assert trace_differences(fast.trace, full.trace) == []
    assert fast.peak == full.peak
    assert fast.model_states == full.model_states
    rule = states_rule(job.model, strategy, world_size, tp, rank)
    assert {c: fast.model_states[c] for c in rule} == rule
    assert memory_of("x", fast, tp) == memory_of("x", full, tp)  # every figure of the fit table


def test_zero1_whose_partition_changes_with_depth_runs_in_full():
    """ZeRO-1 on 4 ranks: its whole-parameter partition (largest first, to the emptiest rank) gives rank 0 other
    parameters at each depth, so the rows do not repeat block by block: the full dry run, and why."""
    job = rank_job({**MODEL, "n_layer": 6}, "zero1", 4, 1, 1)
    run = periodic_rank(job, 4, 0)
    assert run.why is not None and run.why.startswith("full dry run: the ") and "block" in run.why
    full = dry_run_rank(job, 4, 0).result
    assert trace_differences(run.trace, full.trace) == [] and run.model_states == full.model_states


def test_shallow_models_run_in_full():
    run = periodic_rank(rank_job({**MODEL, "n_layer": 5}, "fsdp2_zero3", 2, 1, 1), 2, 0)
    assert run.why == "full dry run: n_layer 5 is at most 5, the deepest run the period is read from"
    assert "blocks.4" in " ".join(run.trace.timeline.module_names)


def test_states_that_differ_from_the_rules_run_in_full(monkeypatch):
    """A built trace whose model states are not the rules' is not trusted: the full dry run, and why."""
    from anatomy_helpers.distributed import fit

    monkeypatch.setattr(fit, "states_rule", lambda *a: {"parameters": 1, "gradients": 0, "optimizer_state": 0})
    run = periodic_rank(rank_job({**MODEL, "n_layer": 6}, "ddp", 2, 1, 1), 2, 0)
    assert run.why.startswith("full dry run: the model states read from the built trace")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: periodic_rank(dataclasses.asdict(RankJob("ddp")), 2), "job must be a RankJob"),
        (lambda: periodic_rank(RankJob("ddp", batch_size=3, model={**MODEL, "n_layer": 6}), 2), "multiple of"),
        (lambda: periodic_rank(RankJob("ddp", model={**MODEL, "n_layer": 6, "n_head": 3}), 2), "n_head"),
    ],
)
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_fit_table_is_the_periodic_rank_of_every_row(monkeypatch):
    """fit_table's rows are periodic_memory's, rank 0 of each strategy at each N; the periodic ranks themselves are
    the ones test_periodic_rank_equals_the_full_dry_run checked against the full dry run (the same jobs: run once)."""
    from anatomy_helpers.distributed import fit
    from anatomy_helpers.distributed.fit import fit_table, periodic_memory

    monkeypatch.setattr(fit, "periodic_rank", periodic)

    seen = []

    def iterate(runs):
        seen.extend(runs)
        return iter(runs)

    shapes = {"tiny": {**MODEL, "n_layer": 6}}
    table = fit_table(shapes, [("fsdp2_zero3", 1), ("tp_fsdp", 2)], [4], iterate=iterate)
    assert len(seen) == 2 and [m.label for m, _ in table] == ["fsdp2_zero3", "tp2 x fsdp2"]
    assert table[1] == periodic_memory("tiny", shapes["tiny"], "tp_fsdp", 4, 2)
    for (memory, _), strategy, tp in zip(table, ("fsdp2_zero3", "tp_fsdp"), (1, 2)):
        job = rank_job(shapes["tiny"], strategy, 4, tp, 1)
        assert memory == memory_of("tiny", periodic(job, 4, 0), tp) and memory.world_size == 4
    assert all(why is None for _, why in table)
