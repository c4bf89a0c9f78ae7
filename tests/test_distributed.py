"""Per-rank memory under DDP, ZeRO-1 and FSDP2 on a 2-process gloo group, against torch's own figures.

One world runs every strategy once for the whole module (starting processes is what costs time).
"""

import os
import subprocess
import sys

import pytest
import torch

from anatomy_helpers import make_model
from anatomy_helpers.distributed.fake_world import dry_run_rank, rank_differences
from anatomy_helpers.distributed.ranks import STRATEGIES, RankJob
from anatomy_helpers.distributed.world import format_rank_table, rank_rows, run_world
from anatomy_helpers.prediction.formulas import zero_model_states

from .conftest import SMALL

WORLD = 2
NOTEBOOK_COLUMN_PX = 820  # a notebook output in JupyterLab in a 1280 px window: 844 px (scripts/browser_check.py)


@pytest.fixture(scope="module")
def world():
    return run_world([RankJob(s, steps=1, batch_size=4, model=SMALL) for s in STRATEGIES], WORLD)


@pytest.fixture(scope="module")
def reference():
    """(parameter bytes, buffer bytes) of the SMALL model, computed here from its tensors."""
    model = make_model(device="cpu", **SMALL)
    return (
        sum(p.numel() * p.element_size() for p in model.parameters()),
        sum(b.untyped_storage().nbytes() for b in model.buffers()),
    )


def test_every_strategy_ran_on_every_rank(world):
    assert set(world) == set(STRATEGIES)
    assert all([r.rank for r in ranks] == list(range(WORLD)) for ranks in world.values())
    assert all(r.backend == "gloo" for ranks in world.values() for r in ranks)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_tracked_model_states_match_torchs_own_tensors(world, reference, strategy):
    _, buffers = reference
    for r in world[strategy]:
        assert r.model_states["parameters"] == r.torch_param_bytes + buffers  # buffers count as parameters
        assert r.model_states["gradients"] == r.torch_grad_bytes
        assert r.model_states["optimizer_state"] == r.torch_state_bytes


def test_replicated_strategies_hold_the_whole_model_on_every_rank(world, reference):
    params, _ = reference
    for strategy in ("ddp", "ddp_bucket_view", "zero1"):
        for r in world[strategy]:
            assert r.torch_param_bytes == params and r.torch_grad_bytes == params


def test_zero1_splits_the_optimizer_state_between_ranks(world):
    full = world["ddp"][0].torch_state_bytes
    shards = [r.torch_state_bytes for r in world["zero1"]]
    assert sum(shards) == full  # each parameter's state lives on exactly one rank
    assert max(shards) < full


@pytest.mark.parametrize("strategy", ["fsdp2_zero2", "fsdp2_zero3"])
def test_fsdp_shards_parameters_gradients_and_state(world, reference, strategy):
    params, _ = reference
    ranks = world[strategy]
    assert sum(r.torch_param_numel_bytes for r in ranks) == params  # the local shards partition the model
    for r in ranks:
        assert r.torch_param_numel_bytes <= r.torch_param_bytes < params  # padding only adds
        assert r.torch_grad_bytes == r.torch_param_bytes  # a gradient shard per parameter shard
    full = world["ddp"][0].torch_state_bytes
    assert all(r.torch_state_bytes < 0.6 * full for r in ranks)  # about half each ...
    assert sum(r.torch_state_bytes for r in ranks) >= full  # ... plus padding and a step count per rank


def test_ddp_buckets_are_communication_unless_gradients_are_views_of_them(world, reference):
    params, _ = reference
    for r in world["ddp"]:
        assert r.model_states["communication"] == params  # the buckets: one copy of every gradient
    for r in world["ddp_bucket_view"]:
        assert r.model_states["communication"] == 0
        assert r.model_states["gradients"] == params  # the buckets are the gradients


def test_fsdp_all_gathers_are_communication_and_zero3_frees_them_after_forward(world, reference):
    params, _ = reference
    zero2 = [r.trace.timeline.category("communication").max() for r in world["fsdp2_zero2"]]
    zero3 = [r.trace.timeline.category("communication").max() for r in world["fsdp2_zero3"]]
    assert min(zero2) >= params  # every block's full parameters alive between forward and backward
    assert max(zero3) < min(zero2)
    for r in world["fsdp2_zero3"]:
        assert r.model_states["communication"] == 0  # nothing all-gathered is left when the optimizer runs


