"""Fake kernels checked against real ones, so that a dry run is exact or refused.

A dry run (dryrun.py) takes every output's size from the op's *fake* kernel: a shape function written apart
from the real kernel. They usually agree, but not always: on CPU, ``aten.mkldnn_rnn_layer`` (the oneDNN LSTM
kernel) returns a workspace of about half a MiB per layer that autograd saves for backward, and its fake kernel
returns an empty one, so a dry run of an LSTM would read 14 % low and say nothing.

How it is checked. :class:`CheckedFakeTensorMode`, the fake mode itself, sees every op of the dry run with its fake
inputs and outputs. Ops are grouped by *signature*: the op overload with, for each tensor argument, its
device, dtype, number of dimensions and whether it is contiguous, and every other argument but numbers (sizes,
dims, scales and learning rates vary with the model; flags, dtypes, strings and ``None`` do not). For each
signature not yet checked in this process the mode keeps the smallest call's metadata (shapes, strides,
storage sizes, which storages are shared; never the tensors, so storages still die when the step drops them).
After the run :func:`check_calls` runs each such call once for real, on zero-filled tensors of the recorded
layout, and compares every output (shape, strides, storage offset, dtype, which storage it shares with the inputs
or other outputs, and that storage's bytes) and the inputs' storage bytes afterwards (``resize_``) with the fake
run. What autograd saves is always an op's input or output, so that is covered too. A signature that matches is
remembered for the rest of the process (:data:`_PASSED`): a later dry run, of any size, pays one dictionary
lookup per op and runs nothing for real. It is also written to a cache on disk (below), so that a later process on
the same machine and torch version runs nothing for real either.

Why this and not a list of ops known to differ: a list is only as good as whoever wrote it, and goes stale with
each torch release; the check asks the real kernel every time a new signature appears, and costs a few
milliseconds per distinct signature (two steps of the default course GPT have about 130).

What it cannot see, and the limits this puts on the guarantee:

* a real call is made only when the smallest call of a signature is at most :data:`MAX_CHECK_BYTES`
  (inputs and outputs; :data:`MAX_CHECK_BYTES_16BIT_CPU` for a 16-bit matrix product on the CPU); a larger one is
  refused unless a smaller run with the same signature was checked first (``dry_run_config`` and ``dry_run_hf`` do
  that themselves with a small twin of the configuration);
* a check at one shape stands for every shape of the signature: a kernel whose output sizes follow another rule
  only at some sizes would escape it (none is known on CPU);
* a composite op that picks a different path for fake tensors than for real ones would run other ops in the dry
  run; each of those is checked, but not the choice of path. The sweeps in tests/test_dryrun.py compare whole
  traces to catch that;
* memory a kernel allocates and frees inside one op (kernel scratch) is not an output and is not checked.

The cache on disk. Each check's result, the signature passed or how its fake kernel differed (a refusal is stored
too, and refuses again), is kept in one JSON file per *namespace*: the torch version and build (its version, git
commit and build configuration), this machine (operating system, CPU architecture, the CPU's model and instruction
set flags, the instruction set torch's CPU kernels dispatch to, whether oneDNN is built in), the Python version,
and a hash of this file's source, so that a change of any check rule here starts a new file. The file is
``<cache dir>/op-checks/<hash of the namespace>.json``, the cache dir ``$ANATOMY_CACHE_DIR`` if set, else the
platform's user cache (``$XDG_CACHE_HOME`` or ``~/.cache``, ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on
Windows) ``/training-step-anatomy``. Why a result read from it is as good as a check made now:

* a check is a pure function of what is in the namespace: the same op overload, with arguments of the same
  signature, run on zeros by the same kernels of the same build on the same kind of CPU, gives the same outcome
  (the in-process memo above already relies on this across sizes);
* only signatures whose real kernels ship with torch itself are stored: ops of the ``aten`` and ``prims``
  namespaces, every tensor and device on the CPU. A custom op (``torch.library``, another package's kernels) can
  change without torch's version changing, and a GPU's kernels depend on which GPU and driver: those are checked
  once per process, as before. A signature is stored under a text written from its parts (sorted where a
  signature holds a set), never Python's per-process hashes; one whose parts have no such text is not stored;
* a real kernel that ran out of memory is not stored (it may pass another time); any other refusal is;
* the file is written whole to a temporary file in the same directory and moved over the old one
  (``os.replace``, atomic on every platform torch runs on), after reading the file again and adding what other
  processes (xdist workers, ranks) wrote meanwhile: a reader sees an old file or a new one, never half of one. Two
  writers at the same moment can lose one's new entries (until it writes again): those signatures are then checked
  again, nothing worse;
* a file that cannot be read, is not JSON, has another namespace or a wrong shape is ignored (every signature is
  checked again and the next write replaces it); a directory that cannot be written leaves the checks in this
  process only. The cache never makes a dry run fail.

Files of other torch versions or sources are left where they are (a few hundred KiB at most): delete the directory
to clear it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from ..tracking.tracker import StepTracker

#: The largest call (bytes of its inputs' storages and its outputs' new ones) run for real to check its fake kernel.
MAX_CHECK_BYTES = 64 * 2**20
#: The same for a matrix product (:data:`_MATRIX_OPS`) with a bfloat16 or float16 tensor on the CPU. A CPU without
#: 16-bit float arithmetic (AVX2, no AVX-512 BF16 or AMX) runs torch's 16-bit matmuls at 0.2-6 GFLOP/s against about
#: 50 in float32 (measured on a 2-core AMD EPYC: one 1,024 x 2,048 x 8,192 bfloat16 matmul took 200 s), so a 1B
#: model's calls would take minutes; its small twin checks the same signatures in milliseconds. (Element-wise ops,
#: an optimizer's over all the parameters included, cost as many operations as bytes: they keep the first limit.)
MAX_CHECK_BYTES_16BIT_CPU = 2**20
_16BIT = (torch.bfloat16, torch.float16)
_MATRIX_OPS = re.compile(r"_*(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|conv|.*attention|.*rnn)")  # op names

# Not kernels: how a constant made by torch.tensor() enters the fake mode. The real run returns the constant
# itself, the fake run a fake copy of it; both are aliases by the op's schema, so the tracker counts neither.
_ENTRY_OPS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default)

_PASSED: set[tuple] = set(_ENTRY_OPS)  # signatures whose fake kernel matched the real one in this process
_FAILED: dict[tuple, str] = {}  # signature -> how the fake kernel differed
_ASKED: set[tuple] = set()  # signatures looked up in the cache on disk by this process (once each)

#: The environment variable naming the directory of the op checks' cache on disk (see the module docstring).
CACHE_DIR_ENV = "ANATOMY_CACHE_DIR"
_STORED_NAMESPACES = ("aten", "prims")  # ops whose kernels ship with torch: the only ones stored on disk
_PASS = "passed"  # a stored signature's result when it matched; otherwise the sentence saying how it differed
_TRANSIENT = ("MemoryError", "OutOfMemoryError")  # a real kernel's refusals that are not stored


# A tensor's metadata asked through the dispatcher (prim.device, aten.size, aten.stride, aten.storage_offset):
# FakeTensorMode answers these from the fake tensor itself, first thing in its dispatch; no kernel, nothing to check.
# C++ asks a fake tensor its device through Python each time (autograd's engine for every gradient, for one):
# about 60,000 times a step on an 8B model with LoRA adapters, so they skip the signature too.
_METADATA_QUERIES = getattr(fake_tensor, "_DISPATCH_META_HANDLERS", {})

_KEPT = (bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format, type(None))


def _arg_key(a):
    """What of one argument enters a signature (see the module docstring)."""
    if isinstance(a, torch.Tensor):
        device = a.fake_device if type(a) is FakeTensor else a.device  # a.device would dispatch an op
        return (device.type, a.dtype, a.dim(), a.is_contiguous(), a.requires_grad)
    cls = type(a)
    if cls is int or cls is float:
        return cls  # sizes, dims, scales, learning rates: they change with the model, not the rule
    if cls is list or cls is tuple:
        return frozenset(map(_arg_key, a))
    return a if cls in _KEPT else cls  # flags, dtypes, strings, None; an object (the profiler's handle): its type


def signature(func, args, kwargs) -> tuple:
    """The op overload and what of its arguments can change its fake kernel's rule (not sizes)."""
    if func in _ENTRY_OPS:
        return func
    return (func, torch.is_grad_enabled(), *map(_arg_key, args), *((k, _arg_key(v)) for k, v in kwargs.items()))


