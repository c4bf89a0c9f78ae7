"""Two-dimensional parallelism: tensor parallelism inside a node x FSDP2 across nodes, on one 2-D DeviceMesh.

N ranks form a ``(dp, tp) = (N / t, t)`` mesh with dims named ("dp", "tp"), as torchtitan builds it
(``init_device_mesh(..., mesh_dim_names=...)``, then ``parallelize_module`` on ``mesh["tp"]`` and ``fully_shard``
on ``mesh["dp"]``). Rank r sits at ``(r // t, r % t)``: the t ranks of a node share a row of the batch and split
every block's GEMMs (:mod:`~anatomy_helpers.distributed.tp_plan`); the N / t nodes each train their own rows and
shard, row by row, what TP left them (FSDP2 chunks each TP-local shard along dim 0, ZeRO-3-like). Real ranks run it
as the strategy "tp_fsdp" of :mod:`~anatomy_helpers.distributed.ranks` (``RankJob(tp=t)``); a fake rank of any N
runs it through :func:`~anatomy_helpers.distributed.fake_world.dry_run_rank`.

One rank's model states from the shapes alone: :func:`~anatomy_helpers.distributed.fake_world.mesh_states_rule`
(TP's local shard, whole heads and MLP columns, :func:`tp_split_dims` read from the plan itself; then FSDP2's padded
dim-0 chunk of it). Bytes everywhere.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from ..core.model import GPT
from .tp_plan import parallelize_gpt, tp_plan

MESH_DIMS = ("dp", "tp")


def check_mesh(world_size: int, tp: int) -> int:
    """The data-parallel size N / tp of an N-rank 2-D mesh; ValueError unless tp divides N."""
    for name, value in (("world_size", world_size), ("the TP degree", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % tp:
        raise ValueError(
            f"the TP degree ({tp}) must divide the world size ({world_size}): the 2-D mesh is N / tp nodes of "
            "tp ranks each"
        )
    return world_size // tp


def make_mesh(device_type: str, world_size: int, tp: int):
    """The ``(N / tp, tp)`` DeviceMesh with dims ("dp", "tp") over the initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh  # loaded where a rank or a mesh is built

    dp = check_mesh(world_size, tp)
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=MESH_DIMS)


def parallelize_2d(gpt: GPT, mesh, reshard_after_forward: bool = True) -> GPT:
    """TP on ``mesh["tp"]`` (:func:`~anatomy_helpers.distributed.tp_plan.parallelize_gpt`: every block), then FSDP2
    on ``mesh["dp"]`` (each block, then the root), torchtitan's order. In place; returns ``gpt``.

    Under FakeTensorMode (a dry run) the FSDP2 wrapping runs with the fake mode set aside: for each TP parameter
    FSDP2 joins the dp and tp meshes (``DeviceMesh._concatenate``), which computes the joined mesh's rank tensor
    from real integers, an op a FakeTensorMode refuses. The parameters stay fake (a fake tensor's ops go back to its
    own mode); that is checked here, so nothing real the size of a parameter is ever made."""
    from torch.distributed.fsdp import fully_shard  # loaded where a rank or a mesh is built

    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(f"the mesh must have the dims {MESH_DIMS}, got {mesh.mesh_dim_names}")

    def local(p):  # a DTensor's local shard
        return getattr(p, "_local_tensor", p)

    fake = [isinstance(local(p), FakeTensor) for p in gpt.parameters()]
    parallelize_gpt(gpt, mesh["tp"])
    with unset_fake_temporarily():
        for block in gpt.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        fully_shard(gpt, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    if any(fake) and not all(isinstance(local(p), FakeTensor) for p in gpt.parameters()):
        raise RuntimeError("FSDP2's wrapping made a real parameter out of a fake one")
    return gpt


# ---- one rank's model states from the shapes alone -----------------------------------------------------------


def tp_split_dims(sequence_parallel: bool = False, block: str = "gpt2") -> dict[str, int]:
    """``{parameter name in a block: the dim TP shards}`` read from the plan itself: ColwiseParallel shards a
    Linear's weight and bias along dim 0 (output features), RowwiseParallel its weight along dim 1 (input
    features) and keeps its bias whole; every other parameter is whole on each TP rank (torch's TP docs)."""
    from torch.distributed.tensor.parallel import (  # loaded where a rank or a mesh is built
        ColwiseParallel,
        RowwiseParallel,
    )

    out = {}
    for module, style in tp_plan(sequence_parallel, block).items():
        if isinstance(style, ColwiseParallel):
            out.update({f"{module}.weight": 0, f"{module}.bias": 0})
        elif isinstance(style, RowwiseParallel):
            out[f"{module}.weight"] = 1
    return out
