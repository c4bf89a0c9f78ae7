"""Running a world of ranks from a notebook or a test, and reading what the ranks sent back.

:func:`run_world` starts ``world_size`` local ranks, each running what ``python -m anatomy_helpers.distributed``
runs (on Linux forked from a process that imported torch once: :mod:`.zygote`), on a free port on 127.0.0.1:
arguments checked before anything starts, a clear error naming the rank that failed or hung, every process killed
on the way out, and ranks that end themselves if this process dies. It returns each rank's
:class:`~anatomy_helpers.distributed.ranks.RankResult`; :func:`worker_main` is the rank's side. :func:`rank_rows` and
:func:`format_rank_table` set each rank's measured model states beside the ZeRO paper's formulas
(:func:`~anatomy_helpers.prediction.formulas.zero_model_states`). Bytes unless a name says otherwise.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

from ..core.checks import positive_number, torch_at_least
from ..core.tables import Col, format_table
from ..core.units import MiB
from ..prediction.formulas import zero_model_states
from .mesh2d import check_mesh
from .ranks import MESH_STRATEGIES, TP_STRATEGIES, RankJob, RankResult, rank_process_group, run_job
from .zygote import start_rank

# ---- starting the ranks ---------------------------------------------------------------------------------------

# When the runner gives up on a hung world, each rank still running dumps its Python stack on this signal
# (faulthandler, which writes from the signal handler itself, even while the main thread is blocked in C++).
_STACK_SIGNAL = signal.SIGUSR1
# A rank whose innermost frame is in one of these is waiting for its peers (a collective, DDP's hooks, or
# backward, where DDP's all-reduce waits), not the one that hung.
_WAITING_IN = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")
_BACKENDS = ("gloo", "nccl")


class RankFailed(RuntimeError):
    """A rank exited with an error (or the world timed out); every process of the world has been stopped.
    ``rank``: the rank that failed first, or after a time-out the first that was not waiting for the others."""

    def __init__(self, message: str, rank: int | None, pids: list[int]):
        super().__init__(message)
        self.rank, self.pids = rank, pids


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_port(port: int, host: str = "127.0.0.1") -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            raise RuntimeError(
                f"port {port} on {host} is taken (another process group or server listens there): "
                "pass another port, or port=None to pick a free one"
            ) from None


def check_jobs(jobs, world_size: int) -> list[RankJob]:
    """``jobs`` (a RankJob or a non-empty list of them) as a list, each checked against ``world_size`` before any
    rank starts: every data-parallel rank must get the same whole number of rows per micro-batch (:func:`check_rows`:
    a multiple of N for data parallelism, of N / tp for a 2-D mesh, any for tensor parallelism alone)."""
    jobs = [jobs] if isinstance(jobs, RankJob) or hasattr(jobs, "run_rank") else jobs
    # a job with its own run_rank (timed_step.TimedJob) runs that on each rank instead of ranks.run_job
    if (
        not isinstance(jobs, (list, tuple))
        or not jobs
        or not all(isinstance(j, RankJob) or hasattr(j, "run_rank") for j in jobs)
    ):
        raise ValueError(f"jobs must be a RankJob or a non-empty list of RankJob, got {jobs!r}")
    for job in jobs:
        check_rows(job, world_size)
    return list(jobs)


def data_parallel_ranks(job, world_size: int) -> tuple[int, str]:
    """(how many ways ``job``'s global batch is split, what splits it), as :func:`~anatomy_helpers.distributed.ranks.
    run_job` slices the rows: data parallelism gives every rank its own rows (N ways); a 2-D mesh gives each of its
    N / tp nodes its own rows, the same on the node's tp ranks (rank r trains the rows of data-parallel rank
    r // tp); tensor parallelism alone gives every rank the same rows (1 way). ValueError for a bad mesh."""

    if job.strategy in MESH_STRATEGIES:
        return check_mesh(world_size, job.tp), "the N / tp nodes"
    if job.strategy in TP_STRATEGIES:
        return 1, "one (every TP rank trains the same rows)"
    return world_size, "world_size"


def check_rows(job, world_size: int) -> None:
    """ValueError unless ``job``'s global batch gives each data-parallel rank (:func:`data_parallel_ranks`) the
    same whole number of rows per micro-batch."""
    ways, what = data_parallel_ranks(job, world_size)
    if job.batch_size % (ways * job.micro_batches):
        raise ValueError(
            f"{job.strategy}: the global batch ({job.batch_size}) must be a multiple of {what} x micro_batches "
            f"({ways} x {job.micro_batches}), so every rank trains as many rows"
        )


def _check_args(world_size, port, backend, timeout_s) -> None:
    def whole(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not whole(world_size) or world_size not in (1, 2, 3, 4):
        raise ValueError(f"world_size must be an integer from 1 to 4 (ranks on one machine), got {world_size!r}")
    if port is not None and (not whole(port) or not 1 <= port <= 65535):
        raise ValueError(f"port must be None (a free one) or an integer from 1 to 65535, got {port!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    positive_number("timeout_s", timeout_s)  # seconds
    torch_at_least((2, 9), "a world of real ranks")  # checked: 2.9 runs them; 2.6's DDP has no init_sync


def _stop(procs: list[subprocess.Popen]) -> None:
    """Kill each process's group (the rank and anything it started) and reap it."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _tail(path: str, lines: int = 12) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def run_world(
    jobs: list[RankJob] | RankJob,
    world_size: int = 2,
    *,
    port: int | None = None,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> dict[str, list[RankResult]]:
    """Run ``jobs`` on ``world_size`` local processes (one process group for all jobs, in order).

    Returns ``{strategy: [result of rank 0, rank 1, ...]}`` (jobs with the same strategy: the last one). Bad
    arguments (a batch the ranks cannot split evenly among them) raise ValueError before anything starts. Raises
    :class:`RankFailed` naming the first rank that failed (with the end of its error output) or, after
    ``timeout_s``, the rank that hung (with its stack); either way every rank is killed before it returns. If this
    process dies (a kernel restart, SIGKILL), the ranks see their end of a pipe close and end themselves, removing
    the world's temporary folder.
    """
    _check_args(world_size, port, backend, timeout_s)
    jobs = check_jobs(jobs, world_size)
    if port is None:
        port = free_port()
    else:
        _check_port(port)
    with tempfile.TemporaryDirectory(prefix="anatomy_world_") as tmp:
        with open(os.path.join(tmp, "jobs.pkl"), "wb") as f:
            pickle.dump(jobs, f)
        procs = []
        watch, alive = os.pipe()  # the ranks hold the read end; ours closes only when we are done or dead
        try:
            for rank in range(world_size):
                env = dict(
                    os.environ,
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(world_size),
                    LOCAL_WORLD_SIZE=str(world_size),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    OMP_NUM_THREADS="1",
                    ANATOMY_WORLD_WATCH=f"{watch} {os.getpid()}",
                )
                cmd = [sys.executable, "-m", "anatomy_helpers.distributed", "--worker", tmp, f"--backend={backend}"]
                with open(os.path.join(tmp, f"rank{rank}.err"), "w") as err:
                    procs.append(start_rank(cmd, env, stderr=err, pass_fds=(watch,)))  # forked, on Linux
            os.close(watch)
            watch = None
            _wait(procs, tmp, timeout_s)
        finally:
            _stop(procs)
            os.close(alive)
            if watch is not None:
                os.close(watch)
        results: dict[str, list[RankResult]] = {}
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                for res in pickle.load(f):
                    results.setdefault(res.strategy, [None] * world_size)[rank] = res
        return results


def _failure_note(tmp: str, rank: int) -> tuple[float, str, str]:
    """(when ``rank`` failed, "raise" or "exit CODE", the end of its traceback) from the note its worker left;
    (inf, "", "") without one."""
    try:
        with open(os.path.join(tmp, f"rank{rank}.failed")) as f:
            head, _, text = f.read().partition("\n")
            when, _, kind = head.partition(" ")
            return float(when), kind, "\n".join(text.rstrip().splitlines()[-12:])
    except (OSError, ValueError):
        return float("inf"), "", ""


def _hung_ranks(procs: list[subprocess.Popen], running: list[int], tmp: str) -> tuple[list[int], dict[int, str]]:
    """Ask each running rank for its stack; (the ranks not waiting for their peers, each rank's main stack)."""
    for r in running:
        try:
            os.kill(procs[r].pid, _STACK_SIGNAL)
        except ProcessLookupError:
            pass
    paths = {r: os.path.join(tmp, f"rank{r}.stack") for r in running}
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and not all(os.path.exists(p) and os.path.getsize(p) for p in paths.values()):
        time.sleep(0.05)
    time.sleep(0.1)  # let the last one finish writing
    stacks = {r: _main_stack(_tail(p, 200)) for r, p in paths.items()}
    # no stack: the rank had not even started its jobs (still importing, say), so it is behind the others too
    hung = [r for r in running if not stacks[r] or not any(w in stacks[r][0] for w in _WAITING_IN)]
    return hung, {r: "\n".join(s) or "(no stack: it had not started its jobs)" for r, s in stacks.items()}


def _main_stack(dump: str) -> list[str]:
    """The main thread's frames (innermost first) in a faulthandler dump (the watchdog thread's end in threading.py)."""
    blocks, current = [], None
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            current = []
            blocks.append(current)
        elif current is not None and line.strip().startswith("File "):
            current.append(line.strip())
    mains = [b for b in blocks if b and "threading.py" not in b[-1]]
    return mains[0] if mains else []


def _wait(procs: list[subprocess.Popen], tmp: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pids = [p.pid for p in procs]
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            time.sleep(0.5)  # the others usually fail too, a moment later (their peer went away): name the first
            codes = [p.poll() for p in procs]
            noted = {r: _failure_note(tmp, r) for r in range(len(procs))}
            failed = [r for r, c in enumerate(codes) if c not in (None, 0) or noted[r][1]]
            # a rank killed by a signal, else the one that failed first
            r = min(failed, key=lambda r: (not (codes[r] or 0) < 0, noted[r][0]))
            code = codes[r]
            when, kind, text = noted[r]
            if code is not None and code < 0:
                how = f"was killed by {signal.Signals(-code).name}"
            elif kind.startswith("exit"):
                how = f"exited with code {code if code is not None else kind.split()[-1]} (sys.exit)"
            else:
                how = "raised an exception" if kind == "raise" else f"exited with code {code}"
            _stop(procs)
            err = text or _tail(os.path.join(tmp, f"rank{r}.err"))
            raise RankFailed(f"rank {r} of {len(procs)} {how}; the other ranks were stopped.\n{err}", r, pids)
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            hung, stacks = _hung_ranks(procs, running, tmp)
            _stop(procs)
            first = (hung or running)[0]
            if hung:
                what = f"rank(s) {hung} hung (the others were waiting for them)"
            else:
                what = f"rank(s) {running} all waiting for each other (a collective not every rank issued?)"
            raise RankFailed(
                f"timed out after {timeout_s:g} s: {what}; every rank was stopped. Rank {first} was in:\n"
                + stacks.get(first, ""),
                first,
                pids,
            )
        time.sleep(0.05)


# ---- inside a rank ---------------------------------------------------------------------------------------------


def _die_with_parent(tmp: str) -> None:
    """End this rank (removing the world's folder) as soon as the process that started it is gone: its end of the
    pipe closes (or, should another process hold it, this rank's parent changes)."""
    fd, parent = map(int, os.environ["ANATOMY_WORLD_WATCH"].split())

    def watch() -> None:
        while True:
            closed, _, _ = select.select([fd], [], [], 0.5)
            if closed or os.getppid() != parent:
                shutil.rmtree(tmp, ignore_errors=True)
                os._exit(1)

    threading.Thread(target=watch, name="anatomy-world-watch", daemon=True).start()


def worker_main(tmp: str, backend: str | None) -> int:
    """One rank started by :func:`run_world`: run the jobs in ``tmp``/jobs.pkl and leave the results there.

    If a job fails, a note (the time, how: "raise" or "exit CODE", the traceback) is written before the process
    group goes down (which makes the other ranks fail too), so the runner can tell which rank failed first."""

    rank = os.environ["RANK"]
    _die_with_parent(tmp)
    stack = open(os.path.join(tmp, f"rank{rank}.stack"), "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.register(_STACK_SIGNAL, file=stack, all_threads=True)
    with open(os.path.join(tmp, "jobs.pkl"), "rb") as f:
        jobs = pickle.load(f)
    with rank_process_group(backend) as (r, world_size, device):
        try:  # noted inside the group: its teardown makes the other ranks fail, and may take a while
            results = [
                job.run_rank(r, world_size, device) if hasattr(job, "run_rank") else run_job(job, r, world_size, device)
                for job in jobs
            ]
        except SystemExit as e:
            _note(tmp, rank, f"exit {e.code}", "")
            raise
        except BaseException:
            _note(tmp, rank, "raise", traceback.format_exc())
            raise
    path = os.path.join(tmp, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(results, f)
    os.replace(path + ".tmp", path)
    return 0


def _note(tmp: str, rank: str, kind: str, text: str) -> None:
    with open(os.path.join(tmp, f"rank{rank}.failed"), "w") as f:
        f.write(f"{time.time()} {kind}\n{text}")


# ---- formulas and tables --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankRow:
    """One rank's model states (measured just before its last optimizer step) beside the ZeRO formulas (bytes)."""

    strategy: str
    rank: int
    world_size: int
    parameters: int
    gradients: int
    optimizer_state: int
    communication: int  # alive just before the optimizer step
    communication_peak: int  # the most communication memory alive at any moment
    peak: int
    formula_parameters: float
    formula_gradients: float
    formula_optimizer_state: float
    max_memory_allocated: int | None = None  # CUDA only

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def formula_model_states(self) -> float:
        return self.formula_parameters + self.formula_gradients + self.formula_optimizer_state


def rank_row(result: RankResult) -> RankRow:
    """The :class:`RankRow` of one rank's result."""
    zero = "fsdp2_zero3" if result.strategy == "tp_fsdp" else result.strategy  # 2-D: ZeRO-3 over tp x dp ranks
    formula = zero_model_states(zero, result.n_params, result.world_size)
    ms = result.model_states
    return RankRow(
        strategy=result.strategy,
        rank=result.rank,
        world_size=result.world_size,
        parameters=ms["parameters"],
        gradients=ms["gradients"],
        optimizer_state=ms["optimizer_state"],
        communication=ms["communication"],
        communication_peak=int(result.trace.timeline.category("communication").max()),
        peak=result.peak.bytes,
        formula_parameters=formula["parameters"],
        formula_gradients=formula["gradients"],
        formula_optimizer_state=formula["optimizer_state"],
        max_memory_allocated=result.max_memory_allocated,
    )


def rank_rows(results: dict[str, list[RankResult]]) -> list[RankRow]:
    """Every rank of every strategy, strategy by strategy, as :class:`RankRow`."""
    return [rank_row(r) for ranks in results.values() for r in ranks]


def format_rank_table(rows: list[RankRow]) -> str:
    """Measured vs formula per rank: parameters, gradients, optimizer state (measured/formula, MiB), communication
    before the optimizer step and at its peak, the rank's peak (and max_memory_allocated on CUDA)."""

    cuda = any(r.max_memory_allocated is not None for r in rows)
    cols = [
        Col("strategy", 15, align="<"),
        Col("rank", 4, "d"),
        Col("params", 13),
        Col("grads", 13),
        Col("opt state", 13),
        Col("comm", 5, ".2f"),
        Col("comm peak", 9, ".2f"),
        Col("peak", 6, ".2f"),
    ] + ([Col("max_alloc", 9, ".2f")] if cuda else [])

    def pair(measured, formula):
        return f"{measured / MiB:.2f}/{formula / MiB:.2f}"

    out = [
        [
            r.strategy,
            r.rank,
            pair(r.parameters, r.formula_parameters),
            pair(r.gradients, r.formula_gradients),
            pair(r.optimizer_state, r.formula_optimizer_state),
            r.communication / MiB,
            r.communication_peak / MiB,
            r.peak / MiB,
        ]
        + ([None if r.max_memory_allocated is None else r.max_memory_allocated / MiB] if cuda else [])
        for r in rows
    ]
    return format_table(cols, out, note="(MiB; model states measured/formula)")
