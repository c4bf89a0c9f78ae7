"""The 2-D mesh (TP inside a node x FSDP2 across nodes, distributed/mesh2d.py) dry-run on torch's fake process group:
one rank's model states against the shapes (computed here with torch.chunk, independently of the rules), the rules
at large N, and bad input (the full-depth rank from three shallow ones: tests/test_periodic_ranks.py)."""

import pytest
import torch
import torch.distributed as dist

from anatomy_helpers import make_model
from anatomy_helpers.distributed.fake_world import STEP_BYTES, dry_run_rank, mesh_states_rule
from anatomy_helpers.distributed.fit import memory_of, states_rule
from anatomy_helpers.distributed.mesh2d import check_mesh, tp_split_dims
from anatomy_helpers.distributed.ranks import RankJob
from anatomy_helpers.prediction.formulas import zero_model_states

MODEL = dict(n_layer=3, d_model=32, n_head=4, seq_len=16, attn_impl="sdpa")
WORLD, TP = 8, 2  # 4 nodes of 2 ranks
RANK = 7  # the last node (dp rank 3 of 4: a short chunk of the 59-row embedding), second TP rank
BASE = 3  # the rank dry-run with 3, 4 and 5 blocks
COLWISE = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias")  # split by output features
ROWWISE = ("attn.proj.weight", "mlp.proj.weight")  # split by input features (their biases stay whole)


