"""How long ``explain`` takes on a large snapshot, and how much memory it needs.

    python benchmarks/explain_speed.py [--mb 100] [--keep PATH]

Builds a synthetic snapshot of about ``--mb`` MB from the shipped H200 reference
(``lessons/gpu_reference/first_steps.pickle``): its step 2 (a steady-state step: it frees all it allocates) repeated
until the pickle is that big, each copy with its own stack dicts (as a real dump has them) and later times. Then
times, separately, reading the pickle, cutting and classifying (``explain_events``) and the whole of
``explain`` as the CLI runs it, and prints the process's peak resident memory. The issue's target: 100 MB within
30 s on two idle cores. Times depend on the machine and its load: run it on an idle one.
"""

from __future__ import annotations

import argparse
import copy
import pickle
import resource
import sys
import tempfile
import time
from pathlib import Path

from anatomy_helpers.prediction.explain import explain, explain_events
from anatomy_helpers.prediction.explain_read import load_recording, snapshot_events
from anatomy_helpers.prediction.snapshot import GPU_REFERENCE


def step_two(trace: list) -> tuple[int, int]:
    """(first, last + 1) event index of the reference's step 2: from its batch to step 3's batch."""
    batches = [
        i
        for i, e in enumerate(trace)
        if e["action"] == "alloc" and e["frames"][:1] and e["frames"][0]["name"] == "get_batch"
    ]
    return batches[2], batches[4]  # two allocations per batch (inputs and targets)


def build(mb: float) -> dict:
    snap = pickle.loads(GPU_REFERENCE.read_bytes())
    trace = snap["device_traces"][0]
    a, b = step_two(trace)
    one = trace[a:b]
    span = one[-1]["time_us"] - one[0]["time_us"] + 1000
    fresh = [dict(e, frames=copy.deepcopy(e["frames"])) for e in one]
    per_copy = len(pickle.dumps([one, fresh])) - len(pickle.dumps(one))  # its strings already written once
    copies = max(1, int(mb * 1e6 / per_copy))
    tail = trace[b:]
    out = trace[:b]
    for k in range(1, copies + 1):
        for e in one:
            e2 = dict(e, frames=copy.deepcopy(e["frames"]), time_us=e["time_us"] + k * span)
            out.append(e2)
    out += [dict(e, time_us=e["time_us"] + copies * span) for e in tail]
    snap["device_traces"][0] = out
    return snap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100, help="size of the snapshot to build, MB (default: 100)")
    parser.add_argument("--keep", type=Path, default=None, help="write the snapshot there and keep it")
    args = parser.parse_args()
    t = time.perf_counter()
    snap = build(args.mb)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "big.pickle"
        path.write_bytes(pickle.dumps(snap))
        del snap
        built = time.perf_counter() - t
        events = None
        t = time.perf_counter()
        kind, obj = load_recording(path)
        loaded = time.perf_counter() - t
        t = time.perf_counter()
        ev = snapshot_events(obj, str(path))
        events = len(ev)
        del obj
        read = time.perf_counter() - t
        t = time.perf_counter()
        ex = explain_events(ev)
        cut = time.perf_counter() - t
        del ex, ev
        t = time.perf_counter()
        answer = explain(path, "t4")
        whole = time.perf_counter() - t
        size = path.stat().st_size
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(
        f"snapshot: {size / 1e6:.1f} MB, {events:,} allocations and frees, {len(answer.steps):,} steps "
        f"(built in {built:.1f} s)"
    )
    print(f"  unpickle (no classes allowed):   {loaded:6.2f} s")
    print(f"  events and their stacks' labels: {read:6.2f} s")
    print(f"  steps, categories, timeline:     {cut:6.2f} s")
    print(f"  explain(path) as the CLI runs it: {whole:6.2f} s   (target: < 30 s for 100 MB on two idle cores)")
    print(f"  peak resident memory of this process: {rss:,.0f} MiB")
    print(f"python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
