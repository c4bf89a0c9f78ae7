"""Each notebook's execution time idle and beside busy processes, under each OpenMP setting the kernel could get.

    python benchmarks/notebook_times.py                    # every notebook, --busy 2, all settings
    python benchmarks/notebook_times.py 03 05 --busy 2     # by number or name prefix
    python benchmarks/notebook_times.py --settings spin,passive

Why: torch's CPU kernels run on OpenMP threads (libgomp on Linux) that, by default, spin for a while waiting for
the next parallel region instead of sleeping. On a machine whose cores are all busy (a laptop with a browser and a
video call, or the suite's two xdist workers), a spinning thread holds a core another thread needs, and a notebook
runs several times slower. OMP_WAIT_POLICY=PASSIVE makes the waiting threads sleep; libgomp reads it when it is
loaded, so it must be in the environment before torch is imported (the kernel inherits it).

Settings (each a kernel environment; CUDA hidden, as scripts/run_notebooks.py does):
    spin            OpenMP's default wait policy (OMP_WAIT_POLICY removed from the environment)
    passive         OMP_WAIT_POLICY=PASSIVE
    passive-1       OMP_WAIT_POLICY=PASSIVE and OMP_NUM_THREADS=1 (threads sized to a machine with no free core)

Each notebook (a copy, in a temporary folder; tests/execute.py's client, the kernel started from notebooks/ so
relative paths resolve) runs once idle and once beside ``--busy`` processes that each keep one core busy with float
matrix products; the table gives seconds and the loaded/idle ratio. "Idle" means only what else runs on the
machine: print `uptime` with the table and compare settings within one run, not across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
EXECUTE = ROOT / "tests" / "execute.py"
SETTINGS = {
    "spin": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "passive-1": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
}
OMP_KEYS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")
# One core's worth of work: a 256 x 256 float32 product in a loop, on one BLAS thread.
BUSY = "import numpy as np\na = np.random.rand(256, 256).astype(np.float32)\nwhile True:\n    a @ a\n"


def selected(names: list[str]) -> list[Path]:
    every = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return every
    chosen = [p for p in every if any(p.name.startswith(n) for n in names)]
    if len(chosen) < len(names):
        raise SystemExit(f"no notebook matches one of {names}; there are {[p.name for p in every]}")
    return chosen


def kernel_env(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OMP_KEYS}
    env.update(SETTINGS[setting], CUDA_VISIBLE_DEVICES="", PYDEVD_DISABLE_FILE_VALIDATION="1", ANATOMY_AUTORUN="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return env


@contextmanager
def busy(n: int):
    """``n`` processes that each keep one core busy until the block ends."""
    one_thread = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", BUSY], env=one_thread) for _ in range(n)]
    try:
        time.sleep(1.0)  # let them start spinning
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


def execute(path: Path, setting: str) -> float:
    """Seconds to run a copy of ``path`` top to bottom (kernel start included) with ``setting``'s environment."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, str(EXECUTE), tmp, str(path)],
            cwd=NOTEBOOKS, env=kernel_env(setting), capture_output=True, text=True,
        )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{path.name} failed under {setting}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="numbers or name prefixes (default: all)")
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the loaded run (default 2)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or args.busy < 1:
        parser.error(f"--settings must be among {list(SETTINGS)} (got {unknown}); --busy at least 1")
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average), {os.cpu_count()} CPUs", flush=True)
    print(f"| notebook | setting | idle s | beside {args.busy} busy s | loaded/idle |")
    print("|---|---|---:|---:|---:|", flush=True)
    for path in selected(args.notebooks):
        for setting in settings:
            idle = execute(path, setting)
            with busy(args.busy):
                loaded = execute(path, setting)
            print(f"| {path.name[:2]} | {setting} | {idle:.1f} | {loaded:.1f} | {loaded / idle:.2f} |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