@dataclass(frozen=True)
class TensorMeta:
    """A tensor's layout without its data: enough to make a real one like it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    storage: int  # index of its storage among the call's distinct storages
    storage_bytes: int
    requires_grad: bool


@dataclass
class OpCall:
    """One call of an op: its arguments (tensors as TensorMeta) and what its fake kernel returned."""

    func: object
    args: tuple
    kwargs: dict
    outcome: tuple  # see _outcome
    nbytes: int  # bytes of the distinct storages of its inputs (which call of a signature is the smallest)
    where: str  # "in module 'x', forward phase" (of the step it ran in), or "outside the tracked step"
    grad_enabled: bool


def _writes(func) -> bool:
    """Whether the op may write or resize one of its arguments (its schema marks it mutable)."""
    schema = getattr(func, "_schema", None)
    return schema is None or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _outcome(inputs: list[torch.Tensor], outputs: list) -> tuple:
    """What a dry run takes from an op: each output's layout, which storage it is (one of the inputs', another
    output's or a new one) and that storage's bytes; the inputs' storage bytes after the op (resize_); and how
    many distinct storages the inputs have (outputs' storage numbers from there on are new).
    Strides of dimensions of size 1, and all strides of an empty tensor, are left out: they address nothing."""
    index: dict[int, int] = {}
    for t in inputs:
        index.setdefault(_storage_id(t), len(index))
    n_inputs = len(index)  # storages numbered from here on are new
    after = tuple(t.untyped_storage().nbytes() for t in inputs)
    outs = []
    for o in outputs:
        if not isinstance(o, torch.Tensor):
            outs.append(None if o is None else type(o).__name__)
            continue
        strides = tuple(s if n > 1 and o.numel() else None for s, n in zip(o.stride(), o.shape))
        which = index.setdefault(_storage_id(o), len(index))
        outs.append((tuple(o.shape), strides, o.storage_offset(), o.dtype, which, o.untyped_storage().nbytes()))
    return after, tuple(outs), n_inputs


def _where() -> str:

    tracker = StepTracker._running
    if tracker is None:
        return "outside the tracked step"
    return f"in module {tracker.module!r}, {tracker.phase} phase"


class CheckedFakeTensorMode(FakeTensorMode):
    """torch's FakeTensorMode that also keeps the smallest call of each op signature not yet checked (see the
    module docstring). Itself the fake mode rather than a dispatch mode on top: a second mode would add a round
    trip through Python to every op of every dry run."""

    def __init__(self):
        super().__init__()
        self.calls: dict[tuple, OpCall] = {}
        self._depth = 0  # > 0 inside an op: the ops a fake kernel runs itself (decompositions) are its own affair

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        query = _METADATA_QUERIES.get(func)
        if query is not None:
            return query(args)
        kwargs = kwargs or {}
        if self._depth:
            return super().__torch_dispatch__(func, types, args, kwargs)
        self._depth += 1
        try:
            return self._note(func, types, args, kwargs)
        finally:
            self._depth -= 1

    def _note(self, func, types, args, kwargs):
        key = signature(func, args, kwargs)  # before the call: an in-place op may change its inputs' layout
        if key in _PASSED or (key not in _ASKED and _passed_on_disk(key)):
            return super().__torch_dispatch__(func, types, args, kwargs)
        flat_in = _tensors(args, kwargs)
        known = self.calls.get(key)
        if known is not None and _nbytes(flat_in) >= known.nbytes:  # not the smallest call: nothing to note
            return super().__torch_dispatch__(func, types, args, kwargs)
        margs, mkwargs = _metas(args, kwargs)  # before the call, as the key
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented:  # a tensor subclass's op (DTensor): it runs its local ops, noted one by one
            return out
        flat_out = tree_flatten(out)[0]
        tensors_out = [t for t in flat_out if isinstance(t, torch.Tensor)]
        if not flat_in and not tensors_out:  # no tensor in or out (the profiler's record_function ops)
            _PASSED.add(key)
            return out
        if not tensors_out and not _writes(func):  # reads metadata only (prim.device): nothing it could allocate
            _PASSED.add(key)
            return out
        where = known.where if known is not None else _where()  # where the op was first seen
        outcome = _outcome(flat_in, flat_out)
        self.calls[key] = OpCall(func, margs, mkwargs, outcome, _nbytes(flat_in), where, key[1])
        return out


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an op's arguments (an ATen op's arguments nest one level at most: lists of tensors)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


def _nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: how large a call is, to keep the smallest."""
    return sum({_storage_id(t): t.untyped_storage().nbytes() for t in tensors}.values())


