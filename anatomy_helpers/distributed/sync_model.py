"""The cost of synchronizing one data-parallel step across N devices: a model a learner can read and change.

Everything here is a *model*, with its assumptions in one place (:data:`ASSUMPTIONS`); what goes in is measured:

* compute: the FLOPs of one rank's forward and backward as torch's ``FlopCounterMode`` counts them
  (:func:`~anatomy_helpers.training.step.step_flops`), at a device's peak throughput times a stated utilisation;
* communication: the bytes each rank's collectives carry, read from a rank's trace (a real rank's, or a dry-run
  rank of any N from :mod:`~anatomy_helpers.distributed.fake_world`; FSDP2's from the rule that equals its dry
  run, which grows with N), priced with the alpha-beta cost of ring
  collectives (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009; NCCL's bus-bandwidth factors): an
  all-reduce of ``S`` bytes on ``N`` ranks takes ``2(N-1) alpha + 2(N-1)/N * S / beta``; a reduce-scatter or an
  all-gather (``S`` the whole gathered buffer) half of that;
* overlap: DDP all-reduces its buckets while backward runs, FSDP all-gathers the next block's parameters while the
  current one computes; only what sticks out of the compute it hides behind is *exposed*;
* tensor parallelism x FSDP (the 2-D mesh of :mod:`~anatomy_helpers.distributed.mesh2d`): each collective priced on
  its own group: TP's (DTensor's functional collectives) on the ``t`` ranks of a node over NVLink, every one of
  them exposed (a block's next GEMM needs its result); FSDP2's on the ``N / t`` data-parallel ranks over the
  inter-node link, overlapped as above;
* stragglers: every rank waits for the slowest, so a step takes the *expected maximum* of N per-rank compute times,
  drawn from a distribution of step times measured here (:func:`expected_max`).

Seconds and bytes everywhere; bandwidths in bytes per second.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..core.model import GPT, ModelConfig
from ..training.step import StepPlan, run_step, step_flops
from ..training.train import make_model, make_optimizer
from .fake_world import dry_run_rank, fsdp_collectives_rule
from .mesh2d import check_mesh
from .ranks import FUNCTIONAL_COLLECTIVES, MESH_STRATEGIES, Collective, RankJob
from .tp_plan import check_tp

ASSUMPTIONS = (
    "Ring collectives on one link per rank (the slowest on the ring: inter-node once N exceeds a node); no tree "
    "or hierarchical algorithms, no in-network reduction.",
    "Compute runs at peak x utilisation; the optimizer step and element-wise ops are not counted (FlopCounterMode "
    "counts matrix multiplications and attention).",
    "Backward's collectives (DDP's buckets, FSDP's reduce-scatters and re-gathers) become ready as backward "
    "produces their bytes, evenly in bytes through backward, and run one at a time on the link: only what runs "
    "past backward's end is exposed. DDP's buckets are the ones its reducer builds (bucket_cap_mb, 1 MiB first). "
    "FSDP's forward all-gathers hide behind forward, except the first (nothing to hide behind yet).",
    "Stragglers: the ranks' compute times are independent draws from the measured distribution of step times "
    "(relative to its median); the step ends when the slowest rank is done.",
    "TP x FSDP: the t ranks of a TP group sit in one node; DTensor's collectives (TP's all-reduces, 2 per block in "
    "forward and 2 in backward) run on those t ranks over NVLink and sit on the critical path (the next GEMM waits "
    "for each; none is overlapped); FSDP2's all-gathers and reduce-scatters run on the N/t data-parallel ranks over "
    "the inter-node link, overlapped with compute as above. The two links never contend. A node trains t x the "
    "rows of a data-parallel rank (the same global batch at every N); each TP rank computes 1/t of every block's "
    "GEMMs and attention heads and the embedding and head whole (the plan splits only the blocks).",
)


@dataclass(frozen=True)
class Link:
    """A rank's network link: ``bandwidth`` bytes per second in each direction, ``latency`` seconds per message."""

    name: str
    bandwidth: float
    latency: float


#: Links with their data-sheet figures (docs/references.md): per GPU, one direction.
LINKS = {
    "nvlink4": Link("NVLink 4 (H100 SXM, 900 GB/s both directions)", 450e9, 2e-6),
    "ib_ndr": Link("InfiniBand NDR, 400 Gb/s per GPU", 50e9, 5e-6),
    "ethernet100": Link("100 Gb/s Ethernet per GPU", 12.5e9, 10e-6),
}


