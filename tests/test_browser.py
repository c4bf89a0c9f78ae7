"""The widgets in a real browser: every learner notebook with a slider panel runs in JupyterLab in headless Chromium
(the cells its panels need: browser_check.panel_cells; nbval runs every cell of the same sources), shows no error,
opens each panel with its controls and hint and no figure of its own (the plain call above drew it), then
re-measures when each control of each panel moves (the data its figure draws changes, not only
an echo of the control's value), and fits a 1280 x 900 window (nothing of a panel cut off or shrunk).

The work is scripts/browser_check.py's. Debian's chromium (apt-get) and PyPI's playwright are installed when missing;
where neither can be had the tests are skipped with the reason printed, never passed. Screenshots of each
notebook's first panel as it opens and after its first move are kept in test-artifacts/browser/ (COURSE_ARTIFACTS
overrides the folder).

One test per notebook, each a scheduling scope of its own under `--dist loadfile` (tests/conftest.py), so the two
workers share the notebooks between them; each worker opens one JupyterLab and one Chromium for all of its share
(the session fixture below), not one per notebook.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .test_course import ROOT, load_script

pytestmark = pytest.mark.delivery  # slow: `-m "not delivery"` leaves these out while iterating

browser_check = load_script("browser_check")
NOTEBOOKS = browser_check.panel_notebooks()
WANTED = os.environ.get("COURSE_BROWSER_NOTEBOOKS", "")  # e.g. "00,04" while iterating (or -k 04); CI runs them all
# The later lessons first: they take longest in the browser (at a load of 6: 06 132 s, 08 111 s, 04 73 s, 05 69 s,
# 00 52 s, 01-03 40-46 s), and the longest first finishes the two workers closest together.
CHOSEN = [p for p in reversed(NOTEBOOKS) if not WANTED or p.name[:2] in WANTED.split(",")]


def test_the_panel_notebooks_are_found():
    assert [p.name[:2] for p in NOTEBOOKS][:5] == ["00", "01", "02", "03", "04"]


@pytest.fixture(scope="session")
def browser():
    """One JupyterLab on copies of the panel notebooks and one headless Chromium, for this worker's tests."""
    chromium, why = browser_check.ensure_browser(log=lambda m: print(f"\n[browser test] {m}", flush=True))
    if chromium is None:
        pytest.skip(f"NOT TESTED IN A BROWSER: {why}")
    shots = Path(os.environ.get("COURSE_ARTIFACTS", ROOT / "test-artifacts")) / "browser"
    with browser_check.Browser(CHOSEN, chromium, shots, log=lambda m: print(f"[browser test] {m}")) as b:
        yield b


@pytest.mark.parametrize("notebook", CHOSEN, ids=[p.stem for p in CHOSEN])
def test_panels_rerun_in_jupyterlab_in_chromium(browser, notebook):
    start = time.monotonic()
    r = browser.check(notebook)
    print(f"[browser test] {r.name} in {time.monotonic() - start:.0f} s; screenshots in {browser.shots}")
    assert r.errors == [], (r.name, r.errors)
    assert r.problem == "", (r.name, r.problem)
    assert r.failures == [], (r.name, r.failures)
    assert r.cut_off == [], (r.name, r.cut_off)  # each names the panel and what does not fit 1280 x 900
    assert r.moves, (r.name, "no control moved")
    assert r.image_changed, (r.name, "the plot did not change")


def test_a_reported_setting_is_compared_with_the_control_as_it_shows_it():
    assert browser_check.same_value("1024", "1024.00")  # noUiSlider's aria-valuenow
    assert browser_check.same_value("llama-3.2-1b", "llama-3.2-1b") and not browser_check.same_value("1024", "2048")
    assert not browser_check.same_value("LoRA r=8", "LoRA\xa0r=8")  # an option's text, not its value
