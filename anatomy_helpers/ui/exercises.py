"""Predict, then measure: checking a learner's number against the measured one."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.units import GiB, KiB, MiB

UNITS = {"bytes": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "x": 1, "count": 1}


@dataclass
class Verdict:
    name: str
    predicted: float | None  # in ``unit``
    measured: float  # in ``unit``
    unit: str
    relative_error: float | None  # |predicted - measured| / |measured|; None without a prediction
    ok: bool
    tolerance: float = 0.1  # relative error still counted as right

    def __str__(self) -> str:
        if self.predicted is None:
            return (
                f"{self.name}: no prediction yet. Put your number (in {self.unit}) in the variable above and "
                "re-run this cell; the measured value is revealed when you do."
            )
        word = "within" if self.ok else "outside"
        return (
            f"{self.name}: you predicted {self.predicted:,.4g} {self.unit}, measured {self.measured:,.4g} {self.unit} "
            f"-> off by {self.relative_error:.1%}, {word} the {self.tolerance_text}. "
            + ("Well reasoned." if self.ok else "Look again at what the measurement counts.")
        )

    def __repr__(self) -> str:
        # Shown when the verdict is a cell's last value: must not give the answer away.
        state = "no prediction yet" if self.predicted is None else ("right" if self.ok else "off")
        return f"<Verdict {self.name!r}: {state}>"

    @property
    def tolerance_text(self) -> str:
        return f"{self.tolerance:.0%} tolerance"


def check_prediction(
    name: str, predicted: float | None, measured_bytes: float, unit: str = "MiB", tolerance: float = 0.1
) -> Verdict:
    """Compare a prediction (in ``unit``) with a measured quantity (in bytes, or a plain number for "x"/"count").

    Prints and returns a :class:`Verdict` saying how far off the prediction is.
    ``tolerance`` is the relative error counted as right (0.1 = 10 %).
    """
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {tuple(UNITS)}, got {unit!r}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    measured = measured_bytes / UNITS[unit]
    if predicted is None:
        verdict = Verdict(name, None, measured, unit, None, False, tolerance)
    else:
        err = abs(predicted - measured) / abs(measured) if measured else abs(predicted - measured)
        verdict = Verdict(name, float(predicted), measured, unit, err, err <= tolerance, tolerance)
    _show(verdict)
    return verdict


#: Output metadata key under which an exercise cell records what it asked and what was measured. Invisible to a
#: learner; tests/test_course.py reads it to check that no earlier output of the notebook prints the answer.
METADATA_KEY = "anatomy_helpers_exercise"


def _show(verdict: Verdict) -> None:
    """Print the verdict; in a notebook, as a display output that also carries the measured value as metadata."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    shell = get_ipython() if get_ipython is not None else None
    if shell is None or not hasattr(shell, "kernel"):
        print(verdict)
        return
    meta = {METADATA_KEY: {"name": verdict.name, "measured": verdict.measured, "unit": verdict.unit}}
    display({"text/plain": str(verdict)}, raw=True, metadata=meta)