def ring_seconds(op: str, nbytes: float, n: int, link: Link) -> float:
    """Alpha-beta time of one ring collective of ``nbytes`` (the whole buffer) on ``n`` ranks.

    All-reduce: reduce-scatter then all-gather, ``2(n-1)`` steps each sending ``nbytes / n``; reduce-scatter or
    all-gather: ``n-1`` such steps; broadcast (ZeRO-1's parameters, pipelined along the ring): ``nbytes`` once.
    """
    if n < 1:
        raise ValueError(f"n must be a positive number of ranks, got {n!r}")
    if n == 1:
        return 0.0
    steps = {"all-reduce": 2 * (n - 1), "reduce-scatter": n - 1, "all-gather": n - 1, "broadcast": n - 1}
    if op not in steps:
        raise ValueError(f"op must be one of {tuple(steps)}, got {op!r}")
    if op == "broadcast":
        return steps[op] * link.latency + nbytes / link.bandwidth
    return steps[op] * (link.latency + nbytes / n / link.bandwidth)


#: c10d's ops (DDP, ZeRO-1, FSDP2: "allreduce_", "_allgather_base_", ...) and DTensor's functional ones (tensor
#: parallelism: "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor") by the part of their name that
#: says what they do.
COLLECTIVE_NAMES = (
    ("allgather", "all-gather"),
    ("all_gather", "all-gather"),
    ("reduce_scatter", "reduce-scatter"),
    ("allreduce", "all-reduce"),
    ("all_reduce", "all-reduce"),
    ("all_to_all", "all-to-all"),
    ("broadcast", "broadcast"),
)


def collective_name(op: str) -> str:
    """A collective op by its usual name: "allreduce_" and "all_reduce" -> "all-reduce", "_reduce_scatter_base_"
    and "reduce_scatter_tensor" -> "reduce-scatter", "all_gather_into_tensor" -> "all-gather"."""
    for key, name in COLLECTIVE_NAMES:
        if key in op:
            return name
    return op.strip("_").replace("_", "-")


def is_tensor_parallel(op: str) -> bool:
    """Whether ``op`` is one of DTensor's functional collectives (the TP group's); c10d's are data parallelism's
    (DDP, ZeRO-1, FSDP2, which call the process group directly). tests/test_sync_model.py checks the rule against
    the process group each collective of a 2-D rank really ran on."""
    return op in FUNCTIONAL_COLLECTIVES


@dataclass(frozen=True)
class StepTime:
    """One modelled step on N ranks (seconds)."""

    n: int
    forward: float
    backward: float
    straggler: float  # expected slowest rank's compute minus the median rank's
    communication: float  # every collective of the step, back to back
    exposed: float  # the part of it no compute hides
    step: float  # forward + backward + straggler + exposed + optimizer
    optimizer: float = 0.0  # the optimizer step, when measured (FlopCounterMode does not count it)
    tensor_parallel: float = 0.0  # TP's collectives on the node's t ranks, all exposed (included in the two above)
    priced: tuple[Priced, ...] = ()  # each collective of the step as priced

    @property
    def efficiency(self) -> float:
        """Compute time over step time: the share of the step the devices spend computing."""
        return (self.forward + self.backward) / self.step

    @property
    def latency(self) -> float:
        """Seconds of :attr:`communication` spent on per-message latency (the rest moves bytes)."""
        return sum(p.latency for p in self.priced)


@dataclass(frozen=True)
class Priced:
    """One collective as the model prices it: ``op`` (:func:`collective_name`) of ``bytes`` (the whole buffer: a
    reduce-scatter's input, an all-gather's output) on a ring of ``ranks`` ranks over ``link`` takes ``seconds``, of
    which ``latency`` are per-message latency."""

    phase: str
    op: str
    bytes: int
    ranks: int
    link: str
    seconds: float
    latency: float
    tensor_parallel: bool  # TP's (on a node's t ranks, exposed), else data parallelism's


