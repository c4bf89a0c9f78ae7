"""How long ``python -m anatomy_helpers predict`` takes on a 7B-shaped configuration: one prediction and ``--fix``.

    python benchmarks/predict_time.py            # one prediction and --fix, each in a fresh process
    python benchmarks/predict_time.py --no-fix   # one prediction only

Each run is a fresh ``python -m anatomy_helpers predict`` process, so the times include importing torch and the
course package (printed on its own line: that part no change to the prediction can remove). Each line gives the
wall time and the process's CPU time (user + system): on a machine shared with other work the wall time grows with
the load, the CPU time much less. Targets (issue 17, on 2 cores): one prediction under 10 s, ``--fix`` under 60 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

#: A Llama-7B-shaped model (32 layers of width 4,096, 32 heads, vocabulary 32,000) at batch 1 x 4,096 positions.
SEVEN_B = ["--block", "llama", "--layers", "32", "--d-model", "4096", "--heads", "32", "--vocab", "32000"]
SEVEN_B += ["--seq-len", "4096", "--batch-size", "1", "--attn", "sdpa"]


def timed(args: list[str]) -> str:
    """Wall and CPU seconds of one fresh process running ``args``; its output is checked, not shown."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, env=env, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return f"{wall:5.1f} s wall, {cpu:5.1f} s CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-fix", action="store_true", help="time one prediction only")
    parser.add_argument("--gpu", default="a100-80", help="the device to predict for (default: a100-80)")
    args = parser.parse_args()
    gpu = ["--gpu", args.gpu]
    imports = timed(["-c", "import anatomy_helpers.cli.main, anatomy_helpers.prediction.fit"])
    print(f"import torch and the course package:   {imports} (a floor under every run below)")
    one = timed(["-m", "anatomy_helpers", "predict", *SEVEN_B, *gpu])
    print(f"one prediction, 7B-shaped on {args.gpu}: {one} (target < 10 s)")
    if not args.no_fix:
        fix = timed(["-m", "anatomy_helpers", "predict", *SEVEN_B, *gpu, "--fix"])
        print(f"--fix, 7B-shaped on {args.gpu}:          {fix} (target < 60 s)")


if __name__ == "__main__":
    main()
