"""On a CUDA machine: record a snapshot of a training script with no course code in it (scripts/plain_training.py),
explain it (anatomy_helpers/prediction/explain.py) and check the answer against what torch measured during the run.

    python scripts/explain_check.py [--out DIR]

Once with Python stacks and once with all stacks (C++ too). Checks, per recording: the steps found; each step's
most reserved memory equal to ``torch.cuda.max_memory_reserved`` of that step; each step's peak at most
``max_memory_allocated`` and within 5 % of it (the snapshot's events record the bytes asked for; the allocator
counts whole blocks, rounded up); the parameters alive at the peak equal to the model's parameter bytes; AdamW's two
moments (twice the parameter bytes) made in step 1 and in no later step; a cuBLAS workspace among the unclassified
bytes. Then a torch.profiler chrome trace of the same steps: the steps found, AdamW's state made in step 1 alone.
Prints each answer; exits 1 if a check fails, 2 without CUDA. scripts/gpu_check.py runs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, as the other scripts use it

STEPS = 3


def check(answer, meta) -> list[str]:
    """The failed checks (empty when every one passes)."""
    failed = []
    steps = [s.step for s in answer.steps]
    if steps != list(range(1, STEPS + 1)):
        failed.append(f"steps found {steps}, expected 1..{STEPS}")
        return failed
    for s, p in zip(answer.steps, meta["peaks"]):
        if s.reserved_max != p["max_reserved"]:
            failed.append(
                f"step {s.step}: most reserved {s.reserved_max:,} != max_memory_reserved {p['max_reserved']:,}"
            )
        if not 0.95 * p["max_allocated"] <= s.peak <= p["max_allocated"]:
            failed.append(
                f"step {s.step}: peak {s.peak:,} not within 5 % below max_memory_allocated {p['max_allocated']:,}"
            )
    params = meta["param_bytes"]
    if answer.peak.breakdown["parameters"] != params:
        failed.append(f"parameters at the peak {answer.peak.breakdown['parameters']:,} != the model's {params:,}")
    made = [s.state_made for s in answer.steps]
    if made != [2 * params] + [0] * (STEPS - 1):
        failed.append(f"optimizer state made per step {made}, expected [{2 * params:,}, 0, ...] (AdamW's two moments)")
    if not any("cuBLAS" in why for why in answer.unclassified_at_peak):
        failed.append(f"no cuBLAS workspace among the unclassified bytes at the peak: {answer.unclassified_at_peak}")
    return failed


def check_trace(answer, meta) -> list[str]:
    """The failed checks of a CUDA profile's answer: the steps, and AdamW's state made in step 1 alone (within 1 %:
    the profiler reports the allocator's rounded block sizes)."""
    steps = [s.step for s in answer.steps]
    if steps != list(range(1, STEPS + 1)):
        return [f"steps found {steps}, expected 1..{STEPS}"]
    made, state = [s.state_made for s in answer.steps], 2 * meta["param_bytes"]
    if not (abs(made[0] - state) <= 0.01 * state and not any(made[1:])):
        return [f"optimizer state made per step {made}, expected about [{state:,}, 0, ...]"]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_check_out", help="where the snapshots go")
    args = parser.parse_args()
    import torch  # after the arguments: --help needs no torch

    if not torch.cuda.is_available():
        print("explain_check.py records a CUDA snapshot and needs a GPU", file=sys.stderr)
        return 2
    from anatomy_helpers.prediction.explain import explain

    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for stacks in ("python", "all"):
        path = args.out / f"plain_training_{stacks}.pickle"
        script = [sys.executable, str(ROOT / "scripts" / "plain_training.py"), str(path), "--steps", str(STEPS)]
        subprocess.run([*script, "--stacks", stacks], check=True)  # its own process: no course code imported
        meta = json.loads(path.with_suffix(".json").read_text())
        answer = explain(path, "this GPU")
        print(f"\n--- stacks={stacks}\n{answer.table()}")
        failed += [f"stacks={stacks}: {f}" for f in check(answer, meta)]
    # A torch.profiler chrome trace of the same steps (CUDA memory events): the steps and AdamW's state.
    path, trace = args.out / "plain_training_trace.pickle", args.out / "plain_training_trace.json"
    script = [sys.executable, str(ROOT / "scripts" / "plain_training.py"), str(path), "--steps", str(STEPS)]
    subprocess.run([*script, "--trace", str(trace)], check=True)
    meta = json.loads(path.with_suffix(".json").read_text())
    answer = explain(trace, "this GPU")
    print(f"\n--- torch.profiler trace\n{answer.table()}")
    failed += [f"profiler trace: {f}" for f in check_trace(answer, meta)]
    print("\n" + ("\n".join(f"FAIL {f}" for f in failed) or "every check passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
