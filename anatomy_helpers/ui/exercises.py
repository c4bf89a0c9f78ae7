"""Predict, then measure: checking a learner's number against the right one, and stopping "Run All" before it.

An exercise is two calls. ``require_prediction(my_x, "what")`` at the top of the cell that reveals the answer
stops a notebook's "Run All" there while ``my_x`` is still None, so that no answer reaches the screen before the
learner wrote a number down; ``check_prediction("what", my_x, right_bytes, ...)`` then grades it: right within the
exercise's tolerance, or the one common wrong answer it is nearest to (``mistakes``, each with the message of what
it missed), or how far off it is.

Unattended runs (the tests, ``scripts/run_notebooks.py``) set the environment variable named by ``AUTORUN_ENV``:
there a missing prediction stops nothing and prints nothing, so the committed notebooks execute top to bottom with
every prediction left at None.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..core.checks import one_of
from ..core.units import GiB, KiB, MiB

UNITS = {"bytes": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "x": 1, "count": 1}

#: What the prediction is compared with, and how a verdict names that number (a dry run is not a measurement).
SOURCES = {"measured": "measured", "dry run": "the dry run gives", "formula": "the formula gives"}

#: Set (to anything but "" or "0") by an unattended run of whole notebooks: a missing prediction does not stop it.
AUTORUN_ENV = "ANATOMY_AUTORUN"

#: What a learner reads where "Run All" stopped.
STOP_TEXT = "write your prediction in the cell above, then run from here"


@dataclass
class Verdict:
    name: str
    predicted: float | None  # in ``unit``
    measured: float  # in ``unit``: the right answer, whatever its source
    unit: str
    relative_error: float | None  # |predicted - measured| / |measured|; None without a prediction
    ok: bool
    tolerance: float = 0.1  # relative error still counted as right
    source: str = "measured"  # one of SOURCES
    mistake: str | None = None  # the message of the common wrong answer the prediction matched, if any

    def __str__(self) -> str:
        if self.predicted is None:
            return (
                f"{self.name}: no prediction yet. Put your number (in {self.unit_words}) in the variable above and "
                f"re-run this cell; the {self.revealed} is revealed when you do."
            )
        head = (
            f"{self.name}: you predicted {self.predicted:,.4g} {self.unit}, {SOURCES[self.source]} "
            f"{self.measured:,.4g} {self.unit} -> off by {self.relative_error:.1%}"
        )
        if self.ok:
            return f"{head}, within the {self.tolerance_text}. Well reasoned."
        if self.mistake is not None:
            return f"{head}, outside the {self.tolerance_text}. Your number is a common wrong answer: {self.mistake}"
        return f"{head}, outside the {self.tolerance_text}. Look again at what the {self.counted} counts."

    def __repr__(self) -> str:
        # Shown when the verdict is a cell's last value: must not give the answer away.
        state = "no prediction yet" if self.predicted is None else ("right" if self.ok else "off")
        return f"<Verdict {self.name!r}: {state}>"

    @property
    def tolerance_text(self) -> str:
        return "exact answer" if self.tolerance == 0 else f"{self.tolerance:.0%} tolerance"

    @property
    def unit_words(self) -> str:
        return {"x": "times, a ratio", "count": "a plain count"}.get(self.unit, self.unit)

    @property
    def revealed(self) -> str:
        return {"measured": "measured value", "dry run": "dry run's value", "formula": "formula's value"}[self.source]

    @property
    def counted(self) -> str:
        return {"measured": "measurement", "dry run": "dry run", "formula": "formula"}[self.source]


class PredictionNeeded(Exception):
    """Raised by :func:`require_prediction` to stop "Run All" at an exercise whose prediction is still None.

    IPython shows only the message (``_render_traceback_``), not a traceback: nothing went wrong.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"Stopped here: {self}"]


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def autorun() -> bool:
    """True in an unattended run of whole notebooks (``AUTORUN_ENV`` set to anything but "" or "0")."""
    return os.environ.get(AUTORUN_ENV, "") not in ("", "0")


def _prediction(value, name: str) -> float | None:
    if value is None:
        return None
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(
            f"the prediction for {name!r} must be a plain number (for example 5.5, in the unit the exercise asks "
            f"for) or None, got {value!r}"
        )
    return float(value)