def _metas(args, kwargs) -> tuple:
    """``(args, kwargs)`` with each tensor replaced by its TensorMeta (storages numbered in order of appearance)."""
    index: dict[int, int] = {}

    def meta(a):
        if not isinstance(a, torch.Tensor):
            return a
        storage = index.setdefault(_storage_id(a), len(index))
        return TensorMeta(
            tuple(a.shape), tuple(a.stride()), a.storage_offset(), a.dtype, a.device, storage,
            a.untyped_storage().nbytes(), a.requires_grad,
        )  # fmt: skip

    return tree_map(meta, (tuple(args), dict(kwargs)))


def _real_call(call: OpCall):
    """Run ``call`` for real on zero-filled tensors with the recorded layouts; (outcome, None) or (None, error)."""
    storages: dict[int, torch.UntypedStorage] = {}

    def make(a):
        if not isinstance(a, TensorMeta):
            return a
        if a.storage not in storages:
            storages[a.storage] = torch.zeros(a.storage_bytes, dtype=torch.uint8, device=a.device).untyped_storage()
        t = torch.empty(0, dtype=a.dtype, device=a.device).set_(storages[a.storage], a.offset, a.shape, a.stride)
        return t.requires_grad_(a.requires_grad)

    args, kwargs = tree_map(make, (call.args, call.kwargs))
    inputs = _tensors(args, kwargs)
    devices = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
    try:
        # As in the step: below autograd (the op itself, not its autograd wrapper), with the grad mode and the
        # inputs' requires_grad it ran with (a kernel may read them: oneDNN's LSTM keeps a workspace only for
        # training); dropout's random draws come from a copy of the RNG state, not the caller's.
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(call.grad_enabled):
            with torch._C._AutoDispatchBelowAutograd():
                out = call.func(*args, **kwargs)
    except Exception as e:  # the real kernel refused what the fake one accepted: also a difference
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return _outcome(inputs, tree_flatten(out)[0]), None


