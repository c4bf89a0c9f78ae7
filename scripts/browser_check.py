"""The course's widgets in a real JupyterLab, in headless Chromium: what nbval cannot see.

    python scripts/browser_check.py [NN ...] [--artifacts DIR] [--all-cells]   # default: every notebook with a panel

For each learner notebook with a slider panel: open it in JupyterLab, run the cells its panels need (the setup cell,
the panel cells and the cells that bind a name they read, found by :func:`panel_cells`; --all-cells: every cell),
check that no cell shows an error and that each panel opens as slider_panel builds it: its controls and a one-line
hint, no figure and no digest (the plain call in the cell above drew that setting; the panel draws only when a
control moves). Then move every control of every panel from where the panel opened (a slider one notch, a dropdown
to its next choice; each control is put back before the next one moves) and check that the panel measured again:
after each run a panel writes a hidden digest of the data its figure draws and the numbers it computed
(widgets.figure_digest: lines, bars, areas, not text), and the digest must change. The digest at the opening
settings, which each move is compared with, comes from moving the first control one notch and back before the
moves are counted (the panel opens without one); the hint must be gone after that. Two settings may
legitimately draw the same (Adam and AdamW hold the same memory), so a control moves on up to TRIES notches before
it counts as ignored. A panel that echoes the value in its title or printout but draws the same data fails, naming
the panel and the control. A panel that reports the values it used (its figure's ``panel_used``, written into the
digest element) is checked against its controls after each run: a setting it silently changed fails. In a
1280 x 900 window (a laptop's), each panel is also checked for what would be cut off, before and after each move:
the panel within the window's width, its figure no wider than the output area (JupyterLab would shrink it), no
control label truncated, and controls with figure no taller than the notebook's visible height.
Screenshots of the first panel as it opens and after its first counted move, and of the page, go to --artifacts.
tests/test_browser.py runs the same in CI (`bash scripts/test.sh`), where nbval runs every cell of the same sources
(tests/test_course.py keeps learner/ in sync with notebooks/) and fails on any error: running the lessons' other
cells a second time, in the browser, would cost minutes and check nothing more.

Needs Chromium (Debian's `chromium`; google-chrome works too) and PyPI's `playwright`, which drives that browser
(playwright's own browser downloads are not used). `ensure_browser()` installs both when missing and it can (root or
passwordless sudo for apt-get). JupyterLab runs on a free loopback port with a token, on a copy of the notebooks
(learner/ stays untouched), with the course's Lab settings, and is stopped by its PID.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEARNER = ROOT / "learner"
BROWSERS = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
VIEWPORT = {"width": 1280, "height": 900}  # a laptop's browser window: nothing of a panel may be cut off in it


def find_chromium() -> str | None:
    for candidate in [os.environ.get("CHROMIUM", ""), "/usr/bin/chromium", *BROWSERS]:
        path = shutil.which(candidate) if candidate else None
        if path:
            return path
    return None


def _can_apt() -> list[str] | None:
    """The prefix that runs apt-get as root here ([] as root, ['sudo', '-n'] with passwordless sudo), or None."""
    if not shutil.which("apt-get"):
        return None
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return None


def ensure_browser(log=print) -> tuple[str | None, str]:
    """(Chromium's path, "") once Chromium and playwright are both here, installing what is missing; else
    (None, why not). What it installs it says first, with why; the installers' progress goes to this process's
    stdout as they run (`python scripts/course.py test` calls this before pytest, where nothing hides it)."""
    chromium = find_chromium()
    if chromium is None:
        prefix = _can_apt()
        if prefix is None:
            return None, "no Chromium, and apt-get cannot install it here (needs root or passwordless sudo)"
        log(f"no Chromium found (looked for $CHROMIUM, {', '.join(BROWSERS)}): the browser test needs one. Installing "
            "Debian's chromium and the system libraries it needs (about 25 packages, some minutes) with "
            f"`{' '.join([*prefix, 'apt-get', 'install', 'chromium'])}`, once per machine. CHROMIUM=/path/to/chrome "
            "uses another browser instead.")  # fmt: skip
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                                                  "chromium"]):  # fmt: skip
            sys.stdout.flush()
            done = subprocess.run([*prefix, *cmd], stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)
            if done.returncode:
                return None, f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-300:]}"
        chromium = find_chromium()
        if chromium is None:
            return None, "apt-get installed chromium, but no chromium executable is on PATH"
        log(f"installed {chromium}")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        log("installing playwright from PyPI (about 40 MB; it drives the system Chromium, no browser download)")
        sys.stdout.flush()
        done = subprocess.run([sys.executable, "-m", "pip", "install", "playwright"], stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
        if done.returncode:
            return None, f"pip install playwright failed: {done.stderr.strip()[-300:]}"
    return chromium, ""


def panel_notebooks(folder: Path = LEARNER) -> list[Path]:
    """The notebooks in ``folder`` with a slider panel."""
    found = []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        if any("slider_panel(" in "".join(c["source"]) for c in cells if c["cell_type"] == "code"):
            found.append(path)
    return found


def _binds_and_reads(source: str) -> tuple[set[str], set[str]] | None:
    """(names a cell binds: assigned, imported, defined, or with an attribute or item set; names it reads), or None
    where the cell is not plain Python (a magic, a shell line)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    binds, reads = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (reads if isinstance(node.ctx, ast.Load) else binds).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            binds.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(node.name)
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Load):
            while isinstance(node, (ast.Attribute, ast.Subscript)):
                node = node.value
            if isinstance(node, ast.Name):  # `x.a = ...` changes x
                binds.add(node.id)
    return binds, reads


