"""Data parallelism on several processes, each rank tracked by the course's tracker: DDP, ZeRO-1 and FSDP2.

Everything runs on PyTorch's own distributed engine (``torch.distributed``): gloo on CPU, nccl on GPUs. Every rank
builds the same course GPT (same seed, same weights), wraps it for one strategy, trains a few warm-up steps
untracked (optimizer state made, DDP's buckets rebuilt, FSDP's buffers allocated), then tracks ``steps`` steps
with a :class:`RankTracker` and sends back a :class:`RankResult`: its Trace, the collectives it issued, and
torch's own figures for what it holds (local shard bytes, ``optimizer.state`` bytes).

* :func:`~anatomy_helpers.distributed.world.run_world` starts ``world_size`` local processes from a notebook or a test
  (a free port on 127.0.0.1, a clear error naming the rank that failed, every process killed on the way out), and
  :mod:`anatomy_helpers.distributed.world` also reads what they sent back into per-rank tables;
* ``python -m anatomy_helpers.distributed`` (or ``torchrun --nproc-per-node N -m anatomy_helpers.distributed``,
  see :mod:`anatomy_helpers.distributed.__main__`) is the same entry point: it prints the per-rank table.

Memory that exists only for a collective is the category "communication": DDP's gradient buckets (unless the
gradients are views of them), FSDP's all-gathered parameters and its all-gather and reduce-scatter buffers.
Parameters, gradients and optimizer state stay what they are even when a collective reads or writes them (the
bucket a gradient is a view of counts as gradients). DTensor parameters, gradients and states count by their
local shards. Bytes everywhere.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..core.tensors import optimizer_state_tensors, storage_bytes
from ..tracking.events import COMMUNICATION, GRADIENTS, Peak
from ..tracking.trace import Trace
from ..tracking.tracker import StepTracker
from ..training.step import StepPlan, run_step
from ..training.train import make_model, track_steps
from .fake_ddp import fake_ddp
from .gloo_release import blocking, run_blocking
from .mesh2d import make_mesh, parallelize_2d
from .tp_plan import parallelize_gpt

STRATEGIES = {
    "ddp": "DDP (gradients copied into buckets)",
    "ddp_bucket_view": "DDP, gradient_as_bucket_view=True",
    "zero1": "ZeRO-1: DDP + ZeroRedundancyOptimizer",
    "fsdp2_zero2": "FSDP2, reshard_after_forward=False (ZeRO-2-like)",
    "fsdp2_zero3": "FSDP2, reshard_after_forward=True (ZeRO-3-like)",
}
#: Tensor parallelism over all ranks (distributed/tensor_parallel.py): every rank trains the same rows. Kept apart
#: from STRATEGIES, which lesson 08 runs and tabulates against the ZeRO formulas.
TP_STRATEGIES = {"tp": "tensor parallelism (parallelize_module)", "tp_sp": "tensor + sequence parallelism"}
#: 2-D: RankJob.tp-way TP inside a node x FSDP2 (ZeRO-3-like) across the N / tp nodes (distributed/mesh2d.py).
MESH_STRATEGIES = {"tp_fsdp": "TP inside a node x FSDP2 across nodes (2-D mesh)"}
FAULTS = ("raise", "exit", "kill", "hang")  # for testing the runner: what the faulty rank does
LR, WEIGHT_DECAY = 1e-3, 0.1  # make_optimizer's AdamW


@dataclass
class RankJob:
    """One strategy to run on every rank. ``batch_size`` is the global batch (all ranks together)."""

    strategy: str
    steps: int = 2
    batch_size: int = 8
    micro_batches: int = 1
    warmup: int = 2  # untracked steps first: optimizer state exists, DDP has rebuilt its buckets
    model: dict = field(default_factory=dict)  # ModelConfig overrides
    straggler_s: float = 0.0  # the last rank sleeps this long at the end of each tracked forward
    fault: str | None = None  # testing the runner: FAULTS, on rank fault_rank, after the process group is up
    fault_rank: int = 1
    tp: int = 1  # "tp_fsdp": the TP degree (ranks per node); N / tp nodes shard with FSDP2

    def __post_init__(self):
        known = (*STRATEGIES, *TP_STRATEGIES, *MESH_STRATEGIES)
        if self.strategy not in known:
            raise ValueError(f"strategy must be one of {known}, got {self.strategy!r}")
        if self.tp != 1 and self.strategy not in MESH_STRATEGIES:
            raise ValueError(f"RankJob.tp is the TP degree of a 2-D mesh ({tuple(MESH_STRATEGIES)}), got {self.tp!r}")
        for name in ("steps", "batch_size", "micro_batches", "warmup", "tp"):
            value = getattr(self, name)
            kind = "non-negative" if name == "warmup" else "positive"
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"RankJob.{name} must be a {kind} integer, got {value!r}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"fault must be None or one of {FAULTS}, got {self.fault!r}")


@dataclass(frozen=True)
class Collective:
    """A collective a rank issued: after timeline sample ``index``, ``op`` on ``bytes`` of tensors."""

    index: int
    time_s: float  # seconds since tracking began, when it was issued
    step: int
    phase: str
    op: str  # the c10d op, e.g. "allreduce_", "_allgather_base_", "_reduce_scatter_base_", "broadcast_"
    bytes: int  # bytes of its output tensors


@dataclass
class RankResult:
    """What one rank measured for one strategy. The ``torch_*`` figures are torch's own, read from the tensors."""

    strategy: str
    rank: int
    world_size: int
    backend: str
    trace: Trace
    collectives: list[Collective]
    n_params: int  # parameters of the whole (unsharded) model
    torch_param_bytes: int  # storages behind this rank's parameters (local shards, padding included)
    torch_param_numel_bytes: int  # numel x element size of the local shards (no padding)
    torch_grad_bytes: int  # storages behind this rank's gradients just before the last optimizer step
    torch_state_bytes: int  # storages behind this rank's optimizer.state (ZeRO: its local optimizer's)
    torch_state_by_key: dict[str, int]  # the same by state key ("step", "exp_avg", "exp_avg_sq")
    model_states: dict[str, int]  # the tracker's bytes per category just before the last optimizer step
    max_memory_allocated: int | None = None  # CUDA only: torch.cuda.max_memory_allocated over the tracked steps

    @property
    def peak(self) -> Peak:
        return self.trace.peak()


