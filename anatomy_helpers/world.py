"""Running a world of ranks from a notebook or a test, and reading what the ranks sent back.

:func:`run_world` starts ``world_size`` local processes, each running ``python -m anatomy_helpers.distributed``
(a free port on 127.0.0.1, a clear error naming the rank that failed, every process killed on the way out), and
returns each rank's :class:`~anatomy_helpers.distributed.RankResult`. :func:`rank_rows` and
:func:`format_rank_table` set each rank's measured model states beside the ZeRO paper's formulas
(:func:`zero_model_states`). Bytes unless a name says otherwise.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from .distributed import ZERO_STAGE, RankJob, RankResult

# ---- starting the ranks ---------------------------------------------------------------------------------------


class RankFailed(RuntimeError):
    """A rank exited with an error (or the world timed out); every process of the world has been stopped."""

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

    Returns ``{strategy: [result of rank 0, rank 1, ...]}`` (jobs with the same strategy: the last one). Raises
    :class:`RankFailed` naming the first rank that failed (with the end of its error output) or, after
    ``timeout_s``, the ranks still running; either way every rank is killed before it returns.
    """
    jobs = [jobs] if isinstance(jobs, RankJob) else list(jobs)
    if world_size not in (1, 2, 3, 4):
        raise ValueError(f"world_size must be 1 to 4 on one machine, got {world_size!r}")
    if port is None:
        port = free_port()
    else:
        _check_port(port)
    with tempfile.TemporaryDirectory(prefix="anatomy_world_") as tmp:
        with open(os.path.join(tmp, "jobs.pkl"), "wb") as f:
            pickle.dump(jobs, f)
        procs = []
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
                )
                with open(os.path.join(tmp, f"rank{rank}.err"), "w") as err:
                    procs.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "anatomy_helpers.distributed",
                                "--worker",
                                tmp,
                                f"--backend={backend}",
                            ],
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=err,
                            start_new_session=True,
                        )
                    )
            _wait(procs, tmp, timeout_s)
        finally:
            _stop(procs)
        results: dict[str, list[RankResult]] = {}
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                for res in pickle.load(f):
                    results.setdefault(res.strategy, [None] * world_size)[rank] = res
        return results


def _failure_note(tmp: str, rank: int) -> tuple[float, str]:
    """(when ``rank`` raised, the end of its traceback), from the note its worker left; (inf, "") without one."""
    try:
        with open(os.path.join(tmp, f"rank{rank}.failed")) as f:
            when, _, text = f.read().partition("\n")
            return float(when), "\n".join(text.rstrip().splitlines()[-12:])
    except (OSError, ValueError):
        return float("inf"), ""


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
            # a rank killed by a signal, else the one that raised first
            r = min(failed, key=lambda r: (not (codes[r] or 0) < 0, noted[r][0]))
            code = codes[r]
            if code is not None and code < 0:
                how = f"was killed by {signal.Signals(-code).name}"
            else:
                how = "raised an exception" if noted[r][1] else f"exited with code {code}"
            _stop(procs)
            err = noted[r][1] or _tail(os.path.join(tmp, f"rank{r}.err"))
            raise RankFailed(f"rank {r} of {len(procs)} {how}; the other ranks were stopped.\n{err}", r, pids)
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            _stop(procs)
            raise RankFailed(
                f"timed out after {timeout_s:.0f} s: rank(s) {running} still running (a hang, or a rank waiting "
                "for one that never came); every rank was stopped",
                running[0],
                pids,
            )
        time.sleep(0.05)


# ---- formulas and tables --------------------------------------------------------------------------------------


def zero_model_states(
    strategy: str, n_params: int, world_size: int, *, param_bytes: int = 4, grad_bytes: int = 4, state_bytes: int = 8
) -> dict[str, float]:
    """Model states per rank by the ZeRO paper's formulas (bytes): DP holds everything; ZeRO-1 divides the optimizer
    state by N, ZeRO-2 also the gradients, ZeRO-3 also the parameters. Defaults: fp32 AdamW (4 + 4 + 8 bytes)."""
    stage = ZERO_STAGE[strategy]
    n = world_size
    return {
        "parameters": n_params * param_bytes / (n if stage >= 3 else 1),
        "gradients": n_params * grad_bytes / (n if stage >= 2 else 1),
        "optimizer_state": n_params * state_bytes / (n if stage >= 1 else 1),
    }


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
    formula = zero_model_states(result.strategy, result.n_params, result.world_size)
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
    from .tables import Col, format_table
    from .units import MiB

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
