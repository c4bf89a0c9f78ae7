"""What `bash scripts/lab.sh` opens, started the way a learner starts it: a JupyterLab that serves the learner
notebooks and has the widgets extension, and that stopping lab.sh stops."""

import json
import os
import signal
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
