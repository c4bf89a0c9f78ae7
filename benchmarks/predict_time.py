"""How long ``python -m anatomy_helpers predict`` takes: one prediction and ``--fix``, with the op checks' disk cache
cold and warm.

    python benchmarks/predict_time.py            # each case's prediction and --fix, each in a fresh process
    python benchmarks/predict_time.py --no-fix   # the predictions only

Each run is a fresh ``python -m anatomy_helpers predict`` process, so the times include importing torch and the
course package (printed on its own line: that part no change to the prediction can remove; the next line adds
``torch._dynamo``, which the first dry run of a process imports when it makes its FakeTensorMode). Each line gives the
wall time and the process's CPU time (user + system): on a machine shared with other work the wall time grows with
the load, the CPU time much less.

Each case runs on one fresh cache directory (``ANATOMY_CACHE_DIR``, see prediction/fake_check.py): *cold*, the
first run on this machine and torch version, which checks each op signature of its dry runs against the real kernel,
then *warm*, which reads those checks from the disk, and the fake kernels' answers the cold run remembered
(prediction/fake_memo_cache.py); the line ends with the ratio of their CPU times. (With a
package that has no disk cache, both runs check everything and the ratio is about 1.) Targets (issue 17, on 2 cores):
one prediction under 10 s, ``--fix`` under 60 s.

Then, on the same warm cache, the same command with the full-depth dry run forced (``ANATOMY_FULL_DRY_RUN=1``, see
prediction/fit.py): the second line of each case gives its time and the ratio of its CPU time to the warm run's
(issue 43: a prediction of a model deeper than 5 blocks dry-runs depths 3, 4 and 5 and extends them, see
prediction/periodic.py; a Hugging Face fine-tune, on one device or one rank, the same from 3, 4 and 5 of its layers,
prediction/hf_periodic.py), the third the line the answer starts with, which says which dry run answered. The two
printed answers are compared, all but that line: "same answer", or the benchmark stops. Were the full run to check
op signatures the warm runs had not met, the line says how many (its time then includes those checks).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: A Llama-7B-shaped model (32 layers of width 4,096, 32 heads, vocabulary 32,000) at batch 1 x 4,096 positions.
SEVEN_B = ["--block", "llama", "--layers", "32", "--d-model", "4096", "--heads", "32", "--vocab", "32000"]
SEVEN_B += ["--seq-len", "4096", "--batch-size", "1", "--attn", "sdpa"]
#: GPT-2 small (12 layers of width 768, 12 heads, its vocabulary padded to 50,304) at batch 8 x 1,024 positions.
GPT2_SMALL = ["--layers", "12", "--d-model", "768", "--heads", "12", "--vocab", "50304", "--seq-len", "1024"]
GPT2_SMALL += ["--batch-size", "8"]


def timed(args: list[str], cache_dir: str | None = None, **env_vars: str) -> tuple[float, float, str]:
    """(wall, CPU) seconds of one fresh process running ``args``, and what it printed (checked, not shown)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env_vars}
    if cache_dir is not None:
        env["ANATOMY_CACHE_DIR"] = cache_dir
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], check=True, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def checks_stored(cache_dir: str) -> int:
    """How many op signatures' checks the cache directory holds."""
    files = Path(cache_dir, "op-checks").glob("*.json")
    return sum(len(json.loads(f.read_text())["results"]) for f in files)


def seconds(wall_cpu: tuple[float, float, str]) -> str:
    return f"{wall_cpu[0]:5.1f} s wall, {wall_cpu[1]:5.1f} s CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-fix", action="store_true", help="time the predictions only")
    parser.add_argument("--gpu", default="a100-80", help="the device for the 7B-shaped model (default: a100-80)")
    args = parser.parse_args()
    imports = timed(["-c", "import anatomy_helpers.cli.main, anatomy_helpers.prediction.fit"])
    print(f"import torch and the course package: {seconds(imports)} (a floor under every run below)")
    dynamo = timed(["-c", "import anatomy_helpers.cli.main, anatomy_helpers.prediction.fit, torch._dynamo"])
    print(f"  and torch._dynamo, which a dry run's FakeTensorMode imports: {seconds(dynamo)} (the floor of a dry run)")
    predict = ["-m", "anatomy_helpers", "predict"]
    cases = [
        ("course default", [], None),
        ("GPT-2 small, batch 8, t4", [*GPT2_SMALL, "--gpu", "t4"], None),
        (f"7B-shaped llama, {args.gpu}", [*SEVEN_B, "--gpu", args.gpu], "< 10 s"),
    ]
    cases += [  # a shipped Hugging Face model: LoRA on one T4 (a Colab learner's question), and one rank of 8
        ("HF llama-3.1-8b LoRA r16, t4", ["--hf", "llama-3.1-8b", "--lora-rank", "16", "--gpu", "t4"], None),
        ("HF llama-3.1-8b, 8 ranks, ZeRO-3", ["--hf", "llama-3.1-8b", "--world-size", "8", "--zero", "3"], None),
    ]
    if not args.no_fix:
        cases += [
            ("--fix, GPT-2 small, batch 8, t4", [*GPT2_SMALL, "--gpu", "t4", "--fix"], None),
            (f"--fix, 7B-shaped llama, {args.gpu}", [*SEVEN_B, "--gpu", args.gpu, "--fix"], "< 60 s"),
        ]
    ratios, speedups = [], []
    for name, options, target in cases:
        with tempfile.TemporaryDirectory(prefix="anatomy-cache-") as cache:
            cold = timed([*predict, *options], cache)
            warm = timed([*predict, *options], cache)
            known = checks_stored(cache)
            full = timed([*predict, *options], cache, ANATOMY_FULL_DRY_RUN="1")
            new_checks = checks_stored(cache) - known
        ratios.append(cold[1] / warm[1])
        speedups.append(full[1] / warm[1])
        answer, full_answer = warm[2].splitlines(), full[2].splitlines()
        if answer[1:] != full_answer[1:]:
            sys.exit(f"{name}: the full-depth dry run's answer differs:\n{warm[2]}\n---\n{full[2]}")
        goal = f" (target {target})" if target else ""
        print(f"{name:34} cold {seconds(cold)}; warm {seconds(warm)}; CPU cold/warm {ratios[-1]:.2f}x{goal}")
        checked = f"; it checked {new_checks} op signatures the warm runs had not" if new_checks else ""
        print(f"{'':34} full depth {seconds(full)}; CPU full/warm {speedups[-1]:.2f}x; same answer{checked}")
        print(f"{'':34} {answer[0]}")
    print(f"CPU cold/warm over the cases: {' '.join(f'{r:.2f}x' for r in ratios)}")
    print(f"CPU full depth/warm over the cases: {' '.join(f'{r:.2f}x' for r in speedups)}")


if __name__ == "__main__":
    main()
