"""One rank of a data-parallel Hugging Face fine-tune, full size, through the CLI: per-phase peaks and wall time.

The case of issue 40: Qwen2.5 7B (shipped config), full fine-tune, bf16, AdamW (foreach), batch 1 x 2,048 tokens per
rank, ZeRO-2 at 4 ranks. ``predict --hf`` dry-runs rank 0 of the sharded step on torch's fake process group
(distributed/hf_fit.py); the unit tests check the same path on the architecture's tiny twin. A fresh process, so the
time includes importing torch and transformers and checking each op on the twin; the process's CPU time is what the
wall time would be on an idle core.

    python benchmarks/hf_rank_fit.py [--model qwen2.5-7b] [--world-size 4] [--zero 2]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--zero", type=int, default=2)
    args = parser.parse_args()
    cmd = [sys.executable, "-m", "anatomy_helpers", "predict", "--hf", args.model, "--json"]
    cmd += ["--world-size", str(args.world_size), "--zero", str(args.zero)]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    answer = json.loads(out.stdout)
    for p in answer["phases"]:
        print(f"step {p['step']} {p['phase']:<9} {p['tensor_bytes'] / 2**30:6.2f} GiB tensors")
    print(answer["note"])
    print(f"wall {wall:.1f} s, CPU {child.ru_utime + child.ru_stime:.1f} s, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
