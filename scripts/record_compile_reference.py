"""Record what torch.compile does to lesson 10's logits-bound step, for learners whose run skips the compile.

    python scripts/record_compile_reference.py   # -> anatomy_helpers/lessons/compile_reference.json (minutes on a CPU)

Runs ``lessons.optimizations.compile_memory`` on the notebook's configuration (``LOGITS_BOUND``, ``LOGITS_BATCH``,
CPU): the peak of torch.profiler's memory timeline over two profiled steps, eager and compiled with inductor. It
writes those peaks with what they were measured on (torch version, platform, CPU count, date, and the wall time of
the whole run with inductor's cache empty: a temporary TORCHINDUCTOR_CACHE_DIR). Notebook 10 prints them, saying
where they come from, when its compile cell is not run. Re-record after a torch upgrade.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")  # the time of a first compile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a clone without installing the package

import torch  # noqa: E402

from anatomy_helpers.lessons.lesson10_optimizations import (  # noqa: E402
    COMPILE_REFERENCE,
    LOGITS_BATCH,
    LOGITS_BOUND,
    compile_memory,
)


def main() -> int:
    start = time.perf_counter()
    peaks = compile_memory(LOGITS_BOUND, LOGITS_BATCH, device="cpu")
    record = {
        "config": LOGITS_BOUND,
        "batch_size": LOGITS_BATCH,
        "peaks": peaks,  # bytes: the profiler's memory timeline, two steps after a warm-up (compile) step
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "recorded": time.strftime("%Y-%m-%d"),
        "seconds": round(time.perf_counter() - start),
    }
    COMPILE_REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    COMPILE_REFERENCE.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {COMPILE_REFERENCE.relative_to(ROOT)}: {peaks} in {record['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
