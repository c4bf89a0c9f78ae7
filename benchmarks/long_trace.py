"""Do trace queries stay linear? Summarise and plot a long trace of a small model, and print the times.

    python benchmarks/long_trace.py [--steps 1000]

Tracks ``--steps`` steps of a 1-layer, 32-wide model (cheap to run), then times what a learner does with the
trace: the phase summaries, the phase x category table, the peak, and the timeline plot (drawn to PNG).
Target: all of it under 2 s for 1,000 steps (it took 88 s + 76 s when the queries were quadratic).
"""

from __future__ import annotations

import argparse
import io
import time

from anatomy_helpers import make_model, make_optimizer, plot_timeline, track_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="training steps to track (default: 1000)")
    args = parser.parse_args()
    model = make_model(device="cpu", n_layer=1, d_model=32, n_head=2, seq_len=16)
    start = time.perf_counter()
    trace = track_steps(model, make_optimizer(model, "adamw"), steps=args.steps, batch_size=2)
    tracked_s = time.perf_counter() - start
    print(f"{args.steps} steps tracked in {tracked_s:.1f} s: {len(trace.timeline):,} samples")

    timings = {}
    start = time.perf_counter()
    phases = trace.phases()
    timings["phases()"] = time.perf_counter() - start
    start = time.perf_counter()
    table = trace.table()
    timings["table()"] = time.perf_counter() - start
    start = time.perf_counter()
    peak = trace.peak()
    timings["peak()"] = time.perf_counter() - start
    start = time.perf_counter()
    plot_timeline(trace).savefig(io.BytesIO(), format="png")
    timings["plot_timeline + PNG"] = time.perf_counter() - start
    for name, t in timings.items():
        print(f"{name:>20}: {t:6.3f} s")
    total = sum(timings.values())
    print(f"{len(phases)} phases, {len(table.splitlines())} table lines, peak {peak}")
    print(f"summarised and plotted in {total:.2f} s: {'meets' if total < 2 else 'MISSES'} the 2 s target")


if __name__ == "__main__":
    main()
