"""One rank of an N-rank job, dry-run in this process: per-rank memory at any world size without N processes.

Lesson 08 runs every rank for real (:func:`~anatomy_helpers.distributed.world.run_world`, 2 to 4 gloo processes).
Here one process plays rank ``rank`` of ``world_size`` ranks: torch's fake process group (``FakeStore`` and the
"fake" backend, which torch's own tests and torchtitan's memory estimator use: every collective returns at once and
moves no data) under ``FakeTensorMode`` (tensors with shapes and storages sizes but no data,
:mod:`~anatomy_helpers.prediction.dryrun`). The rank runs :func:`~anatomy_helpers.distributed.ranks.run_job`, the
code a real rank runs: the same wrappers (DDP, ZeroRedundancyOptimizer, FSDP2 ``fully_shard``), the same warm-up,
the same tracked :func:`~anatomy_helpers.training.step.run_step` with a
:class:`~anatomy_helpers.distributed.ranks.RankTracker`.
So its :class:`~anatomy_helpers.distributed.ranks.RankResult` has the same Trace, collectives and torch figures a
real rank sends back, for any N (a fake rank of 4,096 takes about as long as one of 2).

What differs from a real rank, and why it does not change the bytes: :data:`FAKE_RULES`. Checked: at N = 2 and 4 every
rank's table row, torch's own figures, activation peak, timeline length and collectives equal a real gloo rank's
(:func:`rank_differences`); at any N the model states equal :func:`model_states_rule`, the rules lesson 08 found,
computed from the shapes alone, and an FSDP2 rank's collectives :func:`fsdp_collectives_rule` (the time model's input
where an FSDP2 dry run grows too slow). Bytes everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.checks import rank_of_world, torch_at_least
from ..core.interrupts import DeferredInterrupt
from ..core.model import GPT, ModelConfig
from ..core.tables import Col, format_table
from ..core.units import GiB, KiB
from ..prediction.dryrun import build_fake_model, check_ops, course_batch, refuse_compiled, twin_config
from ..prediction.fake_check import CheckedFakeTensorMode
from ..prediction.formulas import ZERO_STAGE, zero_model_states
from ..tracking.compiled import CompiledCodeError
from .mesh2d import check_mesh, make_mesh, tp_split_dims
from .ranks import MESH_STRATEGIES, STRATEGIES, Collective, RankJob, RankResult, run_job
from .tp_plan import check_tp
from .world import check_rows, rank_row

#: What a fake rank cannot do as a real one does, and the rule used instead (each one leaves the bytes unchanged;
#: tests/test_fake_world.py checks the tables against real gloo ranks byte for byte).
FAKE_RULES = {
    "collectives": "A fake collective moves no data and allocates nothing of its own: it returns its output "
    "tensors (allocated by the caller, as a real one's are) at once. Gloo's and NCCL's internal staging buffers are "
    "invisible to the tracker in real runs too (they live in the backend, not in torch tensors), so the tables count "
    "the same buffers: the wrapper's (DDP's buckets, FSDP's all-gather and reduce-scatter outputs). A real gloo "
    "rank's blocking collectives return once gloo's worker thread has let go of their tensors (gloo_release.py), so "
    "it frees them in program order, as a fake rank does.",
    "DDP start-up": "DDP checks that every rank's parameters have the same shapes and broadcasts rank 0's weights "
    "(init_sync); both read values a fake tensor lacks, so a fake rank skips them. What they allocate is freed "
    "before the first step, so the tracked steps see the same memory.",
    "DDP buckets": "A real DDP rebuilds its gradient buckets once, after the first backward, in the order the "
    "gradients became ready, and agrees on that order by broadcasting indices from rank 0 (values again). A fake "
    "rank keeps DDP's first assignment. The buckets hold every gradient once either way, so the bytes are the same; "
    "how they are cut into all-reduces differs (here: one 25 MiB bucket where a real rank has a 1 MiB first bucket "
    "and the rest), so DDP's all-reduces are compared by their total bytes.",
    "batch": "The global batch of each step is made by dryrun.course_batch (the same allocations as get_batch, "
    "without the text); each rank copies out its own rows, as a real rank does.",
    "loss": "A fake loss has no value: the step does not read it (.item() allocates nothing anyway).",
    "kernel scratch": "Not measured by a real rank either (RankTracker(kernel_scratch=False)).",
}

#: Collectives, not kernels: c10d's in-place ops (DDP, FSDP2, ZeRO) and the functional ones DTensor issues (tensor
#: parallelism). They need a real process group to run, so the dry run's kernel check leaves them out.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")

#: A fake rank's world can be larger than any machine, not unbounded (FSDP2 builds per-rank tables of size N).
MAX_WORLD_SIZE = 65_536


@dataclass(frozen=True)
class FakeRun:
    """A dry-run rank: its result (as a real rank's) and how long the dry run took (s)."""

    result: RankResult
    seconds: float


def check_rank_job(job: RankJob, world_size: int, rank: int, *, fake: bool = True) -> None:
    if not isinstance(job, RankJob):
        raise ValueError(f"job must be a RankJob, got {type(job).__name__}")
    rank_of_world(rank, world_size, at_most=MAX_WORLD_SIZE)
    check_rows(job, world_size)  # a 2-D mesh: the N / tp nodes split the batch, a node's ranks share it
    if job.strategy in MESH_STRATEGIES:
        check_tp(ModelConfig(**job.model), job.tp)
    if not fake:
        return
    if job.fault is not None or job.straggler_s:
        raise ValueError("a fake rank runs no faults and no stragglers (those are for real ranks' timing)")
    check_no_process_group()


def check_no_process_group() -> None:
    if dist.is_initialized():
        raise ValueError(
            "a process group is already initialised in this process: a fake rank needs its own (run it outside "
            "torchrun, or in a fresh process)"
        )


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """torch's fake process group for ``rank`` of ``world_size``, destroyed on the way out whatever happens."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's test-only fake process group

    # Checked: 2.11 runs every dry run of ranks; 2.9 and 2.10 have no fake kernel for c10d's barrier and scatter.
    torch_at_least((2, 11), "a dry run of ranks (fake process group and fake tensors)")

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dry_run_rank(job: RankJob, world_size: int, rank: int = 0) -> FakeRun:
    """Dry-run rank ``rank`` of a ``world_size``-rank job: the RankResult a real rank of that world would send.

    ``job.batch_size`` is the global batch (all ranks). Exact or refused, as every dry run of the course
    (prediction/dryrun.py): each op signature of the step is checked once against the real kernel (the result kept on
    disk: fake_check_cache; on a small twin of the model for a large one) and an op whose fake kernel differs raises
    DryRunError; the collectives are not kernels (:data:`FAKE_RULES`). Bad input (N that does not divide the batch, a
    rank outside the world, a process group already up) raises ValueError before anything starts; the fake process group
    and the fake mode are gone when it returns or raises.
    """

    check_rank_job(job, world_size, rank)
    cfg = ModelConfig(**job.model)  # a bad config fails here
    run, calls = fake_rank(
        job, world_size, rank, lambda: GPT(cfg), lambda step: course_batch(job.batch_size, cfg.seq_len)
    )

    def twin_calls() -> dict:
        twin = twin_config(cfg)
        small = dataclasses.replace(job, model=dataclasses.asdict(twin))
        return fake_rank(
            small, world_size, rank, lambda: GPT(twin), lambda step: course_batch(small.batch_size, twin.seq_len)
        )[1]

    check_ops(calls, f"rank {rank} of {world_size} ({job.strategy})", twin_calls)
    return run


def fake_rank(
    job: RankJob, world_size: int, rank: int, build, batch, *, trainee=None, mode=None, around=None
) -> tuple[FakeRun, dict]:
    """The dry run of one rank, whatever it trains: (the FakeRun, the op calls to check, without the collectives).

    On the fake process group, the model ``build()`` makes (on the meta device, then fake: dryrun.build_fake_model)
    runs :func:`~anatomy_helpers.distributed.ranks.run_job` with ``batch(i)``, step ``i``'s global batch, made in
    the fake mode. The course GPT (:func:`dry_run_rank`) and a Hugging Face fine-tune (distributed/hf_fit.py,
    ``trainee``: ranks.Trainee) both come here. ``mode``: the fake mode (a CheckedFakeTensorMode; default a new
    one); ``around``: a context the job runs inside, in the fake mode."""

    start = time.perf_counter()
    # Ctrl-C inside FakeTensorMode's Python, called from torch's C++ dispatcher, aborts the process (see dryrun.py)
    interrupt = DeferredInterrupt()
    interrupt.start()
    try:
        with fake_process_group(world_size, rank):
            mode = CheckedFakeTensorMode() if mode is None else mode
            model = build_fake_model(build, mode)
            mode.calls.clear()  # making the fake model is the dry run's own doing
            mesh = None
            if job.strategy.startswith("fsdp"):  # made outside the fake mode: it reads the ranks' values
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh("cpu", (world_size,))
            elif job.strategy in MESH_STRATEGIES:
                mesh = make_mesh("cpu", world_size, job.tp)
            with mode, around if around is not None else contextlib.nullcontext():
                cpu = torch.device("cpu")
                result = run_job(job, rank, world_size, cpu, gpt=model, mesh=mesh, batch=batch, trainee=trainee)
    except CompiledCodeError as e:  # a compiled function the step called (the tracker refused it before it ran)
        raise refuse_compiled(e.where) from e
    finally:
        interrupt.stop()
    calls = {key: call for key, call in mode.calls.items() if call.func.namespace not in COLLECTIVE_NAMESPACES}
    return FakeRun(result, time.perf_counter() - start), calls


# ---- exact per-rank model states from the shapes alone: the rules lesson 08 found --------------------------------

#: AdamW's "step": a float32 scalar tensor per parameter it holds state for (bytes).
STEP_BYTES = 4


def zero1_partition(numels: list[int], world_size: int) -> list[list[int]]:
    """Which parameters (indices into ``numels``) each rank's ZeroRedundancyOptimizer holds state for: torch's own
    rule (``_partition_parameters``): largest first, each to the rank holding the fewest elements so far (the
    lowest such rank on a tie). With fewer parameters than ranks, the last ranks hold none."""
    sizes = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):  # stable: model order on ties
        r = sizes.index(min(sizes))
        out[r].append(i)
        sizes[r] += numels[i]
    return out


def fsdp_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """(rows of a parameter's dim 0 that ``rank`` holds, rows its shard's storage has) under FSDP2: ``torch.chunk``
    into ``world_size`` pieces of ``ceil(dim0 / N)`` rows (the last pieces short or empty), each padded to that."""
    chunk = -(-dim0 // world_size)
    return max(0, min(chunk, dim0 - rank * chunk)), chunk


def model_states_rule(model: dict, strategy: str, world_size: int, rank: int = 0) -> dict[str, int]:
    """Rank ``rank``'s parameters, gradients and optimizer state just before its optimizer step (bytes), from the
    course GPT's shapes alone (built on the meta device), by the rules a real rank follows:

    * DDP and ZeRO-1 hold every parameter and gradient; the model's buffers (the causal masks) count as parameters;
    * AdamW keeps two moments per element (the parameter's dtype) and a 4-byte "step" per parameter it updates;
    * ZeRO-1 updates only the parameters :func:`zero1_partition` gives this rank;
    * FSDP2 (either mode, at rest after backward) keeps each parameter's dim-0 shard padded to ``ceil(dim0 / N)``
      rows (:func:`fsdp_rows`), its gradient likewise; the moments cover only the rows the rank really holds, and
      every rank keeps a "step" for every parameter, even with an empty shard.

    The ZeRO paper's formulas (:func:`~anatomy_helpers.prediction.formulas.zero_model_states`) are these rules with
    every split even, no padding, no buffers and no step counts.
    """

    if strategy not in ZERO_STAGE:
        raise ValueError(f"strategy must be one of {tuple(ZERO_STAGE)}, got {strategy!r}")
    check_rank_job(RankJob(strategy, batch_size=world_size, model=dict(model)), world_size, rank, fake=False)
    with torch.device("meta"):
        gpt = GPT(ModelConfig(**model))
    params = list(gpt.parameters())  # as the optimizer sees them: a tied weight once
    buffers = sum(b.untyped_storage().nbytes() for b in gpt.buffers())
    size = [p.element_size() for p in params]
    if strategy.startswith("fsdp"):
        held, padded = zip(*(fsdp_rows(p.shape[0], world_size, rank) for p in params))
        per_row = [p.numel() // p.shape[0] * s for p, s in zip(params, size)]
        return {
            "parameters": sum(r * b for r, b in zip(padded, per_row)) + buffers,
            "gradients": sum(r * b for r, b in zip(padded, per_row)),
            "optimizer_state": sum(2 * r * b for r, b in zip(held, per_row)) + STEP_BYTES * len(params),
        }
    whole = sum(p.numel() * s for p, s in zip(params, size))
    mine = range(len(params))
    if strategy == "zero1":
        mine = zero1_partition([p.numel() for p in params], world_size)[rank]
    return {
        "parameters": whole + buffers,
        "gradients": whole,
        "optimizer_state": sum(2 * params[i].numel() * size[i] + STEP_BYTES for i in mine),
    }


def mesh_states_rule(model: dict, world_size: int, tp: int, rank: int = 0) -> dict[str, int]:
    """Rank ``rank``'s parameters, gradients and optimizer state just before its optimizer step under "tp_fsdp"
    (bytes), from the course GPT's shapes alone:

    * TP: a parameter :func:`tp_split_dims` names keeps ``1/tp`` of that dim (whole heads: check_tp), the others
      stay whole on every TP rank;
    * FSDP2 over the ``N / tp`` nodes, on that local tensor: its dim 0 chunked and padded to ``ceil(dim0 / dp)``
      rows (parameters and gradients), the AdamW moments over the rows really held, a 4-byte "step" for every
      parameter; the buffers (the causal masks) whole, counted as parameters.

    With no whole (replicated) parameters and no padding this is the ZeRO-3 formula at N = tp x dp ranks."""

    dp = check_mesh(world_size, tp)
    check_rank_job(RankJob("tp_fsdp", batch_size=dp, model=dict(model), tp=tp), world_size, rank, fake=False)
    cfg = ModelConfig(**model)
    check_tp(cfg, tp)
    with torch.device("meta"):
        gpt = GPT(cfg)
    split = tp_split_dims(block=cfg.block)
    dp_rank = rank // tp
    params = grads = moments = 0
    for name, p in gpt.named_parameters():
        shape = list(p.shape)
        dim = split.get(name.split(".", 2)[-1]) if name.startswith("blocks.") else None
        if dim is not None:
            shape[dim] //= tp
        held, padded = fsdp_rows(shape[0], dp, dp_rank)
        row = p.element_size() * math.prod(shape[1:])  # bytes of one dim-0 row of the TP-local shard
        params += padded * row
        grads += padded * row
        moments += 2 * held * row + STEP_BYTES
    buffers = sum(b.untyped_storage().nbytes() for b in gpt.buffers())
    return {"parameters": params + buffers, "gradients": grads, "optimizer_state": moments}


def fsdp_collectives_rule(model: dict, world_size: int) -> list[Collective]:
    """The collectives a "fsdp2_zero3" rank (FSDP2, reshard_after_forward=True, each block then the root wrapped)
    issues in one step of one micro-batch, as its trace notes them (phase, c10d op, bytes of the output), from the
    course GPT's shapes alone: what a dry-run rank of any N records, without the dry run (which grows with N).

    It follows torch's FSDP2 (torch/distributed/fsdp/_fully_shard/):

    * a group is one ``fully_shard`` call's parameters: each block's, and the root's (those in no block: the
      embeddings, the final norm, the head; a tied weight once). Each parameter's shard is its dim 0 cut by
      ``torch.chunk`` and padded to the first chunk, ``ceil(dim0 / N)`` rows (_fsdp_param.py, :func:`fsdp_rows`);
    * an all-gather's output holds every rank's padded shards of the group: ``N x`` one rank's
      (``foreach_all_gather``, _fsdp_collectives.py); a reduce-scatter's output is one rank's padded shard of the
      group's gradients (``foreach_reduce``: its input is each gradient padded to ``ceil(dim0 / N) x N`` rows);
    * forward all-gathers the root, then each block in order; every group reshards after its forward, so backward
      gathers again: the root's pre-backward gathers the root, and each group's pre-backward prefetches the group
      that ran before it in forward (``_backward_prefetch``, one group ahead: block L-1 from the root's); each
      block's post-backward reduce-scatters it, and the root's gradients (the tied weight gets its last gradient at
      the embedding) are reduce-scattered at the very end;
    * at N = 1 FSDP2 issues no collective (``unshard`` and ``foreach_reduce`` skip them).

    ``index`` and ``time_s`` are 0 (a rule has no timeline), ``step`` 1. tests/test_fake_world.py checks the list
    against dry-run ranks, op by op and byte for byte."""
    check_rank_job(RankJob("fsdp2_zero3", batch_size=world_size, model=dict(model)), world_size, 0, fake=False)
    if world_size == 1:
        return []
    with torch.device("meta"):
        gpt = GPT(ModelConfig(**model))

    def shard(params) -> int:  # one rank's padded shard of each parameter: ceil(dim0 / N) rows (bytes)
        total = 0
        for p in params:
            row = p.numel() // p.shape[0] * p.element_size()  # bytes of one dim-0 row
            total += fsdp_rows(p.shape[0], world_size, 0)[1] * row
        return total

    in_blocks = {id(p) for b in gpt.blocks for p in b.parameters()}
    root = shard(p for p in gpt.parameters() if id(p) not in in_blocks)
    blocks = [shard(b.parameters()) for b in gpt.blocks]

    def note(phase: str, op: str, nbytes: int) -> Collective:
        return Collective(index=0, time_s=0.0, step=1, phase=phase, op=op, bytes=nbytes)

    def gather(phase: str, group: int) -> Collective:
        return note(phase, "_allgather_base_", world_size * group)

    out = [gather("forward", g) for g in (root, *blocks)]
    out += [gather("backward", root), gather("backward", blocks[-1])]
    for i in reversed(range(len(blocks))):
        if i > 0:
            out.append(gather("backward", blocks[i - 1]))  # prefetched before block i's backward runs
        out.append(note("backward", "_reduce_scatter_base_", blocks[i]))
    return out + [note("backward", "_reduce_scatter_base_", root)]


# ---- a fake rank against a real one, and the per-rank table at any N ----------------------------------------------


def rank_differences(real: RankResult, fake: RankResult) -> dict[str, tuple]:
    """Every figure of a real rank's result that its dry run does not reproduce byte for byte: ``{name: (real,
    fake)}``, empty when they agree. Compared: the rank table's row (model states, communication before the step
    and at its peak, the peak), torch's own figures, the activation peak, the timeline's length, and the collectives
    (op and bytes, in order). DDP's buckets: a fake rank keeps DDP's first bucket assignment (FAKE_RULES), so for
    DDP and ZeRO-1 the gradient all-reduces are compared by their total bytes, every other collective one by one."""

    out: dict[str, tuple] = {}
    a, b = rank_row(real), rank_row(fake)
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            out[name] = (x, y)
    for name in ("n_params", "torch_param_bytes", "torch_param_numel_bytes", "torch_grad_bytes", "torch_state_bytes"):
        if getattr(real, name) != getattr(fake, name):
            out[name] = (getattr(real, name), getattr(fake, name))
    if real.torch_state_by_key != fake.torch_state_by_key:
        out["torch_state_by_key"] = (real.torch_state_by_key, fake.torch_state_by_key)
    acts = [int(r.trace.timeline.category("activations").max()) for r in (real, fake)]
    if acts[0] != acts[1]:
        out["activations"] = tuple(acts)
    if len(real.trace.timeline) != len(fake.trace.timeline):
        out["timeline samples"] = (len(real.trace.timeline), len(fake.trace.timeline))
    colls = [_collectives(r) for r in (real, fake)]
    if colls[0] != colls[1]:
        out["collectives"] = tuple(colls)
    return out


def _collectives(result: RankResult) -> list[tuple[str, str, int]]:
    """(phase, op, bytes) of each collective; DDP's gradient all-reduces (backward) as one total."""
    bucketed = result.strategy in ("ddp", "ddp_bucket_view", "zero1")
    out = [(c.phase, c.op, c.bytes) for c in result.collectives if not (bucketed and c.phase == "backward")]
    if bucketed:
        out.append(("backward", "allreduce_", sum(c.bytes for c in result.collectives if c.phase == "backward")))
    return out


