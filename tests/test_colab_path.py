"""The Colab path, simulated on CPU: a learner opens a badge, Colab has torch, ipywidgets 7 and matplotlib already,
and the notebook's first cell pip-installs the course from GitHub.

A fresh virtual environment gets Colab's kernel stack (ipykernel 6.17.1, IPython 7.34.0, ipywidgets 7.7.1,
jupyter-client 6.1.12, tornado, pyzmq and traitlets at Colab's versions, from PyPI, installed with uv where it is at
hand: fresh_env.FreshEnv.install_pinned) with torch, numpy and matplotlib "preinstalled" (linked from this
environment: no torch download). `google.colab` is importable in it, so the first cell takes its Colab branch and
runs its own pip line, unchanged: git is told to fetch `https://github.com/<slug>` from a local repository made of
this checkout's files (tracked and new), so the package is built and installed non-editably from exactly what would
be pushed. Then the learner copies execute from a folder outside the repository, with no path back into it.

By default the tour and notebook 01 (the quickest other one; slider panel and progress bars) run, which keeps the
suite inside its time budget; COURSE_COLAB_NOTEBOOKS=all runs every notebook (about 3 minutes more on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .fresh_env import make_env, pip_failed
from .test_course import REF, ROOT, SLUG

pytestmark = pytest.mark.delivery  # slow: `-m "not delivery"` leaves these out while iterating

# What Colab's runtime has (checked against a Colab runtime's `pip list`, 2025); only the kernel side matters here.
COLAB_STACK = [
    "ipykernel==6.17.1", "ipython==7.34.0", "ipywidgets==7.7.1", "widgetsnbextension==3.6.10",
    "jupyterlab-widgets==3.0.15", "jupyter-client==6.1.12", "tornado==6.4.2", "pyzmq==24.0.1", "traitlets==5.7.1",
    "matplotlib-inline==0.1.7", "comm==0.2.2", "prompt-toolkit==3.0.51",
]  # fmt: skip
PREINSTALLED = ["torch", "numpy", "matplotlib", "nbclient", "nbformat", "jedi", "pexpect", "pygments", "psutil",
                "debugpy", "packaging", "setuptools"]  # fmt: skip
NOT_LINKED = {"ipywidgets", "ipykernel", "ipython", "widgetsnbextension", "jupyterlab-widgets", "jupyter-client",
              "tornado", "pyzmq", "traitlets", "comm", "matplotlib-inline", "prompt-toolkit"}  # fmt: skip
DEFAULT_NOTEBOOKS = ["00_tour.ipynb", "01_forward.ipynb"]
COLAB_STUB = 'import sys, types; sys.modules.setdefault("google.colab", types.ModuleType("google.colab"))\n'


def first_cell_install(notebook: dict) -> str:
    """The requirement the notebook's first code cell gives pip on Colab (``anatomy_helpers @ git+...@<ref>``), as
    written there: the Colab test's diagnostic re-runs exactly that, so a wrong ref shows pip's own reason."""
    source = "".join(next(c for c in notebook["cells"] if c["cell_type"] == "code")["source"])
    course = re.search(r'^COURSE = "([^"]+)"$', source, re.M)
    name = re.search(r'f"(anatomy_helpers(?:\[[\w,]+\])?) @ \{COURSE\}"', source)
    if not (course and name):
        raise ValueError('the first code cell has no `COURSE = "git+..."` line and pip install of it')
    return f"{name.group(1)} @ {course.group(1)}"


def checkout_as_remote(dest: Path, ref: str) -> Path:
    """A git repository at ``dest`` holding this checkout's files (tracked and untracked, not ignored) on ``ref``."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q", "-b", ref], ["add", "-A"], ["commit", "-q", "-m", "checkout"]):
        subprocess.run([*git, *cmd], cwd=dest, check=True)
    return dest


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    if shutil.which("git") is None:
        pytest.skip("NOT TESTED: the Colab path needs git (the first cell installs with pip from a git URL)")
    tmp = tmp_path_factory.mktemp("colab")
    env = make_env(tmp, PREINSTALLED, exclude=NOT_LINKED)
    installed = env.install_pinned(COLAB_STACK, check=False)
    if installed.returncode:
        pip_failed("installing Colab's kernel stack from PyPI", installed.stderr)
    (env.site / "google_colab_stub.pth").write_text(COLAB_STUB)
    remote = checkout_as_remote(tmp / "remote", ref=REF)
    return env, tmp, remote


