"""Does a long tracked run give its memory back? RSS of a process before, during and after many tracked steps.

    python benchmarks/tracking_memory.py [--steps 1000] [--d-model 64] [--layers 2]

Each variant runs in a fresh process: build the model, read RSS, track ``--steps`` steps in one ``with`` block,
then drop the trace and read RSS again. "trim" is the tracker as it is (it hands the freed heap back to the system
after reading a long memory session, scratch.release_freed_heap); "no trim" switches that off, to show what glibc
would keep otherwise. A process on Linux only (RSS from /proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import gc, json, sys
import torch
from anatomy_helpers import make_model, make_optimizer, track_steps
import anatomy_helpers.tracking.scratch as scratch

steps, d_model, layers, trim = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if not trim:
    scratch.TRIM_AFTER_EVENTS = float("inf")

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

torch.set_num_threads(1)
model = make_model(device="cpu", n_layer=layers, d_model=d_model, n_head=2, seq_len=32)
opt = make_optimizer(model, "adamw")
track_steps(model, opt, steps=2, batch_size=4)  # warm: optimizer state and allocator pools exist
gc.collect()
before = rss()
trace = track_steps(model, opt, steps=steps, batch_size=4)
events = len(trace.timeline)
del trace
gc.collect()
print(json.dumps({"before": before, "after": rss(), "events": events}))
"""


def run(steps: int, d_model: int, layers: int, trim: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(steps), str(d_model), str(layers), "1" if trim else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    print(f"{args.steps} tracked steps in one block, {args.layers} layers x {args.d_model}, batch 4, seq 32")
    print(f"{'variant':<8}  {'events':>9}  {'RSS before':>10}  {'RSS after':>10}  {'kept (MB)':>9}")
    for trim in (True, False):
        r = run(args.steps, args.d_model, args.layers, trim)
        kept = (r["after"] - r["before"]) / 1e6
        label = "trim" if trim else "no trim"
        print(f"{label:<8}  {r['events']:>9,}  {r['before'] / 1e6:>10.0f}  {r['after'] / 1e6:>10.0f}  {kept:>9.1f}")


if __name__ == "__main__":
    main()