# ---- the tracker of one rank ----------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") and hasattr(t, "device_mesh") else t


#: DTensor's functional collectives (torch.ops._c10d_functional), noted as collectives: not its wait_tensor, nor
#: the autograd wrapper a real process group adds around their outputs.
FUNCTIONAL_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


class _Collectives(TorchDispatchMode):
    """Sees each c10d op with its arguments (inside the tracker's own mode): marks its buffers and notes it."""

    def __init__(self, tracker: RankTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tracker = self.tracker
        tracker._poll_watched()
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            # a blocking gloo op returns once gloo's worker thread has let go of its tensors, or a buffer would be
            # freed out of program order (gloo_release.py: why, with torch's source lines)
            gloo_blocking = tracker.gloo and blocking(func, args, kwargs)
            out = run_blocking(func, args, kwargs) if gloo_blocking else func(*args, **kwargs)
            tracker._on_collective(func, args, out)
            return out
        out = func(*args, **kwargs)
        if func.namespace == "_c10d_functional" and func._schema.name.split("::")[-1] in FUNCTIONAL_COLLECTIVES:
            tracker._on_collective(func, args, out, mark=False)  # DTensor's (TP): noted, its tensors left as they are
        return out


class RankTracker(StepTracker):
    """A StepTracker for one data-parallel rank, built on the StepTracker's extension points.

    ``communication``: tensors alive before tracking that exist only for collectives (DDP's buckets).
    ``watched``: storages a wrapper resizes in place without an op (FSDP's all-gathered parameters: resized to
    0 when resharded, back when all-gathered); their size is read before every op. Both count as
    "communication" unless they turn out to be a model state (events.CATEGORY_PRECEDENCE). Every tensor a c10d op
    reads or writes that is no model state counts as communication too; each collective is noted in
    :attr:`collectives`. DTensors count by their local shards. Kernel scratch is not measured (one profiler
    session per process would only add noise here). ``gloo``: a real gloo rank, whose blocking collectives return
    only once gloo's worker thread has let go of their tensors (gloo_release.py), so every free is in program order.
    """

    def __init__(self, model, optimizer, *, accumulate: bool = False, communication=(), watched=(), gloo=False):
        super().__init__(model, optimizer, kernel_scratch=False, accumulate=accumulate)
        self.gloo = gloo  # a real gloo rank: its blocking collectives run by gloo_release.run_blocking
        self._communication = list(communication)
        self._watched = list(watched)
        self._polled: list[tuple] = []  # (tensor, its storage, allocation id) of each watched one
        self._polled_storages, self._polled_bytes = [], []  # those storages, and their bytes when last read
        self.collectives: list[Collective] = []

    # ---- the StepTracker's extension points ----
    def storage_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A DTensor's bytes live in its local shard."""
        return _local(t)

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state, and ZeroRedundancyOptimizer's inner optimizer's (its shard's state lives there)."""
        tensors = super().state_tensors()
        inner = getattr(self.optimizer, "optim", None)
        if isinstance(inner, torch.optim.Optimizer):
            tensors += optimizer_state_tensors(inner)
        return tensors

    def on_baseline(self) -> None:
        """The communication buffers and the watched storages, alive before tracking."""
        for t in self._communication:
            self.mark(t, COMMUNICATION)
        ids = [(t, self.mark(t, COMMUNICATION)) for t in self._watched]
        self._polled = [(t, t.untyped_storage(), i) for t, i in ids if i is not None]
        self._polled_storages = [st for _, st, _ in self._polled]
        self._polled_bytes = list(map(torch.UntypedStorage.nbytes, self._polled_storages))

    def on_optimizer_step(self) -> None:
        """Mark the gradients the optimizer is about to read: FSDP sets its sharded ones without autograd's hooks."""
        if any(t.untyped_storage()._cdata != st._cdata for t, st, _ in self._polled):  # FSDP2 resizes, never swaps
            raise RuntimeError("a watched all-gather output changed storage: the tracker follows in-place resizes")
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.mark(p.grad, GRADIENTS)

    def inner_modes(self) -> list[TorchDispatchMode]:
        """Sees each c10d op first, with its arguments."""
        return [_Collectives(self)]

    # ---- what the modes report ----
    def _poll_watched(self) -> None:
        """Record resizes of the watched storages (FSDP resizes them in place, outside any op): their storages found
        once, their bytes read and compared as one list (per op: a loop in Python was 12 % of a ZeRO-3 LoRA rank)."""
        if not self.recording:
            return
        now = list(map(torch.UntypedStorage.nbytes, self._polled_storages))
        if now != self._polled_bytes:
            for (_, _, allocation), before, nbytes in zip(self._polled, self._polled_bytes, now):
                if nbytes != before:
                    self.resize(allocation, nbytes)
            self._polled_bytes = now

    def _on_collective(self, func, args, out, mark: bool = True) -> None:
        if not self.recording:
            return
        for t in tree_leaves(args) if mark else ():
            if isinstance(t, torch.Tensor):
                self.mark(t, COMMUNICATION)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        self.collectives.append(
            Collective(
                index=self.samples - 1,
                time_s=self.elapsed_s(),
                step=self.step,
                phase=self.phase,
                op=func._schema.name.split("::")[-1],
                bytes=sum(_local(o).nbytes for o in outs),
            )
        )


# ---- one rank -------------------------------------------------------------------------------------------------


class _BufferSpy(TorchDispatchMode):
    """Notes (weakly) the storages every c10d op touches: run over the warm-up to find DDP's buckets."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple[weakref.ref, torch.Tensor | None]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            for a in tree_leaves(args):
                if isinstance(a, torch.Tensor):
                    a = _local(a)
                    self.refs[a.untyped_storage()._cdata] = weakref.ref(a)
        return out

    def alive(self) -> list[torch.Tensor]:
        return [t for ref in self.refs.values() if (t := ref()) is not None]


@dataclass(frozen=True)
class Trainee:
    """What a rank trains when not the course GPT (a Hugging Face fine-tune, distributed/hf_fit.py), the model being
    run_job's ``gpt``: ``blocks(model)``, the modules FSDP2 shards one by one before the root (the GPT's ``blocks``);
    ``optimizer(params, **optimizer_kwargs)`` over the parameters that train (ZeRO-1: the inner optimizer of
    ZeroRedundancyOptimizer); ``plan``: more StepPlan fields of its step (``loss``, ``autocast``; a real rank's
    ``batch`` too); ``build()``: a real rank's model, on the CPU (a dry run passes its fake one instead)."""

    blocks: Callable[[torch.nn.Module], list[torch.nn.Module]]
    optimizer: type
    optimizer_kwargs: dict
    plan: dict
    build: Callable[[], torch.nn.Module] | None = None


def _wrap(job: RankJob, device: torch.device, gpt=None, mesh=None, trainee: Trainee | None = None):
    """(module to call, the model, optimizer) for ``job.strategy``: the course GPT, or ``trainee``'s ``gpt``.

    ``gpt``: a model already built (a dry run's fake one, fake_world.py) instead of ``make_model``'s; DDP then skips
    its start-up check and broadcast of the weights (``init_sync=False``: they read values a fake tensor lacks; what
    they allocate is freed before the first step). ``mesh``: FSDP2's device mesh (a dry run makes it outside the
    fake mode); None: one dimension of all ranks, on this rank's device."""

    fake = gpt is not None
    if gpt is None:
        built = trainee is not None and trainee.build is not None
        gpt = trainee.build().to(device) if built else make_model(device=device, seed=0, **job.model)
    if trainee is not None and job.strategy not in STRATEGIES:
        raise ValueError(f"a Trainee runs under {tuple(STRATEGIES)}, not {job.strategy!r} (the course GPT's TP plan)")
    course = (torch.optim.AdamW, dict(lr=LR, weight_decay=WEIGHT_DECAY))  # train.make_optimizer's "adamw"
    cls, kw = course if trainee is None else (trainee.optimizer, trainee.optimizer_kwargs)  # ZeRO-1: the inner one

    def optimizer(zero1: bool = False):  # over the parameters that train, once the wrapper has made them
        trains = [p for p in gpt.parameters() if p.requires_grad]
        if not zero1:
            return cls(trains, **kw)
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imported here: it warns about torch.jit

        return ZeroRedundancyOptimizer(trains, optimizer_class=cls, **kw)

    ids = [device.index] if device.type == "cuda" else None
    if job.strategy in ("ddp", "ddp_bucket_view", "zero1"):
        wrapped = DDP(
            gpt, device_ids=ids, gradient_as_bucket_view=job.strategy == "ddp_bucket_view", init_sync=not fake
        )
        if fake:
            fake_ddp(wrapped)
        return wrapped, gpt, optimizer(zero1=job.strategy == "zero1")
    if job.strategy in MESH_STRATEGIES:
        parallelize_2d(gpt, mesh if mesh is not None else make_mesh(device.type, dist.get_world_size(), job.tp))
        return gpt, gpt, optimizer()
    from torch.distributed.device_mesh import init_device_mesh  # loaded where a rank or a mesh is built

    # On the rank's device: fully_shard's default mesh is on the GPU, and sets GPU LOCAL_RANK even for a gloo rank.
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    if job.strategy in TP_STRATEGIES:
        parallelize_gpt(gpt, mesh, sequence_parallel=job.strategy == "tp_sp")
        return gpt, gpt, optimizer()
    from torch.distributed.fsdp import fully_shard  # loaded where a rank or a mesh is built

    reshard = job.strategy == "fsdp2_zero3"
    for block in gpt.blocks if trainee is None else trainee.blocks(gpt):
        fully_shard(block, reshard_after_forward=reshard, mesh=mesh)
    fully_shard(gpt, reshard_after_forward=reshard, mesh=mesh)
    return gpt, gpt, optimizer()


def _fsdp_buffers(gpt) -> list[torch.Tensor]:
    """FSDP2's per-parameter all-gather outputs (the unsharded parameters' storage), if it is FSDP."""
    out = []
    for module in gpt.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        group = state()._fsdp_param_group
        if group is not None:
            out.extend(t for p in group.fsdp_params for t in p.all_gather_outputs)
    return out


def run_job(
    job: RankJob,
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    gpt=None,
    mesh=None,
    batch=None,
    trainee: Trainee | None = None,
) -> RankResult:
    """Run ``job`` on this rank of the initialised process group and measure it.

    A dry run (fake_world.py) passes its fake ``gpt``, FSDP2's ``mesh`` and ``batch(i)``, the global batch of step
    ``i`` (fake tensors shaped and allocated as the course batches are); the step itself is the same. ``trainee``:
    ``gpt`` is not the course GPT but this (:class:`Trainee`)."""

    if job.fault is not None and rank == job.fault_rank:
        _fail(job.fault)
    dist.barrier()
    wrapped, gpt, opt = _wrap(job, device, gpt, mesh, trainee)
    step = {} if batch is None else {"batch": batch, "read_loss": False}  # a fake loss has no value to read
    step |= trainee.plan if trainee is not None else {}
    data_rank, data_ranks = (0, 1) if job.strategy in TP_STRATEGIES else (rank, world_size)  # TP: the same rows
    if job.strategy in MESH_STRATEGIES:  # a node's tp ranks train the same rows: one data-parallel rank per node
        data_rank, data_ranks = rank // job.tp, world_size // job.tp
    spy = _BufferSpy()
    with spy:
        track_steps_untracked(wrapped, opt, job, data_rank, data_ranks, **step)
    grads_seen: dict[str, int] = {}

    def grads_before_step(o, args, kwargs):
        params = [p for g in o.param_groups for p in g["params"]]
        grads_seen["bytes"] = storage_bytes(_local(p.grad) for p in params if p.grad is not None)

    handle = opt.register_step_pre_hook(grads_before_step)
    params = list(gpt.parameters())
    state_owner = getattr(opt, "optim", opt)
    communication = [t for t in spy.alive() if not any(t.untyped_storage()._cdata == _cdata(p) for p in params)]
    gloo, watched = dist.get_backend() == "gloo", _fsdp_buffers(gpt)
    tracker = RankTracker(
        gpt, opt, accumulate=job.micro_batches > 1, communication=communication, watched=watched, gloo=gloo
    )
    straggle = None
    if job.straggler_s > 0 and rank == world_size - 1:
        straggle = gpt.register_forward_hook(lambda *a: time.sleep(job.straggler_s))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        trace = track_steps(
            wrapped,
            opt,
            steps=job.steps,
            batch_size=job.batch_size,
            micro_batches=job.micro_batches,
            rank=data_rank,
            world_size=data_ranks,
            seed=1,
            tracker=tracker,
            **step,
        )
    finally:
        handle.remove()
        if straggle is not None:
            straggle.remove()
    before = trace.before_last_optimizer_step()
    result = RankResult(
        strategy=job.strategy,
        rank=rank,
        world_size=world_size,
        backend=dist.get_backend(),
        trace=trace,
        collectives=tracker.collectives,
        n_params=sum(p.numel() for p in params),
        torch_param_bytes=storage_bytes(map(_local, params)),
        torch_param_numel_bytes=sum(_local(p).numel() * p.element_size() for p in params),
        torch_grad_bytes=grads_seen.get("bytes", 0),
        torch_state_bytes=storage_bytes(map(_local, optimizer_state_tensors(state_owner))),
        torch_state_by_key=_state_by_key(state_owner),
        model_states={c: before[c] for c in ("parameters", "gradients", "optimizer_state", "communication")},
        max_memory_allocated=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    )
    dist.barrier()
    return result


def _state_by_key(opt: torch.optim.Optimizer) -> dict[str, int]:
    out: dict[str, int] = {}
    for state in opt.state.values():
        for key, t in state.items():
            if isinstance(t, torch.Tensor):
                out[key] = out.get(key, 0) + _local(t).untyped_storage().nbytes()
    return out


def _cdata(p: torch.Tensor) -> int:
    return _local(p).untyped_storage()._cdata


def track_steps_untracked(wrapped, opt, job: RankJob, rank: int, world_size: int, **step) -> None:
    """``job.warmup`` plain training steps of this rank: the step the tracked steps run (same rows, micro-batches
    and seed, :func:`~anatomy_helpers.training.step.run_step`) on batches 1000, 1001, ..., nothing recorded. ``step``:
    more StepPlan fields (a dry run's ``batch``)."""
    plan = StepPlan(job.batch_size, job.micro_batches, rank=rank, world_size=world_size, seed=1, first_batch=1000,
                    **step)  # fmt: skip
    for i in range(job.warmup):
        run_step(wrapped, opt, plan, i)


def _fail(how: str) -> None:
    if how == "raise":
        raise RuntimeError("injected fault: this rank raises")
    if how == "exit":
        sys.exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)  # "hang"


def _rank_device(backend: str) -> torch.device:
    if backend == "nccl":
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


@contextlib.contextmanager
def rank_process_group(backend: str | None):
    """Join the process group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment, as torchrun and
    :func:`~anatomy_helpers.distributed.world.run_world` set them): nccl when every rank has a GPU, else gloo. Yields
    (rank, world size, this rank's device); leaves the group whatever happens."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    try:
        yield dist.get_rank(), dist.get_world_size(), _rank_device(backend)
    finally:
        dist.destroy_process_group()
