"""The offline path for a workshop room: build a wheelhouse with scripts/wheelhouse.py, set up a fresh environment from
it with scripts/course.py --wheelhouse while pip can reach no index and reads no configuration, then start JupyterLab
the way a learner does, still offline, fetch its page over HTTP, and check that the launch installed nothing. And the
wheelhouses for other platforms, built here: each holds what that platform's markers ask for, and nothing else.

torch is left out of the test's wheelhouses and linked into the environment instead: its 190 MB wheel would only
slow the test down (course.py keeps an installed torch, as on a laptop that has one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from .fresh_env import make_env, offline_pip_env, pip_failed
from .lab_server import serving
from .test_course import ROOT, load_script

pytestmark = pytest.mark.delivery  # slow: `-m "not delivery"` leaves these out while iterating

DEAD_INDEX = "http://127.0.0.1:9/simple"  # nothing listens there: any attempt to use an index fails at once
wheelhouse_py = load_script("wheelhouse")


def build(dest: Path, *options: str, env: dict[str, str] | None = None) -> list[Path]:
    """Run scripts/wheelhouse.py into ``dest`` without torch; its wheels. A pip failure fails the test unless the
    package index is out of reach."""
    cmd = [sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), str(dest), "--no-torch", *options]
    built = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if built.returncode:
        pip_failed(f"scripts/wheelhouse.py {' '.join(options)}", built.stdout + built.stderr)
    print(built.stdout.strip().splitlines()[-1])
    return sorted(dest.glob("*.whl"))


def test_setup_from_a_wheelhouse_without_network_then_launch_offline(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheels = build(wheelhouse)
    assert any(p.name.startswith("jupyterlab-") for p in wheels)
    assert any(p.name.startswith("setuptools-") for p in wheels)  # to build `-e .` offline
    assert any(p.name.startswith("peft-") for p in wheels) and not any(p.name.startswith("torch-") for p in wheels)

    env = make_env(tmp_path, ["torch"])
    # PIP_COMPILE=false: course.py's pip skips byte-compiling what it installs (a third of the setup's time here)
    offline = offline_pip_env(PIP_INDEX_URL=DEAD_INDEX, PIP_RETRIES="0", PIP_COMPILE="false")
    course = [str(env.python), str(ROOT / "scripts" / "course.py"), "--here"]
    setup = subprocess.run([*course, "--wheelhouse", str(wheelhouse), "setup"], env=offline, cwd=tmp_path,
                           capture_output=True, text=True)  # fmt: skip
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    assert "keeping the torch already installed" in setup.stdout
    env.run(["-c", "import anatomy_helpers, ipywidgets, jupyterlab, matplotlib"])
    assert (env.root / "training-step-anatomy-setup.json").exists()
    assert (env.root / "share/jupyter/lab/settings/overrides.d/training-step-anatomy.json").exists()

    # The launch a learner makes (lab.sh runs `course.py lab`), still offline: the real server, its page over HTTP.
    with serving([*course, "lab"], tmp_path / "lab.log", env=offline, cwd=tmp_path) as lab:
        page = lab.get("/lab/tree/00_tour.ipynb")
        extensions = lab.get("/lab/api/extensions")
        assert "installing" not in lab.output()  # set up once: the launch touched neither pip nor the network
    assert "JupyterLab" in page and "jupyterlab-manager" in extensions  # the wheelhouse's Lab, with the widgets


# The marker variables of each target, written here from the platforms' definitions (PEP 508), not from the script.
TARGETS = {
    "windows": dict(os_name="nt", sys_platform="win32", platform_system="Windows", platform_machine="AMD64"),
    "macos-arm": dict(os_name="posix", sys_platform="darwin", platform_system="Darwin", platform_machine="arm64"),
}


def requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(name).decode())
    return [Requirement(r) for r in meta.get_all("Requires-Dist") or []]


def needed_closure(wheels: list[Path], roots: list[str], marker_env: dict[str, str], provided: set[str] = frozenset()
                   ) -> tuple[set[str], set[str]]:  # fmt: skip
    """(names some requirement needs on the target, starting from ``roots``; names needed but missing). Names in
    ``provided`` are there already (torch, left out of the wheelhouse): neither needed nor followed."""
    by_name = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in wheels}
    todo = [(canonicalize_name(Requirement(r).name), "") for r in roots]
    seen, missing = set(), set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name in provided:
            continue
        seen.add((name, extra))
        if name not in by_name:
            missing.add(name)
            continue
        for req in requires(by_name[name]):
            if req.marker is None or req.marker.evaluate({**marker_env, "extra": extra}):
                todo += [(canonicalize_name(req.name), e) for e in ["", *req.extras]]
    return {name for name, _ in seen}, missing


@pytest.fixture(scope="module")
def with_uv(tmp_path_factory) -> dict[str, str]:
    """os.environ with uv on PATH, fetched once for the module as wheelhouse.py would fetch it for each run."""
    scratch = tmp_path_factory.mktemp("uv")
    try:
        uv = Path(wheelhouse_py.find_uv(scratch))
    except subprocess.CalledProcessError as err:
        pip_failed("pip install uv", str(err))
    return dict(os.environ, PATH=f"{uv.parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_wheelhouse_for_another_platform_holds_what_its_markers_ask_for(tmp_path, target, with_uv):
    wheels = build(tmp_path / target, "--platform", target, "--python", "3.11", env=with_uv)
    names = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels}
    marker_env = {**default_environment(), **TARGETS[target], "python_version": "3.11", "python_full_version": "3.11.9",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython"}  # fmt: skip
    roots = wheelhouse_py.requirements_without_torch() + wheelhouse_py.BUILD
    needed, missing = needed_closure(wheels, roots, marker_env, provided={"torch"})  # built with --no-torch
    assert not missing, f"the {target} wheelhouse lacks what its packages require there: {sorted(missing)}"
    assert names == needed, f"not required on {target}: {sorted(names - needed)}"  # e.g. Linux-only pexpect
    if target == "windows":
        assert {"colorama", "pywinpty"} <= names and not {"pexpect", "ptyprocess"} & names  # IPython, terminado
    else:
        assert "appnope" in names  # ipykernel on macOS
    for wheel in wheels:  # wheels for the target's platform only
        plats = {t.platform for t in parse_wheel_filename(wheel.name)[3]}
        fits = "win_amd64" if target == "windows" else ("arm64", "universal2")
        assert any(p == "any" or p.endswith(fits) for p in plats), wheel.name
