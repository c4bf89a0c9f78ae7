"""The Binder path: repo2docker builds the image from binder/ alone (it reads nothing else when binder/ exists).

repo2docker itself needs a container engine, which CI does not have. So a fresh virtual environment stands in for
its base image (Python with ipykernel; torch and transformers linked from this environment in place of the
wheels the file asks for, so nothing big is downloaded; peft is not: the [hf] extra must bring it), then gets exactly
what repo2docker does: `pip install -r binder/requirements.txt` from the repository root and binder/postBuild. The
tour's learner copy, which the badge opens, then executes in it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .fresh_env import make_env, pip_failed
from .test_course import REF, ROOT, SLUG

pytestmark = pytest.mark.delivery  # slow: `-m "not delivery"` leaves these out while iterating

BINDER = ROOT / "binder"


def test_binder_folder_has_what_repo2docker_needs():
    reqs = (BINDER / "requirements.txt").read_text().splitlines()
    lines = [line.strip() for line in reqs if line.strip() and not line.startswith("#")]
    assert "-e .[hf]" in lines  # the course package, from the repository, with lesson 09's Hugging Face extra
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines  # the CPU build of torch
    assert any(re.fullmatch(r"torch==\d+\.\d+\.\d+", line) for line in lines)
    assert re.fullmatch(r"python-3\.\d+\n", (BINDER / "runtime.txt").read_text())  # Python pinned
    assert os.access(BINDER / "postBuild", os.X_OK)
    assert not (BINDER / "environment.yml").exists()  # would switch repo2docker to conda and ignore requirements.txt
    readme = (ROOT / "README.md").read_text()
    assert f"mybinder.org/v2/gh/{SLUG}/{REF}?urlpath=lab/tree/learner/00_tour.ipynb" in readme  # Lab, on the tour


def test_binder_environment_runs_the_tour(tmp_path):
    pinned = (BINDER / "runtime.txt").read_text().strip().removeprefix("python-")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if pinned != here:
        print(f"NOTE: binder/runtime.txt pins Python {pinned}; this test runs Python {here}")
    # peft is not linked in: the [hf] extra must bring it (linked, it passed with peft dropped from the extra)
    env = make_env(tmp_path, ["torch", "transformers", "ipykernel", "nbclient", "nbformat"],
                   exclude={"numpy", "matplotlib", "ipywidgets", "anatomy-helpers", "peft"})  # fmt: skip
    for module in ("numpy", "peft"):  # binder/requirements.txt must bring them
        assert env.run(["-c", f"import {module}"], check=False).returncode != 0, module
    # The CPU index is not reachable from CI; don't let pip retry it for every package (torch is already here).
    pip_env = dict(os.environ, PIP_RETRIES="0", PIP_TIMEOUT="5")
    installed = env.pip_install(["-r", "binder/requirements.txt"], cwd=ROOT, env=pip_env, check=False)
    if installed.returncode:
        pip_failed("pip install -r binder/requirements.txt", installed.stderr)
    post_env = dict(
        os.environ, NB_PYTHON_PREFIX=str(env.root), PATH=f"{env.python.parent}{os.pathsep}{os.environ['PATH']}"
    )
    subprocess.run(["bash", "binder/postBuild"], cwd=ROOT, check=True, env=post_env)
    settings = env.root / "share/jupyter/lab/settings/overrides.d/training-step-anatomy.json"
    assert settings.read_text() == (ROOT / "jupyter" / "lab-overrides.json").read_text()
    assert env.version("torch").startswith("2.13.0") and env.version("ipywidgets").startswith("8.")
    env.run(["-c", "import anatomy_helpers, peft, transformers"])  # lesson 09's extra came with the package
    assert env.where("peft").startswith(str(env.site)), env.where("peft")  # installed by pip, not the host's
    run_env = dict(
        os.environ,
        **env.add_kernel("binder"),
        PYDEVD_DISABLE_FILE_VALIDATION="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    run_env.pop("MPLBACKEND", None)
    [result] = env.execute([ROOT / "learner" / "00_tour.ipynb"], tmp_path / "executed", cwd=ROOT / "learner",
                           env=run_env)  # fmt: skip
    print(f"Binder path: the tour executed in {result['seconds']} s")
    assert result["problems"] == []
