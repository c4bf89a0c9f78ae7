"""What `bash scripts/lab.sh` opens, started the way a learner starts it: a JupyterLab that serves the learner's
own copies of the learner notebooks (my-work/, which git ignores: running them leaves `git status` as it was) and
has the widgets extension, and that stopping lab.sh stops."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .lab_server import port_open, serving
from .test_course import ROOT, load_script

pytestmark = pytest.mark.delivery  # starts JupyterLab: `-m "not delivery"` (and test.sh --quick) leave it out

course = load_script("course")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    # --here: this interpreter's environment. lab.sh sets it up first unless it is stamped as set up from the current
    # files; a test must not install into the environment it runs in, so an unstamped one is not tested here.
    env = course.Env(Path(sys.executable), Path(sys.prefix), is_venv=False)
    if not course.is_set_up(env, dev=False):
        pytest.skip(f"NOT TESTED: {sys.prefix} was not set up by `python scripts/course.py --here setup --dev`")
    if os.name == "posix":
        cmd, run_env = ["bash", "scripts/lab.sh", "--here"], dict(os.environ, PYTHON=sys.executable)
    else:
        cmd, run_env = [sys.executable, "scripts/course.py", "--here", "lab"], None
    with serving(cmd, tmp_path_factory.mktemp("lab") / "lab.log", cwd=ROOT, env=run_env) as lab:
        assert "installing" not in lab.output()  # set up already: the launch touched neither pip nor the network
        yield lab


def test_lab_serves_the_learner_tour(lab):
    assert "JupyterLab" in lab.get("/lab/tree/00_tour.ipynb")
    nb = json.loads(lab.get("/api/contents/00_tour.ipynb"))
    assert nb["type"] == "notebook" and nb["content"]["cells"]
    learner = json.loads((ROOT / "learner" / "00_tour.ipynb").read_text())
    assert nb["content"]["cells"][0]["source"] == "".join(learner["cells"][0]["source"])  # learner/, not notebooks/


def test_lab_serves_the_learners_own_copies_which_git_ignores(lab):
    assert "my-work/" in lab.output() or (ROOT / "my-work" / "00_tour.ipynb").exists()  # copied on first launch
    served = json.loads(lab.get("/api/contents/"))
    assert {c["name"] for c in served["content"]} >= {p.name for p in (ROOT / "learner").glob("[0-9][0-9]_*.ipynb")}
    assert (ROOT / "my-work" / "00_tour.ipynb").exists()  # the server's root: the learner's copies


def test_running_a_learner_copy_where_lab_keeps_them_leaves_git_status_as_it_was():
    """JupyterLab's autosave wrote outputs into learner/09 and learner/11 (a `git pull` then conflicted): the
    copies lab opens live in my-work/, which git ignores. The tour runs in a folder of my-work/ of its own (the
    learner's copies there are left alone) and is saved in place with every output, as JupyterLab saves it."""
    git = ["git", "status", "--porcelain", "--untracked-files=all"]
    if subprocess.run(git, cwd=ROOT, capture_output=True).returncode:
        pytest.skip("NOT TESTED: not a git checkout")
    before = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folder = ROOT / "my-work" / f".test-{os.getpid()}"
    try:
        load_script("learner_copies").workspace(folder)
        tour = folder / "00_tour.ipynb"
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
        env.pop("MPLBACKEND", None)
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "execute.py"), str(folder), str(tour)],
                              cwd=folder, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert any(c.get("outputs") for c in json.loads(tour.read_text())["cells"])  # saved with its outputs
        after = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert after == before
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_lab_has_the_ipywidgets_extension(lab):
    exts = json.loads(lab.get("/lab/api/extensions"))
    widgets = [e for e in exts if "jupyterlab-manager" in e["name"]]  # @jupyter-widgets/jupyterlab-manager
    assert widgets and widgets[0]["enabled"], exts


@pytest.mark.skipif(os.name != "posix", reason="SIGTERM is a POSIX signal")
def test_sigterm_to_lab_sh_stops_the_server(lab):
    """lab.sh -> course.py -> JupyterLab is one process (exec): a wrapper that died alone would leave the server."""
    lab.proc.send_signal(signal.SIGTERM)
    lab.proc.wait(timeout=30)
    assert not port_open(lab.port), f"the server still listens on {lab.port} after SIGTERM to lab.sh"