def panel_cells(cells: list[dict]) -> list[int]:
    """Indices of the code cells a notebook's panels need: its first code cell (the setup), each cell that opens a
    panel, and, going back from them, each cell that binds a name a needed cell reads; every code cell where one
    is not plain Python."""
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    keep, wanted = [], set()
    for i in reversed(code):
        source = "".join(cells[i]["source"])
        names = _binds_and_reads(source)
        if names is None:
            return code
        binds, reads = names
        if i == code[0] or "slider_panel(" in source or binds & wanted:
            keep.append(i)
            wanted = (wanted - binds) | reads
    return keep[::-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def jupyterlab(root_dir: Path, work: Path):
    """A JupyterLab server for ``root_dir``: yields (base URL, token). Stopped by its PID on exit."""
    port, token = free_port(), secrets.token_hex(16)
    settings = work / "app-settings"
    settings.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "jupyter" / "lab-overrides.json", settings / "overrides.json")  # the course's settings
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(work / "user-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(work / "workspaces"), PYDEVD_DISABLE_FILE_VALIDATION="1",
               OMP_NUM_THREADS=os.environ.get("COURSE_KERNEL_THREADS", "1"),
               ANATOMY_AUTORUN="1")  # fmt: skip  # unattended: a prediction left at None stops nothing (exercises.py)
    # One thread per kernel: in the suite this runs beside another pytest worker on two cores, and memory numbers
    # do not depend on threads.
    env.pop("MPLBACKEND", None)  # the inline backend, as a learner has it
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}", "--allow-root",
           f"--LabApp.app_settings_dir={settings}", "--LabApp.expose_app_in_browser=True"]  # fmt: skip
    log = open(work / "jupyterlab.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start; see {work / 'jupyterlab.log'}") from None
                time.sleep(0.25)
        yield base, token
    finally:
        proc.terminate()  # by PID: SIGTERM, the server shuts its kernels down
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def stop_kernels(base: str, token: str) -> None:
    """End every session of the server and shut down every kernel (REST API: no dialog to answer)."""
    headers = {"Authorization": f"token {token}"}
    for what in ("sessions", "kernels"):  # a session's end stops its kernel; then any kernel left without one
        found = json.load(urllib.request.urlopen(urllib.request.Request(f"{base}/api/{what}", headers=headers)))
        for k in found:
            req = urllib.request.Request(f"{base}/api/{what}/{k['id']}", method="DELETE", headers=headers)
            urllib.request.urlopen(req, timeout=30)