def test_first_cells_install_the_course_like_colab_and_the_notebooks_run_outside_the_repository(colab):
    env, tmp, remote = colab
    before = {d: (env.version(d), env.where(m)) for d, m in (("torch", "torch"), ("ipywidgets", "ipywidgets"))}
    assert before["ipywidgets"][0] == "7.7.1" and env.version("ipython") == "7.34.0"
    assert before["torch"][1].startswith(str(tmp / "preinstalled")), before  # Colab's own torch: the linked one
    content = tmp / "content"  # Colab's working folder: the notebook alone, nothing of the repository around it
    content.mkdir()
    wanted = os.environ.get("COURSE_COLAB_NOTEBOOKS", "")
    names = sorted(p.name for p in (ROOT / "learner").glob("[0-9][0-9]_*.ipynb")) if wanted == "all" else (
        wanted.split(",") if wanted else DEFAULT_NOTEBOOKS)  # fmt: skip
    for name in names:
        shutil.copy(ROOT / "learner" / name, content / name)
    run_env = dict(
        os.environ,
        **env.add_kernel("colab"),
        PYDEVD_DISABLE_FILE_VALIDATION="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PIP_COMPILE="false",  # the first cell's pip (and its build environment) skips byte-compiling: time only
        GIT_CONFIG_COUNT="1",  # the first cell's `git+https://github.com/<slug>@<ref>` fetches the local copy instead
        GIT_CONFIG_KEY_0=f"url.{remote.as_uri()}.insteadOf",
        GIT_CONFIG_VALUE_0=f"https://github.com/{SLUG}",
    )
    run_env.pop("MPLBACKEND", None)  # Colab's inline backend, as a learner gets it
    results = env.execute([content / n for n in names], tmp / "executed", cwd=content, env=run_env)
    for r in results:
        if any("CalledProcessError" in p["error"] and "pip" in p["error"] for p in r["problems"]):
            # The first cell's pip failed; its words went to the kernel's stderr, not to the notebook: ask pip again
            # with that cell's own requirement (its ref, not a fixed one), to show them (a bad dependency in
            # pyproject.toml or a ref the repository lacks fails here; no network skips).
            course = first_cell_install(json.loads((content / r["notebook"]).read_text()))  # not -q: pip says why
            again = env.run(["-m", "pip", "install", course], env=run_env, cwd=content, check=False)
            if again.returncode:
                pip_failed(f"the first cell's pip install of {course!r}", again.stdout + again.stderr)
    for r in results:
        print(f"Colab path: {r['notebook']} executed in {r['seconds']} s")
        assert r["problems"] == [], r
    first = json.loads((tmp / "executed" / names[0]).read_text())
    first_code = next(c for c in first["cells"] if c["cell_type"] == "code")
    printed = "".join("".join(o.get("text", "")) for o in first_code["outputs"])
    assert "Using device: cpu" in printed and "Change runtime type" in printed  # the Colab branch, on a CPU runtime
    # installed from the git URL, not editable, into the environment; torch and ipywidgets untouched
    installed = env.where("anatomy_helpers")
    assert installed.startswith(str(env.site)) and not installed.startswith(str(ROOT)), installed
    direct = json.loads(env.run(["-c", "import importlib.metadata as m; print(m.distribution('anatomy_helpers')"
                                 ".read_text('direct_url.json'))"]).stdout)  # fmt: skip
    assert direct["url"] == f"https://github.com/{SLUG}" and direct["vcs_info"]["requested_revision"] == REF
    assert direct.get("dir_info", {}).get("editable") is not True
    assert {d: (env.version(d), env.where(m)) for d, m in (("torch", "torch"), ("ipywidgets", "ipywidgets"))} == before


def test_data_ships_with_the_package(colab):
    """What the notebooks read from disk comes with the installed package, not from a clone."""
    env, tmp, _ = colab
    if env.run(["-c", "import anatomy_helpers"], check=False).returncode:
        pytest.fail("the package was not installed: see the first test of this module")
    code = (
        "from anatomy_helpers.core.data import load_text; from anatomy_helpers.lessons import lesson07_profiling as p;"
        "print(len(load_text())); print(p.load_gpu_reference() is not None)"
    )
    lines = env.run(["-c", code], cwd=tmp).stdout.split()
    assert int(lines[0]) > 10_000
    committed = (ROOT / "anatomy_helpers" / "lessons" / "gpu_reference" / "first_steps.pickle").exists()
    # once a GPU reference is recorded, Colab learners must see it too (ship it as package data)
    assert lines[1] == str(committed), "the GPU reference snapshot is not package data"


def test_the_diagnostic_reruns_the_first_cells_own_requirement():
    cell = {"cell_type": "code", "source": ['COURSE = "git+https://github.com/me/repo@my-branch"\n',
                                            'run(["pip", "install", f"anatomy_helpers[hf] @ {COURSE}"])']}  # fmt: skip
    assert first_cell_install({"cells": [cell]}) == "anatomy_helpers[hf] @ git+https://github.com/me/repo@my-branch"
    for path in sorted((ROOT / "learner").glob("[0-9][0-9]_*.ipynb")):
        course = first_cell_install(json.loads(path.read_text())).split(" @ ")[1]
        assert course == f"git+https://github.com/{SLUG}@{REF}", path.name
