"""What each lever of lesson 10 costs: peak memory, state bytes per parameter, extra FLOPs and step time.

    python benchmarks/levers.py [--warm 3] [--timed 10] [--device cpu]

For the lesson's two steps (lessons/lesson10_optimizations.py: the optimizer-bound one and the logits-bound one),
each lever
measured as the notebook measures it (two tracked AdamW steps: peak, where it is, state bytes per parameter, FLOPs
of forward + backward counted by ``FlopCounterMode``), then the median wall time of ``--timed`` untracked steps
after ``--warm`` untimed ones, as a ratio to the baseline's. Time ratios depend on the machine and its load: run it
on an idle one, and more than once.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from anatomy_helpers import make_model, make_optimizer, pick_device
from anatomy_helpers.lessons.lesson10_optimizations import (
    LOGITS_BATCH,
    LOGITS_BOUND,
    OPTIMIZER_BATCH,
    OPTIMIZER_BOUND,
    format_levers,
    format_one_liners,
    has_bitsandbytes,
    lever_named,
    measure_levers,
    one_liners,
)
from anatomy_helpers.training.step import StepPlan, run_step


def step_seconds(cfg: dict, batch_size: int, name: str, warm: int, timed: int, device) -> float:
    """Median wall time of one untracked training step of ``cfg`` with the lever ``name``."""
    lever = lever_named(name, cfg)
    model = make_model(device=device, **cfg, **lever.config)
    opt_kw = {k: v for k, v in lever.step.items() if k in ("fused", "foreach", "in_backward")}
    optimizer = make_optimizer(model, lever.step.get("optimizer", "adamw"), **opt_kw)
    plan = StepPlan(batch_size=batch_size, read_loss=False, set_to_none=lever.step.get("set_to_none", True))
    times = []
    for i in range(warm + timed):
        start = time.perf_counter()
        run_step(model, optimizer, plan, i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warm:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=3, help="untimed steps per lever first (default: 3)")
    parser.add_argument("--timed", type=int, default=10, help="timed steps per lever (default: 10)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the GPU if there is one)")
    args = parser.parse_args()
    device = pick_device(args.device)
    print(f"device {device}, {torch.get_num_threads()} threads")
    optimizer_levers = ["baseline", "optimizer step in backward", "bf16 optimizer state", "SGD", "fused optimizer"]
    if has_bitsandbytes():
        optimizer_levers.insert(3, "8-bit state")
    cases = (
        ("optimizer-bound", OPTIMIZER_BOUND, OPTIMIZER_BATCH, optimizer_levers),
        ("logits-bound", LOGITS_BOUND, LOGITS_BATCH, ["baseline", "chunked loss", "checkpoint=full", "sdpa"]),
    )
    for title, cfg, batch, names in cases:
        rows, _ = measure_levers(cfg, batch, names, device=device)
        print(f"\n{title}: {cfg}, batch {batch}")
        print(format_levers(rows))
        base = step_seconds(cfg, batch, names[0], args.warm, args.timed, device)
        for name, row in zip(names, rows):
            ratio = step_seconds(cfg, batch, name, args.warm, args.timed, device) / base
            print(f"  {row.name:30s} step time x{ratio:.2f}")
    print("\nthe one-liners (bytes):")
    print(format_one_liners(one_liners(device=device)))


if __name__ == "__main__":
    main()
