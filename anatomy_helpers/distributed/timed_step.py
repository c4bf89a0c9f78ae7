"""Real wall time of each rank's DDP step on a local gloo world, and the synchronization model checked against it.

One :class:`TimedJob` runs on every rank of a :func:`~anatomy_helpers.distributed.world.run_world` world (the same
runner lesson 08 uses: a free port, every process stopped on the way out) and measures, on this machine:

* the link: the time of one all-reduce at sizes from 4 KiB to 16 MiB, to whose medians :func:`fit_link` fits the
  alpha-beta cost :func:`~anatomy_helpers.distributed.sync_model.ring_seconds` uses (latency and bandwidth), once
  with the rank idle and once with it multiplying matrices until the all-reduce is done ("busy": on a CPU, gloo's
  threads need the cores that backward computes on, which the model's overlap does not foresee);
* three kinds of steps, interleaved so that they share the machine's load: "synced" (plain DDP), "compute" (the
  same step under ``no_sync()``: no all-reduce, the compute alone) and "straggler" (synced, the last rank sleeping
  ``straggler_s`` at the start of its backward, a slow device);
* per step, each phase's wall time (forward, backward, optimizer), each bucket's all-reduce (issued when DDP's
  comm hook runs, done when its future completes: torch's default ``allreduce_hook``, timed), and DDP's own
  figures from its logger (``_get_ddp_logging_data``: backward compute, communication and their overlap).

What a rank waits inside backward after its own compute is done is its *exposed* communication: backward's wall
time minus the moment its last bucket was issued (the last gradient ready). :func:`model_vs_measured` feeds the
model the compute steps' times, the buckets DDP built and each fitted link, and sets its step and exposed time
beside the synced steps' (:func:`format_model_vs_measured`): on a CPU the idle link's model is a lower bound and
the busy link's an upper one. Seconds and bytes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..core.tables import Col, format_table
from ..training.step import StepHooks, StepPlan, run_step
from ..training.train import make_model, make_optimizer
from .ranks import Collective
from .sync_model import Link, price_step
from .world import run_world

KINDS = ("synced", "compute", "straggler")
SWEEP_BYTES = tuple(4096 * 16**k for k in range(4))  # 4 KiB, 64 KiB, 1 MiB, 16 MiB


@dataclass
class TimedJob:
    """What every rank of a timed world runs (:mod:`module docstring <anatomy_helpers.distributed.timed_step>`).
    ``batch_size`` is the global batch; ``steps`` of each kind follow ``warmup`` untimed synced steps (DDP rebuilds
    its buckets in the second)."""

    steps: int = 5
    batch_size: int = 8
    warmup: int = 3
    model: dict = field(default_factory=dict)  # ModelConfig overrides
    bucket_cap_mb: float | None = None  # None: DDP's default (25 MiB, the first 1 MiB)
    straggler_s: float = 0.1  # 0: no straggler steps
    sweep_bytes: tuple[int, ...] = SWEEP_BYTES
    sweep_reps: int = 5
    strategy: str = "ddp"  # the runner files results by strategy; DDP is the one timed here
    micro_batches: int = 1

    def __post_init__(self):
        for name in ("steps", "batch_size", "warmup", "sweep_reps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (2 if name == "warmup" else 1):
                raise ValueError(f"TimedJob.{name} must be an integer >= {2 if name == 'warmup' else 1}, got {value!r}")
        if not self.straggler_s >= 0:
            raise ValueError(f"TimedJob.straggler_s must be a non-negative number of seconds, got {self.straggler_s!r}")
        if not self.sweep_bytes or any(b < 4 or b % 4 for b in self.sweep_bytes):
            raise ValueError(f"sweep_bytes must be multiples of 4 bytes (float32 elements), got {self.sweep_bytes!r}")

    def run_rank(self, rank: int, world_size: int, device: torch.device) -> RankTimes:
        """This rank's part (called by the runner's worker inside the process group). CPU ranks only: the clocks
        here are host clocks, which a GPU's asynchronous kernels would outrun."""
        if device.type != "cpu":
            raise ValueError(f"TimedJob times CPU ranks (gloo) with host clocks; got a {device.type} rank")
        return _run_rank(self, rank, world_size, device)


