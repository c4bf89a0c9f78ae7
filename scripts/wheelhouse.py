"""Download every wheel the course needs into one folder, for installing in a room without (good) network.

    python scripts/wheelhouse.py wheelhouse/                                   # this machine's platform and Python
    python scripts/wheelhouse.py wheelhouse/ --platform linux --platform windows --platform macos-arm --python 3.11
    python scripts/course.py --wheelhouse wheelhouse/ lab                      # then, on each laptop: no network

Run it on a machine with network; copy the folder with the repository (USB stick, shared drive). `course.py
--wheelhouse` installs with `pip --no-index --find-links`, so it never reaches for an index. For Linux and Windows
the CPU build of torch comes from PyTorch's CPU index (about 190 MB for Linux, less for Windows); macOS wheels
come from PyPI (torch ships no Intel-Mac wheels since 2.3, so only Apple silicon). The rest (JupyterLab, numpy,
matplotlib, ipywidgets, lesson 09's transformers and peft, and what they need) is about 105-120 MB per platform
and Python version (131 wheels for Linux and Python 3.11; 116 MiB for Windows, 103 MiB for macOS; December 2026).

Another platform's set of packages is not this machine's: `pip download --platform` evaluates environment markers
for the machine that runs it, so a Windows wheelhouse built on Linux would lack colorama (IPython needs it on
Windows) and a macOS one appnope. So the set is resolved for the target by uv (`uv pip compile --python-platform ...
--python-version ...`, which evaluates the target's markers and checks its wheel tags), and pip then downloads
exactly those pins (--no-deps) for that target. uv also keeps torch out of that set although lesson 09's peft and
accelerate require it (an override drops the requirement): torch comes on its own, from the right index, or not at
all with --no-torch; pip alone would fetch the CUDA build from PyPI on Linux. uv is taken from PATH (or beside
this Python), else from PyPI into a temporary folder (about 18 MB) that goes away afterwards. The script itself
needs only the standard library.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from course import CPU_INDEX, LEARNER_REQUIREMENTS, TORCH_VERSION  # noqa: E402

# pip expands each to the older manylinux / macOS versions it is compatible with.
PLATFORMS = {
    "linux": ["manylinux_2_28_x86_64"],
    "linux-arm": ["manylinux_2_28_aarch64"],
    "windows": ["win_amd64"],
    "macos-arm": ["macosx_14_0_arm64"],
}
# uv's names for the same targets (MACOS_TARGET: the oldest macOS the wheels may ask for, as the pip tag above).
UV_PLATFORMS = {
    "linux": "x86_64-manylinux_2_28",
    "linux-arm": "aarch64-manylinux_2_28",
    "windows": "x86_64-pc-windows-msvc",
    "macos-arm": "aarch64-apple-darwin",
}
#: The oldest macOS the macOS wheelhouse serves: as low as its wheels allow. torch 2.13's only macOS wheel is
#: macosx_14_0_arm64 (`pip install --dry-run --platform macosx_13_0_arm64 torch==2.13.0` finds none), so 14.0; a
#: lower target would only pick numpy's older-macOS build while torch still needs 14. Stated in README.
MACOS_TARGET = "14.0"
BUILD = ["setuptools>=68", "wheel"]  # what `pip install -e .` needs to build the course package, offline


def requirements_without_torch(path: Path = LEARNER_REQUIREMENTS) -> list[str]:
    """The requirement lines of ``path`` except torch's (torch is downloaded on its own, from the right index)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not re.match(r"torch\s*($|[<>=!~;\[])", line, re.I)]


def target_args(plat: str | None, python: str | None) -> list[str]:
    """pip download options for one target (None, None: this interpreter)."""
    args = []
    for tag in PLATFORMS[plat] if plat else []:
        args += ["--platform", tag]
    if python:
        args += ["--python-version", python, "--implementation", "cp"]
    if plat or python:
        args += ["--only-binary=:all:"]
    return args


def torch_index(plat: str | None) -> str | None:
    system = {"linux": "Linux", "linux-arm": "Linux", "windows": "Windows", "macos-arm": "Darwin"}.get(
        plat or "", platform.system()
    )
    return CPU_INDEX if system in ("Linux", "Windows") else None


