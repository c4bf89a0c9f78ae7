"""One command for a CUDA machine: prediction rules vs a real step, CUDA-only tests, the CLI and notebooks on the GPU.

First the CUDA rules a prediction applies (anatomy_helpers/prediction/cuda_rules.py) against a real step, phase by
phase; then the CUDA-only tests, the CLI on the GPU, and every notebook executed on the GPU.

    python scripts/gpu_check.py [--out DIR] [--jobs N]

Prints a pass/fail line per check and a summary; exits non-zero if any check failed. Notebooks are executed
into DIR (not in place: the committed outputs stay the CPU ones; `--out docs/gpu_outputs` records them for CPU
learners, see docs/instructor_guide.md) and are not compared with the stored outputs,
since GPU numbers differ (the CUDA AdamW default is foreach, and the allocator rounds sizes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(name: str, cmd: list[str], results: list, timeout: int = 900, cwd: Path = ROOT, lines: int = 25) -> None:
    """Run one check in a subprocess; print the last ``lines`` lines of its output, append (name, passed, seconds)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        ok, output = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        ok, output = False, f"{err.stdout or ''}{err.stderr or ''}\ntimed out after {timeout} s"
    elapsed = time.perf_counter() - start
    tail = output.strip().splitlines()[-lines:]
    # One print per check, so that checks run side by side (--jobs) do not interleave their lines.
    print(f"\n=== {name} ({elapsed:.1f} s): {' '.join(cmd)}\n" + "\n".join(tail), flush=True)
    results.append((name, ok, elapsed))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "gpu_check_out"), help="where executed notebooks and PNGs go")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks executed side by side (each its own kernel)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: gpu_check needs a GPU (the CPU suite is scripts/test.sh)")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    results: list = []
    py = sys.executable
    # Alone first, in a fresh process: the CUDA rules of a prediction (cuda_rules.py: cuBLAS workspaces, dropout
    # masks) against a real step, per phase; its cuBLAS workspaces must not exist yet. Prints the table.
    rules_test = "tests/test_cuda_rules.py::test_cuda_rules_against_a_real_step"
    run("CUDA rules vs a real step", [py, "-m", "pytest", "-q", "-s", "-rs", rules_test], results, lines=80)
    run("CUDA tests", [py, "-m", "pytest", "-q", "-rs", "tests", "-m", "cuda"], results, lines=80)  # @pytest.mark.cuda
    run(
        "CLI on cuda",
        [py, "-m", "anatomy_helpers", "--device", "cuda", "--steps", "3", "--out", str(out / "timeline_cuda.png")],
        results,
    )
    env_note = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env_note == "":
        print("warning: CUDA_VISIBLE_DEVICES is empty; notebooks would run on CPU")
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    # tests/execute.py, not nbconvert: nbconvert's Output-widget stand-in can stall a panel cell for good under
    # Colab's ipywidgets 7 (see that file); run from notebooks/ as the notebooks expect. Each notebook has its own
    # kernel and CUDA context, so their memory figures do not mix when they run side by side.
    os.environ["ANATOMY_AUTORUN"] = "1"  # unattended: a prediction left at None stops nothing (exercises.py)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for nb in notebooks:
            execute = [py, str(ROOT / "tests" / "execute.py"), str(out), str(nb)]
            pool.submit(run, f"notebook {nb.stem}", execute, results, cwd=ROOT / "notebooks")
    print("\n=== summary")
    for name, ok, elapsed in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  ({elapsed:.1f} s)")
    failed = sum(not ok for _, ok, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