def test_collectives_are_marked_where_each_strategy_issues_them(world):
    def ops(strategy, phase):
        return {c.op for c in world[strategy][0].collectives if c.phase == phase}

    assert any("allreduce" in op for op in ops("ddp", "backward"))
    assert any("allgather" in op for op in ops("fsdp2_zero3", "forward"))
    assert any("allgather" in op for op in ops("fsdp2_zero3", "backward"))  # re-gathered for backward
    assert any("reduce_scatter" in op for op in ops("fsdp2_zero3", "backward"))
    assert not any("allgather" in op for op in ops("fsdp2_zero2", "backward"))  # kept from forward
    assert any("broadcast" in op for op in ops("zero1", "optimizer"))  # each owner sends its updated shard


def test_formulas_and_the_table(world):
    f = zero_model_states("fsdp2_zero3", 1000, 4)
    assert f == {"parameters": 1000.0, "gradients": 1000.0, "optimizer_state": 2000.0}
    assert zero_model_states("zero1", 1000, 4)["gradients"] == 4000
    rows = rank_rows(world)
    assert len(rows) == len(STRATEGIES) * WORLD
    text = format_rank_table(rows)
    assert all(s in text for s in STRATEGIES)


def test_torchrun_runs_the_same_entry_point_and_rank_0_prints_every_rank(tmp_path):
    """``torchrun -m anatomy_helpers.distributed``: each rank joins the group itself; rank 0 gathers the rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += ["-m", "anatomy_helpers.distributed", "--strategies", "ddp", "--steps", "1", "--batch-size", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("ddp ")]
    assert [int(r[1]) for r in rows] == list(range(WORLD))
    for r in rows:  # DDP: every rank holds all gradients, as the formula says
        measured, formula = r[3].split("/")
        assert measured == formula


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs two GPUs")
@pytest.mark.cuda
def test_nccl_reports_max_memory_allocated_per_rank():
    world = run_world(RankJob("fsdp2_zero3", model=SMALL), 2, backend="nccl")
    assert all(r.max_memory_allocated > 0 for r in world["fsdp2_zero3"])


# ---- notebook 08's gap table and communication peak -----------------------------------------------------------


def test_formula_gaps_are_made_of_the_split_padding_and_step_counts(world, reference):
    from anatomy_helpers.lessons.lesson08_scaling import formula_gaps

    params, buffers = reference
    model = make_model(device="cpu", **SMALL)
    row = model.cfg.d_model * 4
    short = -model.cfg.vocab_size % WORLD  # rows the last rank's embedding shard is short of the others
    for g in formula_gaps(world, buffers):  # formula_gaps itself checks that the terms add up to the gap
        if g.strategy.startswith("fsdp2"):
            rows = -(-model.cfg.vocab_size // WORLD) - (short if g.rank == WORLD - 1 else 0)  # ceil, then short
            assert g.split == rows * row - model.cfg.vocab_size * row // WORLD
            assert g.padding == (short * row if g.rank == WORLD - 1 else 0)
            assert g.moments == 2 * g.split  # exp_avg and exp_avg_sq of the unpadded shard
            assert g.at_rest == (params // WORLD - params if g.strategy == "fsdp2_zero2" else 0)
        else:
            assert g.split == g.padding == g.at_rest == 0
        assert g.step_counts == world[g.strategy][g.rank].torch_state_by_key["step"]


def test_zero2_communication_peak_is_the_unsharded_model_and_two_flat_buffers(world, reference):
    from anatomy_helpers.lessons.lesson08_scaling import communication_at_peak

    params, _ = reference
    model = make_model(device="cpu", **SMALL)
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    padded = params + (-model.cfg.vocab_size % WORLD) * model.cfg.d_model * 4
    for r in world["fsdp2_zero2"]:
        _, alive, last = communication_at_peak(r)
        assert alive[:2] == [block, block] and sum(alive) == padded + 2 * block
        gathers = [c for c in r.collectives if "allgather" in c.op]
        assert last == gathers[model.cfg.n_layer] and last.phase == "forward"  # the last block's, in forward


def test_rank_timelines_legend_names_every_category_marker_and_shading(world):
    from matplotlib.lines import Line2D

    from anatomy_helpers.lessons.lesson08_scaling import plot_rank_timelines
    from anatomy_helpers.tracking.events import CATEGORIES
    from anatomy_helpers.ui.plots import CATEGORY_LABELS

    fig = plot_rank_timelines(world)
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + fig.legends
    assert len(legends) == 1  # one legend for the ten panels
    listed = [t.get_text() for t in legends[0].get_texts()]
    drawn = {  # every category some rank of some strategy holds at some moment, from the traces themselves
        CATEGORY_LABELS[c]
        for ranks in world.values()
        for r in ranks
        for c in CATEGORIES
        if r.trace.timeline.category(c).any()
    }
    assert drawn <= set(listed) and "communication" in drawn
    ops = " ".join(c.op for ranks in world.values() for r in ranks for c in r.collectives)
    known = {"allgather": "all-gather", "allreduce": "all-reduce", "reduce_scatter": "reduce-scatter"}
    names = {n for key, n in {**known, "broadcast": "broadcast"}.items() if key in ops}
    assert names == {"all-gather", "all-reduce", "reduce-scatter", "broadcast"}
    assert all(any(n in label and label.endswith("issued") for label in listed) for n in names), listed
    for phase in ("forward", "backward", "optimizer"):
        assert f"shading: {phase}" in listed
    assert "a training step starts" in listed
    # every marker drawn on a panel has an entry with the same symbol and fill
    symbols = {(h.get_marker(), h.get_fillstyle()) for h in legends[0].legend_handles if isinstance(h, Line2D)}
    for ax in fig.axes:
        for line in ax.lines:
            if line.get_marker() not in ("None", None, ""):
                assert (line.get_marker(), line.get_fillstyle()) in symbols


def test_rank_timelines_wrap_four_ranks_into_two_rows(world):
    from anatomy_helpers.lessons.lesson08_scaling import plot_rank_timelines

    four = {"ddp": world["ddp"] * 2}  # four panels (ranks 0, 1, 0, 1): the layout is what is tested
    fig = plot_rank_timelines(four)
    grid = {(ax.get_subplotspec().rowspan.start, ax.get_subplotspec().colspan.start) for ax in fig.axes}
    assert grid == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert fig.get_size_inches()[0] == pytest.approx(plot_rank_timelines(world).get_size_inches()[0])
    assert fig.get_size_inches()[0] * 100 <= NOTEBOOK_COLUMN_PX  # unshrunk in a 1280 px window


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_fake_rank_equals_each_real_rank_byte_for_byte(world, strategy):
    """fake_world.py's dry run of each rank of this world (N = 4: tests/test_fake_world.py)."""
    for rank in range(WORLD):
        fake = dry_run_rank(RankJob(strategy, steps=1, batch_size=4, model=SMALL), WORLD, rank).result
        assert rank_differences(world[strategy][rank], fake) == {}, (strategy, rank)


