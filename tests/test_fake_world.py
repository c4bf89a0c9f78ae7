"""One rank of an N-rank job dry-run in this process (distributed/fake_world.py): equal to real gloo ranks byte for
byte at N = 4 (N = 2: tests/test_distributed.py, on that module's world), and at large N equal to the rules
lesson 08 found, which the ZeRO formulas are with even splits. One real world for the module (4 processes)."""

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from anatomy_helpers import make_model
from anatomy_helpers.core.model import GPT, ModelConfig
from anatomy_helpers.core.tensors import storage_bytes
from anatomy_helpers.distributed import fake_world
from anatomy_helpers.distributed.fake_world import (
    STEP_BYTES,
    dry_run_rank,
    fake_process_group,
    format_world_table,
    fsdp_rows,
    model_states_rule,
    rank_differences,
    world_rows,
    zero1_partition,
)
from anatomy_helpers.distributed.ranks import STRATEGIES, RankJob
from anatomy_helpers.distributed.world import run_world
from anatomy_helpers.prediction.dryrun import course_batch
from anatomy_helpers.prediction.formulas import zero_model_states

from .conftest import SMALL

WORLD = 4


def job(strategy: str, world_size: int, rows_per_rank: int = 1) -> RankJob:
    return RankJob(strategy, steps=1, batch_size=rows_per_rank * world_size, model=dict(SMALL))


# 2-D: 2 nodes of 2 ranks, one row per node (a batch of 2 on 4 ranks: the rows are split among the nodes only)
MESH_JOB = RankJob("tp_fsdp", steps=1, batch_size=WORLD // 2, model=dict(SMALL), tp=2)


@pytest.fixture(scope="module")
def world4():
    return run_world([job(s, WORLD) for s in STRATEGIES] + [MESH_JOB], WORLD)


def model_states(result) -> dict[str, int]:
    return {k: result.model_states[k] for k in ("parameters", "gradients", "optimizer_state")}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_fake_rank_equals_its_real_gloo_rank_byte_for_byte(world4, strategy):
    for rank in range(WORLD):
        fake = dry_run_rank(job(strategy, WORLD), WORLD, rank).result
        assert fake.backend == "fake" and world4[strategy][rank].backend == "gloo"
        assert rank_differences(world4[strategy][rank], fake) == {}, (strategy, rank)


def test_rank_differences_names_what_differs(world4):
    real = world4["fsdp2_zero3"]
    diff = rank_differences(real[0], real[WORLD - 1])  # rank 0 holds more optimizer state than the last rank
    assert "optimizer_state" in diff and diff["optimizer_state"][0] > diff["optimizer_state"][1]
    assert "parameters" not in diff  # every FSDP shard is padded to the same rows


# ---- large N: the rules, checked against the dry run; the formulas, against the rules --------------------------


@pytest.mark.parametrize(
    "strategy, world_size, ranks",
    [
        ("ddp", 4096, (0, 4095)),
        ("ddp_bucket_view", 1024, (1023,)),
        ("zero1", 4096, (0, 1, 4095)),  # the largest parameter alone on rank 0; the last ranks hold no state
        ("fsdp2_zero2", 96, (0, 63, 64)),  # 64 rows of d_model: one on each of ranks 0-63, none after
        ("fsdp2_zero3", 1024, (1023,)),
    ],
)
def test_dry_run_model_states_follow_the_rules_at_large_n(strategy, world_size, ranks):
    for rank in ranks:
        run = dry_run_rank(job(strategy, world_size), world_size, rank)
        assert run.result.world_size == world_size
        assert model_states(run.result) == model_states_rule(SMALL, strategy, world_size, rank), (strategy, rank)


def test_fsdp_rows_are_torch_chunk_padded_to_the_first_chunk():
    for dim0 in (1, 5, 64, 65, 100):
        for n in (1, 2, 3, 7, 96, 4096):
            pieces = torch.empty(dim0).chunk(n)
            for rank in range(n):
                held, padded = fsdp_rows(dim0, n, rank)
                assert held == (pieces[rank].numel() if rank < len(pieces) else 0)
                assert padded == pieces[0].numel()


# A model whose rows few N divide (d_model 100, 300 in qkv, 400 in the MLP, the 59-token embedding), with three blocks
# to show FSDP2's backward prefetch order; beside it notebook 11's time model (d_model 1,024).
PADDED = dict(n_layer=3, d_model=100, n_head=4, seq_len=16)


@pytest.mark.parametrize("model", ["PADDED", "SYNC_CONFIG"])
def test_the_fsdp_collectives_rule_is_what_a_dry_run_rank_issues(model):
    """fsdp_collectives_rule against dry-run ranks: every collective (phase, op, bytes), in order, at N = 1 (FSDP2
    issues none), powers of two and not (96 pads d_model = 1,024 too; 128 leaves PADDED's last ranks empty rows);
    at 96 the padding shows."""
    from anatomy_helpers.distributed.fake_world import fsdp_collectives_rule
    from anatomy_helpers.lessons.lesson11_scale import SYNC_CONFIG

    config, world_sizes = (PADDED, (1, 8, 96, 128)) if model == "PADDED" else (SYNC_CONFIG, (96,))
    traced = {}
    for n in world_sizes:
        fsdp = RankJob("fsdp2_zero3", steps=1, warmup=0, batch_size=n, model=dict(config))
        traced[n] = [(c.phase, c.op, c.bytes) for c in dry_run_rank(fsdp, n, 0).result.collectives]
        assert [(c.phase, c.op, c.bytes) for c in fsdp_collectives_rule(config, n)] == traced[n], n
    with torch.device("meta"):
        gradients = sum(p.numel() * p.element_size() for p in GPT(ModelConfig(**config)).parameters())
    reduced = sum(nbytes for _, op, nbytes in traced[96] if op == "_reduce_scatter_base_")  # one rank's shard
    assert 96 * reduced > gradients  # every rank's padded shard: more than the gradients


def test_zero1_partition_is_largest_first_onto_the_emptiest_rank():
    assert zero1_partition([10, 30, 20, 5], 2) == [[1, 3], [2, 0]]
    assert zero1_partition([4, 4, 4], 4) == [[0], [1], [2], []]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_zero_formulas_are_the_rules_without_padding_buffers_or_step_counts(strategy):
    """Summed over every rank, the sharded states hold every element once: the rules then equal N x the formula's
    share, plus the buffers, the step counts and the padding, each computed here from the model's tensors."""
    model = make_model(device="cpu", **SMALL)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    world_size = 96
    rules = [model_states_rule(SMALL, strategy, world_size, r) for r in range(world_size)]
    formula = zero_model_states(strategy, n, world_size)
    moments = sum(r["optimizer_state"] for r in rules)
    steps = STEP_BYTES * len(params) * (1 if strategy == "zero1" else world_size)  # ZeRO-1: each on one rank
    assert moments - steps == formula["optimizer_state"] * world_size
    if strategy.startswith("fsdp"):
        padded = sum(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) * 4 for p in params)
        assert all(r["gradients"] == padded and r["parameters"] == padded + buffers for r in rules)
        assert padded * world_size > formula["gradients"] * world_size  # padding: 64 rows on 96 ranks
    else:
        assert all(r["parameters"] == formula["parameters"] + buffers for r in rules)
        assert all(r["gradients"] == formula["gradients"] for r in rules)


