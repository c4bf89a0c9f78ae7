"""Which strategy fits a 7B- or 70B-shaped model on 80 GB devices, and at what N: one rank's memory, estimated from
dry runs of a few layers of the real shape.

A fake rank of the full 70B shape (80 blocks) would run every op of 80 blocks through FakeTensorMode and FSDP2's
per-parameter bookkeeping for each of its 4,096 ranks' chunks: minutes per (strategy, N) on two cores. The blocks
are identical, so what one rank holds is, per category:

* **model states** (parameters, gradients, optimizer state): the exact rules, from the full model's shapes
  (:func:`~anatomy_helpers.distributed.fake_world.model_states_rule`,
  :func:`~anatomy_helpers.distributed.mesh2d.mesh_states_rule`), which the dry runs equal byte for byte. Not scaled
  per layer: ZeRO-1's whole-parameter partition of 80 blocks is not 80 times that of one;
* **activations, communication peak**: dry-run at ``base`` and ``base + 1`` blocks of the real width and scaled
  linearly, ``X(L) = X(base) + (L - base) (X(base + 1) - X(base))``;
* **peak**: the full model's states plus the rest of the peak (peak minus states: activations, buffers, the
  batch), scaled the same way.

:func:`layer_rule_gaps` sets the estimate beside the full dry run of a small model. Measured (2 heads, h = 64, 32
tokens, N = 8): TP x FSDP2 from 3 and 4 blocks equals the 5-block dry run in every figure, byte for byte
(tests/test_mesh2d.py); so do DDP (2, 3 -> 5 blocks) and FSDP2 (3, 4 -> 6). ZeRO-1's peak does not: it falls in the
optimizer step, whose AdamW temporaries follow ZeRO-1's whole-parameter partition, not the blocks (+32,768 B of
4,166,440 B at 6 blocks); its model states are exact (the rules), its peak approximate. Bytes everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.tables import Col, format_table
from ..core.units import GiB, KiB
from .fake_world import dry_run_rank, mesh_states_rule, model_states_rule
from .ranks import RankJob

#: Model shapes of the GPT-2 block (LayerNorm, 4h GELU MLP, biases, tied embeddings) at the widths and depths of
#: LLaMA 7B and Llama 2 70B (Touvron et al. 2023), with sdpa attention (no s x s scores kept) and fp32 weights,
#: gradients and AdamW state: 4 + 4 + 8 = 16 bytes a parameter, the total of the ZeRO paper's mixed-precision Adam
#: but not its split (2 + 2 + 12: a rank that keeps whole weights and gradients, DDP's or ZeRO-1's, holds 8 bytes of
#: them here against the paper's 4). Dropout 0. A sequence of 4,096 tokens, one row per data-parallel rank.
SHAPES = {
    "7B": dict(n_layer=32, d_model=4096, n_head=32, seq_len=4096, vocab_size=32000, attn_impl="sdpa"),
    "70B": dict(n_layer=80, d_model=8192, n_head=64, seq_len=4096, vocab_size=32000, attn_impl="sdpa"),
}
#: (strategy, TP degree): data parallelism alone, and TP = 8 (one node of 8 GPUs) x FSDP2 across the nodes.
FIT_STRATEGIES = (("ddp", 1), ("zero1", 1), ("fsdp2_zero3", 1), ("tp_fsdp", 8))
FIT_WORLD_SIZES = (8, 1024, 4096)
DEVICE_BYTES = 80 * 10**9  # an 80 GB device (H100 SXM, A100 80GB data sheets: GB, 10^9 bytes)
FIGURES = ("parameters", "gradients", "optimizer_state", "activations", "communication_peak", "peak")


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory (bytes) under ``strategy`` (TP degree ``tp``) at ``world_size`` ranks."""

    model: str
    strategy: str
    tp: int
    world_size: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # the most activation bytes alive at any moment of the step
    communication_peak: int
    peak: int

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def label(self) -> str:
        return f"tp{self.tp} x fsdp2" if self.strategy == "tp_fsdp" else self.strategy