def test_rank_timelines_put_one_rank_of_each_strategy_side_by_side(world):
    """Lesson 08 draws rank 0 of each strategy (the ranks hold the same): the strategies fill two columns, row by
    row, so the figure is as wide as the two-rank one and its legend is not cut off."""
    from anatomy_helpers.lessons.lesson08_scaling import plot_rank_timelines

    fig = plot_rank_timelines({s: ranks[:1] for s, ranks in world.items()})
    shown = [ax for ax in fig.axes if ax.get_visible()]
    places = [(ax.get_subplotspec().rowspan.start, ax.get_subplotspec().colspan.start) for ax in shown]
    assert places == [(k // 2, k % 2) for k in range(len(world))]  # in the strategies' order, two a row
    assert [ax.get_title() for ax in shown] == [f"{s}, rank 0" for s in world]
    assert fig.get_size_inches()[0] == pytest.approx(plot_rank_timelines(world).get_size_inches()[0])
    assert fig.get_size_inches()[0] * 100 <= NOTEBOOK_COLUMN_PX


def test_rank_timelines_draw_each_ranks_bytes_and_mark_each_collective_where_it_was_issued(world):
    from anatomy_helpers.lessons.lesson08_scaling import plot_rank_timelines

    from .figure_data import assert_stack_is_the_trace

    fig = plot_rank_timelines(world)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    for strategy, ranks in world.items():
        for r in ranks:
            ax = panels[f"{strategy}, rank {r.rank}"]
            assert_stack_is_the_trace(ax, r.trace)
            last = len(r.trace.timeline) - 1
            marks = sorted(ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_marker() not in ("None", None, ""))
            assert marks == sorted(min(max(c.index, 0), last) for c in r.collectives)
