"""Execute the course notebooks top to bottom on CPU and save their outputs in place.

    python scripts/run_notebooks.py                 # every notebooks/NN_*.ipynb
    python scripts/run_notebooks.py 00_tour 01      # only these (name or number prefix)

Run it after changing a notebook or helper code that changes a number, then read
`git diff notebooks/` before committing: nbval compares these stored outputs in CI.
CUDA is hidden so the stored outputs are the CPU ones whatever machine you are on.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def selected(args: list[str]) -> list[Path]:
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not args:
        return paths
    chosen = [p for p in paths if any(p.stem.startswith(a) for a in args)]
    if not chosen:
        sys.exit(f"no notebook matches {args}; have {[p.stem for p in paths]}")
    return chosen


def execute(path: Path, timeout_s: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    ExecutePreprocessor(timeout=timeout_s, kernel_name="python3").preprocess(nb, {"metadata": {"path": str(NOTEBOOKS)}})
    elapsed = time.perf_counter() - start
    for cell in nb.cells:  # keep diffs small: no per-run cell metadata
        cell.get("metadata", {}).pop("execution", None)
    nb.metadata.pop("widgets", None)  # widget state is per-run noise; the views are rebuilt on run
    nbformat.write(nb, path)
    return elapsed


if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # stored outputs are CPU outputs (the kernel inherits this)
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    os.environ["ANATOMY_AUTORUN"] = "1"  # unattended: a prediction left at None stops nothing (exercises.py)
    for p in selected(sys.argv[1:]):
        print(f"{p.name}: executed in {execute(p):.1f} s", flush=True)