# ---- bad input, and nothing left behind ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        ((job("ddp", 4), 0, 0), "world_size must be an integer"),
        ((job("ddp", 4), 4, 4), "rank must be in"),
        ((job("ddp", 4), 3, 0), "must be a multiple of world_size"),
        ((RankJob("ddp", batch_size=4, model=dict(SMALL), fault="raise"), 4, 0), "no faults"),
        (("ddp", 4, 0), "job must be a RankJob"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(args, message):
    with pytest.raises(ValueError, match=message):
        dry_run_rank(*args)
    assert not dist.is_initialized()


def test_a_process_group_already_up_is_refused_and_left_alone():
    with fake_process_group(2, 0):
        with pytest.raises(ValueError, match="already initialised"):
            dry_run_rank(job("ddp", 2), 2, 0)
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_a_failing_dry_run_leaves_no_process_group_and_no_mode(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(fake_world, "run_job", boom)
    with pytest.raises(RuntimeError, match="injected"):
        dry_run_rank(job("fsdp2_zero3", 8), 8, 0)
    assert not dist.is_initialized() and _get_current_dispatch_mode() is None


def test_model_states_rule_refuses_bad_input():
    with pytest.raises(ValueError, match="strategy must be one of"):
        model_states_rule(SMALL, "tp", 8)
    with pytest.raises(ValueError, match="rank must be in"):
        model_states_rule(SMALL, "ddp", 8, 8)


def test_storage_bytes_counts_fake_storages_apart():
    with FakeTensorMode():
        a, b = torch.empty(10), torch.empty(6)
        assert storage_bytes([a, b, a[2:]]) == 64


def test_world_rows_give_each_asked_rank_with_its_formula_and_rules():
    rows = world_rows(SMALL, ["zero1"], (2, 8), ranks=(0, -1))
    assert [(r.world_size, r.rank) for r in rows] == [(2, 0), (2, 1), (8, 0), (8, 7)]
    for r in rows:
        assert r.model_states == r.rule_model_states
        n_params = sum(p.numel() for p in make_model(device="cpu", **SMALL).parameters())
        assert r.formula_model_states == sum(zero_model_states("zero1", n_params, r.world_size).values())
    assert rows[3].optimizer_state < rows[1].optimizer_state  # more ranks, less state on each
    table = format_world_table(rows)
    assert table.count(" yes") == 4 and "KiB per rank" in table


def test_the_step_ops_are_checked_and_the_collectives_left_out():
    from anatomy_helpers.prediction import fake_check

    cfg, ddp = ModelConfig(**SMALL), job("ddp", 2)
    run, calls = fake_world.fake_rank(ddp, 2, 0, lambda: GPT(cfg), lambda i: course_batch(ddp.batch_size, cfg.seq_len))
    assert not any(str(call.func).startswith("c10d.") for call in calls.values())
    assert run.result.collectives  # the all-reduce was issued all the same
    dry_run_rank(job("ddp", 2), 2, 0)  # (calls holds only signatures this session has not checked yet)
    assert any(isinstance(key, tuple) and str(key[0]) == "aten.addmm.default" for key in fake_check._PASSED)


def test_an_fsdp_rank_is_exact_as_the_first_dry_run_of_a_process(tmp_path):
    """FSDP2 resizes its unsharded storages to 0; an op that only reads a tensor's metadata (prim.device) on one
    must not be refused (fake_check: no output, nothing written, nothing to check). A fresh process and an empty
    cache on disk: no op signature checked before."""
    import os
    import subprocess
    import sys

    code = (
        "from anatomy_helpers.distributed.ranks import RankJob\n"
        "from anatomy_helpers.distributed.fake_world import dry_run_rank\n"
        f"r = dry_run_rank(RankJob('fsdp2_zero3', steps=1, batch_size=2, model={SMALL!r}), 2, 1).result\n"
        "print(r.model_states['optimizer_state'])\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", ANATOMY_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == model_states_rule(SMALL, "fsdp2_zero3", 2, 1)["optimizer_state"]


@pytest.mark.parametrize("rank", [0, WORLD - 1])
def test_a_fake_2d_rank_equals_its_real_gloo_rank_byte_for_byte(world4, rank):
    """TP x FSDP2 on a (2, 2) mesh (distributed/mesh2d.py): the first rank of the first node, the last of the last."""
    real = world4["tp_fsdp"][rank]
    assert real.backend == "gloo" and real.world_size == WORLD
    assert rank_differences(real, dry_run_rank(MESH_JOB, WORLD, rank).result) == {}


def test_the_time_model_prices_what_a_real_2d_rank_issued(world4):
    """The TP x FSDP time model's input, from real gloo ranks (2 nodes x 2): each block's 4 all-reduces (2 in forward,
    2 in backward) of a node's rows' residual stream, priced on the node's 2 ranks; every other collective FSDP2's
    all-gathers and reduce-scatters, priced on the 2 nodes; nothing else."""
    from anatomy_helpers.distributed.sync_model import price_step

    tp = MESH_JOB.tp
    rows = MESH_JOB.batch_size // (WORLD // tp)  # a node's rows
    stream = rows * SMALL["seq_len"] * SMALL["d_model"] * 4  # float32
    blocks = SMALL["n_layer"]
    for real in world4["tp_fsdp"]:
        priced = price_step(real.collectives, WORLD, forward=1.0, backward=1.0, tp=tp).priced
        assert len(priced) == len(real.collectives)
        assert [(p.phase, p.op, p.bytes, p.ranks) for p in priced if p.tensor_parallel] == [
            ("forward", "all-reduce", stream, tp)
        ] * (2 * blocks) + [("backward", "all-reduce", stream, tp)] * (2 * blocks)
        fsdp = [p for p in priced if not p.tensor_parallel]
        assert {(p.op, p.ranks) for p in fsdp} == {("all-gather", WORLD // tp), ("reduce-scatter", WORLD // tp)}
        # what FSDP2 reduces is what it gathered: every node's padded shard of every parameter, once each way
        gathered = {p.bytes for p in fsdp if p.op == "all-gather" and p.phase == "forward"}
        assert sum(p.bytes for p in fsdp if p.op == "reduce-scatter") == (WORLD // tp) * real.torch_param_bytes
        assert gathered
