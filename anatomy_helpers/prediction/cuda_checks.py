"""What a stored GPU run measured against the predictions: the "checked" clause of every prediction for a GPU.

:data:`CUDA_CHECKS` (package data) is written by ``scripts/record_cuda_checks.py`` from the GPU run the repository
keeps (``lessons/gpu_reference/first_steps.json``, ``docs/gpu_outputs``), never typed in; tests/test_cuda_rules.py
records it again and compares. :func:`checked_text` says, per compute capability, how far ``max_memory_allocated``
was above (or under) the prediction's tensors and the allocator simulator's blocks; :func:`checks_table` lists the
rows. ``cuda_rules.rules_text`` puts the clause in every prediction's rules line.

MiB (2**20 bytes) everywhere here, as the runs printed them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ..core.tables import Col, format_table

NOT_CHECKED = "not yet checked on this GPU"
#: What the stored GPU run measured against the predictions (MiB, per run and row), written by
#: ``scripts/record_cuda_checks.py`` from ``lessons/gpu_reference/first_steps.json`` and ``docs/gpu_outputs``.
CUDA_CHECKS = Path(__file__).with_name("cuda_checks.json")


@dataclass(frozen=True)
class CheckRow:
    """One comparison of a stored GPU run (MiB, as the run printed them or from its bytes, 2 decimals)."""

    label: str
    measured_mib: float  # torch.cuda.max_memory_allocated over the step(s)
    predicted_mib: float  # the prediction's (or the GPU tracker's) peak of tensors
    simulated_mib: float | None = None  # the allocator simulator's peak of allocated bytes (whole blocks), if made

    @property
    def gap_mib(self) -> float:
        """Measured - predicted (positive: the GPU held more than predicted)."""
        return round(self.measured_mib - self.predicted_mib, 2)


@dataclass(frozen=True)
class CheckRun:
    """One stored GPU run's comparisons: where they were read (``source``), what ran, on which GPU and torch, and
    against what (``against``: "prediction", a dry run with CUDA's rules; "tracked", the tracker on the GPU)."""

    source: str
    what: str
    gpu: str
    torch: str
    capability: tuple[int, int]
    against: str
    rows: tuple[CheckRow, ...]


@functools.cache
def checked_runs() -> tuple[CheckRun, ...]:
    """The stored GPU runs of :data:`CUDA_CHECKS` (none if the file is missing)."""
    if not CUDA_CHECKS.exists():
        return ()
    runs = json.loads(CUDA_CHECKS.read_text())["runs"]
    return tuple(
        CheckRun(
            r["source"],
            r["what"],
            r["gpu"],
            r["torch"],
            tuple(r["capability"]),
            r["against"],
            tuple(
                CheckRow(x["label"], x["measured_mib"], x["predicted_mib"], x.get("simulated_mib")) for x in r["rows"]
            ),
        )  # fmt: skip
        for r in runs
    )


def _span(gaps: list[float]) -> str:
    """Gaps (MiB, measured - predicted) in words: "5.01 to 6.01 MiB above", "1.00 MiB under", "-0.50 to +2.00 MiB"."""
    lo, hi = min(gaps), max(gaps)
    if lo < 0 < hi:
        return f"{lo:+.2f} to {hi:+.2f} MiB against"
    a, b = sorted((abs(lo), abs(hi)))
    size = f"{a:.2f} MiB" if a == b else f"{a:.2f} to {b:.2f} MiB"
    return f"{size} {'under' if hi < 0 else 'above'}"


def checked_text(capability: tuple[int, int] | None) -> str:
    """What the stored GPU runs of this compute capability measured against the prediction, in one clause (read
    from :data:`CUDA_CHECKS`, never typed in); :data:`NOT_CHECKED` where none was stored."""
    runs = [r for r in checked_runs() if capability is not None and r.capability == tuple(capability)]
    runs = [r for r in runs if r.against == "prediction"]
    if not runs:
        return NOT_CHECKED
    rows = [row for r in runs for row in r.rows]
    gpus = " and ".join(dict.fromkeys(f"an {r.gpu} (torch {r.torch})" for r in runs))
    text = f"checked on {gpus}: max_memory_allocated {_span([row.gap_mib for row in rows])} the predicted tensors"
    simulated = [round(row.measured_mib - row.simulated_mib, 2) for row in rows if row.simulated_mib is not None]
    if simulated:
        text += f", {_span(simulated)} the simulated allocator's blocks"
    return text


def checks_table(against: str = "prediction") -> str:
    """The stored GPU runs compared ``against`` "prediction" or "tracked", row by row (MiB), as a text table."""
    cols = [Col("run", 20, align="<"), Col("rows", 10, align="<"), Col("measured", 9, ".2f")]
    cols += [Col(against if against == "tracked" else "predicted", 9, ".2f"), Col("gap", 7, "+.2f")]
    cols += [Col("simulated", 9, ".2f"), Col("gap", 7, "+.2f")]
    table = []
    for r in (r for r in checked_runs() if r.against == against):
        for row in r.rows:
            sim = row.simulated_mib
            gap = None if sim is None else round(row.measured_mib - sim, 2)
            table.append(
                (r.source.split("/")[-1], row.label, row.measured_mib, row.predicted_mib, row.gap_mib, sim, gap)
            )
    note = "(MiB; measured: max_memory_allocated; gap: measured - the column before it)"
    return format_table(cols, table, note=note)


__all__ = ["CUDA_CHECKS", "NOT_CHECKED", "CheckRow", "CheckRun", "checked_runs", "checked_text", "checks_table"]
