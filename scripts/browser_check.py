"""Open the tour notebook in a real JupyterLab in headless Chromium, run it, and move a slider.

    python scripts/browser_check.py [--chromium /usr/bin/chromium] [--screenshot lab.png]

Checks what nbval cannot: that the widgets render in JupyterLab and re-measure when a slider moves.
Needs Chromium and `pip install playwright` (no browser download: it drives the system Chromium).
Works on a copy of notebooks/, so the committed outputs are untouched. Prints PASS/FAIL lines.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(root_dir: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           "--IdentityProvider.token=", "--allow-root", f"--ServerApp.root_dir={root_dir}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=1)
            return proc
        except OSError:
            time.sleep(0.25)
    proc.terminate()
    raise SystemExit("FAIL JupyterLab did not start")


def drive(page, port: int, results: list) -> None:
    """Open the tour, run all cells, wait for the slider panel, move the batch-size slider."""
    page.goto(f"http://127.0.0.1:{port}/lab/tree/00_tour.ipynb")
    page.wait_for_selector(".jp-Notebook", timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    page.locator(".jp-Notebook").click()
    page.keyboard.press("Escape")
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_text("Run All Cells", exact=True).click()
    panel = page.locator(".widget-interact").first
    panel.locator(".widget-slider").first.wait_for(timeout=240_000)
    results.append(("slider panel renders", True))
    panel.locator("img").first.wait_for(timeout=120_000)
    results.append(("panel shows the measured plot", True))
    before = panel.inner_text()
    panel.locator(".ui-slider-handle, .noUi-handle").first.focus()
    page.keyboard.press("ArrowRight")  # batch size 8 -> 9
    page.wait_for_function(
        "el => el.innerText.includes('batch 9 x seq 128')", arg=panel.element_handle(), timeout=120_000
    )
    results.append(("moving the slider re-measures (batch 9)", "batch 8 x seq 128" in before))
    panel.locator("img").first.wait_for(timeout=120_000)
    results.append(("the re-measured plot is shown", True))
    panel.locator("img").first.scroll_into_view_if_needed()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--screenshot", default="browser_check.png")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="anatomy-lab-"))
    shutil.copy(ROOT / "notebooks" / "00_tour.ipynb", work / "00_tour.ipynb")
    port = free_port()
    lab = start_lab(work, port)
    results = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=args.chromium,
                headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                drive(page, port, results)
            except Exception as e:  # report, don't hide: the failing step is the one after the last PASS
                results.append((f"browser run ({type(e).__name__}: {str(e).splitlines()[0][:200]})", False))
            page.screenshot(path=args.screenshot)
            browser.close()
    finally:
        lab.terminate()
        lab.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    for name, ok in results:
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    failed = sum(not ok for _, ok in results)
    print(f"{len(results) - failed} passed, {failed} failed; screenshot: {args.screenshot}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
