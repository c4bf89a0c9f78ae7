"""Reading a learner's own recording for :mod:`anatomy_helpers.prediction.explain`: a CUDA memory snapshot (the
pickle of ``torch.cuda.memory._dump_snapshot``) or a torch.profiler trace (the JSON of
``prof.export_chrome_trace``, recorded with ``profile_memory=True``), each turned into one
:class:`MemoryEvents`: every allocation and free in order, with what its stack or its time says of the phase.

What each format holds, from torch's source:

* a snapshot (``torch/cuda/memory.py``'s ``_snapshot``/``_dump_snapshot``, read the way ``torch/cuda/_memory_viz.py``
  reads it): ``segments`` (the allocator's state when dumped: segments and their blocks) and ``device_traces`` (the
  ring buffer of ``_record_memory_history``: ``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``,
  ``segment_free``, ``segment_map``/``segment_unmap`` with expandable segments, ``oom``), each event with the stack
  that caused it (``frames``, innermost first; Python frames only with ``stacks="python"``, also C++ with
  ``"all"``). A block alive at the dump that no ``alloc`` event made was alive before the recording began (or its
  ``alloc`` fell out of the ring buffer: ``max_entries``);
* a chrome trace (``torch/profiler/profiler.py``'s ``export_chrome_trace``): ``[memory]`` instant events (``Addr``,
  ``Bytes``, ``Total Allocated``, ``Total Reserved``, ``Device Type``) and the ranges of ops, of
  ``record_function`` labels and of the optimizer's own ``Optimizer.step#...`` / ``Optimizer.zero_grad#...``.

The pickle is read by an unpickler that refuses every class and function (a snapshot holds only dicts, lists,
strings and numbers), so a file that is not a snapshot cannot run code. Bytes everywhere; times in microseconds.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .snapshot import SIMULATED

# What an event's stack (or its time) says, before steps are cut (explain.py's state machine).
UNKNOWN, IDLE, FWD, BWD, OPT = range(5)
LABELS = ("no stack", "outside the step's code", "forward", "backward", "optimizer")
# Flags an event may carry besides its label.
ZERO_GRAD, RECOMPUTE, MODULE_INIT = 1, 2, 4

#: The largest file explain reads (bytes): a snapshot pickle is unpickled whole, and its Python objects take about
#: ten times the file's size in memory. benchmarks/explain_speed.py measured 117 MB (564,000 events) in 13-17 s
#: and 1.3 GiB of memory on two busy cores (December 2026): this limit is about a minute and 6 GiB.
MAX_FILE_BYTES = 512 << 20


class RecordingError(ValueError):
    """A file explain cannot read, with the file's name and why."""


@dataclass
class MemoryEvents:
    """Every allocation (``delta`` > 0) and free (< 0) of one device, in order (numpy columns of one length).

    ``label``: one of the codes above (UNKNOWN ... OPT); ``flags``: ZERO_GRAD, RECOMPUTE, MODULE_INIT bits.
    ``reserved``: the allocator's reserved bytes after each row (None when the format does not say).
    ``alive_before``: sizes of blocks alive before the recording began and still alive at its end (a snapshot's
    final state holds them; a profiler trace does not). ``before_seen``: whether memory from before the recording
    is visible at all (False for a CPU profile: c10's CPU allocator reports only what it allocated while profiling).
    """

    source: str
    kind: str
    time_us: np.ndarray
    addr: np.ndarray
    delta: np.ndarray
    label: np.ndarray
    flags: np.ndarray
    reserved: np.ndarray | None
    alive_before: list[int]
    before_seen: bool
    reserved_before: int | None = None  # the allocator's reserved bytes when the recording began
    before_is_a_sum: bool = False  # alive_before is one sum (a CUDA profile's), not the blocks one by one
    notes: list[str] = field(default_factory=list)
    oom_rows: list[int] = field(default_factory=list)  # rows just after an ``oom`` event

    def __len__(self) -> int:
        return len(self.delta)


