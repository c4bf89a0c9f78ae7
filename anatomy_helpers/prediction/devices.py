"""The GPUs a prediction can name: their memory as the driver reports it and as a process sees it, their compute
capability, and what is left for tensors once the CUDA context has taken its share. Used by
:mod:`anatomy_helpers.prediction.fit` and the CLI.

Two totals per GPU (MiB of 2**20 bytes), each with where it comes from (:class:`Capacity`; sources in
docs/references.md): the driver's (``nvidia-smi``'s ``memory.total``) and the smaller one a process sees
(``torch.cuda.get_device_properties().total_memory``, CUDA's ``totalGlobalMem``: the total of ``cudaMemGetInfo``),
0.25 to 0.7 GiB less. A process can never allocate more than the second, so a fit uses it; where public logs
give several figures for one GPU (drivers differ), the lowest. The product pages' "16 GB" or "80 GB" are marketing
figures, neither 10**9 nor 2**30 bytes (an "80 GB" A100 reports 81,920 MiB, an "80 GB" H100 81,559 MiB).

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..core.tables import Col, format_table
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
class Capacity:
    """A GPU's memory as two sources give it, MiB: ``driver_mib`` (``nvidia-smi``'s ``memory.total``) and
    ``process_mib``, every figure of ``torch.cuda.get_device_properties().total_memory`` (or deviceQuery's
    ``totalGlobalMem``, the same field) found in public logs, lowest first; ``*_source`` says where each is from."""

    driver_mib: int
    driver_source: str
    process_mib: tuple[int, ...]
    process_source: str

    def __post_init__(self):
        if not self.process_mib or list(self.process_mib) != sorted(self.process_mib):
            raise ValueError(f"process_mib must be one or more figures, lowest first, got {self.process_mib}")
        if self.process_mib[-1] > self.driver_mib:
            raise ValueError(f"a process cannot see more than the driver's {self.driver_mib} MiB: {self.process_mib}")

    @property
    def process_total(self) -> int:
        """Bytes a process sees: the lowest figure found (the conservative one where they differ)."""
        return self.process_mib[0] * MiB

    def note(self) -> str:
        """Which total a fit uses, in words (MiB)."""
        low, high = self.process_mib[0], self.process_mib[-1]
        seen = f"{low:,} MiB" if low == high else f"the lowest of {low:,} to {high:,} MiB"
        return f"(as a process sees it: {seen} in public logs; nvidia-smi says {self.driver_mib:,} MiB)"


@dataclass(frozen=True)
class Device:
    """A GPU to predict for: ``total`` bytes as a process sees them (what ``torch.cuda.mem_get_info`` reports as
    the total, less than the driver's ``nvidia-smi`` figure; for a size given by hand, that size), and its compute
    capability (None when only a size was given). ``context`` is what the CUDA context is allowed (or measured) to
    take. ``capacity``: both totals and their sources, for the named GPUs (None otherwise)."""

    name: str
    total: int
    capability: tuple[int, int] | None = None
    context: int = CUDA_CONTEXT_BYTES
    context_measured: bool = False  # True for "this GPU": measured as total - free - PyTorch's reserved bytes
    capacity: Capacity | None = None

    @property
    def driver_total(self) -> int | None:
        """Bytes ``nvidia-smi`` reports, where known (a named GPU)."""
        return None if self.capacity is None else self.capacity.driver_mib * MiB

    def total_note(self) -> str:
        """Which total ``total`` is, in words: a named GPU's (:meth:`Capacity.note`), "this GPU"'s or a size's."""
        if self.capacity is not None:
            return self.capacity.note()
        return "(as this process sees it: mem_get_info)" if self.name.startswith(THIS_GPU) else ""

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


THIS_GPU = "this GPU"

#: Where each total comes from, in short (the sources themselves are in docs/references.md, "GPUs").
SMI = "modal-client PR 2797"  # nvidia-smi's memory.total per GPU, listed in a public pull request
SMI_LOGS = "nvidia-smi logs"  # nvidia-smi's table printed in public logs
PROPS = "get_device_properties logs"  # torch.cuda.get_device_properties(0) printed in public logs
DEVICE_QUERY = "deviceQuery logs"  # CUDA's deviceQuery sample (totalGlobalMem) printed in public logs


def _nvidia(name: str, capability: tuple[int, int], capacity: Capacity) -> Device:
    return Device(name, capacity.process_total, capability, capacity=capacity)


#: The devices known by short name: both totals (:class:`Capacity`; a fit uses what a process sees), compute
#: capabilities from NVIDIA's CUDA GPUs page (docs/references.md).
DEVICES: dict[str, Device] = {
    "t4": _nvidia("T4", (7, 5), Capacity(15_360, SMI, (14_930, 15_079, 15_095, 15_102, 15_109), PROPS)),
    "l4": _nvidia("L4", (8, 9), Capacity(23_034, SMI, (22_518,), DEVICE_QUERY)),
    "a100-40": _nvidia("A100 40GB", (8, 0), Capacity(40_960, SMI, (40_339, 40_536), f"{DEVICE_QUERY[:-5]}, {PROPS}")),
    "a100-80": _nvidia("A100 80GB", (8, 0), Capacity(81_920, SMI, (81_221,), DEVICE_QUERY)),
    "h100": _nvidia("H100 80GB HBM3", (9, 0), Capacity(81_559, SMI, (81_082, 81_089, 81_090), PROPS)),
    "h200": _nvidia("H200", (9, 0), Capacity(143_771, SMI_LOGS, (143_156,), PROPS)),
}

#: The GPU a prediction is for when none is named (both ``predict`` commands, the will-it-fit functions, the
#: panels): a free Colab runtime's T4, what a learner has.
DEFAULT_GPU = "t4"


def capacity_table() -> str:
    """The named GPUs' two totals (MiB) with where each comes from, the one a fit uses, and the compute capability,
    as a text table."""
    cols = [Col("device", 8, align="<"), Col("nvidia-smi", 10, ",d"), Col("from", 20, align="<")]
    cols += [Col("a process sees", 14, align=">"), Col("from", 38, align="<"), Col("fit uses", 8, ",d")]
    cols += [Col("compute", 7, align=">")]
    rows = []
    for key, dev in DEVICES.items():
        c = dev.capacity
        seen = f"{c.process_mib[0]:,}" if len(c.process_mib) == 1 else f"{c.process_mib[0]:,}-{c.process_mib[-1]:,}"
        major, minor = dev.capability
        rows.append((key, c.driver_mib, c.driver_source, seen, c.process_source, dev.total // MiB, f"{major}.{minor}"))
    return format_table(cols, rows, note="(MiB; a fit uses the lowest figure a process was seen with)")


def this_gpu() -> Device:
    """The CUDA device in use: its total from ``torch.cuda.mem_get_info`` (what this process sees), its compute
    capability, and the memory already taken outside PyTorch's allocator (``total - free - memory_reserved``: the
    context, and any other process), or :data:`CUDA_CONTEXT_BYTES` if that is larger (the context grows when cuBLAS
    starts)."""
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
    device whose process sees that total, compute capability unknown) or a Device. Anything else is a ValueError."""
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
