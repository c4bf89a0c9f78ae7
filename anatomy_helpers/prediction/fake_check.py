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

Once a signature has passed, the fake kernel's answer for each call is remembered by its exact input layouts
(fake_memo.py): a later call with the same layouts, in any dry run of the process, gets the same output layouts
without asking FakeTensorMode again (about five times cheaper per op, profiled on a 7B-shaped ``--fix``), and only
while its signature stays checked; those answers are kept on disk too (fake_memo_cache.py), so that a later process
takes them from there once the signature is checked in it.

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

The cache on disk (fake_check_cache.py says where, and why a result read from it is as good as a check made now):
each check's result, passed or how the fake kernel differed, is kept per torch build, machine, Python and the source
of this file and that one, so that a later process runs no kernel for a signature checked before. Only ops of torch's
own ``aten`` and ``prims`` namespaces on the CPU are stored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from ..core.tensors import tensor_args
from ..tracking.tracker import StepTracker
from . import fake_memo
from .fake_check_cache import PASSED, checks_on_disk, signature_text, write_checks

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
_TRANSIENT = ("MemoryError", "OutOfMemoryError")  # a real kernel's refusals that are not stored on disk


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

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a dispatch mode's __torch_dispatch__ so that torch.compile does not trace into it (10 % of a
        # dry run's time, measured on a 7B-shaped Llama). A dry run compiles nothing (a compiled model is refused
        # before it runs: dryrun.py), so this mode's is left unwrapped; torch's own FakeTensorMode keeps its wrapper.
        return False

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
        layout = fake_memo.layout_key(self, func, args, kwargs)  # None: an op whose answer is not remembered
        if layout is not None:
            out = fake_memo.outputs_from(self, layout, args, kwargs, _PASSED)
            if out is not fake_memo.MISS:
                return out
        self._depth += 1
        try:
            return self._note(func, types, args, kwargs, layout)
        finally:
            self._depth -= 1

    def _note(self, func, types, args, kwargs, layout=None):
        key = signature(func, args, kwargs)  # before the call: an in-place op may change its inputs' layout
        if key in _PASSED or (key not in _ASKED and _passed_on_disk(key)):
            if layout is not None:  # checked: an earlier process may have remembered its answer (fake_memo.py)
                out = fake_memo.stored_outputs(self, layout, key, args, kwargs)
                if out is not fake_memo.MISS:
                    return out
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if layout is not None:  # checked: its answer is remembered for the next call like it
                fake_memo.remember(self, layout, key, func, args, kwargs, out)
            return out
        flat_in = tensor_args(args, kwargs)
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
    inputs = tensor_args(args, kwargs)
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
        write_checks()  # what this call checked, for later processes
        fake_memo.write_answers()  # and the fake kernels' answers remembered since the last call


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
                _store(key, call, PASSED)
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


def _passed_on_disk(key: tuple) -> bool:
    """Whether the cache on disk holds ``key`` as passed (then it is passed in this process too); a stored difference
    is taken as this process's. Asked once per signature and process."""
    _ASKED.add(key)
    text = signature_text(key)
    disk = checks_on_disk() if text is not None else None
    result = disk.results.get(text) if disk is not None else None
    if result == PASSED:
        _PASSED.add(key)
        return True
    if result is not None:
        _FAILED[key] = result
    return False


def _store(key: tuple, call: OpCall, result: str) -> None:
    """Keep a check's result for the cache on disk if its signature is stored (fake_check_cache.py): not a call with
    a tensor or a device off the CPU (a GPU's kernels depend on the GPU and its driver)."""
    text = signature_text(key)
    parts = tree_flatten((call.args, call.kwargs))[0]
    devices = [a.device if isinstance(a, TensorMeta) else a for a in parts if isinstance(a, (TensorMeta, torch.device))]
    disk = checks_on_disk() if text is not None and all(d.type == "cpu" for d in devices) else None
    if disk is not None:
        disk.add(text, result)
