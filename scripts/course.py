"""Set the course up once, then open JupyterLab or run the tests, on Linux, macOS and Windows.

    python scripts/course.py lab [--executed] [JUPYTER ARGS]   # set up if needed, open the learner notebooks
    python scripts/course.py test [--quick] [PYTEST ARGS]       # set up with the development tools, ruff + pytest
    python scripts/course.py setup [--dev]                      # only set up

Options, before or after the command:
    --here              use the Python running this script (a conda env, an existing venv) instead of .venv/
    --wheelhouse DIR    install only from DIR (built by scripts/wheelhouse.py): no network at all
    --cpu | --cuda      which torch build to install when none is installed (default: CUDA only where nvidia-smi
                        works; a torch that is already installed is always kept)

`bash scripts/lab.sh` / `scripts\\lab.cmd` and `bash scripts/test.sh` / `scripts\\test.cmd` call this script.

JupyterLab's kernels and the tests get a passive OpenMP wait policy (see ``openmp_env``).

Set up once, then launch offline: setup installs into the environment and writes a stamp there; later runs compare
the stamp with the requirement files and touch neither pip nor the network while they match. Standard library only
(it runs before anything is installed); Python >= 3.10.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_VERSION = os.environ.get("TORCH_VERSION", "2.13.0")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
LEARNER_REQUIREMENTS = ROOT / "requirements.txt"
DEV_REQUIREMENTS = ROOT / "requirements-dev.txt"
LAB_SETTINGS = ROOT / "jupyter" / "lab-overrides.json"  # the course's JupyterLab settings (no news pop-up)
STAMP = "training-step-anatomy-setup.json"  # written into the environment's prefix
MIN_PYTHON = (3, 10)


@dataclass(frozen=True)
class Env:
    """The Python environment the course runs in."""

    python: Path  # its interpreter
    prefix: Path  # its sys.prefix
    is_venv: bool  # the course's own .venv (False: --here)

    @property
    def stamp(self) -> Path:
        return self.prefix / STAMP


def venv_python(venv: Path, windows: bool = os.name == "nt") -> Path:
    """The interpreter of the virtual environment ``venv`` (Scripts\\python.exe on Windows, bin/python elsewhere)."""
    return venv / "Scripts" / "python.exe" if windows else venv / "bin" / "python"


def lab_settings_target(prefix: Path) -> Path:
    """Where JupyterLab (in the environment at ``prefix``) reads the course's settings overrides from."""
    return prefix / "share" / "jupyter" / "lab" / "settings" / "overrides.d" / "training-step-anatomy.json"