@dataclass
class NotebookResult:
    name: str
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # error outputs, "cell N: Ename: message"
    stderr: list[str] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)  # "panel P, control C (label a -> b)", each that re-measured
    failures: list[str] = field(default_factory=list)  # each control whose move did not change the measurement
    # or whose panel reported using another value than the control shows
    used_checked: int = 0  # (setting the panel reported, control) pairs that agreed
    unreported: list[str] = field(default_factory=list)  # panels that report none of the values they used
    cut_off: list[str] = field(default_factory=list)  # "panel P: what does not fit the window", each once
    sizes: list[str] = field(default_factory=list)  # each panel's measured layout (px), for the log
    text_before: str = ""
    text_after: str = ""
    image_changed: bool = False
    numbers_changed: bool = False
    problem: str = ""  # what went wrong driving the page, if anything

    @property
    def ok(self) -> bool:
        return (
            not (self.errors or self.problem or self.failures or self.cut_off)
            and bool(self.moves)
            and self.image_changed
        )


# JavaScript run in the page, against JupyterLab's exposed application object.
JS_CURRENT = """(name) => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  return !!(w && w.content && w.context && w.context.path === name && w.sessionContext && w.sessionContext.session
            && w.sessionContext.session.kernel && w.sessionContext.session.kernel.status === 'idle'); }"""
JS_OPEN = "(name) => window.jupyterapp.commands.execute('docmanager:open', {path: name})"
# Close every open document without the "save your changes?" dialog (the copies' changes are not wanted).
JS_CLOSE_ALL = """() => { for (const w of Array.from(window.jupyterapp.shell.widgets('main'))) {
  if (w.context && w.context.model) w.context.model.dirty = false;
  w.dispose(); } }"""
JS_DONE = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const cells = w.content.widgets.filter(c => c.model.type === 'code');
  const status = w.sessionContext.session.kernel.status;
  return status === 'idle' && cells.every(c => c.model.executionCount !== null);
}"""
JS_OUTPUTS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const found = [];
  w.content.widgets.forEach((c, i) => {
    if (c.model.type !== 'code') return;
    for (const o of c.model.outputs.toJSON()) {
      if (o.output_type === 'error') found.push(['error', i, o.ename + ': ' + o.evalue]);
      if (o.output_type === 'stream' && o.name === 'stderr') found.push(['stderr', i, [].concat(o.text).join('')]);
    }
  });
  return found;
}"""
JS_PANEL_STATE = """(panel) => {
  const out = panel.querySelector('.widget-output');
  const img = out && out.querySelector('img');
  const mark = out && out.querySelector('.anatomy-panel-digest');  // widgets.DIGEST_CLASS
  const hint = panel.querySelector('.anatomy-panel-hint');  // widgets.HINT_CLASS: shown until a control moves
  return {text: out ? out.innerText : '', image: img ? img.getAttribute('src') : '',
          digest: mark ? mark.dataset.digest : '', panel: mark ? mark.dataset.panel : '',
          used: mark && mark.dataset.used ? JSON.parse(mark.dataset.used) : {},  // widgets.digest_html
          hint: !!hint && hint.getBoundingClientRect().height > 0 ? hint.innerText.trim() : ''};  // shown or ''
}"""

JS_FIT = """(panel) => {
  const vw = window.innerWidth, px = (v) => Math.round(v);
  const found = [];
  const box = panel.getBoundingClientRect();
  if (box.left < -0.5 || box.right > vw + 0.5)
    found.push(`the panel spans x ${px(box.left)}..${px(box.right)} px, past the ${vw} px window`);
  const out = panel.querySelector('.widget-output');
  const room = out ? out.clientWidth : 0;
  let figure = '';
  for (const img of panel.querySelectorAll('.widget-output img')) {
    figure = `${img.naturalWidth}x${img.naturalHeight}`;
    if (img.naturalWidth > room)
      found.push(`the figure is ${img.naturalWidth} px wide in a ${room} px output area (shown shrunk)`);
  }
  for (const c of panel.querySelectorAll('.widget-slider, .widget-hslider, .widget-dropdown')) {
    const r = c.getBoundingClientRect();
    const label = c.querySelector('.widget-label');
    const name = label ? label.textContent.trim() : '?';
    if (r.right > vw + 0.5) found.push(`control "${name}" ends at x ${px(r.right)} px, past the ${vw} px window`);
    for (const t of c.querySelectorAll('.widget-label, .widget-readout'))
      if (t.scrollWidth > t.clientWidth + 1)
        found.push(`the text "${t.textContent.trim()}" of control "${name}" is cut ` +
                   `(${t.scrollWidth} px in ${t.clientWidth} px)`);
  }
  // what a learner sees at once: the notebook's scrolling area
  const scroller = panel.closest('.jp-WindowedPanel-outer') || panel.closest('.jp-Notebook');
  const visible = scroller ? scroller.clientHeight : window.innerHeight;
  const controls = [...panel.children].filter(c => !c.classList.contains('widget-output')
                                               && c.getBoundingClientRect().height > 0);  // not a hidden status line
  const top = Math.min(...controls.map(c => c.getBoundingClientRect().top), box.bottom);
  const img = out && out.querySelector('img');
  const bottom = img ? img.getBoundingClientRect().bottom : box.bottom;
  if (bottom - top > visible + 0.5)
    found.push(`controls to figure's bottom are ${px(bottom - top)} px high; the notebook shows ${visible} px`);
  return {found, sizes: `panel ${px(box.width)}x${px(box.height)}, figure ${figure || 'none'} in ${room} px, ` +
                        `controls to figure ${px(bottom - top)} of ${visible} px visible`};
}"""


