"""Execute notebooks headlessly, inside whatever environment runs this file (the delivery tests run it with a fresh
environment's Python): nbclient and nbformat only, no import from the course.

    python tests/execute.py OUT_DIR NOTEBOOK...    # run from the folder the notebooks should see as their own

Writes each executed notebook to OUT_DIR and prints one JSON line per notebook: its name, the seconds it took, and
every error or stderr output (cell index, text). Exits 1 if any cell raised.

It does not stand in for the Output widget, which is what made Colab's stack (ipywidgets 7.7.1) hang headless runs
of the panel cells. nbclient normally mimics a frontend's Output widget: it sends each output the widget captures
back to the kernel as a comm message on the shell channel, while it awaits the cell's execute_reply on that same
socket. jupyter_client's Session.send writes through a blocking *shadow* of the asyncio socket, so pyzmq's asyncio
layer does not look at the socket again after the send; libzmq, though, handles the socket's pending commands during
the send, including "a message has arrived" for an execute_reply that landed just before, and so clears the edge-
triggered file descriptor the asyncio poll waits on. The reply then sits in the socket (its EVENTS say POLLIN) and
the poll never wakes: nbclient waits out its whole timeout (nbconvert without one hangs). With ipywidgets 7,
`interactive` runs its function when it is displayed, at the very end of the cell, so these sends land right as the
kernel replies (4 of 14 `nbconvert --execute` runs of the tour stalled here); ipywidgets 8 runs it at construction,
earlier in the cell, which is why the project's own environment rarely meets it. Without the stand-in nothing is
sent during a cell (captured outputs land in the cell's own outputs, which these tests do not compare).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

CELL_TIMEOUT_S = int(os.environ.get("COURSE_CELL_TIMEOUT_S", "300"))


class HeadlessClient(NotebookClient):
    def on_comm_open_jupyter_widget(self, msg):  # no Output-widget stand-in: see the module docstring
        return None


def run(path: Path, out_dir: Path, kernel: str) -> dict:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    client = HeadlessClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name=kernel, allow_errors=True, resources={"metadata": {"path": os.getcwd()}}
    )
    client.execute()
    seconds = time.perf_counter() - start
    nbformat.write(nb, out_dir / path.name)
    problems = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                problems.append({"cell": i, "error": f"{out.ename}: {out.evalue}"[:500]})
            elif out.output_type == "stream" and out.name == "stderr":
                problems.append({"cell": i, "stderr": out.text[:500]})
    return {"notebook": path.name, "seconds": round(seconds, 1), "problems": problems}


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    kernel = os.environ.get("COURSE_KERNEL", "python3")
    failed = False
    for arg in sys.argv[2:]:
        result = run(Path(arg), out_dir, kernel)
        print(json.dumps(result), flush=True)
        failed |= any("error" in p for p in result["problems"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