def price_collective(c: Collective, n: int, link: Link, tp: int = 1, tp_link: Link = LINKS["nvlink4"]) -> Priced:
    """``c`` priced on the group it runs on: TP's (:func:`is_tensor_parallel`) on the ``tp`` ranks of a node over
    ``tp_link``; the others on the ``n / tp`` data-parallel ranks (all ``n`` without TP) over ``link``."""
    tensor = is_tensor_parallel(c.op)
    ranks, on = (tp, tp_link) if tensor else (n // tp, link)
    name = collective_name(c.op)
    # a trace notes a collective's output: a reduce-scatter's is one rank's shard of the buffer the ring reduces
    whole = c.bytes * ranks if name == "reduce-scatter" else c.bytes
    seconds = ring_seconds(name, whole, ranks, on)
    latency = ring_seconds(name, whole, ranks, dataclasses.replace(on, bandwidth=float("inf")))
    return Priced(c.phase, name, whole, ranks, on.name, seconds, latency, tensor)


def expected_max(samples: Sequence[float], n: int) -> float:
    """The expected maximum of ``n`` independent draws (with replacement) from the measured ``samples``:
    ``sum_i x_(i) [(i/m)^n - ((i-1)/m)^n]`` over the m sorted samples (exact for the empirical distribution)."""
    x = np.sort(np.asarray(samples, dtype=float))
    if x.size == 0 or n < 1:
        raise ValueError(f"need at least one sample and n >= 1, got {x.size} samples and n={n!r}")
    m = x.size
    i = np.arange(1, m + 1)
    return float(np.sum(x * ((i / m) ** n - ((i - 1) / m) ** n)))


def step_time(
    collectives: Sequence[Collective],
    n: int,
    *,
    flops: float,
    peak_flops: float,
    utilisation: float = 0.4,
    **network,
) -> StepTime:
    """Model one step of a rank whose trace issued ``collectives`` (one tracked step), on ``n`` ranks.

    ``flops``: one rank's forward + backward (backward is two thirds of it, as for matrix multiplications);
    ``peak_flops`` per second at ``utilisation``; ``network``: :func:`price_step`'s ``link``, ``jitter`` (measured
    step times relative to their median), ``tp`` and ``tp_link`` (the TP degree of a 2-D mesh and its groups' link).
    """
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must be in (0, 1], got {utilisation!r}")
    compute = flops / (peak_flops * utilisation)
    return price_step(collectives, n, forward=compute / 3, backward=2 * compute / 3, **network)


def price_step(
    collectives: Sequence[Collective],
    n: int,
    *,
    forward: float,
    backward: float,
    optimizer: float = 0.0,
    link: Link = LINKS["ib_ndr"],
    jitter: Sequence[float] = (1.0,),
    tp: int = 1,
    tp_link: Link = LINKS["nvlink4"],
) -> StepTime:
    """:func:`step_time` from compute times given in seconds (measured ones, say) instead of FLOPs: the
    collectives priced on ``link``, overlapped with ``forward`` and ``backward`` as :data:`ASSUMPTIONS` says, plus
    the straggler tail of ``jitter`` and an ``optimizer`` step that overlaps nothing.

    ``tp`` > 1: a 2-D mesh of ``n / tp`` nodes of ``tp`` ranks. TP's collectives (:func:`is_tensor_parallel`) are
    priced on ``tp`` ranks over ``tp_link`` and all exposed; the others on the ``n / tp`` data-parallel ranks over
    ``link``, overlapped as with one dimension."""

    check_mesh(n, tp)
    if tp == 1 and any(is_tensor_parallel(c.op) for c in collectives):
        raise ValueError("the trace has tensor-parallel collectives (DTensor's): pass tp, the TP group's size")
    straggler = (forward + backward) * (expected_max(jitter, n) - float(np.median(jitter)))
    priced = tuple(
        price_collective(c, n, link, tp, tp_link)
        for c in collectives
        if c.phase in ("forward", "backward", "optimizer")
    )
    tensor_parallel = sum(p.seconds for p in priced if p.tensor_parallel)
    timed = [(p.phase, p.bytes, p.seconds) for p in priced if not p.tensor_parallel]
    total = sum(p.seconds for p in priced)
    exposed = tensor_parallel  # on the critical path: the next GEMM needs each all-reduce's result
    in_forward = [s for p, _, s in timed if p == "forward"]
    if in_forward:  # the first all-gather has nothing to hide behind
        exposed += in_forward[0] + max(0.0, sum(in_forward[1:]) - forward)
    exposed += backward_overhang([(b, s) for p, b, s in timed if p == "backward"], backward)
    exposed += sum(s for p, _, s in timed if p == "optimizer")  # ZeRO-1's broadcasts follow the step
    step = forward + backward + straggler + exposed + optimizer
    return StepTime(n, forward, backward, straggler, total, exposed, step, optimizer, tensor_parallel, priced)


def backward_schedule(issued: Sequence[tuple[float, float]], backward: float) -> list[tuple[float, float]]:
    """(start, end) of each of backward's collectives, given as (bytes, seconds) in the order they are issued:
    collective k is ready when backward has produced its bytes (evenly in bytes through ``backward`` seconds)
    and starts once it is ready and the one before it is done (one link)."""
    total = sum(b for b, _ in issued) or 1
    out, done, produced = [], 0.0, 0
    for nbytes, seconds in issued:
        produced += nbytes
        start = max(done, backward * produced / total)
        done = start + seconds
        out.append((start, done))
    return out


def backward_overhang(issued: Sequence[tuple[float, float]], backward: float) -> float:
    """Seconds backward's collectives (:func:`backward_schedule`) run past the end of backward: the exposed part."""
    schedule = backward_schedule(issued, backward)
    return max(0.0, schedule[-1][1] - backward) if schedule else 0.0


# ---- DDP's buckets -------------------------------------------------------------------------------------------

FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_CAP_MB = 25  # torch/nn/parallel/distributed.py's _DEFAULT_BUCKET_CAP_MB


def ddp_buckets(sizes: Sequence[int], order: Sequence[int], bucket_cap_mb: float | None = None) -> list[list[int]]:
    """The buckets DDP's reducer rebuilds after its first backward: parameter indices, bucket by bucket, in the order
    their all-reduces are issued. ``sizes``: each parameter's gradient bytes (registration order); ``order``: the
    order the gradients become ready in backward (:func:`gradient_ready_order`).

    As torch's ``compute_bucket_assignment_by_size`` (reducer.cpp): gradients join the open bucket in ready order and
    a bucket closes once it holds at least its cap; the first cap is 1 MiB when ``bucket_cap_mb`` is None (DDP's
    default, 25 MiB after it), else every cap is ``bucket_cap_mb`` MiB (torch's _BucketCapacityConfig)."""
    if sorted(order) != list(range(len(sizes))):
        raise ValueError(f"order must list each of the {len(sizes)} parameters once, got {list(order)!r}")
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be None (DDP's default) or positive, got {bucket_cap_mb!r}")
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    limit = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    buckets, current, held = [], [], 0
    for i in order:
        current.append(i)
        held += sizes[i]
        if held >= limit:
            buckets.append(current)
            current, held, limit = [], 0, cap
    return buckets + ([current] if current else [])


def gradient_ready_order(model, batch: Sequence) -> list[int]:
    """Indices of ``model``'s parameters in the order backward finishes their gradients (one forward and backward
    of ``batch``, the course loss): the order DDP's reducer records in its first backward (it hooks the same
    gradient accumulators, ``register_post_accumulate_grad_hook``). Runs on meta tensors too."""

    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    order: list[int] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: order.append(index[id(p)])) for p in params]
    # the course's step stopped after backward: its optimizer is never stepped (and holds no state)
    plan = StepPlan(batch=lambda i: batch, optimizer_step=False, read_loss=False)
    try:
        run_step(model, torch.optim.SGD(params), plan, 0)
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return order


