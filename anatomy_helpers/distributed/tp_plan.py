"""How the course GPT is split for tensor parallelism (and sequence parallelism) with torch's own
``parallelize_module``: the plan of one block (GPT-2's or Llama's), the checks, and the fused qkv rows put in rank
order. Used by real ranks (distributed/ranks.py, strategies "tp" and "tp_sp") and by the dry run
(distributed/tensor_parallel.py).

The Llama block splits as torchtitan splits Llama: the fused qkv and the SwiGLU's gate and up by output columns
(``ColwiseParallel``), the out-projection and the down projection by input rows (``RowwiseParallel``). Each rank
computes ``n_head / t`` query heads and the ``kv_heads / t`` key/value heads they share (grouped-query attention),
and ``F / t`` of the MLP's columns. With sequence parallelism the RMSNorms run on a sequence shard
(``SequenceParallel``); the SwiGLU all-gathers its input once for gate and up (``PrepareModuleInput`` on ``mlp``,
torchtitan's ``feed_forward``), not once per Linear.
"""

from __future__ import annotations

import torch

from ..core.model import BLOCKS, GPT, ModelConfig


def tp_plan(sequence_parallel: bool = False, block: str = "gpt2") -> dict:
    """The ``parallelize_module`` plan of one course GPT block (its module names), GPT-2's or Llama's."""
    from torch.distributed.tensor import Replicate, Shard  # loaded where a rank or a mesh is built
    from torch.distributed.tensor.parallel import (  # loaded where a rank or a mesh is built
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
    fc = ("mlp.gate", "mlp.up") if block == "llama" else ("mlp.fc",)  # the MLP's column-split Linears
    if not sequence_parallel:
        return {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            **{name: ColwiseParallel() for name in fc},
            "mlp.proj": RowwiseParallel(),
        }
    if block == "llama":  # gate and up share one input: gathered once, for the whole SwiGLU
        mlp_in = {"mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
        mlp_in.update({name: ColwiseParallel() for name in fc})
    else:
        mlp_in = {"mlp.fc": ColwiseParallel(input_layouts=Shard(1))}
    return {
        # the block takes the replicated residual stream and keeps its own sequence shard of it
        "": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
        "ln1": SequenceParallel(),
        "ln2": SequenceParallel(),
        "attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        **mlp_in,
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def check_tp(cfg: ModelConfig, t: int) -> None:
    """ValueError unless the course GPT ``cfg`` can be split ``t`` ways: whole heads per rank (Llama: whole query
    and whole key/value heads, so t divides both n_head and kv_heads) and MLP columns."""
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ValueError(f"the TP degree must be a positive integer, got {t!r}")
    if cfg.block not in BLOCKS:
        raise ValueError(f"tensor parallelism here covers the blocks {BLOCKS}, not {cfg.block!r}")
    if cfg.n_head % t:
        raise ValueError(f"the TP degree ({t}) must divide n_head ({cfg.n_head}): each rank computes whole heads")
    if cfg.kv_heads % t:
        raise ValueError(
            f"the TP degree ({t}) must divide the key/value heads (n_kv_head = {cfg.kv_heads}): each rank computes "
            "whole key/value heads, shared by the query heads it holds"
        )


def qkv_rank_order(n_embd: int, t: int, kv_width: int | None = None) -> torch.Tensor:
    """Row order of the fused qkv weight that gives ColwiseParallel's contiguous chunk r the q, k and v rows of
    rank r's heads: ``[q_0, k_0, v_0, q_1, k_1, v_1, ...]``. The weight's rows are ``n_embd`` q rows, then
    ``kv_width`` k rows and ``kv_width`` v rows (GPT-2: ``kv_width = n_embd``, the default; Llama's grouped-query
    attention: ``kv_heads * head_dim``). Rank r's chunk holds q rows ``[r n_embd/t, (r+1) n_embd/t)`` and k and v
    rows ``[r kv_width/t, (r+1) kv_width/t)``: query heads ``r H/t ...`` and the key/value heads they use
    (``repeat_interleave`` gives query head i the key/value head ``i // (H/K)``)."""
    kv_width = n_embd if kv_width is None else kv_width
    starts, widths = (0, n_embd, n_embd + kv_width), (n_embd // t, kv_width // t, kv_width // t)
    return torch.cat(
        [torch.arange(start + r * w, start + (r + 1) * w) for r in range(t) for start, w in zip(starts, widths)]
    )


def parallelize_gpt(gpt: GPT, mesh, sequence_parallel: bool = False) -> GPT:
    """Parallelise every block of ``gpt`` over the 1-D ``mesh`` (in place; returns it). The fused qkv rows are put
    in rank order first (:func:`qkv_rank_order`), so each rank's chunk is its own heads' q, k and v."""
    from torch.distributed.tensor import Replicate, Shard  # loaded where a rank or a mesh is built
    from torch.distributed.tensor.parallel import (  # loaded where a rank or a mesh is built
        PrepareModuleOutput,
        parallelize_module,
    )

    cfg, t = gpt.cfg, mesh.size()
    check_tp(cfg, t)
    order = qkv_rank_order(cfg.d_model, t, cfg.kv_heads * cfg.head_dim)
    for block in gpt.blocks:
        with torch.no_grad():
            for p in (block.attn.qkv.weight, block.attn.qkv.bias):
                if p is not None:  # Llama's Linears have no bias
                    p.copy_(p[order.to(p.device)])
        parallelize_module(block, mesh, tp_plan(sequence_parallel, cfg.block))
        if sequence_parallel:  # the residual stream leaves the block whole again (all-gather)
            out = PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))
            parallelize_module(block, mesh, out)
    return gpt
