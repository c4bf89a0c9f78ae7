"""How long ``python -m anatomy_helpers predict`` takes: one prediction and ``--fix``, with the op checks' disk cache
cold and warm.

    python benchmarks/predict_time.py            # each case's prediction and --fix, each in a fresh process
    python benchmarks/predict_time.py --no-fix   # the predictions only

Each run is a fresh ``python -m anatomy_helpers predict`` process, so the times include importing torch and the
course package (printed on its own line: that part no change to the prediction can remove). Each line gives the
wall time and the process's CPU time (user + system): on a machine shared with other work the wall time grows with
the load, the CPU time much less.

Each case runs twice on one fresh cache directory (``ANATOMY_CACHE_DIR``, see prediction/fake_check.py): *cold*, the
first run on this machine and torch version, which checks each op signature of its dry runs against the real kernel,
then *warm*, which reads those checks from the disk; the line ends with the ratio of their CPU times. (With a
package that has no disk cache, both runs check everything and the ratio is about 1.) Targets (issue 17, on 2 cores):
one prediction under 10 s, ``--fix`` under 60 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

#: A Llama-7B-shaped model (32 layers of width 4,096, 32 heads, vocabulary 32,000) at batch 1 x 4,096 positions.
SEVEN_B = ["--block", "llama", "--layers", "32", "--d-model", "4096", "--heads", "32", "--vocab", "32000"]
SEVEN_B += ["--seq-len", "4096", "--batch-size", "1", "--attn", "sdpa"]
#: GPT-2 small (12 layers of width 768, 12 heads, its vocabulary padded to 50,304) at batch 8 x 1,024 positions.
GPT2_SMALL = ["--layers", "12", "--d-model", "768", "--heads", "12", "--vocab", "50304", "--seq-len", "1024"]
GPT2_SMALL += ["--batch-size", "8"]


def timed(args: list[str], cache_dir: str | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh process running ``args``; its output is checked, not shown."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if cache_dir is not None:
        env["ANATOMY_CACHE_DIR"] = cache_dir
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, env=env, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def seconds(wall_cpu: tuple[float, float]) -> str:
    return f"{wall_cpu[0]:5.1f} s wall, {wall_cpu[1]:5.1f} s CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-fix", action="store_true", help="time the predictions only")
    parser.add_argument("--gpu", default="a100-80", help="the device for the 7B-shaped model (default: a100-80)")
    args = parser.parse_args()
    imports = timed(["-c", "import anatomy_helpers.cli.main, anatomy_helpers.prediction.fit"])
    print(f"import torch and the course package: {seconds(imports)} (a floor under every run below)")
    predict = ["-m", "anatomy_helpers", "predict"]
    cases = [
        ("course default", [], None),
        ("GPT-2 small, batch 8, t4", [*GPT2_SMALL, "--gpu", "t4"], None),
        (f"7B-shaped llama, {args.gpu}", [*SEVEN_B, "--gpu", args.gpu], "< 10 s"),
    ]
    if not args.no_fix:
        cases += [
            ("--fix, GPT-2 small, batch 8, t4", [*GPT2_SMALL, "--gpu", "t4", "--fix"], None),
            (f"--fix, 7B-shaped llama, {args.gpu}", [*SEVEN_B, "--gpu", args.gpu, "--fix"], "< 60 s"),
        ]
    ratios = []
    for name, options, target in cases:
        with tempfile.TemporaryDirectory(prefix="anatomy-cache-") as cache:
            cold = timed([*predict, *options], cache)
            warm = timed([*predict, *options], cache)
        ratios.append(cold[1] / warm[1])
        goal = f" (target {target})" if target else ""
        print(f"{name:34} cold {seconds(cold)}; warm {seconds(warm)}; CPU cold/warm {ratios[-1]:.2f}x{goal}")
    print(f"CPU cold/warm over the cases: {' '.join(f'{r:.2f}x' for r in ratios)}")


if __name__ == "__main__":
    main()