@dataclass(frozen=True)
class WorldRow:
    """One dry-run rank of an N-rank job: what it holds (bytes) beside the ZeRO formula and the exact rules."""

    strategy: str
    world_size: int
    rank: int
    parameters: int  # just before the optimizer step, as the rank tables of lesson 08
    gradients: int
    optimizer_state: int
    activations: int  # the most activation bytes alive at any moment of the step
    communication_peak: int  # the most bucket / all-gather / reduce-scatter bytes alive at once
    peak: int
    formula_model_states: float  # zero_model_states: even splits, no padding, no buffers, no step counts
    rule_model_states: int  # model_states_rule, from the shapes alone
    seconds: float  # how long the dry run of this rank took

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def world_rows(
    model: dict, strategies=None, world_sizes=(8, 1024, 4096), *, rows_per_rank: int = 1, ranks=(0,)
) -> list[WorldRow]:
    """Dry-run ranks ``ranks`` (negative: from the end, -1 the last) of each strategy at each world size, one tracked
    step after the warm-up, ``rows_per_rank`` rows of the course batches per rank. Returns their :class:`WorldRow`."""

    out = []
    for strategy in strategies or STRATEGIES:
        for n in world_sizes:
            for rank in sorted({r % n for r in ranks}):
                run = dry_run_rank(RankJob(strategy, steps=1, batch_size=rows_per_rank * n, model=dict(model)), n, rank)
                r, ms = run.result, run.result.model_states
                out.append(
                    WorldRow(
                        strategy=strategy,
                        world_size=n,
                        rank=rank,
                        parameters=ms["parameters"],
                        gradients=ms["gradients"],
                        optimizer_state=ms["optimizer_state"],
                        activations=int(r.trace.timeline.category("activations").max()),
                        communication_peak=int(r.trace.timeline.category("communication").max()),
                        peak=r.peak.bytes,
                        formula_model_states=sum(zero_model_states(strategy, r.n_params, n).values()),
                        rule_model_states=sum(model_states_rule(model, strategy, n, rank).values()),
                        seconds=run.seconds,
                    )
                )
    return out


