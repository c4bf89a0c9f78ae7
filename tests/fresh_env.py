"""Fresh virtual environments for the delivery tests, fast and without downloading torch.

A fresh environment gets some distributions "preinstalled" by linking them from this interpreter's site-packages
into a folder that a .pth file puts on the new environment's path (after its own site-packages, so anything pip
installs there wins). pip is linked the same way, so ``python -m pip`` works inside it as in any venv. Everything
else is installed by pip, as the user's platform would.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SITE = Path(sysconfig.get_paths()["purelib"])


def closure(names: list[str], exclude: set[str] = frozenset()) -> set[str]:
    """Canonical names of ``names`` and everything they require (installed here), minus ``exclude`` (not followed)."""
    exclude = {canonicalize_name(n) for n in exclude}
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name in exclude:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def link_distributions(names: set[str], dest: Path) -> None:
    """Symlink each distribution's top-level files and folders (and its .dist-info) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in sorted(names):
        dist = metadata.distribution(name)
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = Path(dist.locate_file(top))
            if src.exists() and not (dest / top).exists() and top != "__pycache__":
                (dest / top).symlink_to(src, target_is_directory=src.is_dir())


@dataclass(frozen=True)
class FreshEnv:
    root: Path
    python: Path
    site: Path

    def run(self, args: list[str], **kw) -> subprocess.CompletedProcess:
        """Run this environment's Python; check=True, text output captured unless told otherwise."""
        kw.setdefault("check", True)
        kw["env"] = without_checkout_path(kw.get("env"))
        kw.setdefault("cwd", self.root)  # not the checkout: `python -c` would import the package from the cwd
        kw.setdefault("text", True)
        if "stdout" not in kw and "capture_output" not in kw:
            kw["capture_output"] = True
        return subprocess.run([str(self.python), *args], **kw)

    def pip_install(self, args: list[str], **kw) -> subprocess.CompletedProcess:
        """pip install into this environment. --no-compile: pip byte-compiles every file it installs, for files these
        tests mostly never import (binder/requirements.txt installed in 14 s with it off, 22 s with it on)."""
        return self.run(["-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", *args], **kw)

    def install_pinned(self, requirements: list[str], **kw) -> subprocess.CompletedProcess:
        """Install ``requirements``, each pinned (``name==version``), as scaffolding for a test (not the install the
        test is about): with uv where this interpreter has it beside it (scripts/course.py installs it for its own
        setup), from where pip would take them (course.uv_flags), else with pip. uv installed Colab's kernel stack in
        5 s where pip took 41 s on 2 cores. uv does not see the distributions linked in through the .pth file, so it
        installs the pinned packages' dependencies itself, into site-packages, ahead of the linked copies on the path
        (pip would have kept the linked ones); the tests check that torch stays the linked one."""
        unpinned = [r for r in requirements if "==" not in r]
        if unpinned:
            raise ValueError(f"install_pinned takes name==version pins only, got {unpinned}")
        uv = Path(sys.executable).parent / ("uv.exe" if os.name == "nt" else "uv")
        if not uv.exists():
            return self.pip_install(requirements, **kw)
        from .test_course import load_script  # scripts/ is not a package

        config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
        flags = load_script("course").uv_flags(config.stdout)
        cmd = [str(uv), "pip", "install", "-q", "--python", str(self.python), *flags, *requirements]
        kw.setdefault("check", True)
        kw.setdefault("text", True)
        kw.setdefault("capture_output", True)
        return subprocess.run(cmd, env=without_checkout_path(kw.pop("env", None)), **kw)

    def version(self, dist: str) -> str:
        return self.run(["-c", f"import importlib.metadata as m; print(m.version({dist!r}))"]).stdout.strip()

    def where(self, module: str) -> str:
        return self.run(["-c", f"import {module}; print({module}.__file__)"]).stdout.strip()

    def add_kernel(self, name: str) -> dict[str, str]:
        """A kernelspec ``name`` running this environment's ipykernel; returns the variables that make it findable."""
        spec = self.root / "share" / "jupyter" / "kernels" / name
        spec.mkdir(parents=True, exist_ok=True)
        argv = [str(self.python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": name, "language": "python"}))
        return {"COURSE_KERNEL": name, "JUPYTER_PATH": str(self.root / "share" / "jupyter")}

    def execute(self, notebooks: list[Path], out_dir: Path, cwd: Path, env: dict[str, str]) -> list[dict]:
        """Run tests/execute.py here on ``notebooks`` from ``cwd``: per notebook, its name, seconds and problems."""
        out = self.run([str(Path(__file__).with_name("execute.py")), str(out_dir), *map(str, notebooks)], cwd=cwd,
                       env=env, check=False, timeout=1500)  # fmt: skip
        results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if len(results) != len(notebooks):
            raise AssertionError(f"the notebooks did not all run:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return results


def make_env(root: Path, preinstalled: list[str], exclude: set[str] = frozenset()) -> FreshEnv:
    """A venv at ``root/env`` with pip and the closure of ``preinstalled`` (minus ``exclude``) linked in."""
    env_dir = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    farm = root / "preinstalled"
    link_distributions(closure(["pip", *preinstalled], exclude) | {"pip"}, farm)
    (site / "preinstalled.pth").write_text(str(farm) + "\n")
    return FreshEnv(env_dir, python, site)


def without_checkout_path(env: dict[str, str] | None) -> dict[str, str]:
    """``env`` (default os.environ) without PYTHONPATH: a fresh environment, and the kernels it runs, must import the
    course from what was installed into it, never from a checkout a developer put on the path."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONPATH"}


def offline_pip_env(**extra: str) -> dict[str, str]:
    """os.environ (less PYTHONPATH) for a pip that reads no configuration file and no PIP_* variable of this machine."""
    env = {k: v for k, v in without_checkout_path(None).items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


# pip's own option parser, so the index is the one pip uses here (PIP_INDEX_URL, pip.conf, or PyPI).
_PIP_INDEX = (
    "from pip._internal.commands import create_command; print(create_command('download').parse_args([])[0].index_url)"
)


@functools.cache
def index_unreachable() -> str | None:
    """Why the package index pip is configured with cannot be reached from here, or None when it answers.

    Asked once per test process: a request to the index's root page. Any HTTP answer (even an error status) means the
    network is there, so a pip failure is the files' fault, not the network's."""
    url = subprocess.run([sys.executable, "-c", _PIP_INDEX], capture_output=True, text=True).stdout.strip()
    url = url or "https://pypi.org/simple"
    try:
        urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + "/", method="HEAD"), timeout=15).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as err:  # URLError (DNS, refused, TLS), timeouts
        return f"the package index {url} does not answer ({err})"
    return None


def pip_failed(what: str, output: str) -> None:
    """Skip when the index is out of reach (no network: said so), otherwise fail with pip's own words."""
    why = index_unreachable()
    if why:
        pytest.skip(f"NOT TESTED: {what}: {why}")
    errors = "\n".join(line for line in output.splitlines() if line.lower().startswith("error"))
    pytest.fail(f"{what} failed while the package index answers (a bad requirement?):\n{errors}\n"
                f"--- the end of its output ---\n{output[-2000:]}")  # fmt: skip
