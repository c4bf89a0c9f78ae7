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
    return any(r.alias_info is not None for r in func._schema.returns)


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
        seen[st.data_ptr()] = st.nbytes()
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
