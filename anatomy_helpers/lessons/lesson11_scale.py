"""Notebook 11: one step across thousands of devices. Per-rank memory at any world size from one process
(:mod:`~anatomy_helpers.distributed.fake_world`), tensor parallelism against Korthikanti et al.
(:mod:`~anatomy_helpers.distributed.tensor_parallel`), and the modelled cost of synchronizing
(:mod:`~anatomy_helpers.distributed.sync_model`). Bytes unless a name says otherwise; seconds for times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ..core.model import GPT, ModelConfig
from ..core.tables import Col, format_table
from ..core.units import KiB, MiB
from ..distributed.fake_world import WorldRow, fsdp_collectives_rule, world_rows
from ..distributed.fit import (
    FIGURES,
    RankMemory,
    dry_run_memory,
)
from ..distributed.sync_model import ASSUMPTIONS, LINKS, Link, StepTime, expected_max, scaling_curve
from ..distributed.tensor_parallel import TPPart, compare_tp_layer, korthikanti_tp_terms, tp_dry_run
from ..distributed.timed_step import TimedJob, measure_timed_world
from ..ui.plots import CATEGORY_COLORS, FIGURE_WIDTH_IN, PHASE_SHADES, CourseFigure

# Section 1: lesson 08's model, so that the small-N rows can be read beside its real gloo tables.
CONFIG = dict(n_layer=2, d_model=128, n_head=4, seq_len=64)
# DDP and ZeRO-1 dry runs take about as long at 4,096 ranks as at 2; FSDP2's grow with N (per-rank tables of size
# N), so the lesson stops it at 64 to stay within a minute on a laptop.
WORLD_SIZES = (2, 8, 64, 1024, 4096)
FSDP_WORLD_SIZES = (2, 8, 64)
# What the shrink table follows: the model states, the activations and the communication buffers' peak.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication_peak")
# Where the lesson follows FSDP2's all-gather buffers (fsdp_collectives_rule: the shapes alone, any N), and the one
# N past the block's fewest rows (128) at which it dry-runs a rank to check the rule and measure the peak.
GATHER_WORLD_SIZES = (8, 64, 128, 256, 1024, 4096)
GATHER_CHECK_N = 256

# Section 2: 16-bit activations and dropout on, as the formula assumes; 8 heads so that t = 8 leaves one per rank.
TP_CONFIG = ModelConfig(n_layer=2, d_model=128, n_head=8, seq_len=64, dropout=0.1, dtype="bfloat16")
TP_BATCH = 4
TP_DEGREES = ((1, False), (2, False), (8, False), (8, True))  # (t, sequence parallelism)
# The Llama block: 16 query heads sharing 8 key/value heads, so that t = 8 leaves each rank 2 and the 1 they share.
LLAMA_TP_CONFIG = ModelConfig(
    n_layer=1, d_model=128, n_head=16, n_kv_head=8, seq_len=64, dropout=0.1, dtype="bfloat16", block="llama"
)

# Section 3: a wider model, so that a rank's compute is not negligible next to its communication (the dry runs'
# cost grows with the number of ops, not with their sizes).
SYNC_CONFIG = dict(n_layer=2, d_model=1024, n_head=8, seq_len=256)
SYNC_ROWS = 32  # rows per rank (weak scaling: the same at every N)
SYNC_WORLD_SIZES = {
    "ddp": (8, 64, 512, 4096),
    "zero1": (8, 64, 512, 4096),
    "fsdp2_zero3": (8, 64, 512, 4096),  # by fsdp_collectives_rule: its dry runs grow with N (30-60 s at 4,096)
    "tp_fsdp": (8, 64, 512, 4096),  # FSDP2 over N / 8 ranks: its dry runs stay short up to 4,096
}
SYNC_CHECK_N = 64  # where the notebook sets FSDP2's rule beside its dry run (about 1 s)
SYNC_TP = 8  # "tp_fsdp": TP over the 8 GPUs of a node (8 heads: one per rank), FSDP2 across the nodes
TP_LINK = LINKS["nvlink4"]
PEAK_FLOPS = 989e12  # H100 SXM, dense bf16 (NVIDIA's data sheet, docs/references.md), FLOP/s
UTILISATION = 0.4
LINK = LINKS["ib_ndr"]


# ---- section 1: per-rank memory at any N -------------------------------------------------------------------------


def per_rank_rows(
    model: dict = CONFIG, world_sizes: Sequence[int] = WORLD_SIZES, fsdp_world_sizes: Sequence[int] = FSDP_WORLD_SIZES
) -> list[WorldRow]:
    """Rank 0 of DDP and ZeRO-1 at each of ``world_sizes`` and of FSDP2 (ZeRO-3-like) at each of
    ``fsdp_world_sizes``, dry-run in this process (:func:`~anatomy_helpers.distributed.fake_world.world_rows`),
    one row of the course batch per rank."""
    return world_rows(model, ["ddp", "zero1"], tuple(world_sizes)) + world_rows(
        model, ["fsdp2_zero3"], tuple(fsdp_world_sizes)
    )


def shrink_factors(rows: Sequence[WorldRow]) -> dict[str, dict[str, float]]:
    """How many times smaller each of :data:`CATEGORIES` is on a rank at a strategy's largest N than at its smallest:
    ``{strategy: {category: bytes at smallest N / bytes at largest N}}`` (1.0: it does not shrink with N; under 1:
    it grows)."""
    out: dict[str, dict[str, float]] = {}
    for strategy in dict.fromkeys(r.strategy for r in rows):
        mine = sorted((r for r in rows if r.strategy == strategy), key=lambda r: r.world_size)
        if len(mine) < 2:
            raise ValueError(f"{strategy}: need rows at two world sizes at least, got {len(mine)}")
        first, last = mine[0], mine[-1]
        out[strategy] = {c: getattr(first, c) / getattr(last, c) for c in CATEGORIES}
    return out


def format_shrink(rows: Sequence[WorldRow]) -> str:
    """:func:`shrink_factors` as a table, one strategy a row, with the N range it spans."""
    names = {"communication_peak": "comm peak"}
    cols = [Col("strategy", 12, align="<"), Col("N", 10, align="<")]
    cols += [Col(names.get(c, c), 15, ".1f") for c in CATEGORIES]
    out = []
    for strategy, factors in shrink_factors(rows).items():
        ns = sorted(r.world_size for r in rows if r.strategy == strategy)
        out.append([strategy, f"{ns[0]}->{ns[-1]}"] + [factors[c] for c in CATEGORIES])
    return format_table(cols, out, note="(x smaller per rank from the smallest N to the largest)")


@dataclasses.dataclass(frozen=True)
class GatherRow:
    """FSDP2's all-gather of one block at one N (bytes), from :func:`~anatomy_helpers.distributed.fake_world.
    fsdp_collectives_rule`: each parameter's dim 0 chunked into N shards of ``ceil(rows / N)`` rows, padded to that,
    and the all-gather's output is N of them (torch's ``_fsdp_param.py``: ``padded_sharded_param_size``)."""

    world_size: int
    block_bytes: int  # block 0's own parameters
    gathered: int  # block 0's all-gather output: N x its padded shard
    fewest_rows: int  # the smallest dim 0 of block 0's parameters: past it N x ceil(rows / N) > rows

    @property
    def padding(self) -> int:
        return self.gathered - self.block_bytes


def fsdp_gathers(model: dict = CONFIG, world_sizes: Sequence[int] = GATHER_WORLD_SIZES) -> list[GatherRow]:
    """Block 0's FSDP2 all-gather at each of ``world_sizes`` (:class:`GatherRow`), from the shapes alone."""
    with torch.device("meta"):
        block = GPT(ModelConfig(**model)).blocks[0]
    own = sum(p.numel() * p.element_size() for p in block.parameters())
    fewest = min(p.shape[0] for p in block.parameters())
    # forward's second all-gather is block 0's (the root's comes first)
    return [GatherRow(n, own, fsdp_collectives_rule(model, n)[1].bytes, fewest) for n in world_sizes]


def format_gathers(rows: Sequence[GatherRow]) -> str:
    """:func:`fsdp_gathers` as a table (KiB)."""
    cols = [
        Col("N", 5, "d"),
        Col("block", 8, ",.0f"),
        Col("all-gather", 10, ",.0f"),
        Col("padding", 8, ",.0f"),
        Col("x block", 7, ".2f"),
    ]
    out = [[r.world_size, r.block_bytes / KiB, r.gathered / KiB, r.padding / KiB, r.gathered / r.block_bytes]
           for r in rows]  # fmt: skip
    return format_table(cols, out, note="(KiB; block 0's FSDP2 all-gather output, by the rule)")


# ---- section 2: tensor parallelism -------------------------------------------------------------------------------


def tp_layers(
    cfg: ModelConfig = TP_CONFIG, degrees: Sequence[tuple[int, bool]] = TP_DEGREES, batch_size: int = TP_BATCH
) -> dict[tuple[int, bool], list[TPPart]]:
    """Block 0 of rank 0 of a t-way TP group (with or without sequence parallelism), dry-run, part by part against
    Korthikanti et al.: ``{(t, sequence_parallel): [TPPart, ...]}``."""
    return {
        (t, sp): compare_tp_layer(tp_dry_run(cfg, t, sequence_parallel=sp, batch_size=batch_size), cfg, batch_size)
        for t, sp in degrees
    }


def tp_totals(layers: dict, cfg: ModelConfig = TP_CONFIG, batch_size: int = TP_BATCH) -> list[dict]:
    """One row per (t, sp): one block's measured activations on one rank, the paper's closed form (16-bit), the
    known gaps (:data:`~anatomy_helpers.distributed.tensor_parallel.GAP_REASONS`) and what is left unexplained."""
    s, b, h, a = cfg.seq_len, batch_size, cfg.d_model, cfg.n_head
    rows = []
    for (t, sp), parts in layers.items():
        closed = s * b * h / t * (34 + 5 * a * s / h) if sp else s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        measured = sum(p.measured for p in parts)
        gap = sum(p.known_gap for p in parts)
        rows.append(
            dict(
                t=t,
                sequence_parallel=sp,
                measured=measured,
                formula=closed,
                terms=sum(korthikanti_tp_terms(s, b, h, a, t, sp).values()),
                known_gap=gap,
                unexplained=measured - closed - gap,
            )
        )
    return rows


def format_tp_totals(rows: Sequence[dict]) -> str:
    """:func:`tp_totals` as a table (bytes)."""
    cols = [
        Col("t", 3, "d"),
        Col("SP", 3, align="<"),
        Col("measured", 10, ",d"),
        Col("Korthikanti", 11, ",.0f"),
        Col("known gap", 10, "+,d"),
        Col("unexplained", 11, "+,.0f"),
    ]
    out = [
        [
            r["t"],
            "yes" if r["sequence_parallel"] else "no",
            r["measured"],
            r["formula"],
            r["known_gap"],
            r["unexplained"],
        ]
        for r in rows
    ]
    return format_table(cols, out, note="(bytes, one block, one rank)")


def llama_tp_layers(
    cfg: ModelConfig = LLAMA_TP_CONFIG, degrees: Sequence[int] = (2, 8), batch_size: int = TP_BATCH
) -> dict[str, list[TPPart]]:
    """Block 0 of the Llama block on a dry-run rank 0 of each t-way TP group, part by part against
    :data:`~anatomy_helpers.distributed.tensor_parallel.LLAMA_TERMS`: ``{"t=2": [TPPart, ...], ...}``. (At t = 2
    the dry run equals two real gloo ranks byte for byte: tests/test_tensor_parallel.py runs both.)"""
    return {f"t={t}": compare_tp_layer(tp_dry_run(cfg, t, batch_size=batch_size), cfg, batch_size) for t in degrees}


def format_tp_columns(layers: dict[str, list[TPPart]]) -> str:
    """Several runs of one block side by side (:func:`llama_tp_layers`): per run each part's measured bytes, the
    formula's and the known gap (measured = formula + gap when the rules hold), and the gap's reason."""
    keys = list(layers)
    parts = {key: {p.module: p for p in layers[key]} for key in keys}
    cols = [Col("part", 15, align="<")]
    for key in keys:
        cols += [Col(f"{key}", 9, ",d"), Col("formula", 9, ",.0f"), Col("gap", 8, "+,d")]
    cols.append(Col("why", 11, align="<", gap="  "))
    rows = []
    for module in parts[keys[0]]:
        row: list = [module]
        for key in keys:
            p = parts[key][module]
            row += [p.measured, p.formula, p.known_gap]
        rows.append(row + [parts[keys[0]][module].why or "-"])
    total = [
        [sum(p.measured for p in layers[k]), sum(p.formula for p in layers[k]), sum(p.known_gap for p in layers[k])]
        for k in keys
    ]
    rows.append(["total", *[v for three in total for v in three], ""])
    return format_table(cols, rows, note="(bytes, one block, rank 0)")


# ---- section 3: the synchronization model ------------------------------------------------------------------------


def sync_curves(
    model: dict = SYNC_CONFIG,
    world_sizes: dict = SYNC_WORLD_SIZES,
    *,
    rows_per_rank: int = SYNC_ROWS,
    jitter: Sequence[float] = (1.0,),
    peak_flops: float = PEAK_FLOPS,
    utilisation: float = UTILISATION,
    link: Link = LINK,
    tp: int = SYNC_TP,
    tp_link: Link = TP_LINK,
) -> dict[str, list[StepTime]]:
    """The modelled step of each strategy at each of its world sizes (:func:`~anatomy_helpers.distributed.
    sync_model.scaling_curve`): ``{strategy: [StepTime, ...]}``; "tp_fsdp" with ``tp``-way TP over ``tp_link``.
    A model, not a measurement."""
    return {
        strategy: scaling_curve(
            model,
            strategy,
            ns,
            rows_per_rank=rows_per_rank,
            peak_flops=peak_flops,
            utilisation=utilisation,
            link=link,
            jitter=jitter,
            **(dict(tp=tp, tp_link=tp_link) if strategy == "tp_fsdp" else {}),
        )
        for strategy, ns in world_sizes.items()
    }


def with_stragglers(curves: dict[str, list[StepTime]], jitter: Sequence[float]) -> dict[str, list[StepTime]]:
    """The same modelled steps with the straggler tail of measured ``jitter`` (step times relative to their median)
    added, as :func:`~anatomy_helpers.distributed.sync_model.step_time` adds it, without dry-running again."""
    out = {}
    for name, rows in curves.items():
        out[name] = []
        for r in rows:
            tail = (r.forward + r.backward) * (expected_max(jitter, r.n) - float(np.median(jitter)))
            out[name].append(dataclasses.replace(r, straggler=tail, step=r.step - r.straggler + tail))
    return out


def format_assumptions(
    peak_flops: float = PEAK_FLOPS, utilisation: float = UTILISATION, link: Link = LINK, tp_link: Link = TP_LINK
) -> str:
    """The model's inputs and assumptions, in one place, to print beside its output."""
    lines = [f"device: {peak_flops / 1e12:,.0f} TFLOP/s peak at {utilisation:.0%} utilisation"] + [
        f"{what}: {k.name}: {k.bandwidth / 1e9:,.1f} GB/s per direction, {k.latency * 1e6:.0f} us per message"
        for what, k in (("link", link), ("TP's link, inside a node", tp_link))
    ]
    return "\n".join(lines + [f"- {a}" for a in ASSUMPTIONS])


def format_step_times(curves: dict[str, list[StepTime]], *, note_below: bool = False) -> str:
    """The modelled steps as a table: compute, communication, its exposed part, straggler tail, step (ms), and the
    share of the step spent computing. ``note_below``: the unit note under the rows, not beside the header (a
    panel's output is narrower than the notebook's)."""
    cols = [
        Col("strategy", 12, align="<"),
        Col("N", 5, "d"),
        Col("compute", 8, ",.3f"),
        Col("comm", 8, ",.3f"),
        Col("exposed", 8, ",.3f"),
        Col("straggler", 9, ",.3f"),
        Col("step", 8, ",.3f"),
        Col("efficiency", 10, ".3f"),
    ]
    out = [
        [name, r.n, (r.forward + r.backward) * 1e3, r.communication * 1e3, r.exposed * 1e3, r.straggler * 1e3]
        + [r.step * 1e3, r.efficiency]
        for name, rows in curves.items()
        for r in rows
    ]
    note = "(modelled, milliseconds per step)"
    return format_table(cols, out, footer=[note]) if note_below else format_table(cols, out, note=note)


def format_priced(steps: dict[str, StepTime]) -> str:
    """The collectives each modelled step priced (:attr:`~anatomy_helpers.distributed.sync_model.StepTime.priced`),
    by group and op: how many, on a ring of how many ranks, their bytes (whole buffers, MiB), their time and the
    part of it that is per-message latency (ms)."""

    cols = [
        Col("strategy", 12, align="<"),
        Col("N", 5, "d"),
        Col("group", 14, align="<"),
        Col("op", 14, align="<"),
        Col("count", 5, "d"),
        Col("ranks", 5, "d"),
        Col("MiB", 9, ",.1f"),
        Col("ms", 8, ",.3f"),
        Col("latency ms", 10, ",.3f"),
    ]
    out = []
    for name, step in steps.items():
        kinds: dict[tuple, list] = {}
        for p in step.priced:
            group = "TP (one node)" if p.tensor_parallel else "data-parallel"
            kinds.setdefault((group, p.op, p.ranks), []).append(p)
        for (group, op, ranks), ps in kinds.items():
            seconds, latency = sum(p.seconds for p in ps), sum(p.latency for p in ps)
            out.append([name, step.n, group, op, len(ps), ranks, sum(p.bytes for p in ps) / MiB, seconds * 1e3,
                        latency * 1e3])  # fmt: skip
    return format_table(cols, out, note="(modelled, per step; MiB: whole buffers)")


# ---- section 3, real ranks: the model against a measured 2-rank step ---------------------------------------------

# Lesson 08's model, DDP's buckets capped at 0.25 MiB so that it has several (its default 25 MiB would hold the
# whole model in two), a straggler sleeping 0.15 s, and a sweep of three sizes, all small enough to run in seconds.
TIMED_BUCKET_MB = 0.25
TIMED_STRAGGLER_S = 0.15


def timed_world(world_size: int = 2, steps: int = 3) -> list:
    """Each rank's :class:`~anatomy_helpers.distributed.timed_step.RankTimes` of ``steps`` synced, compute-only and
    straggler steps of lesson 08's model on ``world_size`` real gloo ranks (2 rows each)."""

    job = TimedJob(
        steps=steps,
        batch_size=2 * world_size,
        model=dict(CONFIG),
        bucket_cap_mb=TIMED_BUCKET_MB,
        straggler_s=TIMED_STRAGGLER_S,
        sweep_bytes=(4096, 1 << 18, 1 << 22),
        sweep_reps=3,
    )
    return measure_timed_world(job, world_size)


def plot_timed_step(ranks: Sequence, kinds: Sequence[str] = ("synced", "straggler")):
    """One step of each of ``kinds`` on each rank (its median step), one panel per kind: forward, backward until
    its last bucket was issued, its wait for the all-reduces, the optimizer and the rest; under each rank, when
    each bucket's all-reduce was issued and done. Returns the Figure."""

    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 1.0 + 1.3 * len(kinds) * len(ranks) / 2), layout="constrained")
    axes = fig.subplots(len(kinds), 1, sharex=True, squeeze=False)[:, 0]
    # the phases in the greys every timeline shades them with; the wait in the colour of communication buffers
    colours = {**PHASE_SHADES, "wait": CATEGORY_COLORS["communication"]}
    for ax, kind in zip(axes, kinds):
        for r in ranks:
            steps = sorted(r.of(kind), key=lambda s: s.step)
            s = steps[len(steps) // 2]
            y = 2 * (len(ranks) - 1 - r.rank)
            parts = [("forward", s.forward), ("backward", s.backward_compute), ("wait", s.wait)]
            x = 0.0
            for name, width in parts + [("optimizer", s.step - s.forward - s.backward)]:
                ax.barh(y + 0.6, width * 1e3, left=x * 1e3, height=0.7, color=colours[name], edgecolor="#999",
                        label=name)  # fmt: skip
                x += width
            for _, issued, done in s.buckets:
                ax.plot([(s.forward + issued) * 1e3, (s.forward + done) * 1e3], [y, y], color="black", lw=3)
                ax.plot([(s.forward + issued) * 1e3], [y], marker="|", color="black", markersize=8)
        ax.set_yticks([2 * (len(ranks) - 1 - r.rank) + 0.3 for r in ranks], [f"rank {r.rank}" for r in ranks])
        ax.set_title(f"{kind} step (each rank's median)", fontsize=9)
    axes[-1].set_xlabel("ms since the step began; black: each bucket's all-reduce, issued (|) to done")
    handles, labels = axes[0].get_legend_handles_labels()
    keep = dict(zip(labels, handles))
    fig.legend(keep.values(), ["forward", "backward", "wait in backward", "optimizer + rest"], ncol=4, fontsize=8,
               loc="outside lower center")  # fmt: skip
    fig.suptitle(f"DDP steps on {len(ranks)} real gloo ranks, measured", fontsize=10)
    return fig


# ---- section 2b: a 2-D mesh (TP inside a node x FSDP2 across nodes), and which strategy fits a 70B model ---------

# 4 heads so that t = 2 splits them; 8 ranks: 4 nodes of 2
MESH_CONFIG = dict(n_layer=2, d_model=64, n_head=4, seq_len=32)
MESH_WORLD, MESH_TP = 8, 2
# The 7B / 70B fit table, dry-run in the notebook at full depth (distributed/fit.py's periodic_rank): N = 8 and 1,024
# for every strategy (FSDP2's bookkeeping grows with N: one FSDP2 rank of 4,096 takes about a minute of CPU), then
# the 70B shape's TP = 8 x FSDP2 rank between them, where its first fit lies.
FIT_SIZES = (8, 1024)
FIT_BETWEEN = (16, 32, 64, 128)


def mesh_comparison(rows: Sequence[WorldRow], model: dict = CONFIG, world_size: int = MESH_WORLD, tp: int = MESH_TP):
    """Rank 0 of FSDP2 at ``world_size`` ranks (section 1's row, from ``rows``) and rank 0 of tp x FSDP2 on a
    ``(world_size / tp, tp)`` mesh, dry-run here, as two :class:`~anatomy_helpers.distributed.fit.RankMemory`."""

    fsdp = next(r for r in rows if r.strategy == "fsdp2_zero3" and r.world_size == world_size)
    same = RankMemory("section 1", "fsdp2_zero3", 1, world_size, *(getattr(fsdp, f) for f in FIGURES))
    return [same, dry_run_memory("section 1", model, "tp_fsdp", world_size, tp)]
