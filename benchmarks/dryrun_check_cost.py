"""What does checking the fake kernels cost a dry run? Times dry_run_config with and without the op check.

    python benchmarks/dryrun_check_cost.py [--repeats 5]

Two figures per configuration (the default model, and 7B-shaped GPT-2 and llama configurations at batch 1):

* the first dry run in a process, with nothing checked yet (an empty cache on disk): it records the ops, runs each
  new op signature once for real (a 7B-shaped run does that on its small twin, see dryrun.twin_config) and is timed
  against an unchecked dry run;
* the first dry run of a later process (forgetting what this one checked): every signature is read from the cache on
  disk the first run wrote (fake_check_cache.py), and nothing runs for real;
* later dry runs: every signature was checked already, so the check costs one signature lookup per op; the
  median of ``--repeats`` runs each way, interleaved round-robin so that a machine that gets busier or quieter
  affects both alike.

"Unchecked" replaces the checking fake mode by torch's own FakeTensorMode (it notes no calls, checks nothing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from torch._subclasses.fake_tensor import FakeTensorMode

from anatomy_helpers import ModelConfig
from anatomy_helpers.prediction import dryrun, fake_check, fake_check_cache

CONFIGS = {
    "default, batch 8": (ModelConfig(), dict(batch_size=8)),
    "7B gpt2 sdpa, s 2048, batch 1": (
        ModelConfig(n_layer=32, d_model=4096, n_head=32, seq_len=2048, vocab_size=32000, attn_impl="sdpa"),
        dict(batch_size=1, foreach=True),
    ),
    "7B llama sdpa, s 2048, batch 1": (
        ModelConfig(
            block="llama", n_layer=32, d_model=4096, n_head=32, seq_len=2048, vocab_size=32000, attn_impl="sdpa"
        ),
        dict(batch_size=1, foreach=True),
    ),
}


class _Unchecked(FakeTensorMode):
    """torch's fake mode with the ``calls`` the dry run reads: none."""

    def __init__(self):
        super().__init__()
        self.calls = {}


def timed(cfg, kw, checked: bool) -> float:
    dryrun.CheckedFakeTensorMode = fake_check.CheckedFakeTensorMode if checked else _Unchecked
    start = time.perf_counter()
    dryrun.dry_run_config(cfg, **kw)
    return time.perf_counter() - start


def forget() -> None:
    """Forget what this process checked and read from the disk, as a new process starts."""
    fake_check._PASSED.intersection_update(fake_check._ENTRY_OPS)
    fake_check._FAILED.clear()
    fake_check._ASKED.clear()
    fake_check_cache._current = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    header = f"{'first: checked':>15} {'from disk':>10} {'unchecked':>10} {'later: checked':>15} {'unchecked':>10}"
    print(f"{'configuration':32} {header} ratio")
    for name, (cfg, kw) in CONFIGS.items():
        cache = os.environ[fake_check_cache.CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="anatomy-cache-")  # an empty one
        forget()
        timed(cfg, kw, checked=False)  # first-call costs (imports, fake-mode caches), not timed
        first_unchecked = timed(cfg, kw, checked=False)
        first_checked = timed(cfg, kw, checked=True)
        forget()  # as a new process: the cache on disk is kept
        from_disk = timed(cfg, kw, checked=True)
        runs = {True: [], False: []}
        for _ in range(repeats):
            for checked in (True, False):
                runs[checked].append(timed(cfg, kw, checked))
        later = {k: statistics.median(v) for k, v in runs.items()}
        print(
            f"{name:32} {first_checked:14.2f}s {from_disk:9.2f}s {first_unchecked:9.2f}s {later[True]:14.2f}s "
            f"{later[False]:9.2f}s {later[True] / later[False]:.2f}x"
        )
        shutil.rmtree(cache)
    dryrun.CheckedFakeTensorMode = fake_check.CheckedFakeTensorMode


if __name__ == "__main__":
    main()
