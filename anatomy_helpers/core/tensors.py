"""Facts about tensors and their storages: which device, how many distinct bytes, which ops make new memory."""

from __future__ import annotations

from functools import cache

import torch


def on_device(t: torch.Tensor | torch.UntypedStorage, device: torch.device | str | None) -> bool:
    """Whether ``t`` (a tensor or storage) lives on ``device``: the same type, and the same index only when
    ``device`` names one.

    ``torch.device("cuda") != torch.device("cuda:0")``, so comparing devices with ``==`` would miss every
    tensor on the current GPU when ``device`` is plain ``"cuda"``. None matches every device.
    """
    if device is None:
        return True
    device = torch.device(device)
    # A CPU tensor's device has no index; "cpu:0" is the same device.
    return t.device.type == device.type and (device.index is None or (t.device.index or 0) == device.index)


@cache
def returns_alias(func) -> bool:
    """Whether an ATen op's outputs alias its inputs (views, in-place and out= ops): memory that already existed."""
    return op_outputs(func) != ALLOCATES


# What an ATen op hands back, as far as memory goes (see op_outputs).
ALLOCATES, VIEWS, IN_PLACE, REUSES = range(4)


def op_outputs(func) -> int:
    """Classify an ATen op by what its outputs are, from its schema.

    ``ALLOCATES``: fresh storages (or no tensors at all); ``VIEWS``: only views of its inputs, so it allocates
    nothing and resizes nothing (``view``, ``t``, ``detach``); ``IN_PLACE``: only its own mutated ``self``,
    which keeps its size (``add_``, ``mul_``); ``REUSES``: any other aliasing output, memory that existed but
    may have been resized (``out=`` ops, ``resize_``, ``set_``).
    """
    schema = func._schema
    aliases = [r.alias_info for r in schema.returns]
    if not any(a is not None for a in aliases):
        return ALLOCATES
    if all(a is not None and not a.is_write for a in aliases):
        return VIEWS
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    storage_ops = "resize" in schema.name or schema.name.endswith("set_")
    if all(not a.kwarg_only for a in written) and not storage_ops and all(a is not None for a in aliases):
        return IN_PLACE
    return REUSES


def tensor_args(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an op's arguments (an ATen op's arguments nest one level at most: lists of tensors)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


def storage_bytes(tensors, device: torch.device | str | None = None) -> int:
    """Bytes held by the distinct storages behind ``tensors`` (views counted once).

    With ``device``, only storages on that device count (see :func:`on_device`). This is what the
    tracker's per-category totals should equal, computed straight from the tensors.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if not on_device(t, device):
            continue
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()  # the storage itself: fake storages (a dry run) have no data pointer
    return sum(seen.values())


def largest_tensor_bytes(tensors) -> int:
    """Bytes of the largest single tensor among ``tensors`` (what a single-tensor loop works on at once)."""
    return max((t.nelement() * t.element_size() for t in tensors), default=0)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (exp_avg, exp_avg_sq, step, momentum_buffer ...)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def state_bytes_by_key(optimizer: torch.optim.Optimizer, device: torch.device | str | None = None) -> dict[str, int]:
    """Bytes of optimizer state per state name (``exp_avg``, ``momentum_buffer``, ``step`` ...).

    With ``device``, only tensors on that device count (torch keeps Adam's ``step`` on the CPU
    unless the optimizer is fused or capturable).
    """
    out: dict[str, int] = {}
    for state in optimizer.state.values():
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                out[key] = out.get(key, 0) + storage_bytes([v], device)
    return out


#: Why a sparse gradient is refused where memory is watched or predicted (the tracker, dry runs).
SPARSE_GRADIENT_REASON = (
    "a sparse gradient's bytes are the indices and values tensors inside it, not a strided storage the tracker "
    "counts, and their rows follow the batch's values (padding tokens left out; an optimizer coalesces them to the "
    "distinct rows looked up). Use sparse=False (a dense gradient of the whole table)"
)


def sparse_gradient_modules(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s modules whose weight gets a sparse gradient (``nn.Embedding(..., sparse=True)``,
    ``nn.EmbeddingBag(..., sparse=True)``; ``model`` itself: its class name).

    Such a gradient is a sparse COO tensor: its bytes are an indices and a values tensor held inside it, not a
    strided storage, and their number depends on how many rows the batch looked up.
    """
    return [
        f"{name or type(model).__name__} ({type(m).__name__}(sparse=True))"
        for name, m in model.named_modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
    ]
