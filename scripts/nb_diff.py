"""Show what changed in a notebook as plain text: cell sources and text outputs, against a git revision.

    python scripts/nb_diff.py notebooks/01_forward.ipynb          # working tree vs HEAD
    python scripts/nb_diff.py notebooks/01_forward.ipynb HEAD~3   # ... vs another revision

Images and widget views are summarised by their type; execution counts and metadata are ignored, so what is
left is what a reviewer (and nbval) cares about. Exits 1 when something changed.
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path


def cell_lines(nb: dict) -> list[str]:
    """The notebook as text: each cell's source, then its outputs (text as is, other data by type)."""
    lines: list[str] = []
    for i, cell in enumerate(nb["cells"]):
        lines.append(f"=== cell {i} ({cell['cell_type']})")
        lines += "".join(cell["source"]).splitlines()
        for out in cell.get("outputs", []):
            if "text" in out:
                lines += [f">>> {line}" for line in "".join(out["text"]).splitlines()]
            for mime, data in out.get("data", {}).items():
                if mime == "text/plain":
                    lines += [f">>> {line}" for line in "".join(data).splitlines()]
                else:
                    lines.append(f">>> [{mime}]")
    return lines


def main() -> int:
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    path, rev = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) == 3 else "HEAD"
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    rel = path.resolve().relative_to(Path(top.stdout.strip()))
    old = json.loads(subprocess.run(["git", "show", f"{rev}:{rel}"], capture_output=True, text=True, check=True).stdout)
    new = json.loads(path.read_text())
    diff = list(difflib.unified_diff(cell_lines(old), cell_lines(new), f"{rel}@{rev}", f"{rel}", lineterm=""))
    print("\n".join(diff) if diff else "no change")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