def rank_job(model: dict, strategy: str, world_size: int, tp: int, rows: int) -> RankJob:
    """The one rank's job of ``model`` under ``strategy`` on ``world_size`` ranks (``tp``-way tensor parallel),
    ``rows`` rows per data-parallel rank: what :func:`dry_run_memory` (and lesson 11's panel) dry-run."""
    return RankJob(strategy, steps=1, batch_size=rows * world_size // tp, model=dict(model), tp=tp)


def states_rule(model: dict, strategy: str, world_size: int, tp: int = 1, rank: int = 0) -> dict[str, int]:
    """The exact model states of rank ``rank`` (fake_world's or mesh2d's rules, from the shapes alone)."""

    if strategy == "tp_fsdp":
        return mesh_states_rule(model, world_size, tp, rank)
    return model_states_rule(model, strategy, world_size, rank)


def dry_run_memory(
    name: str, model: dict, strategy: str, world_size: int, tp: int = 1, rows: int = 1, rank: int = 0
) -> RankMemory:
    """Rank ``rank``'s memory from a full dry run of ``model`` (fake_world.dry_run_rank), ``rows`` rows per
    data-parallel rank."""

    return memory_of(name, dry_run_rank(rank_job(model, strategy, world_size, tp, rows), world_size, rank).result, tp)


def memory_of(name: str, result, tp: int = 1) -> RankMemory:
    """A dry-run (or real) rank's RankResult as a :class:`RankMemory`."""
    ms = result.model_states
    return RankMemory(
        name,
        result.strategy,
        tp,
        result.world_size,
        ms["parameters"],
        ms["gradients"],
        ms["optimizer_state"],
        int(result.trace.timeline.category("activations").max()),
        int(result.trace.timeline.category("communication").max()),
        result.peak.bytes,
    )


def layer_scaled_memory(
    name: str, model: dict, strategy: str, world_size: int, tp: int = 1, rows: int = 1, base: int = 2
) -> RankMemory:
    """Rank 0's memory for ``model`` (all its blocks) from dry runs of ``base`` and ``base + 1`` blocks of its
    shape, scaled per block as the module docstring says; the model states by the exact rules."""
    layers = model["n_layer"]
    if not isinstance(base, int) or isinstance(base, bool) or not 1 <= base < layers:
        raise ValueError(f"base must be an integer in [1, n_layer) = [1, {layers}), got {base!r}")
    small = [dry_run_memory(name, {**model, "n_layer": n}, strategy, world_size, tp, rows) for n in (base, base + 1)]
    return scale_layers(small, model, base)


def scale_layers(small: list[RankMemory], model: dict, base: int, rank: int = 0) -> RankMemory:
    """The estimate for ``model`` from ``small``, rank ``rank``'s memory with ``base`` and ``base + 1`` blocks."""
    layers = model["n_layer"]
    name, strategy, world_size, tp = small[0].model, small[0].strategy, small[0].world_size, small[0].tp
    states = states_rule(model, strategy, world_size, tp, rank)

    def scaled(a: int, b: int) -> int:
        return a + (layers - base) * (b - a)

    rest = [m.peak - m.model_states for m in small]  # the peak beside the model states
    return RankMemory(
        name,
        strategy,
        tp,
        world_size,
        states["parameters"],
        states["gradients"],
        states["optimizer_state"],
        scaled(small[0].activations, small[1].activations),
        scaled(small[0].communication_peak, small[1].communication_peak),
        sum(states.values()) + scaled(*rest),
    )


def layer_rule_gaps(estimate: RankMemory, full: RankMemory) -> dict[str, int]:
    """``{figure: estimate - full dry run}`` (bytes): the per-block rule against the truth."""
    return {f: getattr(estimate, f) - getattr(full, f) for f in FIGURES}


def fit_table(
    shapes: dict = SHAPES, strategies=FIT_STRATEGIES, world_sizes=FIT_WORLD_SIZES, base: int = 2
) -> list[RankMemory]:
    """:func:`layer_scaled_memory` for every shape, strategy and world size (minutes: scripts/record_fit.py keeps
    the result, lessons/fit_reference.json)."""
    return [
        layer_scaled_memory(name, model, strategy, n, tp, base=base)
        for name, model in shapes.items()
        for strategy, tp in strategies
        for n in world_sizes
    ]


def as_records(rows: list[RankMemory]) -> list[dict]:
    return [dataclasses.asdict(r) for r in rows]


def from_records(records: list[dict]) -> list[RankMemory]:
    return [RankMemory(**r) for r in records]


def format_fit_table(rows: list[RankMemory], device_bytes: int | None = DEVICE_BYTES, unit: str = "GiB") -> str:
    """One rank's memory per shape, strategy and N (``unit``: "GiB" or "KiB"), and whether its peak fits a
    ``device_bytes`` device (None: no such column)."""

    scale = {"GiB": GiB, "KiB": KiB}[unit]
    cols = [
        Col("model", 9, align="<"),
        Col("strategy", 12, align="<"),
        Col("N", 5, "d"),
        Col("params", 8, ",.2f" if unit == "GiB" else ",.0f"),
        Col("grads", 8, ",.2f" if unit == "GiB" else ",.0f"),
        Col("opt state", 9, ",.2f" if unit == "GiB" else ",.0f"),
        Col("activations", 11, ",.2f" if unit == "GiB" else ",.0f"),
        Col("comm peak", 9, ",.2f" if unit == "GiB" else ",.0f"),
        Col("peak", 8, ",.2f" if unit == "GiB" else ",.0f"),
    ]
    out = [[r.model, r.label, r.world_size] + [getattr(r, f) / scale for f in FIGURES] for r in rows]
    note = f"({unit} per rank)"
    if device_bytes is not None:
        cols.append(Col("fits", 4, align="<", gap="  "))
        for row, r in zip(out, rows):
            row.append("yes" if r.peak <= device_bytes else "no")
        note = f"({unit} per rank; fits: peak <= {device_bytes / 1e9:.0f} GB)"
    return format_table(cols, out, note=note)


def smallest_fitting_n(rows: list[RankMemory], device_bytes: int = DEVICE_BYTES) -> dict[tuple[str, str], int | None]:
    """``{(model, strategy label): the smallest N of the rows whose peak fits a device_bytes device, or None}``."""
    out: dict[tuple[str, str], int | None] = {}
    for r in rows:
        key = (r.model, r.label)
        out.setdefault(key, None)
        if r.peak <= device_bytes and (out[key] is None or r.world_size < out[key]):
            out[key] = r.world_size
    return out