class _NoClasses(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to {module}.{name}; a memory snapshot holds no classes")


def _open_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise RecordingError(f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise RecordingError(
            f"{path}: {size / 2**20:,.0f} MiB is more than explain reads ({MAX_FILE_BYTES / 2**20:,.0f} MiB: a "
            "snapshot's objects take about ten times its size in memory); record fewer steps, a smaller "
            "max_entries or fewer frames"
        )
    if size == 0:
        raise RecordingError(f"{path}: the file is empty")
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise RecordingError(f"{path}: a gzip file that does not decompress ({e}): truncated?") from None
    return data


def load_recording(path: str | Path) -> tuple[str, object]:
    """("snapshot", the unpickled dict) or ("trace", the parsed chrome-trace JSON) of ``path`` (plain or gzipped);
    anything else, a truncated file or one over :data:`MAX_FILE_BYTES`, is a :class:`RecordingError` naming it."""
    path = Path(path)
    data = _open_bytes(path)
    if data[:1] == b"\x80":
        try:
            return "snapshot", _NoClasses(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, MemoryError, IndexError, KeyError) as e:
            raise RecordingError(f"{path}: not a readable memory snapshot pickle ({e}); truncated?") from None
    if data.lstrip()[:1] in (b"{", b"["):
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise RecordingError(f"{path}: JSON that does not parse ({e}); truncated?") from None
        if isinstance(obj, dict) and "traceEvents" in obj:
            return "trace", obj
        if isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], list):
            raise RecordingError(
                f"{path}: a memory timeline (export_memory_timeline's [times, sizes]) holds totals per category "
                "and no phases; explain the chrome trace of the same profile (prof.export_chrome_trace) instead"
            )
        raise RecordingError(f"{path}: JSON, but neither a chrome trace (no 'traceEvents') nor a snapshot")
    raise RecordingError(
        f"{path}: neither a memory snapshot (a pickle from torch.cuda.memory._dump_snapshot) nor a torch.profiler "
        "trace (JSON from prof.export_chrome_trace)"
    )


# ---- snapshots --------------------------------------------------------------------------------------------------


def frame_label(frames: list) -> tuple[int, int]:
    """(label, flags) of one event's stack, from the frames torch records (innermost first).

    Rules, in order: a ``zero_grad`` frame (an optimizer's or a module's) or any frame in ``torch/optim/`` is the
    optimizer; ``torch/utils/checkpoint.py``'s ``unpack_hook``/``recompute_fn`` is backward recomputing forward;
    ``Tensor.backward`` / ``torch.autograd.backward`` / ``grad`` or a C++ ``autograd::Engine`` frame is backward;
    ``Module._call_impl`` is forward; ``Module._apply`` / ``__init__`` / ``torch/nn/init.py`` is building a model.
    No frames: UNKNOWN (backward's work on autograd's device thread has no Python stack). A simulated snapshot's
    frames name no torch code and give IDLE; its phases come from :func:`snapshot_events`.
    """
    if not frames:
        return UNKNOWN, 0
    found = IDLE
    flags = 0
    for f in frames:
        name, file = f.get("name", ""), f.get("filename", "")
        if name == "zero_grad":
            return OPT, ZERO_GRAD
        if "torch/optim/" in file:
            return OPT, 0
        if file.endswith("torch/utils/checkpoint.py") and name in ("unpack_hook", "recompute_fn"):
            return BWD, RECOMPUTE
        if (
            (name == "backward" and file.endswith(("torch/_tensor.py", "torch/autograd/__init__.py")))
            or (name == "grad" and file.endswith("torch/autograd/__init__.py"))
            or "autograd::Engine::" in name
        ):
            found = BWD
        elif found == IDLE and file.endswith("torch/nn/modules/module.py"):
            if name == "_call_impl":
                found = FWD
            elif name in ("_apply", "__init__", "to", "cuda"):
                flags |= MODULE_INIT
        elif file.endswith("torch/nn/init.py") or file.endswith("torch/nn/parameter.py"):
            flags |= MODULE_INIT
    return found, flags if found == IDLE else 0


def _check_snapshot(obj, source: str) -> tuple[list, list]:
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        raise RecordingError(f"{source}: a pickle, but not a memory snapshot (no 'segments' list)")
    traces = obj.get("device_traces")
    if not isinstance(traces, list) or not any(traces):
        raise RecordingError(
            f"{source}: a memory snapshot without a trace of events: record it with "
            "torch.cuda.memory._record_memory_history() before the steps, then _dump_snapshot()"
        )
    return obj["segments"], traces


def snapshot_events(snapshot: dict, source: str = "<snapshot>") -> MemoryEvents:
    """The allocations and frees of a snapshot's one recorded device, labelled from their stacks."""
    segments, traces = _check_snapshot(snapshot, source)
    busy = [i for i, t in enumerate(traces) if t]
    if len(busy) > 1:
        raise RecordingError(f"{source}: events on devices {busy}; explain reads one device's snapshot at a time")
    device = busy[0]
    trace = traces[device]
    segs = [s for s in segments if s.get("device", device) == device]
    try:
        return _snapshot_rows(trace, segs, source)
    except (KeyError, TypeError, AttributeError) as e:
        raise RecordingError(
            f"{source}: a snapshot event or segment lacks a field ({e!r}); not torch's format"
        ) from None