def ddp_bucket_bytes(model: dict, rows: int = 1, bucket_cap_mb: float | None = None) -> list[int]:
    """Bytes of each of DDP's buckets (in the order issued) for the course GPT of ``model`` (ModelConfig overrides)
    trained on ``rows`` rows, from its shapes alone (on meta tensors)."""

    cfg = ModelConfig(**model)
    with torch.device("meta"):
        gpt = GPT(cfg)
        x = torch.zeros(rows, cfg.seq_len, dtype=torch.long)
        order = gradient_ready_order(gpt, (x, x))
    sizes = [p.numel() * p.element_size() for p in gpt.parameters()]
    return [sum(sizes[i] for i in b) for b in ddp_buckets(sizes, order, bucket_cap_mb)]


def with_buckets(collectives: Sequence[Collective], bucket_bytes: Sequence[int]) -> list[Collective]:
    """A DDP rank's collectives with its backward all-reduce(s) replaced by one all-reduce per bucket: a dry-run
    rank keeps DDP's first assignment (every gradient in one bucket), a real one rebuilds it after one step."""
    grads = [c for c in collectives if c.phase == "backward" and collective_name(c.op) == "all-reduce"]
    if sum(c.bytes for c in grads) != sum(bucket_bytes):
        raise ValueError(
            f"the buckets hold {sum(bucket_bytes):,} bytes but the trace all-reduced {sum(c.bytes for c in grads):,} "
            "in backward: not the same model?"
        )
    first = grads[0]
    buckets = [dataclasses.replace(first, bytes=int(b), op="allreduce_") for b in bucket_bytes]
    out, placed = [], False
    for c in collectives:
        if any(c is g for g in grads):
            if not placed:
                out.extend(buckets)
                placed = True
        else:
            out.append(c)
    return out


