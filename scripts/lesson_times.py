"""How long each lesson takes in a room: prose to read, exercises, panels and execution, per notebook.

    python scripts/lesson_times.py              # the static counts and the estimate, as a Markdown table
    python scripts/lesson_times.py --execute    # also execute each notebook once (a copy) and time it

The estimate is a model, not a measured walk-through: reading at 200 words per minute, plus 2 minutes per
predict-then-measure exercise (predict, run, read the verdict), 3 minutes per slider panel (move two or three
controls, read what changed) and the notebook's execution time. docs/instructor_guide.md carries the table (with
the execution times measured once on a 2-core laptop-class CPU) and its plan; tests/test_course.py checks that the
table's counts are the notebooks' and that every slot of the plan is at least the estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
WORDS_PER_MINUTE = 200
EXERCISE_MIN = 2
PANEL_MIN = 3
WORD = re.compile(r"[A-Za-z0-9][\w'’-]*")


@dataclass(frozen=True)
class LessonTime:
    """One notebook's counts and the estimated minutes in a room."""

    number: str
    words: int  # words of Markdown prose
    code_cells: int
    exercises: int
    panels: int
    execute_s: float  # seconds to run every cell on CPU

    @property
    def reading_min(self) -> float:
        return self.words / WORDS_PER_MINUTE

    @property
    def estimate_min(self) -> float:
        """Reading + exercises + panels + execution, in minutes."""
        return self.reading_min + EXERCISE_MIN * self.exercises + PANEL_MIN * self.panels + self.execute_s / 60


def counts(path: Path, execute_s: float = 0.0) -> LessonTime:
    """The static counts of one notebook (execution time as given)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    words = sum(len(WORD.findall("".join(c["source"]))) for c in cells if c["cell_type"] == "markdown")
    exercises = sum(bool(re.search(r"^my_\w+ = None", src, re.M)) for src in code)
    panels = sum(src.count("slider_panel(") for src in code)
    return LessonTime(path.name[:2], words, len(code), exercises, panels, execute_s)


def execute_seconds(path: Path) -> float:
    """Run a copy of the notebook top to bottom on CPU; seconds taken."""
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        shutil.copy(path, copy)
        nb = nbformat.read(copy, as_version=4)
        os.environ["ANATOMY_AUTORUN"] = "1"  # unattended: a prediction left at None stops nothing (exercises.py)
        start = time.perf_counter()
        ExecutePreprocessor(timeout=600, kernel_name="python3").preprocess(nb, {"metadata": {"path": str(NOTEBOOKS)}})
        return time.perf_counter() - start


def table(rows: list[LessonTime]) -> str:
    """The Markdown table docs/instructor_guide.md carries (tests/test_course.py parses it back)."""
    lines = [
        "| lesson | words | reading (min) | code cells | exercises | panels | execution (s) | estimate (min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.number} | {r.words:,} | {r.reading_min:.1f} | {r.code_cells} | {r.exercises} | {r.panels} "
            f"| {r.execute_s:.0f} | {r.estimate_min:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execute", action="store_true", help="execute each notebook once and time it")
    args = parser.parse_args()
    rows = []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        seconds = execute_seconds(path) if args.execute else 0.0
        rows.append(counts(path, seconds))
        print(f"{path.name}: {rows[-1].estimate_min:.0f} min", file=sys.stderr, flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