def _new_bytes(outcome: tuple) -> int:
    """Bytes of the storages an op's outputs got that none of its inputs had (see _outcome)."""
    new = {o[4]: o[5] for o in outcome[1] if isinstance(o, tuple) and o[4] >= outcome[2]}
    return sum(new.values())


def _describe(output) -> str:
    if not isinstance(output, tuple):
        return "nothing" if output is None else str(output)
    shape, _, offset, dtype, which, nbytes = output
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')} at offset {offset} of storage {which} ({nbytes:,} B)"


def _difference(fake: tuple, real: tuple) -> str:
    """One sentence: the first output (or input storage) whose fake and real versions differ."""
    where = next((i for i, (f, r) in enumerate(zip(fake[1], real[1])) if f != r), None)
    if where is not None:
        what = f"output {where} is {_describe(fake[1][where])} in the fake run, {_describe(real[1][where])} for real"
    elif len(fake[1]) != len(real[1]):
        what = f"{len(fake[1])} outputs in the fake run, {len(real[1])} for real"
    else:
        what = f"its inputs' storages end at {fake[0]} B in the fake run, {real[0]} B for real"
    return f"{what}; new storages: {_new_bytes(fake):,} B fake, {_new_bytes(real):,} B real at its smallest call"


def op_checked(key: tuple) -> bool:
    """Whether the op signature ``key`` matched its real kernel in this process."""
    return key in _PASSED


