"""What does tracking cost? Times one training step of the default model several ways and prints ratios.

    python benchmarks/tracker_overhead.py [--repeats 15]

Each variant runs warm steps (Adam state already created), interleaved round-robin so a machine that gets busier
or quieter affects every variant alike; the figure is the median. The time of a variant is the whole ``with``
block: entering the tool, the step, and leaving it (the StepTracker builds its Trace on exit, the profiler stops
and, in the "+ export" variant, writes its memory timeline). The "steps per block" row tracks several steps in
one block, as the notebooks do, and reports the time per step.
Target: StepTracker (with kernel scratch, the default) <= 1.15x untracked.

Two floor rows show what any tracker built like this one pays before it records anything: a
``TorchDispatchMode`` that only runs each op (every op of the step, backward included, makes a round trip
through Python), and the memory-only profiler session that kernel scratch is read from (started, run, stopped
and its events read). The StepTracker's own bookkeeping is what it costs above their sum.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from anatomy_helpers import StepTracker, get_batch, make_model, make_optimizer, train_step
from anatomy_helpers.tracking.scratch import MemoryEvents, quiet_stderr


class _RunEveryOp(TorchDispatchMode):
    """The floor of a dispatch-mode tracker: each op goes through Python and is run, nothing else."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as the StepTracker's own mode (see tracker._OpWatcher)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


BLOCK = 5  # steps in one `with` block for the amortised row: entering and leaving are paid once for them all


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

    def tracked(batch, kernel_scratch=True, steps=1):
        with StepTracker(model, opt, kernel_scratch=kernel_scratch) as tracker:
            for _ in range(steps):
                train_step(model, opt, *batch)
        assert tracker.trace.peak().bytes > 0

    def mode_only(batch):
        with _RunEveryOp():
            train_step(model, opt, *batch)

    def memory_session_only(batch):
        session = MemoryEvents()
        session.start()
        train_step(model, opt, *batch)
        session.stop()

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
        f"StepTracker, {BLOCK} steps per block": lambda b: tracked(b, steps=BLOCK),
        "floor: dispatch mode that only runs ops": mode_only,
        "floor: memory session alone": memory_session_only,
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

    steps_per_call = {f"StepTracker, {BLOCK} steps per block": BLOCK}  # its time is per step
    times: dict[str, list[float]] = {name: [] for name in variants}
    with warnings.catch_warnings(), quiet_stderr():
        warnings.simplefilter("ignore")  # export_memory_timeline is deprecated (FutureWarning)
        for batch in batches:
            for name, run in variants.items():
                start = time.perf_counter()
                run(batch)
                times[name].append((time.perf_counter() - start) / steps_per_call.get(name, 1))
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