@dataclass(frozen=True)
class StepTimes:
    """One step of one rank: wall times from the rank's own clock (seconds)."""

    kind: str  # one of KINDS
    forward: float
    backward: float  # loss.backward(): compute, then waiting for the last all-reduces
    optimizer: float
    step: float  # the whole step, batch included
    buckets: tuple[tuple[int, float, float], ...]  # (bytes, issued, done), seconds since backward began
    ddp: dict[str, float]  # DDP's logger, seconds: backward_compute, backward_comm, overlap, exposed

    @property
    def backward_compute(self) -> float:
        """Until the last bucket was issued (its last gradient ready); the whole backward if none was."""
        return max((issued for _, issued, _ in self.buckets), default=self.backward)

    @property
    def comm_busy(self) -> float:
        """Seconds the link was busy with this step's buckets: each from when it could start (issued, and the one
        before it done) to when it was done, summed."""
        busy, free = 0.0, 0.0
        for _, issued, done in sorted(self.buckets, key=lambda b: b[2]):
            busy += done - max(issued, free)
            free = done
        return busy

    @property
    def wait(self) -> float:
        """Seconds backward waited for all-reduces after this rank's own compute: its exposed communication."""
        return self.backward - self.backward_compute


@dataclass
class RankTimes:
    """What one rank of a timed world measured."""

    strategy: str
    rank: int
    world_size: int
    sweep: dict[int, list[float]]  # bytes -> seconds of each all-reduce
    sweep_busy: dict[int, list[float]]  # the same while this rank computes (matrix products) until it is done
    steps: list[StepTimes]
    bucket_sizes: list[int]  # DDP's rebuilt buckets, in the order issued (its logger's rebuilt_bucket_sizes)
    bucket_params: list[list[int]]  # the parameter indices in each (rebuilt_per_bucket_param_indices)
    param_bytes: list[int]  # each parameter's bytes, registration order
    straggler_s: float
    pid: int  # this rank's process (gone once the runner returns)
    port: int  # the process group's port (free once the runner returns)

    def of(self, kind: str) -> list[StepTimes]:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return [s for s in self.steps if s.kind == kind]

    def median(self, kind: str, what: str) -> float:
        """Median over this rank's steps of ``kind`` of a :class:`StepTimes` field ("step", "wait", ...)."""
        return float(np.median([getattr(s, what) for s in self.of(kind)]))


# ---- inside a rank ---------------------------------------------------------------------------------------------


class _Timer(StepHooks):
    """Times each phase of :func:`~anatomy_helpers.training.step.run_step`; sleeps ``delay`` before backward if
    asked."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self.delay = 0.0
        self.backward_start = 0.0

    def phase(self, name: str):
        @contextlib.contextmanager
        def timed():
            start = time.perf_counter()
            if name == "backward":
                self.backward_start = start
                if self.delay:
                    time.sleep(self.delay)  # a slow device: its backward starts late, all of its gradients come late
            yield
            self.times[name] = time.perf_counter() - start

        return timed()


def _sweep(sizes: Sequence[int], reps: int, busy: bool = False) -> dict[int, list[float]]:
    """Seconds of each of ``reps`` all-reduces of a float32 buffer per size, all ranks released by a barrier.
    ``busy``: this rank multiplies matrices until its all-reduce is done, as backward keeps computing while DDP's
    buckets are all-reduced (on a CPU the link's work needs the same cores)."""
    a = torch.randn(128, 128)
    out = {}
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4)
        dist.all_reduce(t)  # warm-up: gloo sets up its buffers for this size
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            work = dist.all_reduce(t, async_op=True)
            while busy and not work.is_completed():
                a @ a
            work.wait()
            times.append(time.perf_counter() - start)
        out[nbytes] = times
    return out