def check_calls(calls: dict[tuple, OpCall], max_bytes: int | None = None) -> tuple[dict[tuple, str], list]:
    """Run each recorded call once for real (see the module docstring); returns (differences, unchecked).

    ``differences``: signature -> a sentence naming the op, where it ran and how its fake kernel differs from
    the real one (the first such op in the order of the run: the check stops there); ``unchecked``: the
    signatures whose smallest call is over ``max_bytes`` (default :data:`MAX_CHECK_BYTES`; never over
    :data:`MAX_CHECK_BYTES_16BIT_CPU` for a 16-bit matrix product on the CPU) or on a device this machine does not have.
    """
    max_bytes = MAX_CHECK_BYTES if max_bytes is None else max_bytes
    try:
        return _check_calls(calls, max_bytes)
    finally:
        disk = _DISK
        if disk is not None:
            disk.write()  # what this call checked, for later processes


def _check_calls(calls: dict[tuple, OpCall], max_bytes: int) -> tuple[dict[tuple, str], list]:
    problems: dict[tuple, str] = {}
    unchecked: list[tuple] = []
    for key, call in calls.items():
        if key in _PASSED:
            continue
        if key not in _FAILED:
            metas = [a for a in tree_flatten((call.args, call.kwargs))[0] if isinstance(a, TensorMeta)]
            missing = any(a.device.type == "cuda" for a in metas) and not torch.cuda.is_available()
            slow = _MATRIX_OPS.match(getattr(call.func, "_opname", "")) and any(
                a.device.type == "cpu" and a.dtype in _16BIT for a in metas
            )  # see MAX_CHECK_BYTES_16BIT_CPU
            limit = min(max_bytes, MAX_CHECK_BYTES_16BIT_CPU) if slow else max_bytes
            if missing or call.nbytes + _new_bytes(call.outcome) > limit:
                unchecked.append(key)
                continue
            real, error = _real_call(call)
            if error is None and real == call.outcome:
                _PASSED.add(key)
                _store(key, call, _PASS)
                continue
            if error is not None:
                _FAILED[key] = f"the real kernel refused the fake run's inputs ({error})"
            else:
                _FAILED[key] = _difference(call.outcome, real)
            if error is None or not error.startswith(_TRANSIENT):
                _store(key, call, _FAILED[key])
        problems[key] = f"{call.func} (first seen {call.where}): {_FAILED[key]}"
        # Stop at the first difference: later calls may take that op's outputs as inputs, and a real kernel fed
        # a fake kernel's wrong sizes can crash (mkldnn_rnn_layer_backward given an empty workspace does).
        break
    return problems, unchecked


# ---- the cache on disk (see the module docstring) ------------------------------------------------------------------


def cache_dir() -> Path:
    """The directory of the op checks' cache on disk: ``$ANATOMY_CACHE_DIR``, else the platform's user cache."""
    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen:
        return Path(chosen)
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "training-step-anatomy"