def check_fit(page, panel, name: str, result: NotebookResult) -> None:
    """Record what of ``panel`` does not fit the window (each problem once) and its measured layout."""
    fit = page.evaluate(JS_FIT, panel.element_handle())
    for what in fit["found"]:
        if f"panel {name}: {what}" not in result.cut_off:
            result.cut_off.append(f"panel {name}: {what}")
    result.sizes.append(f"{name}: {fit['sizes']}")


def same_value(used: str, shown: str) -> bool:
    """Whether a value a panel reported using (its text) is what a control shows: a dropdown's option, or a
    slider's position (noUiSlider writes aria-valuenow as 1024.00)."""
    try:
        return float(used) == float(shown)
    except (TypeError, ValueError):
        return used == shown


def check_used(panel, controls, state: dict, name: str, result: NotebookResult, after: str) -> None:
    """Compare each value the panel reported using (``state["used"]``: {control label: value}, widgets.digest_html)
    with what that control shows; a mismatch (a setting silently changed: a sequence clamped, a choice ignored) is
    a failure naming the panel, the control and both values."""
    shown = {}
    for j in range(controls.count()):
        c = controls.nth(j)
        shown[c.locator(".widget-label").first.inner_text().strip()] = value_of(c)
    if not state.get("used"):
        if name not in result.unreported:
            result.unreported.append(name)
        return
    for label, value in state["used"].items():
        if label not in shown:
            continue
        if same_value(value, shown[label]):
            result.used_checked += 1
        else:
            result.failures.append(
                f"panel {name}, after {after}: it used {label} = {value} where the control shows {shown[label]}"
            )


