"""Byte units and rounding, shared by every module. Sizes are bytes unless a name says otherwise."""

from __future__ import annotations

import numpy as np

KiB, MiB, GiB = 2**10, 2**20, 2**30


def round_up(nbytes, multiple: int):
    """``nbytes`` rounded up to a multiple of ``multiple`` (an int, or element-wise for a numpy array)."""
    if multiple <= 0:
        raise ValueError(f"multiple must be a positive number of bytes, got {multiple!r}")
    if isinstance(nbytes, np.ndarray):
        return -(-nbytes // multiple) * multiple
    return -(-int(nbytes) // multiple) * multiple


def pick_unit(nbytes: float) -> tuple[str, int]:
    """('GiB', 2**30) for sizes of 2 GiB and up, else ('MiB', 2**20): the unit a plot or table shows."""
    return ("GiB", GiB) if nbytes >= 2 * GiB else ("MiB", MiB)


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it at 1 or more: '512 B', '1.50 KiB', '74.36 MiB'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:,.0f} B"