def require_prediction(value, name: str):
    """Stop here while the prediction ``value`` for the exercise ``name`` is None; return it otherwise.

    Call it at the top of the cell that would reveal the answer. In a notebook run cell by cell or with "Run All",
    a None raises :class:`PredictionNeeded` (the run stops; the learner reads :data:`STOP_TEXT`); in an unattended
    run (:func:`autorun`) it does nothing. ``value`` is a number (a finite one) or, for an exercise that asks for a
    choice, a non-empty name; anything else is a ValueError.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be the exercise's name (a non-empty string), got {name!r}")
    if isinstance(value, str):  # a choice by name (lesson 05's policy): any non-empty name, checked by its exercise
        if not value.strip():
            raise ValueError(f"the choice for {name!r} must be a non-empty name (or None), got {value!r}")
        return value
    value = _prediction(value, name)
    if value is None and not autorun():
        raise PredictionNeeded(f"{name}: {STOP_TEXT}.")
    return value


def check_prediction(
    name: str,
    predicted: float | None,
    measured_bytes: float,
    unit: str = "MiB",
    tolerance: float = 0.1,
    *,
    source: str = "measured",
    mistakes: Mapping[str, float] | None = None,
) -> Verdict:
    """Compare a prediction (in ``unit``) with the right answer (in bytes, or a plain number for "x"/"count").

    Prints and returns a :class:`Verdict`. ``tolerance`` is the relative error counted as right (0.1 = 10 %): set
    it per exercise, tight where the lesson is a small difference. ``source`` says what the right answer is:
    "measured", "dry run" or "formula" (the verdict names it). ``mistakes`` maps a message to a common wrong answer
    (in the same scale as ``measured_bytes``); a wrong prediction nearer to one of them than to the right answer,
    and within ``tolerance`` of it, gets that message (say what the wrong answer missed) instead of the distance.
    """
    one_of("unit", unit, UNITS)
    one_of("source", source, SOURCES)
    if not _is_real(tolerance) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a number in [0, 1) (a relative error), got {tolerance!r}")
    if not _is_real(measured_bytes) or not math.isfinite(measured_bytes):
        raise ValueError(f"measured_bytes must be a finite number, got {measured_bytes!r}")
    scale = UNITS[unit]
    measured = measured_bytes / scale
    wrong = _mistakes(mistakes, measured, scale, tolerance)
    predicted = _prediction(predicted, name)
    if predicted is None:
        verdict = Verdict(name, None, measured, unit, None, False, tolerance, source)
    else:
        err = _relative(predicted, measured)
        ok = err <= tolerance
        matched = None
        if not ok:
            near = [(abs(predicted - v), msg) for msg, v in wrong if _relative(predicted, v) <= tolerance]
            near = [(d, msg) for d, msg in near if d < abs(predicted - measured)]
            matched = min(near)[1] if near else None
        verdict = Verdict(name, predicted, measured, unit, err, ok, tolerance, source, matched)
    _show(verdict)
    return verdict


def _relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference) if reference else abs(value - reference)


def _mistakes(mistakes, measured: float, scale: float, tolerance: float) -> list[tuple[str, float]]:
    """The common wrong answers as (message, value in the verdict's unit), each checked."""
    if mistakes is None:
        return []
    if not isinstance(mistakes, Mapping):
        raise ValueError(f"mistakes must be a mapping {{message: wrong answer}}, got {type(mistakes).__name__}")
    out = []
    for message, value in mistakes.items():
        if not isinstance(message, str) or not message.strip():
            raise ValueError(f"each mistake's key must be its message (a non-empty string), got {message!r}")
        if not _is_real(value) or not math.isfinite(value):
            raise ValueError(f"the wrong answer for {message!r} must be a finite number, got {value!r}")
        value = value / scale
        if _relative(value, measured) <= tolerance:
            raise ValueError(
                f"the wrong answer for {message!r} ({value:,.4g}) lies within the {tolerance:.0%} tolerance of the "
                f"right one ({measured:,.4g}): it would be graded right; tighten the tolerance or drop it"
            )
        out.append((message, value))
    return out


#: Output metadata key under which an exercise cell records what it asked and what was measured. Invisible to a
#: learner; tests/test_course.py reads it to check that no earlier output of the notebook prints the answer.
METADATA_KEY = "anatomy_helpers_exercise"


def _show(verdict: Verdict) -> None:
    """Print the verdict; in a notebook, as a display output that also carries the right answer as metadata."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    shell = get_ipython() if get_ipython is not None else None
    if shell is None or not hasattr(shell, "kernel"):
        print(verdict)
        return
    meta = {
        METADATA_KEY: {
            "name": verdict.name,
            "measured": verdict.measured,
            "unit": verdict.unit,
            "source": verdict.source,
        }
    }
    display({"text/plain": str(verdict)}, raw=True, metadata=meta)