def measure_jitter(steps: int = 20, batch_size: int = 4, **config) -> np.ndarray:
    """Wall times of ``steps`` training steps of one process (after two warm-up steps), divided by their median:
    the spread a rank's compute time has on this machine (threads, caches, other processes)."""

    model = make_model(device="cpu", **config)
    opt = make_optimizer(model, "adamw")
    plan = StepPlan(batch_size)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        run_step(model, opt, plan, i)
        times.append(time.perf_counter() - start)
    times = np.asarray(times[2:])
    return times / np.median(times)


def tp_rank_flops(model: dict, rows: int, tp: int) -> int:
    """FLOPs of one forward + backward of one rank of a ``tp``-way TP group on ``rows`` rows (the whole group's):
    ``FlopCounterMode`` on the course GPT with each block's four GEMMs at one rank's width (qkv and fc: 1/tp of the
    output columns, attn.proj and mlp.proj: 1/tp of the input rows, as :mod:`~anatomy_helpers.distributed.tp_plan`
    splits them; the attention then runs n_head/tp heads), the embedding and head whole. Shapes only (meta)."""

    cfg = ModelConfig(**model)
    check_tp(cfg, tp)
    h, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    with torch.device("meta"):
        gpt = GPT(cfg)
        for b in gpt.blocks if tp > 1 else ():  # this rank's share of each GEMM pair
            dtype = b.attn.qkv.weight.dtype
            b.attn.qkv, b.attn.proj = nn.Linear(h, 3 * h // tp, dtype=dtype), nn.Linear(h // tp, h, dtype=dtype)
            b.mlp.fc, b.mlp.proj = nn.Linear(h, f // tp, dtype=dtype), nn.Linear(f // tp, h, dtype=dtype)
        x = torch.zeros(rows, cfg.seq_len, dtype=torch.long)
        return step_flops(gpt, x, x)


def scaling_curve(
    model: dict,
    strategy: str,
    world_sizes: Sequence[int],
    *,
    rows_per_rank: int = 1,
    peak_flops: float,
    utilisation: float = 0.4,
    **network,
) -> list[StepTime]:
    """:func:`step_time` at each world size, the collectives' bytes from a dry-run rank 0 of that world (DDP's and
    ZeRO-1's gradients in the buckets a real DDP rebuilds, :func:`ddp_bucket_bytes`) and the FLOPs from
    ``FlopCounterMode`` on one rank's rows (weak scaling: the same global batch per rank, ``rows_per_rank`` x N, at
    every N); ``network``: :func:`price_step`'s link, jitter, tp and tp_link. "tp_fsdp": ``tp``-way TP inside each
    node, a node training ``tp x rows_per_rank`` rows, each rank computing its share of them
    (:func:`tp_rank_flops`); TP's collectives priced on ``tp_link``.

    "fsdp2_zero3": the collectives from :func:`~anatomy_helpers.distributed.fake_world.fsdp_collectives_rule` at
    every N instead: an FSDP2 dry run grows with N (2 s at 128 ranks, 30-60 s at 4,096 on two cores), the rule
    takes milliseconds and equals the dry run wherever both run (tests/test_fake_world.py; notebook 11 checks one N).
    One source for the whole curve: a dry run at small N would change no byte of it."""

    tp = network.get("tp", 1)
    if tp != 1 and strategy not in MESH_STRATEGIES:
        raise ValueError(
            f"tp is the TP degree of a 2-D mesh ({tuple(MESH_STRATEGIES)}), got tp={tp!r} for {strategy!r}"
        )
    flops = tp_rank_flops(model, rows_per_rank * tp, tp)  # tp = 1: the whole model on a rank's own rows
    buckets = ddp_bucket_bytes(model, rows_per_rank) if strategy in ("ddp", "ddp_bucket_view", "zero1") else None
    out = []
    for n in world_sizes:
        if strategy == "fsdp2_zero3":
            collectives = fsdp_collectives_rule(model, n)
        else:
            # no warm-up: a fake rank issues the same collectives in its first step as after any warm-up (tested)
            job = RankJob(strategy, steps=1, warmup=0, batch_size=rows_per_rank * n, model=dict(model), tp=tp)
            traced = dry_run_rank(job, n, 0).result.collectives
            collectives = traced if buckets is None else with_buckets(traced, buckets)
        out.append(step_time(collectives, n, flops=flops, peak_flops=peak_flops, utilisation=utilisation, **network))
    return out