def has_nvidia_gpu() -> bool:
    """Whether an NVIDIA driver answers (nvidia-smi lists a GPU)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def torch_attempts(
    *, system: str, gpu: bool, version: str = TORCH_VERSION, wheelhouse: Path | None = None
) -> list[tuple[str, list[str]]]:
    """(what, pip install arguments) to try in order for installing torch; the first that succeeds wins.

    A wheel pip already finds on this machine without the network (its find-links) comes first. Then: on Linux
    and Windows without a GPU, PyTorch's CPU wheel index (about 190 MB, against several GB for the CUDA build and
    its NVIDIA libraries that PyPI serves on Linux); with a GPU, or on macOS (no CUDA builds), PyPI.
    """
    spec = f"torch=={version}"
    if wheelhouse is not None:
        return [("torch from the wheelhouse", ["--no-index", "--find-links", str(wheelhouse), "torch"])]
    local = ("a torch wheel already on this machine", ["--no-index", "--no-deps", spec])
    if system in ("Linux", "Windows") and not gpu:
        return [local, ("the CPU build from PyTorch's CPU index (~190 MB)", ["--index-url", CPU_INDEX, spec])]
    return [local, ("torch from the package index" + (" (CUDA build, several GB)" if gpu else ""), [spec])]


def setup_key(dev: bool) -> str:
    """What the environment was set up from: changes whenever a requirement file or the package metadata does."""
    h = hashlib.sha256()
    dev_files = [DEV_REQUIREMENTS, ROOT / "site" / "requirements.txt"]  # the second: requirements-dev's -r
    files = [LEARNER_REQUIREMENTS, ROOT / "pyproject.toml", LAB_SETTINGS] + (dev_files if dev else [])
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def read_stamp(env: Env) -> dict:
    try:
        return json.loads(env.stamp.read_text())
    except (OSError, ValueError):
        return {}


def is_set_up(env: Env, dev: bool) -> bool:
    """Whether ``env`` was set up from the current files (a development setup also serves the learner one)."""
    stamp = read_stamp(env)
    return stamp.get("key") == setup_key(dev) or (not dev and stamp.get("learner_key") == setup_key(False))


def find_env(here: bool) -> Env:
    """The running interpreter's environment (``here``), or the course's .venv, created if missing."""
    if here:
        return Env(Path(sys.executable), Path(sys.prefix), is_venv=False)
    venv = ROOT / ".venv"
    python = venv_python(venv)
    if not python.exists():
        print(f"creating {venv.relative_to(ROOT)}/ with Python {platform.python_version()} ({sys.executable})")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    return Env(python, venv, is_venv=True)


def pip(env: Env, args: list[str], quiet: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    """pip install into ``env``. pip byte-compiles what it installs, and that stays: --no-compile halved the setup's
    CPU time, but where PYTHONDONTWRITEBYTECODE is set (CI machines, some containers) Python then compiled torch again
    in every process that imported it, and a fresh-clone suite took 150 s longer."""
    cmd = [str(env.python), "-m", "pip", "install", *(["-q"] if quiet else []), *args]
    return subprocess.run(cmd, check=check, cwd=ROOT)


#: pip's settings that say where packages come from, and uv's flag for each (uv reads no pip configuration).
PIP_TO_UV = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
             "constraint": "--constraint"}  # fmt: skip


def uv_flags(pip_config: str) -> list[str]:
    """``pip config list``'s output (files and PIP_* variables, e.g. ``global.find-links='/opt/wheels'``) as uv
    flags, so that uv installs from where pip would: a mirror, a local wheel folder, a constraints file. Like pip,
    uv then takes the best version any of those indexes has (pip's rule; uv's own default prefers the first index
    that has the package at all)."""
    flags: dict[str, list[str]] = {}
    for line in sorted(pip_config.splitlines(), key=lambda line: line.startswith(":env:")):
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in PIP_TO_UV:  # PIP_* variables (":env:", sorted last) override the files, as in pip
            flags[name] = value.strip().strip("'\"").split()
    out = [flag for name, values in flags.items() for v in values for flag in (PIP_TO_UV[name], v)]
    return out + ["--index-strategy", "unsafe-best-match"]


def fast_install(env: Env, args: list[str]) -> bool:
    """Install ``args`` into ``env`` with uv (pip's interface, in parallel: about 15 s for the development
    requirements against about 55 s with pip on 2 cores), byte-compiled as pip does. False, having printed why,
    where uv cannot be had or fails: the caller then uses pip."""
    got = subprocess.run([str(env.python), "-m", "pip", "install", "-q", "uv"], cwd=ROOT, capture_output=True)
    if got.returncode:
        print("uv could not be installed; installing with pip (slower)", flush=True)
        return False
    config = subprocess.run([str(env.python), "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    cmd = [str(env.python), "-m", "uv", "pip", "install", "-q", "--python", str(env.python), "--compile-bytecode"]
    done = subprocess.run([*cmd, *uv_flags(config), *args], cwd=ROOT)
    if done.returncode:
        print("uv failed (above); installing with pip instead", flush=True)
    return done.returncode == 0


def env_has(env: Env, module: str) -> bool:
    return subprocess.run([str(env.python), "-c", f"import {module}"], capture_output=True).returncode == 0


def install_torch(env: Env, gpu: bool, wheelhouse: Path | None) -> None:
    attempts = torch_attempts(system=platform.system(), gpu=gpu, wheelhouse=wheelhouse)
    for i, (what, args) in enumerate(attempts):
        last = i == len(attempts) - 1
        print(f"installing torch: trying {what}", flush=True)
        # The last attempt is the download (about 190 MB, minutes on a slow line): pip shows what it fetches and,
        # in a terminal, its progress bar. Earlier attempts are quiet: their failure is expected and not shown.
        done = subprocess.run(
            [str(env.python), "-m", "pip", "install", *([] if last else ["-q"]), *args],
            cwd=ROOT, capture_output=not last, text=True,
        )  # fmt: skip
        if done.returncode == 0:
            return
    raise SystemExit(
        "could not install torch. Install it yourself (https://pytorch.org/get-started/locally/), then run this again:"
        " a torch that is already installed is kept."
    )


def setup(env: Env, *, dev: bool, gpu: bool, wheelhouse: Path | None = None) -> None:
    """Install what the course needs into ``env`` (torch only if missing), then stamp it."""
    start = time.perf_counter()
    offline = ["--no-index", "--find-links", str(wheelhouse)] if wheelhouse else []
    if env_has(env, "torch"):
        print("keeping the torch already installed")
    else:
        install_torch(env, gpu, wheelhouse)
    requirements = DEV_REQUIREMENTS if dev else LEARNER_REQUIREMENTS
    print(f"installing {requirements.name}", flush=True)
    # uv into the course's own .venv only (never into an environment of yours: --here), and never offline
    if wheelhouse is not None or not env.is_venv or not fast_install(env, ["-r", str(requirements)]):
        pip(env, [*offline, "-r", str(requirements)])
    print("installing the course package (editable)", flush=True)
    pip(env, [*offline, "--no-deps", "-e", str(ROOT)])
    target = lab_settings_target(env.prefix)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(LAB_SETTINGS, target)
    stamp = {"key": setup_key(dev), "learner_key": setup_key(False), "dev": dev, "when": time.strftime("%F %T")}
    env.stamp.write_text(json.dumps(stamp, indent=1) + "\n")
    print(f"set up in {time.perf_counter() - start:.0f} s; later runs skip this while the requirement files match")


def ensure_setup(env: Env, *, dev: bool, gpu: bool, wheelhouse: Path | None) -> None:
    """Set up unless the stamp says it is done. A stale setup that cannot be refreshed (no network) still runs."""
    if is_set_up(env, dev) and wheelhouse is None:
        return
    had_setup = bool(read_stamp(env))
    try:
        setup(env, dev=dev, gpu=gpu, wheelhouse=wheelhouse)
    except (subprocess.CalledProcessError, SystemExit) as err:
        if not had_setup:
            raise
        print(f"\nWARNING: the requirement files changed since setup, and updating failed ({err}).")
        print("Carrying on with the environment as it is (no network?). Run `python scripts/course.py setup` later.\n")


def torch_summary(env: Env) -> None:
    code = (
        'import torch; print(f\'torch {torch.__version__} (CUDA build: {torch.version.cuda or "no"}), '
        "{torch.get_num_threads()} threads')"
    )
    subprocess.run([str(env.python), "-c", code], check=True)


def openmp_env(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with OMP_WAIT_POLICY=PASSIVE unless it sets one: for JupyterLab (its kernels inherit it) and pytest.

    torch's CPU kernels run on OpenMP threads that by default spin while they wait for the next parallel region.
    Where every core is busy (a laptop with a browser and a video call, the suite's two workers) a spinning thread
    holds a core another one needs: a notebook ran 3-5x slower beside two busy processes, and close to its idle time
    with the passive policy (benchmarks/notebook_times.py measures it). libgomp reads the variable once, when torch is
    imported, so it has to be in the environment the kernel starts with.
    """
    return {"OMP_WAIT_POLICY": "PASSIVE", **environ}


