"""What both prediction commands share (``cli.py`` for the course GPT, ``cli_hf.py`` for Hugging Face models):
argparse types that check through checks.py, and the JSON form of a fit report and its fixes (bytes)."""

from __future__ import annotations

import argparse

from .checks import int_in, positive_int, positive_number


def _argument(parse, check, what: str):
    """An argparse ``type``: ``parse`` the text (``what`` is expected), then ``check`` the value (checks.py says
    why it is refused)."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            return check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("the value ")) from None

    return convert


positive_int_arg = _argument(int, lambda v: positive_int("the value", v), "a whole number")
seed_arg = _argument(int, lambda v: int_in("the value", v, 0, 2**32, "2**32"), "a whole number")
positive_gib_arg = _argument(float, lambda v: positive_number("the value", v), "a number of GiB")


def report_answer(report, device) -> dict:
    """A FitReport as a JSON-ready dict (bytes): the verdict, each phase and the peak's breakdown."""
    return {
        "config": report.label,
        "device": report.device,
        "capacity_bytes": report.capacity,
        "usable_bytes": report.usable,
        "compute_capability": None if device.capability is None else ".".join(map(str, device.capability)),
        "rules": report.rules,
        "fits": report.fits,
        "runs_out_first": None if report.failure is None else dict(zip(("step", "phase"), report.failure)),
        "phases": [
            dict(step=p.step, phase=p.phase, tensor_bytes=p.tensors, reserved_bytes=p.reserved) for p in report.phases
        ],
        "peak_breakdown_bytes": report.peak.breakdown,
    }


def fixes_answer(fixes) -> list[dict]:
    """Ranked fixes (prediction/fixes.py Fix) as JSON-ready dicts."""
    return [
        dict(
            change=f.name,
            fits=f.fits,
            peak_bytes=f.report.peak.tensors,
            extra_flops=f.extra_flops,
            changes=f.effect,
            changes_training=f.changes_training,
        )
        for f in fixes
    ]
