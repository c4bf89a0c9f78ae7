"""What does tracking cost? Times one training step of the default model several ways and prints ratios.

    python benchmarks/tracker_overhead.py [--repeats 15]

Each variant runs warm steps (Adam state already created), interleaved round-robin so a machine that gets busier
or quieter affects every variant alike; the figure is the median. The time of a variant is the whole ``with``
block: entering the tool, the step, and leaving it (the StepTracker builds its Trace on exit, the profiler stops
and, in the "+ export" variant, writes its memory timeline).
Target: StepTracker (with kernel scratch, the default) <= 1.15x untracked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch

from anatomy_helpers import StepTracker, get_batch, make_model, make_optimizer, train_step
from anatomy_helpers.scratch import quiet_stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per variant (default: 15)")
    args = parser.parse_args()

    model = make_model(device="cpu")
    opt = make_optimizer(model, "adamw")
    batches = [get_batch(8, model.cfg.seq_len, step=i) for i in range(args.repeats)]
    for x, y in batches[:2]:  # warm-up: Adam state, allocator and thread pools
        train_step(model, opt, x, y)
    out_dir = tempfile.mkdtemp()

    def plain(batch):
        train_step(model, opt, *batch)

    def tracked(batch, kernel_scratch=True):
        with StepTracker(model, opt, kernel_scratch=kernel_scratch) as tracker:
            train_step(model, opt, *batch)
        assert tracker.trace.peak().bytes > 0

    def profiled(batch, export=False):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
            train_step(model, opt, *batch)
        if export:
            p.export_memory_timeline(os.path.join(out_dir, "timeline.json"), device="cpu")

    variants = {
        "untracked": plain,
        "StepTracker": tracked,
        "StepTracker, no kernel scratch": lambda b: tracked(b, kernel_scratch=False),
        "torch.profiler (collect)": profiled,
        "torch.profiler + export_memory_timeline": lambda b: profiled(b, export=True),
    }
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        def mem_tracker(batch):
            mt = MemTracker()
            mt.track_external(model, opt)
            with mt:
                train_step(model, opt, *batch)

        variants["MemTracker"] = mem_tracker
    except ImportError:
        pass

    times: dict[str, list[float]] = {name: [] for name in variants}
    with warnings.catch_warnings(), quiet_stderr():
        warnings.simplefilter("ignore")  # export_memory_timeline is deprecated (FutureWarning)
        for batch in batches:
            for name, run in variants.items():
                start = time.perf_counter()
                run(batch)
                times[name].append(time.perf_counter() - start)
    results = {name: statistics.median(ts) for name, ts in times.items()}
    base = results["untracked"]
    print(
        f"default model, batch 8 x {model.cfg.seq_len}, AdamW, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} warm steps (enter + step + exit)"
    )
    for name, t in results.items():
        print(f"{name:>40}: {t * 1e3:7.1f} ms per step   {t / base:5.2f}x untracked")
    ratio = results["StepTracker"] / base
    print(f"StepTracker {'meets' if ratio <= 1.15 else 'MISSES'} the 1.15x target ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
