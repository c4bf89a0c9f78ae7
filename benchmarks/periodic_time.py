"""How long the periodic dry run takes beside the full-depth dry run it equals, in one process.

    python benchmarks/periodic_time.py

For a 7B-shaped Llama (32 layers of width 4,096, batch 1 x 4,096 positions, sdpa) and GPT-2 small (12 layers of
width 768, batch 8 x 1,024), it times ``dry_run_config`` and ``periodic_dry_run`` (anatomy_helpers/prediction/
periodic.py: depths 3, 4 and 5, then the full depth's rows built from them) and prints their ratio, and checks the
two traces are the same (every sample's bytes per category, phases, peaks, allocations). A first full dry run of
each model runs before the timed ones, so neither timed run pays the once-per-session op checks. Wall and CPU
seconds of this process; on a loaded machine the wall time grows with the load, the CPU time much less.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from anatomy_helpers.core.model import ModelConfig  # noqa: E402
from anatomy_helpers.prediction import periodic  # noqa: E402
from anatomy_helpers.prediction.dryrun import dry_run_config  # noqa: E402

CASES = {
    "7B-shaped Llama, batch 1 x 4096, sdpa": (
        ModelConfig(n_layer=32, d_model=4096, n_head=32, vocab_size=32000, seq_len=4096, block="llama",
                    attn_impl="sdpa"),
        {"batch_size": 1},
    ),
    "GPT-2 small, batch 8 x 1024": (
        ModelConfig(n_layer=12, d_model=768, n_head=12, vocab_size=50257, seq_len=1024), {"batch_size": 8}
    ),
}  # fmt: skip


def timed(fn, *args, **kwargs):
    """(``fn(*args, **kwargs)``, wall seconds, CPU seconds of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, (cfg, run) in CASES.items():
        dry_run_config(cfg, **run)  # the op checks, once per session
        full, full_wall, full_cpu = timed(dry_run_config, cfg, **run)
        (fast, why), fast_wall, fast_cpu = timed(periodic.periodic_dry_run, cfg, **run)
        diff = periodic.trace_differences(fast, full)
        same = "byte-identical" if not diff else f"DIFFERENT: {', '.join(diff)}"
        print(
            f"{name}: full {full_wall:5.1f} s wall ({full_cpu:5.1f} s CPU), periodic {fast_wall:5.1f} s wall "
            f"({fast_cpu:5.1f} s CPU): {full_wall / fast_wall:.2f}x wall, {full_cpu / fast_cpu:.2f}x CPU; {same}"
            + (f"; {why}" if why else "")
        )


if __name__ == "__main__":
    main()
