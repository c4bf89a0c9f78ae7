"""Record which strategy fits a 7B- and a 70B-shaped model on 80 GB devices, for notebook 11 (too slow to run there).

    python scripts/record_fit.py   # -> anatomy_helpers/lessons/fit_reference.json (about 20 minutes on 2 cores)

Runs ``distributed.fit.fit_table`` (rank 0 of DDP, ZeRO-1, FSDP2 and TP = 8 x FSDP2 at N = 8, 1,024 and 4,096; model
states by the exact rules, the rest from dry runs of BASE and BASE + 1 blocks of the real shape scaled per block)
and writes the rows (bytes) with what they were computed on. Notebook 11 prints them and recomputes one row live.
Re-record after a torch upgrade or a change to the shapes.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a clone without installing the package

import torch  # noqa: E402

from anatomy_helpers.distributed.fit import FIT_STRATEGIES, FIT_WORLD_SIZES, SHAPES, as_records, layer_scaled_memory  # noqa: E402
from anatomy_helpers.lessons.lesson11_scale import FIT_BASE, FIT_REFERENCE  # noqa: E402


def main() -> int:
    start = time.perf_counter()
    rows = []
    for name, model in SHAPES.items():
        for strategy, tp in FIT_STRATEGIES:
            for n in FIT_WORLD_SIZES:
                t = time.perf_counter()
                rows.append(layer_scaled_memory(name, model, strategy, n, tp, base=FIT_BASE))
                print(f"{name} {strategy} tp={tp} N={n}: peak {rows[-1].peak:,} B ({time.perf_counter() - t:.0f} s)")
    record = {
        "shapes": SHAPES,
        "base": FIT_BASE,
        "rows": as_records(rows),  # bytes, rank 0
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "recorded": time.strftime("%Y-%m-%d"),
        "seconds": round(time.perf_counter() - start),
    }
    FIT_REFERENCE.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {FIT_REFERENCE.relative_to(ROOT)}: {len(rows)} rows in {record['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