def drive(
    page, base: str, token: str, name: str, shots: Path, run_timeout_s: float = 180, cells=None
) -> NotebookResult:
    """Open ``name`` (loading JupyterLab into ``page`` first, or beside it once loaded), run all its cells, check
    outputs, then move every control of every panel once. ``cells``: the index in the learner notebook of each cell
    of ``name`` (a copy holding only some of them), for the messages."""
    result = NotebookResult(name)
    start = time.monotonic()
    if page.url.startswith(base):  # JupyterLab is loaded already (an earlier notebook): open this one beside it
        page.evaluate(JS_OPEN, name)
    else:  # a workspace of its own, reset: only this notebook open, nothing restored from an earlier run
        page.goto(f"{base}/lab/workspaces/course-check/tree/{name}?reset&token={token}")
    page.wait_for_function(JS_CURRENT, arg=name, timeout=60_000, polling=200)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # every execution count starts empty (learner copies), so "all counted and the kernel idle" means all ran
    page.wait_for_function(JS_DONE, timeout=run_timeout_s * 1000, polling=200)
    result.seconds = time.monotonic() - start
    for kind, cell, text in page.evaluate(JS_OUTPUTS):
        cell = cells[cell] if cells else cell
        (result.errors if kind == "error" else result.stderr).append(f"cell {cell}: {text.strip()[:300]}")
    panels = page.locator(".widget-interact")
    if not panels.count():
        result.problem = "no slider panel on the page"
        return result
    for i in range(panels.count()):
        panel = panels.nth(i)
        panel.scroll_into_view_if_needed(timeout=30_000)
        try:  # the panel opens with its controls and a hint, and draws nothing until a control moves
            page.wait_for_function(f"(p) => ({JS_PANEL_STATE})(p).hint !== ''", arg=panel.element_handle(),
                                   timeout=120_000)  # fmt: skip
        except Exception:
            result.problem = f"panel {i + 1} never showed its opening hint (no panel drawn within 120 s)"
            return result
        opening = page.evaluate(JS_PANEL_STATE, panel.element_handle())
        if opening["digest"] or opening["image"]:
            result.failures.append(f"panel {i + 1} opened with a figure of its own: a second copy of the plain "
                                   "call's above (a panel draws only when a control moves)")  # fmt: skip
        check_fit(page, panel, str(i + 1), result)
        controls = panel.locator(".widget-slider, .widget-hslider, .widget-dropdown")
        opened = [value_of(controls.nth(j)) for j in range(controls.count())]
        if i == 0:
            panel.screenshot(path=str(shots / f"{Path(name).stem}_before.png"))  # as it opens: controls and hint

        # What the panel draws at its opening settings, for the moves to be compared with: it drew nothing there,
        # so the first control moves one notch (any run counts: there is no digest yet) and back, and the run back
        # gives it. (The plain call above drew the same settings, but as a picture in the page, not a digest.)
        def on_prime(st, what, panel=panel, controls=controls, i=i):
            check_used(panel, controls, st, st["panel"] or str(i + 1), result, f"moving {what}")

        primed, moved_state, why = move(page, panel, controls.nth(0), opening, on_run=on_prime)
        state = put_back(page, panel, controls.nth(0), opened[0], moved_state) if not why else moved_state
        if why or not state["digest"]:
            result.failures.append(f"panel {i + 1}: moving {primed} and back: {why or 'it drew nothing'}")
            continue
        if state["hint"]:
            result.failures.append(f"panel {state['panel'] or i + 1}: its opening hint still shows after a move")
        check_used(panel, controls, state, state["panel"] or str(i + 1), result, "moving back to the opening")
        for j in range(controls.count()):
            first_move = not result.moves
            if j:  # each control moves from where the panel opened: a setting may matter only in some states
                state = put_back(page, panel, controls.nth(j - 1), opened[j - 1], state)

            def on_run(st, what, panel=panel, controls=controls, name=state["panel"] or str(i + 1)):
                check_used(panel, controls, st, name, result, f"moving {what}")

            moved, state_after, why = move(page, panel, controls.nth(j), state, on_run=on_run)
            where = f"panel {state['panel'] or i + 1}, control {moved or j + 1}"
            if why:
                result.failures.append(f"{where}: {why}")
                continue
            result.moves.append(where + f" ({moved})")
            check_fit(page, panel, state_after["panel"] or str(i + 1), result)
            if first_move:
                page.wait_for_timeout(500)  # let the figure finish replacing
                panel.screenshot(path=str(shots / f"{Path(name).stem}_after.png"))
                result.text_before, result.text_after = state["text"], state_after["text"]
                result.image_changed = state_after["image"] not in ("", state["image"])
                result.numbers_changed = NUMBER.findall(state["text"]) != NUMBER.findall(state_after["text"])
            state = state_after
    page.screenshot(path=str(shots / f"{Path(name).stem}_page.png"))
    if page.get_by_text("official Jupyter news").count():
        result.problem = "JupyterLab's news pop-up is showing (the course's Lab settings were not applied)"
    return result


JS_MARK = "(p) => p.querySelectorAll('.anatomy-panel-digest').forEach(e => { e.dataset.seen = '1'; })"
JS_RAN_AGAIN = f"""(p) => {{ const s = ({JS_PANEL_STATE})(p);
  return !!p.querySelector('.anatomy-panel-digest:not([data-seen])') && s.digest !== '' && s.image !== ''; }}"""
TRIES = 3  # notches a control may move before the check calls it ignored: two choices can draw the same data


def value_of(control) -> str:
    """A dropdown's chosen value, or a slider's position (aria-valuenow)."""
    if control.locator("select").count():
        return control.locator("select").first.input_value()
    return control.locator(".noUi-handle, .ui-slider-handle").first.get_attribute("aria-valuenow")


#: How long a panel may take to run again after a control moves (seconds). A new setting of lesson 09's panel is a
#: new dry run of a 1B model: 9-56 s on two cores at a load of 5-6, and CI must pass on a loaded machine (90 s timed
#: out there 2 runs in 4).
RUN_WAIT_S = 300