def _run_rank(job: TimedJob, rank: int, world_size: int, device: torch.device) -> RankTimes:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (  # loaded where a rank or a mesh is built
        allreduce_hook,
    )

    dist.barrier()
    sweep = _sweep(job.sweep_bytes, job.sweep_reps)
    sweep_busy = _sweep(job.sweep_bytes, job.sweep_reps, busy=True)
    gpt = make_model(device=device, seed=0, **job.model)
    ddp = DDP(gpt, bucket_cap_mb=job.bucket_cap_mb)
    ddp._set_ddp_runtime_logging_sample_rate(1)  # DDP's logger times every step, not every 100th
    timer = _Timer()
    buckets: list[tuple[int, float, float]] = []

    def timed_allreduce(state, bucket):
        issued = time.perf_counter() - timer.backward_start
        nbytes = bucket.buffer().nbytes

        def done(fut):
            buckets.append((nbytes, issued, time.perf_counter() - timer.backward_start))
            return fut.value()

        return allreduce_hook(state, bucket).then(done)

    timed_allreduce.__annotations__["return"] = torch.futures.Future[torch.Tensor]  # DDP checks it
    ddp.register_comm_hook(None, timed_allreduce)
    opt = make_optimizer(gpt, "adamw")
    plan = StepPlan(job.batch_size, rank=rank, world_size=world_size, seed=1, read_loss=False, hooks=timer)
    kinds = [k for k in KINDS if k != "straggler" or job.straggler_s > 0]
    raw, windows, logs = [], [], {}
    total = job.warmup + job.steps * len(kinds)
    for i in range(total + 1):  # one more synced step: DDP's logger reports a step during the next one's forward
        kind = "synced" if i < job.warmup or i == total else kinds[(i - job.warmup) % len(kinds)]
        buckets.clear()
        timer.times.clear()
        timer.delay = job.straggler_s if kind == "straggler" and rank == world_size - 1 else 0.0
        dist.barrier()  # every rank starts the step together: what it waits for is this step's
        start, start_ns = time.perf_counter(), time.time_ns()  # DDP's logger stamps its events in Unix time
        if kind == "compute":
            with ddp.no_sync():
                run_step(ddp, opt, plan, i)
        else:
            run_step(ddp, opt, plan, i)
        wall = time.perf_counter() - start
        logged = ddp._get_ddp_logging_data()
        logs[logged.get("forward_compute_time_start")] = logged
        if job.warmup <= i < total:
            t = timer.times
            raw.append((kind, t["forward"], t["backward"], t["optimizer"], wall, tuple(buckets)))
            windows.append((start_ns, time.time_ns()))
    steps = []
    for (kind, *times), (a, b) in zip(raw, windows):  # each step's own entry of DDP's logger: stamped inside it
        mine = [log for stamp, log in logs.items() if stamp is not None and a <= stamp <= b]
        steps.append(StepTimes(kind, *times, _ddp_times(mine[0]) if mine and kind != "compute" else {}))
    logged = ddp._get_ddp_logging_data()
    dist.barrier()
    return RankTimes(
        strategy=job.strategy,
        rank=rank,
        world_size=world_size,
        sweep=sweep,
        sweep_busy=sweep_busy,
        steps=steps,
        bucket_sizes=[int(s) for s in logged["rebuilt_bucket_sizes"].split(",")],
        bucket_params=[[int(i) for i in b.split()] for b in logged["rebuilt_per_bucket_param_indices"].split(",")],
        param_bytes=[p.numel() * p.element_size() for p in gpt.parameters()],
        straggler_s=job.straggler_s,
        pid=os.getpid(),
        port=int(os.environ["MASTER_PORT"]),
    )


def _ddp_times(logged: dict) -> dict[str, float]:
    """DDP's logger's timings of the last step (nanoseconds) in seconds; {} when it has none."""
    if "backward_compute_time" not in logged:
        return {}
    return {
        "backward_compute": logged["backward_compute_time"] / 1e9,
        "backward_comm": logged["backward_comm_time"] / 1e9,
        "overlap": logged["backward_compute_comm_overlap_time"] / 1e9,
        "exposed": max(0, logged["backward_comm_time_end"] - logged["backward_compute_time_end"]) / 1e9,
    }


# ---- reading what the ranks measured -------------------------------------------------------------------------


def measure_timed_world(job: TimedJob, world_size: int = 2, *, timeout_s: float = 300.0) -> list[RankTimes]:
    """Run ``job`` on ``world_size`` local gloo ranks; each rank's :class:`RankTimes`."""

    return run_world(job, world_size, timeout_s=timeout_s)[job.strategy]