def lab_command(env: Env, executed: bool, extra: list[str]) -> list[str]:
    """The JupyterLab command line that `lab` runs (from the repository root)."""
    folder = ROOT / ("notebooks" if executed else "learner")
    cmd = [str(env.python), "-m", "jupyter", "lab", str(folder)]
    if hasattr(os, "getuid") and os.getuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root
    return cmd + extra


def run_lab(env: Env, executed: bool, extra: list[str]) -> int:
    cmd = lab_command(env, executed, extra)
    if os.name == "posix":
        # JupyterLab takes this process's place (lab.sh execs this script too), so Ctrl+C, SIGTERM or a closed
        # terminal reach the server itself: a wrapper in between would die and leave the server running on its port.
        sys.stdout.flush()
        os.chdir(ROOT)
        os.execve(cmd[0], cmd, openmp_env(dict(os.environ)))
    try:  # Windows has no exec; Ctrl+C reaches every process of the console, JupyterLab included
        return subprocess.run(cmd, cwd=ROOT, env=openmp_env(dict(os.environ))).returncode
    except KeyboardInterrupt:
        return 0


def runs_browser_test(extra: list[str]) -> bool:
    """Whether pytest with ``extra`` runs tests/test_browser.py: the whole suite or that file named, not
    `-m "not delivery"` nor only other test files."""
    if any("test_browser" in a for a in extra):
        return True
    if any("not delivery" in a for a in extra):
        return False
    return not any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in extra)


def prepare_browser(env: Env) -> None:
    """Find Chromium and playwright for the browser test, or install them (once per machine), before pytest starts:
    under pytest-xdist a worker's output reaches the console only when its test ends, so an install inside the test
    ran for minutes in silence. browser_check says what it installs and why before it starts."""
    code = (
        "import browser_check as b; c, why = b.ensure_browser(log=lambda m: print(f'[browser test] {m}', flush=True));"
        "print(f'[browser test] Chromium: {c}' if c else f'[browser test] will be skipped: {why}')"
    )
    subprocess.run([str(env.python), "-c", code], cwd=ROOT / "scripts")  # its import path: scripts/


