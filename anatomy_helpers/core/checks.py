"""Argument checks shared by every public function: a wrong value is a ValueError that names the argument,
says what it must be and shows what it got, before any work is done.

Each check returns the value (as an int or float where that is what it must be), so a caller writes
``steps = positive_int("steps", steps)``. ``bool`` is refused where a number is meant: ``True`` is an int in
Python, but ``world_size=True`` is a mistake, not 1.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable

import torch


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_int(name: str, value, *, at_most: int | None = None) -> int:
    """``value`` as an int >= 1 (and <= ``at_most`` if given)."""
    if not _is_int(value) or value < 1 or (at_most is not None and value > at_most):
        rule = "a positive integer" if at_most is None else f"an integer from 1 to {at_most:,}"
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return int(value)


def rank_of_world(rank, world_size, *, at_most: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` checked once for every data-parallel entry point: ``world_size`` an integer from 1
    (to ``at_most`` if given), ``rank`` in ``[0, world_size)``."""
    world_size = positive_int("world_size", world_size, at_most=at_most)
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank!r}")
    return int(rank), world_size


def int_in(name: str, value, low: int, high: int, high_text: str | None = None) -> int:
    """``value`` as an int with ``low <= value < high`` (``high_text``: how the message writes ``high``)."""
    if not _is_int(value) or not low <= value < high:
        raise ValueError(f"{name} must be an integer in [{low}, {high_text or high}), got {value!r}")
    return int(value)


def positive_number(name: str, value, *, allow_zero: bool = False) -> float:
    """``value`` as a finite float > 0 (>= 0 with ``allow_zero``): NaN, infinities and strings are refused."""
    ok = _is_real(value) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        rule = "a finite number >= 0" if allow_zero else "a finite positive number"
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return float(value)


def whole_bytes(name: str, value, *, allow_zero: bool = False) -> int:
    """A number of bytes: a finite, whole number (an int, or a float with nothing after the point), > 0."""
    if _is_real(value) and math.isfinite(value) and float(value).is_integer():
        value = int(value)
        if value > 0 or (allow_zero and value == 0):
            return value
    rule = "a whole number of bytes >= 0" if allow_zero else "a positive whole number of bytes"
    raise ValueError(f"{name} must be {rule}, got {value!r}")


def one_of(name: str, value, choices: Iterable):
    """``value`` itself, if it is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def optional_callable(name: str, value) -> Callable | None:
    """``value`` if it is None or can be called."""
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be a function (or None), got {type(value).__name__} {value!r}")
    return value


def torch_at_least(minimum: tuple[int, int], what: str, version: str | None = None) -> None:
    """RuntimeError unless the installed torch (or ``version``, e.g. "2.10.0+cu128") is at least ``minimum``: names
    ``what`` needs it, and how to upgrade. The package itself asks only for torch 2.6 (Colab keeps its own torch)."""

    version = torch.__version__ if version is None else version
    have = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if have < tuple(minimum):
        need = ".".join(map(str, minimum))
        raise RuntimeError(
            f"{what} needs torch {need} or newer; this is torch {version}. Upgrade it (pip install -U 'torch>={need}'; "
            "on Colab, then restart the session), or use the notebook's stored outputs."
        )