def find_uv(scratch: Path) -> str:
    """uv's executable: on PATH or beside this Python, else installed from PyPI into ``scratch`` (nothing else on the
    machine changes)."""
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if found:
        return found
    print("fetching uv from PyPI (to resolve another platform's packages with that platform's markers)", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(scratch / "uv"), "uv"], check=True)
    return str(scratch / "uv" / "bin" / ("uv.exe" if os.name == "nt" else "uv"))


def resolve(
    uv: str,
    requirements: list[str],
    plat: str | None,
    python: str,
    index: str | None = None,
    without_torch: bool = False,
) -> list[str]:
    """The pinned set (``name==version`` lines) ``requirements`` need on ``plat`` (None: this machine's) with Python
    ``python``: resolved by uv with that target's environment markers and wheel tags, wheels only. ``without_torch``:
    a requirement on torch (peft's, accelerate's) is dropped, with what only torch needs."""
    with tempfile.TemporaryDirectory() as scratch:
        override = Path(scratch) / "override.txt"
        override.write_text('torch; sys_platform == "never"\n')  # uv's way to remove a dependency: a marker never true
        cmd = [uv, "pip", "compile", "-", "--python-version", python, "--only-binary", ":all:", "--no-header",
               "--no-annotate", "--quiet", *(["--python-platform", UV_PLATFORMS[plat]] if plat else []),
               *(["--index-url", index] if index else []),
               *(["--override", str(override)] if without_torch else [])]  # fmt: skip
        env = dict(os.environ, MACOSX_DEPLOYMENT_TARGET=MACOS_TARGET)
        done = subprocess.run(cmd, input="\n".join(requirements) + "\n", capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"uv could not resolve {requirements} for {plat or 'this platform'}, Python {python}:\n"
                         f"{done.stderr.strip()}")  # fmt: skip
    return [line.strip() for line in done.stdout.splitlines() if line.strip() and not line.startswith("#")]


def pip_download(base: list[str], requirements: list[str]) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(requirements) + "\n")
    try:
        if subprocess.run([*base, "-r", f.name]).returncode:
            raise SystemExit(f"pip could not download {requirements} (its error is above)")
    finally:
        Path(f.name).unlink()


def download(dest: Path, plat: str | None, python: str | None, torch: bool, index: str | None, uv: str) -> None:
    """Fill ``dest`` for one target (``plat`` None, ``python`` None: this machine's); ``uv`` resolves its set."""
    base = [sys.executable, "-m", "pip", "download", "-q", "--dest", str(dest), *target_args(plat, python)]
    torch_from = torch_index(plat) if index is None else (None if index == "default" else index)
    sets = [(requirements_without_torch() + BUILD, os.environ.get("PIP_INDEX_URL"), True)]
    if torch:
        sets.append(([f"torch=={TORCH_VERSION}"], torch_from, False))
    for requirements, from_index, without_torch in sets:
        where = ["--index-url", from_index] if from_index else []
        python_version = python or "{}.{}".format(*sys.version_info)
        pins = resolve(uv, requirements, plat, python_version, from_index, without_torch)
        print(f"  {len(pins)} packages for that target (uv, with its markers)", flush=True)
        pip_download([*base, *where, "--no-deps"], pins)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the folder to fill (created if missing)")
    parser.add_argument("--platform", action="append", choices=sorted(PLATFORMS), help="repeat for each; default: here")
    parser.add_argument("--python", action="append", help="e.g. 3.11; repeat for each; default: this Python's")
    parser.add_argument("--no-torch", action="store_true", help="leave torch out (the laptops have it already)")
    parser.add_argument("--torch-index", help="index for torch (default: PyTorch's CPU index on Linux and Windows; "
                        "'default' for pip's own)")  # fmt: skip
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        uv = find_uv(Path(scratch))
        for plat in args.platform or [None]:
            for python in args.python or [None]:
                what = f"{plat or 'this platform'}, Python {python or platform.python_version()}"
                print(f"downloading for {what}", flush=True)
                download(args.dest, plat, python, torch=not args.no_torch, index=args.torch_index, uv=uv)
    wheels = sorted(args.dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.0f} MiB in {args.dest} ({time.perf_counter() - start:.0f} s)")
    others = [p.name for p in args.dest.iterdir() if p.suffix != ".whl"]
    if others:
        print(f"not wheels (need building on the laptops, so a compiler): {others}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
