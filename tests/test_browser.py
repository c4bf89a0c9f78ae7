"""The widgets in a real browser: every learner notebook with a slider panel runs in JupyterLab in headless Chromium,
shows no error, re-measures when each control of each panel moves (the data its figure draws changes, not only
an echo of the control's value), and fits a 1280 x 900 window (nothing of a panel cut off or shrunk).

The work is scripts/browser_check.py's. Debian's chromium (apt-get) and PyPI's playwright are installed when missing;
where neither can be had the test is skipped with the reason printed, never passed. Screenshots of each panel before
and after the move are kept in test-artifacts/browser/ (COURSE_ARTIFACTS overrides the folder).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .test_course import ROOT, load_script

pytestmark = pytest.mark.delivery  # slow: `-m "not delivery"` leaves these out while iterating

browser_check = load_script("browser_check")


def test_panels_rerun_in_jupyterlab_in_chromium(capsys):
    with capsys.disabled():
        chromium, why = browser_check.ensure_browser(log=lambda m: print(f"\n[browser test] {m}", flush=True))
    if chromium is None:
        pytest.skip(f"NOT TESTED IN A BROWSER: {why}")
    notebooks = browser_check.panel_notebooks()
    assert [p.name[:2] for p in notebooks][:5] == ["00", "01", "02", "03", "04"]
    wanted = os.environ.get("COURSE_BROWSER_NOTEBOOKS", "")  # e.g. "00,04" while iterating; CI runs them all
    if wanted:
        notebooks = [p for p in notebooks if p.name[:2] in wanted.split(",")]
        print(f"\n[browser test] only {[p.name for p in notebooks]} (COURSE_BROWSER_NOTEBOOKS={wanted})")
    shots = Path(os.environ.get("COURSE_ARTIFACTS", ROOT / "test-artifacts")) / "browser"
    start = time.monotonic()
    with capsys.disabled():
        results = browser_check.check(
            notebooks, chromium, shots, log=lambda m: print(f"[browser test] {m}", flush=True)
        )
        print(f"[browser test] {len(results)} notebooks in {time.monotonic() - start:.0f} s; screenshots in {shots}")
    for r in results:
        assert r.errors == [], (r.name, r.errors)
        assert r.problem == "", (r.name, r.problem)
        assert r.failures == [], (r.name, r.failures)
        assert r.cut_off == [], (r.name, r.cut_off)  # each names the panel and what does not fit 1280 x 900
        assert r.moves, (r.name, "no control moved")
        assert r.image_changed, (r.name, "the plot did not change")
