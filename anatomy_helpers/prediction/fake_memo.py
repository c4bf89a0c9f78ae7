"""The fake kernels' answers remembered: an op called again with the same input layouts gets the same output
layouts without asking its fake kernel again.

A dry run (dryrun.py) runs each op of a step in torch's FakeTensorMode, which asks the op's fake (meta) kernel what
it returns. FakeTensorMode keeps a cache of those answers, but its key describes every tensor argument in full
(about 30 fields each, through a path general enough for symbolic shapes), and it caches no op that returns a list
(``split``, the foreach optimizer ops): about 0.3 ms per op, most of a dry run's time. A model's blocks repeat, so
most calls repeat an earlier one exactly: the same op with the same shapes, strides, dtypes and devices.

:func:`layout_key` is what an op's output layouts can depend on: the op; each tensor argument's shape, strides,
storage offset, dtype, device, requires_grad and conjugate and negative bits (and, for an op that writes its
arguments, its storage's bytes); every other argument by type and value; the grad mode, the default dtype and device
and inference mode. After the first call, :func:`remember` keeps how to make its outputs again, and
:func:`outputs_from` makes them for a later call with the same key: a new storage of the bytes the layout spans (a
fresh output), the same layout on input ``i``'s storage (a view), or input ``i`` itself (an in-place op). Only these
three are remembered, and only where the first call's outputs show it (each remade once, at once, and compared with
the fake kernel's: layout, storage bytes, which storage). The ops left out follow torch's own cache
(``FakeTensorMode._validate_cache_key``): an output shape that depends on values, an in-place view (``t_``,
``as_strided_``), an op outside aten and prims, a composite view op, a constant or non-fake input (``_unsafe_view``,
which torch's cache leaves out, is remembered as the view it is); and an in-place
op whose first call changed an input's layout or storage bytes (``resize_``, an ``out=`` that resizes). A call is
remembered only once its op signature passed the check against the real kernel (fake_check.py), and a remembered
answer is given only while it still has: forgetting the checks forgets these too.

Answers remembered here are appended to a file (fake_memo_cache.py: :func:`write_answers` after each dry run's
checks) and a later process takes them from it (:func:`stored_outputs`) for a call whose op signature has passed its
check in that process.

tests/test_fake_memo.py compares what is remade with the fake kernel's own outputs, op by op, and dry runs with and
without it, byte for byte.
"""

from __future__ import annotations

import contextlib
import json

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..core.tensors import ALLOCATES, VIEWS, op_outputs, tensor_args
from .fake_check_cache import signature_text
from .fake_memo_cache import stored_answers

FRESH, VIEW, IN_PLACE, SAME = "fresh", "view", "in place", "same"
_META = torch.device("meta")
_SCALARS = frozenset(
    (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
)
_METADATA_WRITERS = frozenset(("resize_", "resize_as_", "set_", "_resize_output_", "_set_"))

MISS = object()  # outputs_from: nothing remembered
_KINDS: dict = {}  # op -> FRESH, VIEW, IN_PLACE or None (never remembered)
_ANSWERS: dict[tuple, tuple] = {}  # layout_key -> (the op signature checked, how to make the outputs)
_NEW: list[tuple] = []  # layout keys remembered since the last write_answers()
enabled = True  # tests compare dry runs with and without (see off())


class _NotKept(Exception):
    """A call whose outputs are not remembered (see the module docstring)."""


def op_kind(func) -> str | None:
    """FRESH (new outputs only), VIEW (views of an input only), IN_PLACE (writes its arguments and returns them, or
    nothing) or None: an op whose answers are never remembered."""
    kind = _KINDS.get(func, _NotKept)
    if kind is _NotKept:
        kind = _KINDS[func] = _kind(func)
    return kind


def _kind(func) -> str | None:
    if not isinstance(func, torch._ops.OpOverload) or func.namespace not in ("aten", "prims"):
        return None
    unsure = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.inplace_view)
    if any(tag in func.tags for tag in unsure) or func._schema.name.split("::")[-1] in _METADATA_WRITERS:
        return None
    name = func.name().split(".")[0]
    if name in ("aten::lift", "aten::lift_fresh", "aten::lift_fresh_copy"):  # how constants enter the fake mode
        return None
    if name == "aten::_unsafe_view":  # its schema says a new tensor, but it is a view of its input (hence "unsafe")
        return VIEW
    outputs = op_outputs(func)  # what its schema says it returns, as the tracker reads it
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
    if outputs == VIEWS:
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        )
        return None if composite or writes else VIEW
    if outputs == ALLOCATES:  # new outputs, or none: an op that writes its arguments and returns nothing is in place
        return FRESH if not writes else IN_PLACE if not func._schema.returns else None
    # in place or out=: every output one of the arguments it writes (whose layout remember() checks is unchanged)
    return IN_PLACE if all(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns) else None


