"""The package as a Colab user gets it: installed non-editably, imported from outside the repository."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.delivery  # a pip install: `-m "not delivery"` (and test.sh --quick) leave it out

ROOT = Path(__file__).resolve().parent.parent


def test_non_editable_install_ships_every_module(tmp_path):
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    # The fresh environment sees this one's packages (torch, numpy, ...) through a .pth file, so nothing is
    # downloaded; the course package itself is installed into it, non-editably, from a copy of the source.
    env_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(env_site, "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            ".",
        ],
        cwd=ROOT,
        check=True,
    )
    Path(env_site, "course.pth").write_text(str(target) + "\n")  # first on the path after the env's own site
    script = (
        "import importlib, pkgutil, anatomy_helpers as a\n"
        "names = [m.name for m in pkgutil.walk_packages(a.__path__, 'anatomy_helpers.')]\n"
        "names = [n for n in names if not n.endswith('__main__')]  # importing __main__ would run the CLI\n"
        "for n in names: importlib.import_module(n)\n"
        "from anatomy_helpers.core.data import load_text\n"
        "assert len(load_text()) > 10_000\n"
        "from importlib import resources\n"
        "assert resources.files('anatomy_helpers.prediction').joinpath('hf_configs', 'llama-3.1-8b.json').is_file()\n"
        "print(a.__file__); print(len(names)); print(' '.join(sorted(names)))\n"
    )
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not the checkout a developer put on the path
    out = subprocess.run(
        [python, "-c", script], cwd=tmp_path, env=clean, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert out[0].startswith(str(target)), out[0]  # the installed copy, not the checkout
    source = sorted(
        "anatomy_helpers." + ".".join(p.relative_to(ROOT / "anatomy_helpers").with_suffix("").parts)
        for p in (ROOT / "anatomy_helpers").rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )
    shipped = out[2].split()
    assert [n for n in source if n not in shipped] == []  # every module of the checkout was installed
    assert "anatomy_helpers.lessons.lesson04_first_step" in shipped