def job(model: dict) -> RankJob:
    return RankJob("tp_fsdp", steps=1, batch_size=WORLD // TP, model=dict(model), tp=TP)


@pytest.fixture(scope="module")
def runs():
    """Rank RANK of the 2-D job dry-run with 3, 4 and 5 blocks: {blocks: RankResult}."""
    return {n: dry_run_rank(job({**MODEL, "n_layer": n}), WORLD, RANK).result for n in (BASE, BASE + 1, BASE + 2)}


def expected_states(model: dict, world_size: int, tp: int, rank: int) -> dict[str, int]:
    """From the real model's tensors: TP's shard (torch.chunk of the split dim), then FSDP2's dim-0 chunk of it over
    the dp nodes, padded to the first chunk's rows; AdamW's moments over the rows held, a 4-byte step each."""
    gpt = make_model(device="cpu", **model)
    dp, (dp_rank, tp_rank) = world_size // tp, divmod(rank, tp)
    params = grads = state = 0
    for name, p in gpt.named_parameters():
        local = p.detach()
        short = name.split(".", 2)[-1]
        if name.startswith("blocks.") and (short in COLWISE or short in ROWWISE):
            local = local.chunk(tp, dim=0 if short in COLWISE else 1)[tp_rank]
        pieces = local.chunk(dp, dim=0)
        mine = pieces[dp_rank] if dp_rank < len(pieces) else local[:0]
        params += pieces[0].nbytes
        grads += pieces[0].nbytes
        state += 2 * mine.nbytes + STEP_BYTES
    buffers = sum(b.nbytes for b in gpt.buffers())
    return {"parameters": params + buffers, "gradients": grads, "optimizer_state": state}


def states(result) -> dict[str, int]:
    return {k: result.model_states[k] for k in ("parameters", "gradients", "optimizer_state")}


def test_a_fake_2d_rank_holds_its_tp_shard_of_its_fsdp_chunk(runs):
    for n, result in runs.items():
        model = {**MODEL, "n_layer": n}
        assert result.backend == "fake" and result.world_size == WORLD
        assert states(result) == expected_states(model, WORLD, TP, RANK), n
        assert states(result) == mesh_states_rule(model, WORLD, TP, RANK), n
        assert result.torch_param_numel_bytes < result.torch_param_bytes  # padding: 59 rows on 4 nodes


def test_the_2d_rank_holds_less_than_fsdp_over_its_nodes_and_more_than_over_all_ranks(runs):
    """TP leaves the embeddings and LayerNorms whole on a node's ranks: between ZeRO-3 over N/tp and over N."""
    result = runs[BASE]
    held = sum(states(result).values())
    n = result.n_params
    over_nodes = sum(zero_model_states("fsdp2_zero3", n, WORLD // TP).values())
    assert sum(zero_model_states("fsdp2_zero3", n, WORLD).values()) < held < over_nodes


def test_the_rank_gathers_only_over_its_nodes(runs):
    """FSDP2's all-gathers run over the dp mesh (N / tp = 4 nodes): each is 4 x a padded shard of the group."""
    result = runs[BASE]
    gathers = [c.bytes for c in result.collectives if c.op == "_allgather_base_" and c.phase == "forward"]
    assert len(gathers) == BASE + 1  # the root's group (embeddings, final LayerNorm), then each block's
    assert sum(gathers) == (WORLD // TP) * result.torch_param_bytes  # every node's padded shard, once each


@pytest.mark.parametrize("world_size, tp, ranks", [(4096, 8, (0, 7, 4095)), (96, 4, (0, 63, 95)), (8, 1, (3,))])
def test_the_rules_at_large_n_equal_the_shapes(world_size, tp, ranks):
    model = {**MODEL, "n_head": 8, "d_model": 64}
    for rank in ranks:
        assert mesh_states_rule(model, world_size, tp, rank) == expected_states(model, world_size, tp, rank), rank


def test_tp_split_dims_are_read_from_the_plan():
    split = tp_split_dims()
    assert {k for k, d in split.items() if d == 0} == set(COLWISE)
    assert {k for k, d in split.items() if d == 1} == set(ROWWISE)


def test_memory_of_reads_the_rules_states(runs):
    row = memory_of("x", runs[BASE], TP)
    assert row.gradients == states_rule(MODEL, "tp_fsdp", WORLD, TP, RANK)["gradients"]


# ---- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: dry_run_rank(RankJob("tp_fsdp", batch_size=2, model=MODEL, tp=4), 6, 0),
            "\\(4\\) must divide the world size \\(6\\)",
        ),
        (lambda: dry_run_rank(RankJob("tp_fsdp", batch_size=2, model=dict(MODEL), tp=8), 16, 0), "divide n_head"),
        (lambda: dry_run_rank(RankJob("tp_fsdp", batch_size=3, model=dict(MODEL), tp=2), 8, 0), "N / tp nodes"),
        (lambda: RankJob("ddp", tp=2), "RankJob.tp is the TP degree"),
        (lambda: RankJob("tp_fsdp", tp=0), "RankJob.tp must be a positive integer"),
        (lambda: mesh_states_rule(MODEL, 10, 4), "must divide the world size"),
        (lambda: mesh_states_rule(MODEL, 8, 8), "divide n_head"),
        (lambda: check_mesh(8, True), "must be a positive integer"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(call, message):
    with pytest.raises(ValueError, match=message):
        call()
    assert not dist.is_initialized()
    assert torch.empty(1).device.type == "cpu"  # no fake mode left behind


def test_the_batch_rule_splits_rows_among_data_parallel_ranks_only():
    """run_world's check (world.check_jobs) splits the global batch as ranks.run_job does: among the N / tp nodes of
    a 2-D mesh (a node's TP ranks train the same rows), among no one under TP alone, among all N under DDP/FSDP."""
    from anatomy_helpers.distributed.world import check_jobs, data_parallel_ranks

    mesh = RankJob("tp_fsdp", batch_size=2, model=dict(MODEL), tp=2)
    assert data_parallel_ranks(mesh, 4) == (2, "the N / tp nodes") and check_jobs(mesh, 4) == [mesh]
    assert data_parallel_ranks(mesh, 64)[0] == 32
    tp = RankJob("tp", batch_size=1, model=dict(MODEL))
    assert data_parallel_ranks(tp, 2)[0] == 1 and check_jobs(tp, 2) == [tp]
    assert data_parallel_ranks(RankJob("fsdp2_zero3", batch_size=8), 4)[0] == 4
    for job, world, message in [
        (RankJob("tp_fsdp", batch_size=3, model=dict(MODEL), tp=2), 4, "multiple of the N / tp nodes x micro_batches "
         "\\(2 x 1\\)"),
        (RankJob("tp_fsdp", batch_size=4, model=dict(MODEL), tp=2, micro_batches=4), 4, "\\(2 x 4\\)"),
        (RankJob("tp_fsdp", batch_size=4, model=dict(MODEL), tp=3), 4, "\\(3\\) must divide the world size \\(4\\)"),
        (RankJob("ddp", batch_size=2, model=dict(MODEL)), 4, "multiple of world_size x micro_batches \\(4 x 1\\)"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            check_jobs(job, world)


# ---- the 7B / 70B table's reading ------------------------------------------------------------------------------


def test_smallest_fitting_n_takes_the_smallest_n_whose_peak_fits():
    from anatomy_helpers.distributed.fit import RankMemory, smallest_fitting_n

    def row(n, peak, strategy="ddp"):
        return RankMemory("m", strategy, 1, n, 0, 0, 0, 0, 0, peak)

    rows = [row(4096, 5), row(8, 20), row(1024, 10), row(8, 11, "zero1")]
    assert smallest_fitting_n(rows, device_bytes=10) == {("m", "ddp"): 1024, ("m", "zero1"): None}
    assert smallest_fitting_n(rows, device_bytes=20)[("m", "ddp")] == 8