def _snapshot_rows(trace: list, segs: list, source: str) -> MemoryEvents:
    times, addrs, deltas, labels, flags, oom = [], [], [], [], [], []
    is_sim = False
    seg_delta = 0  # net segment bytes since the recording began
    allocated_addrs: set[int] = set()
    freed_before: list[int] = []
    reserved_after: list[int] = []
    deepest = 0
    cut_unlabelled = 0
    no_stack = 0
    for e in trace:
        action = e["action"]
        if action in ("segment_alloc", "segment_map"):
            seg_delta += e["size"]
            continue
        if action in ("segment_free", "segment_unmap"):
            seg_delta -= e["size"]
            continue
        if action == "oom":
            oom.append(len(deltas))
            continue
        if action == "alloc":
            delta = e["size"]
            allocated_addrs.add(e["addr"])
        elif action == "free_completed":
            delta = -e["size"]
            if e["addr"] not in allocated_addrs:
                freed_before.append(e["size"])
            else:
                allocated_addrs.discard(e["addr"])
        else:
            continue  # free_requested (its bytes return at free_completed), snapshot, ...
        frames = e.get("frames") or []
        deepest = max(deepest, len(frames))
        if frames and frames[-1].get("filename") == SIMULATED:
            is_sim = True
            label, flag = _simulated_label(frames)
        else:
            label, flag = frame_label(frames)
        times.append(e.get("time_us", len(times)))
        addrs.append(e["addr"])
        deltas.append(delta)
        labels.append(label)
        flags.append(flag)
        reserved_after.append(seg_delta)
        if frames and label == IDLE:
            cut_unlabelled += len(frames) == deepest
        no_stack += not frames
    live = [b for s in segs for b in s["blocks"] if b["state"].startswith("active")]
    # requested sizes, as the events record them (a block's "size" is rounded up by the allocator)
    alive_before = [b.get("requested_size") or b["size"] for b in live if b["address"] not in allocated_addrs]
    reserved_end = sum(s["total_size"] for s in segs)
    reserved0 = reserved_end - seg_delta
    notes = []
    if freed_before:
        notes.append(
            f"{len(freed_before)} frees ({sum(freed_before):,} bytes) of blocks no recorded alloc made: alive before "
            "the recording began, or their alloc fell out of the ring buffer (max_entries)"
        )
    if not deepest:
        notes.append("no event has a stack: record with stacks='python' or 'all' for phases")
    elif no_stack and not is_sim:
        notes.append(
            f"{no_stack:,} events have no stack (with stacks='python', the work autograd runs on its own device "
            "thread in backward has no Python frames): each takes the phase of the events before it"
        )
    if deepest and cut_unlabelled and not is_sim:
        notes.append(
            f"{cut_unlabelled} events whose stack stops at {deepest} frames without a module, autograd or optimizer "
            "frame: their phase is the one of the events around them (more frames would tell)"
        )
    ev = MemoryEvents(
        source=source,
        kind="simulated CUDA memory snapshot" if is_sim else "CUDA memory snapshot",
        time_us=np.asarray(times, dtype=np.float64),
        addr=np.asarray(addrs, dtype=np.int64),
        delta=np.asarray(deltas, dtype=np.int64),
        label=np.asarray(labels, dtype=np.int8),
        flags=np.asarray(flags, dtype=np.int8),
        reserved=reserved0 + np.asarray(reserved_after, dtype=np.int64),
        reserved_before=reserved0,
        alive_before=alive_before,
        before_seen=True,
        notes=notes,
        oom_rows=oom,
    )
    return ev


def _simulated_label(frames: list) -> tuple[int, int]:
    """A simulated snapshot's stack (``snapshot_from_replay(..., phases=True)``): its first frame names the module
    and category, its last the step and phase ("step 2 backward"); without that frame, UNKNOWN."""
    words = frames[-1].get("name", "").split()
    codes = {"idle": IDLE, "forward": FWD, "backward": BWD, "optimizer": OPT}
    if len(frames) < 2 or len(words) != 3 or words[0] != "step" or words[2] not in codes:
        return UNKNOWN, 0
    label = codes[words[2]]
    zero = label == OPT and frames[0].get("name", "").startswith("optimizer.zero_grad")
    return label, ZERO_GRAD if zero else 0