def put_back(page, panel, control, value: str, state: dict, timeout_s: float = RUN_WAIT_S) -> dict:
    """Set ``control`` back to ``value`` (where the panel opened) and wait for the panel's run; its state after."""
    for _ in range(TRIES):
        now = value_of(control)
        if now == value:
            return state
        page.evaluate(JS_MARK, panel.element_handle())
        if control.locator("select").count():
            control.locator("select").first.select_option(value=value)
        else:
            control.locator(".noUi-handle, .ui-slider-handle").first.focus()
            page.keyboard.press("ArrowLeft" if float(now) > float(value) else "ArrowRight")
        page.wait_for_function(JS_RAN_AGAIN, arg=panel.element_handle(), timeout=timeout_s * 1000)
        state = page.evaluate(JS_PANEL_STATE, panel.element_handle())
    return state


def move(page, panel, control, before: dict, timeout_s: float = RUN_WAIT_S, on_run=None) -> tuple[str, dict, str]:
    """Move ``control`` one notch (a slider up, or down at its top; a dropdown to its next choice), wait until the
    panel has run again (a fresh digest element with its figure), and check that what it draws changed. Two
    settings can legitimately draw the same (Adam and AdamW hold the same memory): then the control moves on, up to
    :data:`TRIES` notches, before it counts as ignored. ``on_run(state, what)`` is called after every run (each
    notch, not only the last: a setting silently clamped draws the same as the one before, and the next notch
    would hide it). Returns (what moved, the panel's state after, "" or why it failed)."""
    label = control.locator(".widget-label").first.inner_text().strip()
    select = control.locator("select").first if control.locator("select").count() else None
    if select is not None:  # the options' values, as input_value() reads them (their text has non-breaking spaces)
        options = select.locator("option").evaluate_all("os => os.map(o => o.value)")
        if len(options) < 2:
            return label, before, ""  # nothing to choose
        values, tries = [select.input_value()], min(TRIES, len(options) - 1)
    else:  # a slider: steps with the keyboard, committed at once (continuous_update=False)
        handle = control.locator(".noUi-handle, .ui-slider-handle").first
        readout = control.locator(".widget-readout").first
        values, tries = [readout.inner_text().strip()], TRIES
        at_top = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
        key = "ArrowLeft" if at_top else "ArrowRight"
    state = before
    for _ in range(tries):
        page.evaluate(JS_MARK, panel.element_handle())
        if select is not None:
            now = select.input_value()
            select.select_option(index=(options.index(now) + 1) % len(options) if now in options else 1)
            values.append(select.input_value())
        else:
            handle.focus()
            page.keyboard.press(key)
            page.wait_for_timeout(200)
            values.append(readout.inner_text().strip())
        what = f"{label} {' -> '.join(values)}"
        if values[-1] == values[-2]:
            break  # a slider at its end
        try:
            page.wait_for_function(JS_RAN_AGAIN, arg=panel.element_handle(), timeout=timeout_s * 1000)
        except Exception:
            return what, before, f"moving {what}: the panel did not run again (no new figure) within {timeout_s:.0f} s"
        state = page.evaluate(JS_PANEL_STATE, panel.element_handle())
        if on_run is not None:
            on_run(state, what)
        if state["digest"] != before["digest"]:
            return what, state, ""
    return what, state, f"moving {what} did not change what the panel draws (the same data each time)"