def _digest(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def _cpu() -> dict:
    """The CPU as its kernels see it: the instruction set torch dispatches to and, on Linux, the first CPU's model and
    flags (oneDNN picks its own code paths from the flags)."""
    cpu = {"torch_capability": torch.backends.cpu.get_cpu_capability(), "processor": platform.processor()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first CPU's block
                name, _, value = (part.strip() for part in line.partition(":"))
                if name in ("model name", "flags", "Features", "CPU implementer", "CPU part", "CPU variant"):
                    cpu[name] = _digest(value) if name in ("flags", "Features") else value
    except OSError:
        pass  # not Linux: the processor's name and torch's capability stand for it
    return cpu


def namespace() -> dict:
    """What a stored check is valid for: torch's version and build, this machine, Python, this file's source."""
    return {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "torch_build": _digest(torch.__config__.show()),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "system": platform.system(),
        "machine": platform.machine(),
        "cpu": _cpu(),
        "python": f"{sys.implementation.name} {platform.python_version()}",
        "fake_check": _digest(Path(__file__).read_bytes()),
    }


class _DiskChecks:
    """The stored results of one namespace: read once, written after each check that added some."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.namespace = namespace()
        self.path = directory / "op-checks" / f"{_digest(json.dumps(self.namespace, sort_keys=True))}.json"
        self.results = self._read()  # signature text -> _PASS or how its fake kernel differed
        self.new: dict[str, str] = {}

    def _read(self) -> dict[str, str]:
        """The file's results, or none when it is missing, unreadable, of another namespace or of a wrong shape."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            results = data["results"]
            if data["namespace"] == self.namespace and all(
                type(k) is str and type(v) is str for k, v in results.items()
            ):
                return results
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass
        return {}

    def add(self, text: str, result: str) -> None:
        self.results[text] = self.new[text] = result

    def write(self) -> None:
        """What the file holds now and what this process knows, written whole to a temporary file moved over it."""
        if not self.new:
            return
        results = {**self._read(), **self.results}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".op-checks-", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"namespace": self.namespace, "results": results}, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
            tmp = None
        except OSError:
            return  # not writable: the results stay in this process (and are tried again next time)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self.results.update(results)  # what other processes stored meanwhile, too
        self.new.clear()


_DISK: _DiskChecks | None = None  # of the current cache_dir(); made at the first lookup


def _disk() -> _DiskChecks | None:
    """The cache of :func:`cache_dir` (None when it cannot be known: no home directory, this file unreadable)."""
    global _DISK
    try:
        directory = cache_dir()
        if _DISK is None or _DISK.directory != directory:
            _DISK = _DiskChecks(directory)
    except (OSError, RuntimeError):
        return None
    return _DISK


def _text(part) -> str | None:
    """A signature (or a part of it) as text that is the same in every process; None if it has none (not stored)."""
    cls = type(part)
    if cls is tuple or cls is frozenset:
        texts = [_text(p) for p in part]
        if None in texts:
            return None
        return f"({', '.join(texts)})" if cls is tuple else f"{{{', '.join(sorted(texts))}}}"
    if isinstance(part, torch._ops.OpOverload):
        return str(part) if part.namespace in _STORED_NAMESPACES else None
    if cls in (bool, int, str, type(None)):
        return repr(part)
    if cls in (torch.dtype, torch.device, torch.layout, torch.memory_format):
        return f"{cls.__name__}({part})"
    if isinstance(part, type):
        return f"<class {part.__module__}.{part.__qualname__}>"
    return None


def _passed_on_disk(key: tuple) -> bool:
    """Whether the cache on disk holds ``key`` as passed (then it is passed in this process too); a stored difference
    is taken as this process's. Asked once per signature and process."""
    _ASKED.add(key)
    text = _text(key)
    disk = _disk() if text is not None else None
    result = disk.results.get(text) if disk is not None else None
    if result == _PASS:
        _PASSED.add(key)
        return True
    if result is not None:
        _FAILED[key] = result
    return False


def _store(key: tuple, call: OpCall, result: str) -> None:
    """Keep a check's result for the cache on disk if its signature is stored (see the module docstring)."""
    text = _text(key)
    if text is None:
        return
    parts = tree_flatten((call.args, call.kwargs))[0]
    devices = [a.device if isinstance(a, TensorMeta) else a for a in parts if isinstance(a, (TensorMeta, torch.device))]
    if any(d.type != "cpu" for d in devices):
        return  # a GPU's kernels depend on the GPU and its driver
    disk = _disk()
    if disk is not None:
        disk.add(text, result)
