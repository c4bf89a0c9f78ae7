"""What each activation-checkpointing policy costs: peak memory, extra FLOPs and step time, as ratios to "none".

    python benchmarks/checkpointing_cost.py [--batch-size 8] [--warm 3] [--timed 10] [--n-layer 4] [--every 2]

Per policy of notebook 05's line-up (none, offload, attention, selective, every k, full) on the course's default
model: the tracked step peak and activations (two AdamW steps), the FLOPs of one forward + backward counted by
``torch.utils.flop_counter.FlopCounterMode`` (deterministic), and the median wall time of ``--timed`` untracked
training steps after ``--warm`` untimed ones, the policies taking turns step by step. Time ratios depend on the
machine and its load: run it on an idle one, and more than once.
"""

from __future__ import annotations

import argparse

import torch

from anatomy_helpers import pick_device
from anatomy_helpers.lessons.lesson05_checkpointing import (
    lineup,
    measure_policies,
    policy_table,
    time_policies,
    with_time_ratios,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    parser.add_argument("--warm", type=int, default=3, help="untimed steps per policy first (default: 3)")
    parser.add_argument("--timed", type=int, default=10, help="timed steps per policy (default: 10)")
    parser.add_argument("--n-layer", type=int, default=4, help="transformer blocks (default: 4)")
    parser.add_argument("--every", type=int, default=2, help="k of the every-k policy (default: 2)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the GPU if there is one)")
    args = parser.parse_args()
    device = pick_device(args.device)
    policies = lineup(every=args.every)
    config = {"n_layer": args.n_layer}
    print(f"device {device}, {torch.get_num_threads()} threads; {args.n_layer} blocks, batch {args.batch_size}")
    rows, _ = measure_policies(policies, steps=2, batch_size=args.batch_size, device=device, **config)
    seconds = time_policies(
        policies, batch_size=args.batch_size, warm=args.warm, timed=args.timed, device=device, **config
    )
    print(policy_table(with_time_ratios(rows, seconds)))
    print(
        f"median step time over {args.timed} warm steps: "
        + ", ".join(f"{label} {s * 1e3:.1f} ms" for label, s in seconds.items())
    )


if __name__ == "__main__":
    main()