def format_world_table(rows: list[WorldRow]) -> str:
    """The per-rank table: what each dry-run rank holds (KiB below 2 GiB peaks, else GiB), its model states against
    the formula and the rules."""

    unit, scale = ("GiB", GiB) if max(r.peak for r in rows) >= 2 * GiB else ("KiB", KiB)
    fmt = ",.2f" if unit == "GiB" else ",.0f"

    cols = [
        Col("strategy", 15, align="<"),
        Col("N", 5, "d"),
        Col("rank", 4, "d"),
        Col("params", 8, fmt),
        Col("grads", 8, fmt),
        Col("opt state", 9, fmt),
        Col("activations", 11, fmt),
        Col("comm peak", 9, fmt),
        Col("peak", 8, fmt),
        Col("states/formula", 14, ".3f"),
        Col("= rules", 7, align="<", gap="  "),
    ]
    out = [
        [
            r.strategy,
            r.world_size,
            r.rank,
            r.parameters / scale,
            r.gradients / scale,
            r.optimizer_state / scale,
            r.activations / scale,
            r.communication_peak / scale,
            r.peak / scale,
            r.model_states / r.formula_model_states,
            "yes" if r.model_states == r.rule_model_states else "NO",
        ]
        for r in rows
    ]
    return format_table(cols, out, note=f"({unit} per rank; one dry-run rank of an N-rank job)")
