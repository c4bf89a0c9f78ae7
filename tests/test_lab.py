"""What `bash scripts/lab.sh` opens: a JupyterLab that serves the notebooks and has the widgets extension."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         "--IdentityProvider.token=", "--allow-root", f"--ServerApp.root_dir={ROOT / 'notebooks'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/api/status", timeout=1)
                break
            except OSError:
                time.sleep(0.25)
        else:
            pytest.fail("JupyterLab did not start within 30 s")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_lab_serves_the_tour_notebook(lab):
    page = urllib.request.urlopen(f"{lab}/lab/tree/00_tour.ipynb", timeout=10).read().decode()
    assert "JupyterLab" in page
    nb = json.load(urllib.request.urlopen(f"{lab}/api/contents/00_tour.ipynb", timeout=10))
    assert nb["type"] == "notebook" and nb["content"]["cells"]


def test_lab_has_the_ipywidgets_extension(lab):
    exts = json.load(urllib.request.urlopen(f"{lab}/lab/api/extensions", timeout=10))
    widgets = [e for e in exts if "jupyterlab-manager" in e["name"]]  # @jupyter-widgets/jupyterlab-manager
    assert widgets and widgets[0]["enabled"], exts
