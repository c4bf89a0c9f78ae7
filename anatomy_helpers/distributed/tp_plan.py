"""How the course GPT is split for tensor parallelism (and sequence parallelism) with torch's own
``parallelize_module``: the plan of one block, the checks, and the fused qkv rows put in rank order. Used by real
ranks (distributed/ranks.py, strategies "tp" and "tp_sp") and by the dry run (distributed/tensor_parallel.py).
"""

from __future__ import annotations

import torch

from ..model import GPT, ModelConfig


def tp_plan(sequence_parallel: bool = False) -> dict:
    """The ``parallelize_module`` plan of one course GPT block (its module names)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        return {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }
    return {
        # the block takes the replicated residual stream and keeps its own sequence shard of it
        "": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
        "ln1": SequenceParallel(),
        "ln2": SequenceParallel(),
        "attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "mlp.fc": ColwiseParallel(input_layouts=Shard(1)),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def check_tp(cfg: ModelConfig, t: int) -> None:
    """ValueError unless the course GPT ``cfg`` can be split ``t`` ways (whole heads and MLP columns per rank)."""
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ValueError(f"the TP degree must be a positive integer, got {t!r}")
    if cfg.block != "gpt2":
        raise ValueError(f"tensor parallelism here covers the GPT-2 block, not {cfg.block!r}")
    if cfg.n_head % t:
        raise ValueError(f"the TP degree ({t}) must divide n_head ({cfg.n_head}): each rank computes whole heads")


def qkv_rank_order(n_embd: int, t: int) -> torch.Tensor:
    """Row order of the fused qkv weight (3C rows: q, k, v) that gives ColwiseParallel's contiguous chunk r the
    q, k and v rows of rank r's heads: ``[q_0, k_0, v_0, q_1, k_1, v_1, ...]``."""
    c = n_embd // t
    return torch.cat(
        [torch.arange(part * n_embd + r * c, part * n_embd + (r + 1) * c) for r in range(t) for part in range(3)]
    )


def parallelize_gpt(gpt: GPT, mesh, sequence_parallel: bool = False) -> GPT:
    """Parallelise every block of ``gpt`` over the 1-D ``mesh`` (in place; returns it). The fused qkv rows are put
    in rank order first (:func:`qkv_rank_order`), so each rank's chunk is its own heads' q, k and v."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module

    t = mesh.size()
    check_tp(gpt.cfg, t)
    order = qkv_rank_order(gpt.cfg.d_model, t)
    for block in gpt.blocks:
        with torch.no_grad():
            for p in (block.attn.qkv.weight, block.attn.qkv.bias):
                p.copy_(p[order.to(p.device)])
        parallelize_module(block, mesh, tp_plan(sequence_parallel))
        if sequence_parallel:  # the residual stream leaves the block whole again (all-gather)
            out = PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))
            parallelize_module(block, mesh, out)
    return gpt