def fit_link(sweep: dict[int, Sequence[float]], n: int, name: str = "loopback (gloo), measured") -> Link:
    """The :class:`~anatomy_helpers.distributed.sync_model.Link` whose ring all-reduce cost
    ``2(n-1) alpha + 2(n-1)/n * S / beta`` best fits the median time of each size ``S`` of ``sweep`` (least squares
    on relative errors, so that the small sizes, which set the latency, count as much as the large ones). Where
    the times do not grow with size (noise larger than the bandwidth term), the bandwidth is infinite: all latency."""
    if len(sweep) < 2 or n < 2:
        raise ValueError(f"need all-reduce times at two sizes at least and n >= 2, got {len(sweep)} sizes, n={n!r}")
    sizes = np.array(sorted(sweep), dtype=float)
    t = np.array([np.median(sweep[s]) for s in sorted(sweep)])
    rows = np.stack([1 / t, sizes / t], axis=1)  # (a + b S) / t = 1: relative errors
    a, b = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)[0]
    if a < 0 or b < 0:  # noise hid one term (on a loaded machine, often): fit the other alone, the hidden one 0
        keep = 1 if a < 0 else 0
        fit = np.linalg.lstsq(rows[:, keep : keep + 1], np.ones_like(t), rcond=None)[0][0]
        a, b = (0.0, fit) if keep else (fit, 0.0)
    return Link(name, bandwidth=2 * (n - 1) / n / b if b > 0 else float("inf"), latency=float(a) / (2 * (n - 1)))


@dataclass(frozen=True)
class Check:
    """One quantity, measured and modelled on two links (seconds; measured: the median of every rank's medians)."""

    name: str
    measured: float
    idle: float  # modelled, the link fitted to all-reduces alone
    busy: float  # modelled, the link fitted to all-reduces while the rank computes

    def error(self, link: str = "idle") -> float:
        """(model - measured) / measured, the model on ``link`` ("idle" or "busy")."""
        return (getattr(self, link) - self.measured) / self.measured


def fitted_links(ranks: Sequence[RankTimes]) -> dict[str, Link]:
    """The links fitted to every rank's sweeps: "idle" (all-reduces alone) and "busy" (while computing)."""
    n = ranks[0].world_size
    return {
        "idle": fit_link({s: [t for r in ranks for t in r.sweep[s]] for s in ranks[0].sweep}, n, "loopback, idle"),
        "busy": fit_link(
            {s: [t for r in ranks for t in r.sweep_busy[s]] for s in ranks[0].sweep_busy}, n, "loopback, cores busy"
        ),
    }


def model_vs_measured(ranks: Sequence[RankTimes]) -> list[Check]:
    """The model fed what this world measured: the compute steps' forward, backward (no all-reduce) and the rest of
    their step (optimizer, batch), DDP's buckets in the order it issued them, and each fitted link
    (:func:`fitted_links`); against the synced steps: the all-reduces' busy time, the exposed wait and the step."""

    def med(kind, what):
        return float(np.median([r.median(kind, what) for r in ranks]))

    collectives = [Collective(0, 0.0, 0, "backward", "allreduce_", b) for b in ranks[0].bucket_sizes]
    forward, backward = med("compute", "forward"), med("compute", "backward")
    rest = med("compute", "step") - forward - backward  # the optimizer, and fetching the batch
    model = {
        name: price_step(
            collectives, ranks[0].world_size, forward=forward, backward=backward, optimizer=rest, link=link
        )
        for name, link in fitted_links(ranks).items()
    }
    return [
        Check(name, med("synced", what), getattr(model["idle"], attr), getattr(model["busy"], attr))
        for name, what, attr in (
            ("all-reduces, back to back", "comm_busy", "communication"),
            ("exposed (backward's wait)", "wait", "exposed"),
            ("step", "step", "step"),
        )
    ]


def format_model_vs_measured(checks: Sequence[Check]) -> str:
    """:func:`model_vs_measured` as a table (ms), with the model's error on each link."""

    cols = [
        Col("quantity", 26, align="<"),
        Col("measured", 8, ",.1f"),
        Col("model idle", 10, ",.1f"),
        Col("error", 7, "+.0%"),
        Col("model busy", 10, ",.1f"),
        Col("error", 7, "+.0%"),
    ]
    rows = [[c.name, c.measured * 1e3, c.idle * 1e3, c.error("idle"), c.busy * 1e3, c.error("busy")] for c in checks]
    return format_table(cols, rows, note="(ms per step; measured: median over steps, then over ranks)")


def straggler_growth(ranks: Sequence[RankTimes]) -> list[tuple[int, float, float]]:
    """(rank, median step time growth when the last rank straggles, growth of its wait) per rank (seconds)."""
    return [
        (r.rank, r.median("straggler", "step") - r.median("synced", "step"),
         r.median("straggler", "wait") - r.median("synced", "wait"))
        for r in ranks
    ]  # fmt: skip
