"""The cost of synchronizing one data-parallel step across N devices: a model a learner can read and change.

Everything here is a *model*, with its assumptions in one place (:data:`ASSUMPTIONS`); what goes in is measured:

* compute: the FLOPs of one rank's forward and backward as torch's ``FlopCounterMode`` counts them
  (:func:`~anatomy_helpers.step.step_flops`), at a device's peak throughput times a stated utilisation;
* communication: the bytes each rank's collectives carry, read from a rank's trace (a real rank's, or a dry-run
  rank of any N from :mod:`~anatomy_helpers.distributed.fake_world`), priced with the alpha-beta cost of ring
  collectives (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009; NCCL's bus-bandwidth factors): an
  all-reduce of ``S`` bytes on ``N`` ranks takes ``2(N-1) alpha + 2(N-1)/N * S / beta``; a reduce-scatter or an
  all-gather (``S`` the whole gathered buffer) half of that;
* overlap: DDP all-reduces its buckets while backward runs, FSDP all-gathers the next block's parameters while the
  current one computes; only what sticks out of the compute it hides behind is *exposed*;
* stragglers: every rank waits for the slowest, so a step takes the *expected maximum* of N per-rank compute times,
  drawn from a distribution of step times measured here (:func:`expected_max`).

Seconds and bytes everywhere; bandwidths in bytes per second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .ranks import Collective

ASSUMPTIONS = (
    "Ring collectives on one link per rank (the slowest on the ring: inter-node once N exceeds a node); no tree "
    "or hierarchical algorithms, no in-network reduction.",
    "Compute runs at peak x utilisation; the optimizer step and element-wise ops are not counted (FlopCounterMode "
    "counts matrix multiplications and attention).",
    "DDP: the all-reduces hide behind backward except the last bucket's, which starts when backward ends. FSDP: the "
    "all-gathers hide behind forward and backward, the reduce-scatters behind backward, except the first "
    "all-gather (nothing to hide behind yet) and the last reduce-scatter.",
    "Stragglers: the ranks' compute times are independent draws from the measured distribution of step times "
    "(relative to its median); the step ends when the slowest rank is done.",
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


def collective_name(op: str) -> str:
    """A c10d op by its usual name: "allreduce_" -> "all-reduce", "_reduce_scatter_base_" -> "reduce-scatter"."""
    for key, name in (("allgather", "all-gather"), ("reduce_scatter", "reduce-scatter"), ("allreduce", "all-reduce")):
        if key in op:
            return name
    return op.strip("_").replace("_", "-")


@dataclass(frozen=True)
class StepTime:
    """One modelled step on N ranks (seconds)."""

    n: int
    forward: float
    backward: float
    straggler: float  # expected slowest rank's compute minus the median rank's
    communication: float  # every collective of the step, back to back
    exposed: float  # the part of it no compute hides
    step: float  # forward + backward + straggler + exposed

    @property
    def efficiency(self) -> float:
        """Compute time over step time: the share of the step the devices spend computing."""
        return (self.forward + self.backward) / self.step


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
    link: Link = LINKS["ib_ndr"],
    jitter: Sequence[float] = (1.0,),
) -> StepTime:
    """Model one step of a rank whose trace issued ``collectives`` (one tracked step), on ``n`` ranks.

    ``flops``: one rank's forward + backward (backward is two thirds of it, as for matrix multiplications);
    ``peak_flops`` per second at ``utilisation``; ``jitter``: measured step times relative to their median.
    """
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must be in (0, 1], got {utilisation!r}")
    compute = flops / (peak_flops * utilisation)
    forward, backward = compute / 3, 2 * compute / 3
    straggler = compute * (expected_max(jitter, n) - float(np.median(jitter)))
    timed = [
        (c.phase, collective_name(c.op), ring_seconds(collective_name(c.op), c.bytes, n, link)) for c in collectives
    ]
    timed = [(phase, kind, s) for phase, kind, s in timed if phase in ("forward", "backward", "optimizer")]
    total = sum(s for _, _, s in timed)
    exposed = 0.0
    for phase, hide_behind in (("forward", forward), ("backward", backward)):
        in_phase = [s for p, _, s in timed if p == phase]
        if in_phase:  # the first (forward) or the last (backward) collective of the phase cannot overlap
            edge = in_phase[0] if phase == "forward" else in_phase[-1]
            exposed += edge + max(0.0, sum(in_phase) - edge - hide_behind)
    exposed += sum(s for p, _, s in timed if p == "optimizer")  # ZeRO-1's broadcasts follow the step
    return StepTime(n, forward, backward, straggler, total, exposed, forward + backward + straggler + exposed)


def measure_jitter(steps: int = 20, batch_size: int = 4, **config) -> np.ndarray:
    """Wall times of ``steps`` training steps of one process (after two warm-up steps), divided by their median:
    the spread a rank's compute time has on this machine (threads, caches, other processes)."""
    import time

    from ..step import StepPlan, run_step
    from ..train import make_model, make_optimizer

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


def scaling_curve(
    model: dict,
    strategy: str,
    world_sizes: Sequence[int],
    *,
    rows_per_rank: int = 1,
    peak_flops: float,
    utilisation: float = 0.4,
    link: Link = LINKS["ib_ndr"],
    jitter: Sequence[float] = (1.0,),
) -> list[StepTime]:
    """:func:`step_time` at each world size, the collectives' bytes from a dry-run rank 0 of that world and the
    FLOPs from ``FlopCounterMode`` on one rank's rows (weak scaling: the same rows per rank at every N)."""
    import torch

    from ..model import GPT, ModelConfig
    from ..step import step_flops
    from .fake_world import dry_run_rank
    from .ranks import RankJob

    cfg = ModelConfig(**model)
    with torch.device("meta"):  # FlopCounterMode reads shapes only
        gpt = GPT(cfg)
        x = torch.zeros(rows_per_rank, cfg.seq_len, dtype=torch.long)
        flops = step_flops(gpt, x, x)
    out = []
    for n in world_sizes:
        job = RankJob(strategy, steps=1, batch_size=rows_per_rank * n, model=dict(model))
        trace = dry_run_rank(job, n, 0).result
        out.append(
            step_time(
                trace.collectives,
                n,
                flops=flops,
                peak_flops=peak_flops,
                utilisation=utilisation,
                link=link,
                jitter=jitter,
            )
        )
    return out