class Browser:
    """One JupyterLab (on copies of ``notebooks``) and one headless Chromium, opened once for several notebooks:
    :meth:`check` drives one notebook at a time in one page (JupyterLab's application loads once; each notebook is
    closed and its kernel stopped before the next opens; a page where a check failed is replaced). The browser test
    opens one per pytest worker, each checking its share of the notebooks; ``with Browser(...) as b:`` starts both
    and stops both."""

    def __init__(self, notebooks: list[Path], chromium: str, shots: Path, log=print, all_cells: bool = False):
        self.notebooks, self.chromium, self.shots, self.log = list(notebooks), chromium, shots, log
        self.all_cells, self.kept = all_cells, {}  # kept: notebook name -> the learner cells its copy holds
        self.page = None  # the page every notebook opens in, in turn

    def __enter__(self) -> Browser:
        from playwright.sync_api import sync_playwright

        self.shots.mkdir(parents=True, exist_ok=True)
        self._stack = ExitStack()
        try:
            work = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="course-browser-")))
            root_dir = work / "notebooks"
            root_dir.mkdir()
            for nb in self.notebooks:
                notebook = json.loads(nb.read_text(encoding="utf-8"))
                if not self.all_cells:  # the cells the panels need (see panel_cells); nbval runs every cell
                    self.kept[nb.name] = panel_cells(notebook["cells"])
                    notebook["cells"] = [notebook["cells"][i] for i in self.kept[nb.name]]
                (root_dir / nb.name).write_text(json.dumps(notebook, indent=1), encoding="utf-8")
            self.base, self.token = self._stack.enter_context(jupyterlab(root_dir, work))
            p = self._stack.enter_context(sync_playwright())
            self.browser = p.chromium.launch(executable_path=self.chromium, headless=True, args=[
                "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                "--disable-component-update"])  # fmt: skip
            self._stack.callback(self.browser.close)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def check(self, nb: Path) -> NotebookResult:
        """Run :func:`drive` on ``nb`` (one of this session's notebooks) in this session's page; log PASS/FAIL and
        why."""
        for old in self.shots.glob(f"{nb.stem}_*.png"):  # this notebook's screenshots from an earlier run
            old.unlink()
        if self.page is None:  # one page for all: loading JupyterLab's application again costs seconds of CPU
            self.page = self.browser.new_page(viewport=VIEWPORT)
        page = self.page
        try:
            result = drive(page, self.base, self.token, nb.name, self.shots, cells=self.kept.get(nb.name))
        except Exception as e:  # report, don't hide: which step failed is in the message
            result = NotebookResult(nb.name, problem=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            page.screenshot(path=str(self.shots / f"{nb.stem}_failed.png"))
            self.page = None  # the next notebook starts from a fresh page
            page.close()
        else:
            page.evaluate(JS_CLOSE_ALL)  # before its kernel stops: no "kernel died" dialog over the next notebook
        finally:
            stop_kernels(self.base, self.token)  # free the CPU for the next notebook
        cells = f"{len(self.kept[nb.name])} cells the panels need" if nb.name in self.kept else "all cells"
        self.log(f"{'PASS' if result.ok else 'FAIL'} {nb.name} ({cells} in {result.seconds:.0f} s): "
                 f"{len(result.moves)} controls re-measured; plot changed: {result.image_changed}"
                 + f"; {result.used_checked} reported settings agreed with their controls"
                 + (f" (panels reporting none: {result.unreported})" if result.unreported else "")
                 + (f"; FAILED: {result.failures}" if result.failures else "")
                 + (f"; CUT OFF in {VIEWPORT['width']}x{VIEWPORT['height']}: {result.cut_off}" if result.cut_off
                    else f"; nothing cut off in {VIEWPORT['width']}x{VIEWPORT['height']}")
                 + "".join(f"\n    {s}" for s in dict.fromkeys(result.sizes))
                 + (f"; errors: {result.errors}" if result.errors else "")
                 + (f"; {result.problem}" if result.problem else ""))  # fmt: skip
        return result


def check(notebooks: list[Path], chromium: str, shots: Path, log=print, all_cells=False) -> list[NotebookResult]:
    """Run :func:`drive` on each notebook (copies of them), in one JupyterLab and one headless Chromium."""
    shutil.rmtree(shots, ignore_errors=True)
    with Browser(notebooks, chromium, shots, log, all_cells) as browser:
        return [browser.check(nb) for nb in notebooks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="number or name prefixes (default: every notebook with a panel)")
    parser.add_argument("--artifacts", type=Path, default=ROOT / "test-artifacts" / "browser")
    parser.add_argument("--all-cells", action="store_true", help="run every cell, not only those the panels need")
    args = parser.parse_args()
    chromium, why = ensure_browser()
    if chromium is None:
        print(f"cannot run: {why}")
        return 2
    chosen = [p for p in panel_notebooks() if not args.notebooks or any(p.name.startswith(a) for a in args.notebooks)]
    start = time.monotonic()
    results = check(chosen, chromium, args.artifacts, all_cells=args.all_cells)
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed} passed, {failed} failed in {time.monotonic() - start:.0f} s; "
          f"screenshots in {args.artifacts}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
