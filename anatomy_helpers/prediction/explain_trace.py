"""A torch.profiler chrome trace (``prof.export_chrome_trace``, recorded with ``profile_memory=True``) read into
:class:`~anatomy_helpers.prediction.explain_read.MemoryEvents` for :mod:`anatomy_helpers.prediction.explain`.

What the trace holds (torch/profiler/profiler.py's ``export_chrome_trace``, kineto's JSON): ``[memory]`` instant
events (``Addr``, ``Bytes`` > 0 allocated or < 0 freed, ``Total Allocated``, ``Total Reserved``, ``Device Type`` 0
CPU / 1 CUDA, ``Device Id``), the ranges of ops (``cpu_op``), of ``record_function`` labels and of the optimizer's
own ``Optimizer.step#<name>.step`` / ``Optimizer.zero_grad#<name>.zero_grad`` (``user_annotation``), and with
``with_stack=True`` the ``nn.Module: <name>`` Python ranges. A memory event's phase is the range it falls in:

* optimizer: ``Optimizer.step#...``, ``Optimizer.zero_grad#...`` (the latter flagged as zero_grad), or a
  ``record_function("optimizer")``;
* backward: ``autograd::engine::evaluate_function: ...`` ops, or ``record_function("backward")``;
* forward: the outermost ``nn.Module: ...`` ranges, or ``record_function("forward")``; without either, any op
  outside the two above (*heuristic*: data loading made of ops then counts as forward);
* anything else: outside the step's code.

A CPU profile does not see memory allocated before profiling began (c10's ``ProfiledCPUMemoryReporter`` reports
only the allocations it saw made), so its parameters and optimizer state from before are invisible; a CUDA profile's
``Total Allocated`` gives their sum. Bytes everywhere; times in microseconds.
"""

from __future__ import annotations

import numpy as np

from .explain_read import BWD, FWD, IDLE, OPT, ZERO_GRAD, MemoryEvents, RecordingError

CPU, CUDA = 0, 1
#: The categories of the host's ranges in a chrome trace: ops, record_function labels, Python functions.
HOST = ("cpu_op", "user_annotation", "python_function")


def _merged(spans: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, non-overlapping (starts, ends) covering ``spans``."""
    starts, ends = [], []
    for s, e in sorted(spans):
        if starts and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s), ends.append(e)
    return np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)


def _inside(ts: np.ndarray, spans: list[tuple[float, float]]) -> np.ndarray:
    starts, ends = _merged(spans)
    if not len(starts):
        return np.zeros(len(ts), dtype=bool)
    k = np.searchsorted(starts, ts, side="right") - 1
    return (k >= 0) & (ts <= ends[np.maximum(k, 0)])


def _outermost(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    starts, ends = _merged(spans)
    return list(zip(starts.tolist(), ends.tolist()))


def trace_events(trace: dict, source: str = "<trace>") -> MemoryEvents:
    """The ``[memory]`` events of one device of a chrome trace (CUDA's where there are any, else the CPU's),
    labelled by the ranges they fall in (see the module's docstring)."""
    try:
        events = [e for e in trace["traceEvents"] if isinstance(e, dict)]
        mem = [e for e in events if e.get("name") == "[memory]"]
        # the host's ranges only: a GPU's copies of them (gpu_user_annotation, kernels) run later, on its own clock
        ranges = [(e.get("cat"), e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                  if e.get("ph") == "X" and "ts" in e and e.get("cat") in HOST]  # fmt: skip
        if not mem:
            raise RecordingError(f"{source}: a chrome trace without [memory] events: profile with profile_memory=True")
        on_gpu = [e for e in mem if e["args"].get("Device Type") == CUDA]
        mem = on_gpu or mem
        mem.sort(key=lambda e: (float(e["ts"]), e["args"].get("Ev Idx", 0)))
        ts = np.asarray([float(e["ts"]) for e in mem])
        nbytes = np.asarray([int(e["args"]["Bytes"]) for e in mem], dtype=np.int64)
        addr = np.asarray([int(e["args"]["Addr"]) for e in mem], dtype=np.int64)
        total = np.asarray([int(e["args"].get("Total Allocated", 0)) for e in mem], dtype=np.int64)
        reserved = np.asarray([int(e["args"].get("Total Reserved", 0)) for e in mem], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as e:
        raise RecordingError(
            f"{source}: a chrome trace whose events lack a field ({e!r}); not torch's format"
        ) from None

    def within(*prefixes: str, label: str) -> list[tuple[float, float]]:
        """The ranges whose name starts with one of ``prefixes``, and the record_function ranges called ``label``."""
        return [(s, e) for c, n, s, e in ranges if n.startswith(prefixes) or (c == "user_annotation" and n == label)]

    opt = within("Optimizer.step#", label="optimizer")
    zero = within("Optimizer.zero_grad#", label="zero_grad")
    bwd = within("autograd::engine::evaluate_function", label="backward")
    fwd = within("nn.Module: ", label="forward")
    notes = []
    if not fwd:
        fwd = [(s, e) for c, n, s, e in ranges if c == "cpu_op"]
        notes.append("no nn.Module ranges (with_stack=True) nor record_function('forward'): every op outside backward "
                     "and the optimizer counts as forward, data loading included")  # fmt: skip
    label = np.full(len(mem), IDLE, dtype=np.int8)
    label[_inside(ts, _outermost(fwd))] = FWD
    label[_inside(ts, bwd)] = BWD
    in_zero = _inside(ts, zero)
    label[_inside(ts, opt) | in_zero] = OPT
    flags = np.where(in_zero, ZERO_GRAD, 0).astype(np.int8)
    gpu = bool(on_gpu)
    before = int(total[0] - nbytes[0]) if gpu else 0
    if not gpu:
        notes.append("a CPU profile does not see memory allocated before profiling began (parameters, optimizer "
                     "state of earlier steps): they are not in these totals")  # fmt: skip
    return MemoryEvents(
        source=source,
        kind=f"torch.profiler trace ({'CUDA' if gpu else 'CPU'} memory)",
        time_us=ts,
        addr=addr,
        delta=nbytes,
        label=label,
        flags=flags,
        reserved=reserved if gpu else None,
        alive_before=[before] if before > 0 else [],
        before_seen=gpu,
        before_is_a_sum=True,
        notes=notes,
    )
