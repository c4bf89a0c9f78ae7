"""What does tracking cost? Times one training step of the default model four ways and prints ratios.

    python benchmarks/tracker_overhead.py [--repeats 7]

Each variant runs warm steps (Adam state already created), interleaved; the figure is the median step time.
The step time includes entering and leaving each tool (StepTracker builds its Trace on exit).
Target for StepTracker: tracked / untracked <= 1.3x.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch

from anatomy_helpers import StepTracker, get_batch, make_model, make_optimizer, train_step


def step_s(model, opt, batch, wrap) -> float:
    with wrap():
        start = time.perf_counter()
        train_step(model, opt, *batch)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per variant (default: 7)")
    args = parser.parse_args()

    model = make_model(device="cpu")
    opt = make_optimizer(model, "adamw")
    batches = [get_batch(8, model.cfg.seq_len, step=i) for i in range(args.repeats)]
    for x, y in batches[:2]:  # warm-up: Adam state, allocator and thread pools
        train_step(model, opt, x, y)

    def tracked():
        return StepTracker(model, opt)

    def profiled():
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)

    variants = {"untracked": contextlib.nullcontext, "StepTracker": tracked, "torch.profiler": profiled}
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        def mem_tracker():
            mt = MemTracker()
            mt.track_external(model, opt)
            return mt

        variants["MemTracker"] = mem_tracker
    except ImportError:
        pass

    # Round-robin, so a machine that gets busier or quieter during the run affects every variant alike.
    times = {name: [] for name in variants}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in batches:
            for name, wrap in variants.items():
                times[name].append(step_s(model, opt, batch, wrap))
    results = {name: statistics.median(ts) for name, ts in times.items()}
    base = results["untracked"]
    print(
        f"default model, batch 8 x {model.cfg.seq_len}, AdamW, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} warm steps"
    )
    for name, t in results.items():
        print(f"{name:>15}: {t * 1e3:7.1f} ms per step   {t / base:5.2f}x untracked")
    verdict = "meets" if results["StepTracker"] / base <= 1.3 else "MISSES"
    print(f"StepTracker {verdict} the 1.3x target")


if __name__ == "__main__":
    main()
