"""Which strategy fits a 7B- or 70B-shaped model on 80 GB devices, and at what N: one rank's memory, from a dry run
of that rank at the model's full depth.

A fake rank of the full 70B shape (80 blocks) runs every op of 80 blocks through FakeTensorMode and FSDP2's
per-parameter bookkeeping: a minute or more per (strategy, N) on two cores. The blocks are identical, so the rank's
step repeats block by block: :func:`periodic_rank` dry-runs the same rank with 3, 4 and 5 blocks of the real shape
and builds its Trace at the full depth from them
(:func:`~anatomy_helpers.prediction.periodic.periodic_trace`): every sample of the timeline, every phase's peak and
breakdown, computed on the whole step, equal to the full-depth dry run's byte for byte (tests/test_periodic_ranks.py
checks DDP, ZeRO-1, FSDP2 and TP x FSDP2 against full dry runs), never a peak scaled per block. Per rank:

* **model states** (parameters, gradients, optimizer state): read from that Trace as a rank reads its own (just
  before its last optimizer step) and checked against the exact rules, from the full model's shapes
  (:func:`states_rule`: :func:`~anatomy_helpers.distributed.fake_world.model_states_rule`,
  :func:`~anatomy_helpers.distributed.fake_world.mesh_states_rule`);
* **activations, communication peak, peak**: the most bytes of each alive at any moment of that Trace.

Where the rows do not repeat block by block (ZeRO-1 where its whole-parameter partition gives a rank different
parameters at each depth), or the states differ from the rules, it runs the full-depth dry run and says why. Bytes
everywhere.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..core.model import ModelConfig
from ..core.tables import Col, format_table
from ..core.units import GiB, KiB
from ..prediction.periodic import NotPeriodic, periodic_trace, too_shallow
from ..tracking.trace import Trace
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
#: What a rank reads as its model states before its last optimizer step (RankResult.model_states's keys).
MODEL_STATES = ("parameters", "gradients", "optimizer_state", "communication")


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
    """A dry-run (or real) rank's RankResult, or a :class:`PeriodicRank`, as a :class:`RankMemory`."""
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


@dataclass(frozen=True)
class PeriodicRank:
    """One rank's step at its model's full depth, found by :func:`periodic_rank`: what :func:`memory_of` reads."""

    strategy: str
    rank: int
    world_size: int
    trace: Trace
    model_states: dict[str, int]  # bytes per category just before the last optimizer step, as RankResult's
    why: str | None  # None: built from dry runs of 3, 4 and 5 blocks; else why the full-depth dry run ran
    cpu_s: float  # this process's CPU seconds for it

    @property
    def peak(self):
        return self.trace.peak()


def periodic_rank(job: RankJob, world_size: int, rank: int = 0) -> PeriodicRank:
    """Rank ``rank`` of ``job`` on ``world_size`` ranks at its model's full depth, from dry runs of the same rank
    with 3, 4 and 5 blocks (see the module's docstring); the full-depth dry run where that is refused, and why.

    The Trace equals :func:`~anatomy_helpers.distributed.fake_world.dry_run_rank`'s (wall times aside: spread
    evenly); the model states are read from it as a rank reads its own and must equal :func:`states_rule`'s."""
    if not isinstance(job, RankJob):
        raise ValueError(f"job must be a RankJob, got {type(job).__name__}")
    started, cpu = time.perf_counter(), time.process_time()
    depth = ModelConfig(**job.model).n_layer  # a bad config fails here

    def run_at(d: int) -> Trace:
        return dry_run_rank(dataclasses.replace(job, model={**job.model, "n_layer": d}), world_size, rank).result.trace

    why = too_shallow(depth)
    if why is None:
        try:
            trace = periodic_trace(run_at, depth, started=started)
        except NotPeriodic as e:
            why = str(e)
        else:
            states = {c: trace.before_last_optimizer_step()[c] for c in MODEL_STATES}
            rule = states_rule(job.model, job.strategy, world_size, job.tp, rank)
            if all(states[c] == rule[c] for c in rule):
                return PeriodicRank(job.strategy, rank, world_size, trace, states, None, time.process_time() - cpu)
            why = f"the model states read from the built trace, {states}, are not the rules' {rule}"
    full = dry_run_rank(job, world_size, rank).result
    return PeriodicRank(
        job.strategy, rank, world_size, full.trace, full.model_states, f"full dry run: {why}", time.process_time() - cpu
    )


def periodic_memory(
    name: str, model: dict, strategy: str, world_size: int, tp: int = 1, rows: int = 1, rank: int = 0
) -> tuple[RankMemory, str | None]:
    """:func:`periodic_rank` of :func:`rank_job` as a :class:`RankMemory`, and why it ran in full (None: it did
    not)."""
    run = periodic_rank(rank_job(model, strategy, world_size, tp, rows), world_size, rank)
    return memory_of(name, run, tp), run.why


def fit_table(
    shapes: dict = SHAPES,
    strategies: Iterable[tuple[str, int]] = FIT_STRATEGIES,
    world_sizes: Iterable[int] = FIT_WORLD_SIZES,
    iterate: Callable = iter,
) -> list[tuple[RankMemory, str | None]]:
    """:func:`periodic_memory` of rank 0 for every shape, strategy and world size, one row per data-parallel rank
    (``iterate`` wraps the list of rows: e.g. a progress bar)."""
    runs = [(name, model, s, n, tp) for name, model in shapes.items() for s, tp in strategies for n in world_sizes]
    return [periodic_memory(name, model, s, n, tp) for name, model, s, n, tp in iterate(runs)]


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