def layout_key(mode, func, args, kwargs) -> tuple | None:
    """What the output layouts of ``func(*args, **kwargs)`` in the fake ``mode`` can depend on (module docstring),
    or None where its answer is not remembered."""
    return _key(mode, func, args, kwargs) if enabled else None


def _key(mode, func, args, kwargs) -> tuple | None:
    kind = op_kind(func)
    if kind is None:
        return None
    key = [func, torch.is_grad_enabled(), torch.get_default_dtype(), torch._C._get_default_device()]
    key.append(torch.is_inference_mode_enabled())
    try:
        _add(key, args, mode, kind is IN_PLACE)
        for name, value in kwargs.items():
            key.append(name)
            _add(key, (value,), mode, kind is IN_PLACE)
    except (_NotKept, RuntimeError):  # RuntimeError: a sparse tensor's strides
        return None
    return tuple(key)


def _add(key: list, values, mode, storage_bytes: bool) -> None:
    for a in values:
        cls = type(a)
        if cls is FakeTensor:
            if a.fake_mode is not mode or a.constant is not None:
                raise _NotKept
            meta = (a.shape, a.stride(), a.storage_offset(), a.dtype, a.fake_device, a.requires_grad)
            key.append((*meta, a.is_conj(), a.is_neg(), a.untyped_storage().nbytes() if storage_bytes else None))
        elif cls in _SCALARS:
            key.append(cls)
            key.append(a)
        elif cls is list or cls is tuple:
            key.append(cls)
            key.append(len(a))
            _add(key, a, mode, storage_bytes)
        else:  # a plain tensor, a symbolic size, a generator, an object: left to the fake mode
            raise _NotKept


def outputs_from(mode, key: tuple, args, kwargs, checked: set):
    """The outputs remembered for ``key``, made anew (new storages, views of the inputs' storages, the inputs
    themselves; None for an op that returns nothing), or :data:`MISS` where none are remembered or the op signature
    they were remembered under is no longer in ``checked``."""
    found = _ANSWERS.get(key)
    if found is None or found[0] not in checked:
        return MISS
    container, leaves = found[1]
    top = (*args, *kwargs.values())
    made = [_make(mode, leaf, top) for leaf in leaves]
    if container is FakeTensor:
        return made[0]
    return None if container is None else container(made)


def _make(mode, leaf, top):
    if leaf is None:
        return None
    if leaf[0] is SAME:
        return top[leaf[1]]
    shape, stride, offset, dtype, device, requires_grad = leaf[2]
    # no mode is active inside the fake mode's own dispatch, and the guard keeps a tensor subclass's out: torch's
    # in_kernel_invocation_manager, made to run meta kernels on fake inputs, is not needed (and cost 7 % of a verdict)
    with torch._C._DisableTorchDispatch():
        empty = torch.empty_strided(shape, stride, dtype=dtype, device=_META, requires_grad=requires_grad)
        if leaf[0] is VIEW:
            empty.set_(top[leaf[1]].untyped_storage(), offset, shape, stride)
    return FakeTensor(mode, empty, device)


def remember(mode, key: tuple, signature: tuple, func, args, kwargs, out) -> None:
    """Keep how to make ``out`` (what the fake kernel returned for ``func(*args, **kwargs)``, whose layout key is
    ``key`` and op signature ``signature``) again, if it is one of the kinds remembered (module docstring)."""
    kind = op_kind(func)
    top = (*args, *kwargs.values())
    try:
        if kind is IN_PLACE and _key(mode, func, args, kwargs) != key:
            raise _NotKept  # the call changed an input's layout or storage bytes
        if out is None:
            container, outs = None, []
        elif type(out) is FakeTensor:
            container, outs = FakeTensor, [out]
        elif type(out) in (tuple, list):
            container, outs = type(out), list(out)
        else:
            raise _NotKept
        inputs = {t.untyped_storage()._cdata for t in tensor_args(args, kwargs)}
        leaves = [_leaf(mode, kind, o, top, inputs) for o in outs]
        fresh = [o.untyped_storage()._cdata for o, leaf in zip(outs, leaves) if leaf is not None and leaf[0] is FRESH]
        if len(set(fresh)) != len(fresh):
            raise _NotKept  # two outputs on one new storage
        for o, leaf in zip(outs, leaves):  # made once now, and compared with the fake kernel's own
            if _described(_make(mode, leaf, top), top) != _described(o, top):
                raise _NotKept
    except _NotKept:
        return
    _ANSWERS[key] = (signature, (container, tuple(leaves)))
    _NEW.append(key)