def pytest_targets(quick: bool) -> list[str]:
    """What pytest runs: the unit tests and the delivery tests, and every notebook through nbval; ``quick``: the unit
    tests alone (no notebooks, `-m "not delivery"`), for contributors while they work."""
    if quick:
        return ["-m", "not delivery", "tests"]
    return ["--nbval", "--nbval-current-env", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg", "tests", "notebooks"]


def run_tests(env: Env, extra: list[str], quick: bool = False) -> int:
    torch_summary(env)
    if not quick and runs_browser_test(extra):
        prepare_browser(env)
    test_env = openmp_env(
        dict(os.environ, CUDA_VISIBLE_DEVICES="", PYDEVD_DISABLE_FILE_VALIDATION="1", MPLBACKEND="Agg")
    )  # the xdist workers and the nbval kernels inherit it (conftest.py adds ANATOMY_AUTORUN=1: see exercises.py)
    # nbval compares against the stored CPU outputs, so the suite runs on CPU even on a GPU machine;
    # scripts/gpu_check.py covers CUDA.
    # Two workers on two cores (pytest-xdist): the delivery tests wait on pip, kernels and a browser much of the time.
    # loadfile: each file (so each notebook) stays on one worker, except the browser test's notebooks, one scope each
    # (tests/conftest.py's scheduler), so the workers share them; no reorder: the slow files start first, in
    # tests/conftest.py's order. -rs prints every skip's reason; --durations the slowest.
    workers = os.cpu_count() or 1
    dist = ["--dist", "loadfile", "--no-loadscope-reorder"]
    parallel = ["-n", str(min(workers, 4)), *dist] if workers > 1 and env_has(env, "xdist") else []
    steps = [
        [str(env.python), "-m", "ruff", "check", "."],
        [str(env.python), "-m", "pytest", "-q", "-rs", "--durations=12", *parallel, *pytest_targets(quick), *extra],
    ]  # fmt: skip
    start = time.perf_counter()
    for cmd in steps:
        rc = subprocess.run(cmd, cwd=ROOT, env=test_env).returncode
        if rc:
            return rc
    print(f"{'unit tests' if quick else 'whole suite'} (ruff + pytest): {time.perf_counter() - start:.0f} s")
    return 0


def add_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """The options that may come before or after the command. After it, an option left out keeps the value given
    before it (argparse.SUPPRESS: a subcommand's default would overwrite it)."""

    def default(value):
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--here", action="store_true", default=default(False),
                        help="use this Python's environment instead of .venv/")  # fmt: skip
    parser.add_argument("--wheelhouse", type=Path, default=default(None),
                        help="install only from this folder, without network")  # fmt: skip
    build = parser.add_mutually_exclusive_group()
    build.add_argument("--cpu", dest="gpu", action="store_false", default=default(None),
                       help="install the CPU build of torch")  # fmt: skip
    build.add_argument("--cuda", dest="gpu", action="store_true", default=default(None),
                       help="install the CUDA build of torch")  # fmt: skip


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The command line: (course.py's options and command, what goes on to JupyterLab or pytest)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True)
    p_setup = sub.add_parser("setup", help="set up and stop")
    p_setup.add_argument("--dev", action="store_true", help="also the development tools (pytest, ruff, nbval)")
    p_lab = sub.add_parser("lab", help="set up if needed and open JupyterLab")
    p_lab.add_argument("--executed", action="store_true", help="open notebooks/ (with outputs) instead of learner/")
    p_test = sub.add_parser("test", help="set up with the development tools if needed, then ruff + pytest")
    quick = "ruff and the unit tests only: no notebooks, no delivery tests (about 2 minutes)"
    p_test.add_argument("--quick", action="store_true", help=quick)
    for p in (p_setup, p_lab, p_test):
        add_options(p, defaults=False)  # also after the command: `bash scripts/lab.sh --here`
    args, extra = parser.parse_known_args(argv)
    if args.command == "setup" and extra:
        parser.error(f"unknown arguments: {extra}")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    if sys.version_info < MIN_PYTHON:
        raise SystemExit(f"the course needs Python >= 3.10; this is {platform.python_version()} ({sys.executable})")
    args, extra = parse_args(argv)
    gpu = has_nvidia_gpu() if args.gpu is None else args.gpu
    wheelhouse = args.wheelhouse.resolve() if args.wheelhouse else None
    env = find_env(args.here)
    dev = args.command == "test" or (args.command == "setup" and args.dev)
    if args.command == "setup":
        setup(env, dev=dev, gpu=gpu, wheelhouse=wheelhouse)
        return 0
    ensure_setup(env, dev=dev, gpu=gpu, wheelhouse=wheelhouse)
    if args.command == "lab":
        return run_lab(env, args.executed, extra)
    return run_tests(env, extra, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
