"""The GPUs a prediction can name: their memory as the driver reports it, their compute capability, and what is
left for tensors once the CUDA context has taken its share. Used by :mod:`anatomy_helpers.prediction.fit` and the CLI.

Capacities are the totals ``nvidia-smi`` reports (MiB of 2**20 bytes), which is what a training process can ask
the driver for; the product pages' "16 GB" or "80 GB" are marketing figures, neither 10**9 nor 2**30 bytes
(an "80 GB" A100 reports 81,920 MiB, an "80 GB" H100 81,559 MiB). Sources in docs/references.md.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..core.units import GiB, MiB

#: Our allowance for the CUDA context: the driver's state, the kernels' code and the libraries' handles, which
#: take GPU memory outside PyTorch's caching allocator. Neither NVIDIA nor PyTorch documents a figure per
#: architecture; PyTorch sets ``CUDA_MODULE_LOADING=LAZY`` (since 1.13; CUDA's own default on Linux since 12.2),
#: which its pull request measured at 287,047,680 bytes against 666,632,192 loaded eagerly. cuBLAS and cuDNN
#: workspaces come on top once the first matmul runs. So one stated allowance for every device, not a measurement.
CUDA_CONTEXT_BYTES = GiB // 2

#: From this compute capability on, bfloat16 is native (``torch.cuda.is_bf16_supported`` returns True for
#: ``major >= 8`` without trying a tensor); below it, mixed precision means float16 with a GradScaler.
BF16_NATIVE_FROM = (8, 0)


@dataclass(frozen=True)
class Device:
    """A GPU to predict for: ``total`` bytes as the driver reports them, and its compute capability (None when
    only a size was given). ``context`` is what the CUDA context is allowed (or measured) to take."""

    name: str
    total: int
    capability: tuple[int, int] | None = None
    context: int = CUDA_CONTEXT_BYTES
    context_measured: bool = False  # True for "this GPU": measured as total - free - PyTorch's reserved bytes

    @property
    def usable(self) -> int:
        """Bytes left for PyTorch's allocator: ``total - context``."""
        return self.total - self.context

    @property
    def bf16_native(self) -> bool | None:
        """True where bfloat16 is native (compute capability 8.0 and up), None when the capability is unknown."""
        return None if self.capability is None else self.capability >= BF16_NATIVE_FROM

    @property
    def mixed_precision(self) -> str:
        """The autocast dtype that suits the device: "bfloat16" where it is native (or unknown), else "float16"
        (with a GradScaler: fp16's narrow exponent range loses small gradients without loss scaling)."""
        return "float16" if self.bf16_native is False else "bfloat16"

    def context_note(self) -> str:
        return "CUDA context (measured)" if self.context_measured else "CUDA context (assumed)"


def _nvidia(name: str, mib: int, capability: tuple[int, int]) -> Device:
    return Device(name, mib * MiB, capability)


#: The devices known by short name: MiB totals as nvidia-smi reports them, compute capabilities from NVIDIA's
#: CUDA GPUs page (docs/references.md).
DEVICES: dict[str, Device] = {
    "t4": _nvidia("T4", 15_360, (7, 5)),
    "l4": _nvidia("L4", 23_034, (8, 9)),
    "a100-40": _nvidia("A100 40GB", 40_960, (8, 0)),
    "a100-80": _nvidia("A100 80GB", 81_920, (8, 0)),
    "h100": _nvidia("H100 80GB HBM3", 81_559, (9, 0)),
    "h200": _nvidia("H200", 143_771, (9, 0)),
}

#: The GPU a prediction is for when none is named (both ``predict`` commands, the will-it-fit functions, the
#: panels): a free Colab runtime's T4, what a learner has.
DEFAULT_GPU = "t4"

THIS_GPU = "this GPU"


def this_gpu() -> Device:
    """The CUDA device in use: its total from ``torch.cuda.mem_get_info``, its compute capability, and the memory
    already taken outside PyTorch's allocator (``total - free - memory_reserved``: the context, and any other
    process), or :data:`CUDA_CONTEXT_BYTES` if that is larger (the context grows when cuBLAS starts)."""
    if not torch.cuda.is_available():
        raise ValueError(f"device {THIS_GPU!r} needs CUDA, which is not available here; name a device instead")
    index = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    outside = total - free - torch.cuda.memory_reserved(index)
    name = f"{THIS_GPU} ({torch.cuda.get_device_name(index)})"
    capability = tuple(torch.cuda.get_device_capability(index))
    return Device(name, total, capability, max(outside, CUDA_CONTEXT_BYTES), outside >= CUDA_CONTEXT_BYTES)


def device_names() -> tuple[str, ...]:
    """The names :func:`get_device` accepts: the short names, and "this GPU" where CUDA is available."""
    return (*DEVICES, THIS_GPU) if torch.cuda.is_available() else tuple(DEVICES)


def get_device(device: str | int | Device) -> Device:
    """A :class:`Device` from a short name (``"t4"``, ``"a100-80"`` ...), ``"this GPU"``, a number of bytes (a
    device of that total size, compute capability unknown) or a Device. Anything else is a ValueError."""
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        key = device.strip().lower()
        if key in DEVICES:
            return DEVICES[key]
        if key == THIS_GPU.lower():
            return this_gpu()
        raise ValueError(f"device must be one of {device_names()} or a number of bytes, got {device!r}")
    is_whole = isinstance(device, numbers.Integral) and not isinstance(device, bool)
    if not is_whole or device <= 0:
        shown = "not a number" if isinstance(device, float) and math.isnan(device) else repr(device)
        raise ValueError(
            f"device must be a device name {tuple(DEVICES)} or a positive whole number of bytes, got {shown}"
        )
    return Device(f"{device / GiB:.2f} GiB device", int(device))


def gib_device(gib: float) -> Device:
    """A device of ``gib`` GiB in total (the CLI's ``--gpu-gib``); ValueError unless a finite number > 0."""
    if isinstance(gib, bool) or not isinstance(gib, numbers.Real) or not math.isfinite(gib) or gib <= 0:
        raise ValueError(f"the device size must be a finite number of GiB > 0, got {gib!r}")
    return Device(f"{gib:g} GiB device", int(gib * GiB))