# The answers on disk (fake_memo_cache.py), each under its key's repr and its op signature's text: JSON of its
# container and its leaves (each None, ["same", i], ["view", i, layout] or ["fresh", null, layout]).
_CONTAINERS = {"tensor": FakeTensor, "none": None, "tuple": tuple, "list": list}
_CONTAINER_NAMES = {v: k for k, v in _CONTAINERS.items()}
_LEAF_KINDS = {SAME: SAME, VIEW: VIEW, FRESH: FRESH}  # a kind read back as the module's own string (compared by is)


def stored_outputs(mode, key: tuple, signature: tuple, args, kwargs):
    """The outputs of an answer an earlier process remembered for ``key`` (fake_memo_cache.py), for a call whose op
    signature ``signature`` has passed its check in this process; the answer is kept for the rest of the process.
    :data:`MISS` where none is stored (or the memo is off)."""
    stored = stored_answers() if enabled else None
    sig = signature_text(signature) if stored is not None else None
    text = stored.get(repr(key), sig) if sig is not None else None
    answer = _answer_from_text(text) if text is not None else None
    if answer is None:
        return MISS
    _ANSWERS[key] = (signature, answer)
    return outputs_from(mode, key, args, kwargs, (signature,))


def write_answers() -> None:
    """Append the answers remembered since the last call to the file of fake_memo_cache.py, for later processes."""
    new = [(key, *_ANSWERS[key]) for key in _NEW if key in _ANSWERS]
    _NEW.clear()
    stored = stored_answers() if new else None
    if stored is None:
        return
    lines = []
    for key, signature, (container, leaves) in new:
        sig = signature_text(signature)
        if sig is not None:
            leaves_text = [None if leaf is None else [leaf[0], *_plain(leaf[1:])] for leaf in leaves]
            lines.append((repr(key), sig, json.dumps([_CONTAINER_NAMES[container], leaves_text])))
    stored.append(lines)


def _plain(part):
    """A leaf's index and layout as JSON values (dtypes and devices as their names)."""
    if isinstance(part, (tuple, list)):
        return [_plain(p) for p in part]
    return str(part) if isinstance(part, (torch.dtype, torch.device)) else part


def _answer_from_text(text: str):
    """(container, leaves) from a stored answer's text, or None if it is not one."""
    try:
        container, leaves = json.loads(text)
        made = []
        for leaf in leaves:
            if leaf is None:
                made.append(None)
            elif leaf[0] == SAME:
                made.append((SAME, int(leaf[1])))
            else:
                shape, stride, offset, dtype, device, requires_grad = leaf[2]
                dtype = getattr(torch, dtype.removeprefix("torch."))
                if not isinstance(dtype, torch.dtype) or type(requires_grad) is not bool:
                    return None
                layout = (tuple(shape), tuple(stride), int(offset), dtype, torch.device(device), requires_grad)
                made.append((_LEAF_KINDS[leaf[0]], None if leaf[1] is None else int(leaf[1]), layout))
        return _CONTAINERS[container], tuple(made)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError):
        return None  # not an answer of this format: the call asks its fake kernel


def _leaf(mode, kind: str, o, top: tuple, inputs: set):
    """How to make output ``o`` again: None, (SAME, i), (VIEW, i, layout) or (FRESH, None, layout)."""
    if o is None:
        return None
    if type(o) is not FakeTensor or o.fake_mode is not mode or o.constant is not None:
        raise _NotKept
    if kind is IN_PLACE:
        same = [i for i, a in enumerate(top) if a is o]
        if not same:
            raise _NotKept
        return (SAME, same[0])
    if o.layout is not torch.strided or o.is_conj() or o.is_neg():
        raise _NotKept
    layout = (tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, o.fake_device, o.requires_grad)
    if kind is VIEW:
        base = [i for i, a in enumerate(top) if isinstance(a, torch.Tensor) and _same_storage(a, o.untyped_storage())]
        if not base:
            raise _NotKept
        return (VIEW, base[0], layout)
    if o.untyped_storage()._cdata in inputs or o.storage_offset() != 0:
        raise _NotKept
    return (FRESH, None, layout)


def _described(o, top: tuple) -> tuple:
    """An output as a dry run reads it: its layout, its storage's bytes, which input it is or shares storage with."""
    if o is None:
        return (None,)
    storage = o.untyped_storage()
    which = [i for i, a in enumerate(top) if isinstance(a, torch.Tensor) and _same_storage(a, storage)]
    same = [i for i, a in enumerate(top) if a is o]
    meta = (tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, o.fake_device, o.requires_grad, o.layout)
    return (*meta, o.is_conj(), o.is_neg(), storage.nbytes(), tuple(which), tuple(same), type(o))


def _same_storage(t: torch.Tensor, storage) -> bool:
    return t.untyped_storage()._cdata == storage._cdata


@contextlib.contextmanager
def off():
    """Every op asks its fake kernel, as without this module (tests compare the two)."""
    global enabled
    before, enabled = enabled, False
    try:
        yield
    finally:
        enabled = before
