"""The offline path for a workshop room: build a wheelhouse with scripts/wheelhouse.py, set up a fresh environment from
it with scripts/course.py --wheelhouse while pip can reach no index and reads no configuration, then launch JupyterLab
the way a learner does, still offline, and check that the launch installed nothing.

torch is left out of the test's wheelhouse and linked into the environment instead: its 190 MB wheel would only
slow the test down (course.py keeps an installed torch, as on a laptop that has one).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from .fresh_env import make_env, offline_pip_env
from .test_course import ROOT

pytestmark = pytest.mark.delivery  # slow: `-m "not delivery"` leaves these out while iterating

DEAD_INDEX = "http://127.0.0.1:9/simple"  # nothing listens there: any attempt to use an index fails at once


def test_setup_from_a_wheelhouse_without_network_then_launch_offline(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    built = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), str(wheelhouse), "--no-torch"],
        capture_output=True, text=True,
    )  # fmt: skip
    if built.returncode:
        pytest.skip(f"NOT TESTED: could not download the wheelhouse (no network?): {built.stderr[-800:]}")
    print(built.stdout.strip().splitlines()[-1])
    assert any(p.name.startswith("jupyterlab-") for p in wheelhouse.glob("*.whl"))
    assert any(p.name.startswith("setuptools-") for p in wheelhouse.glob("*.whl"))  # to build `-e .` offline

    env = make_env(tmp_path, ["torch"])
    offline = offline_pip_env(PIP_INDEX_URL=DEAD_INDEX, PIP_RETRIES="0")
    course = [str(ROOT / "scripts" / "course.py"), "--here"]
    setup = env.run([*course, "--wheelhouse", str(wheelhouse), "setup"], env=offline, cwd=tmp_path, check=False)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    assert "keeping the torch already installed" in setup.stdout
    env.run(["-c", "import anatomy_helpers, ipywidgets, jupyterlab, matplotlib"])
    assert (env.root / "training-step-anatomy-setup.json").exists()
    assert (env.root / "share/jupyter/lab/settings/overrides.d/training-step-anatomy.json").exists()

    launch = env.run([*course, "lab", "--version"], env=offline, cwd=tmp_path, check=False)
    assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-2000:]
    assert "installing" not in launch.stdout  # set up once: the launch touched neither pip nor the network
    assert launch.stdout.strip().splitlines()[-1][0].isdigit()  # JupyterLab's version: it started
