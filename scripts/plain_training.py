"""A training script with no course code in it, recording a CUDA memory snapshot of its first steps, as a learner's
own script would: ``scripts/explain_check.py`` explains the snapshot and checks it against what torch measured.

    python scripts/plain_training.py SNAPSHOT [--steps 3] [--stacks python|all] [--trace TRACE.json]

Writes SNAPSHOT (``torch.cuda.memory._dump_snapshot``) and SNAPSHOT with the suffix ``.json``: per step
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` (reset at each step's start), and the parameters'
bytes. Needs CUDA; exits 2 without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

VOCAB, WIDTH, BATCH, SEQ = 1000, 256, 16, 128


def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH),
        nn.Linear(WIDTH, 4 * WIDTH),
        nn.GELU(),
        nn.Linear(4 * WIDTH, WIDTH),
        nn.LayerNorm(WIDTH),
        nn.Linear(WIDTH, VOCAB),
    ).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, device: torch.device, peaks: list) -> None:
    """``steps`` plain training steps; appends each step's max allocated and reserved bytes to ``peaks``."""
    for step in range(1, steps + 1):
        torch.cuda.reset_peak_memory_stats()
        x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
        y = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        peaks.append(
            {
                "step": step,
                "max_allocated": torch.cuda.max_memory_allocated(),
                "max_reserved": torch.cuda.max_memory_reserved(),
            }
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", type=Path, help="where to write the snapshot pickle")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    parser.add_argument("--stacks", choices=("python", "all"), default="python", help="stacks to record")
    parser.add_argument(
        "--trace", type=Path, default=None, help="also profile the same steps of a second model (torch.profiler, "
        "CPU and CUDA, profile_memory) and write its chrome trace here"
    )  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("plain_training.py records a CUDA memory snapshot and needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    model, optimizer = build(device)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peaks = []
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks=args.stacks)
    try:
        train(model, optimizer, args.steps, device, peaks)
        torch.cuda.memory._dump_snapshot(str(args.snapshot))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    if args.trace is not None:
        del model, optimizer
        model, optimizer = build(device)
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities, profile_memory=True, with_stack=True) as prof:
            train(model, optimizer, args.steps, device, [])
        prof.export_chrome_trace(str(args.trace))
    meta = {"gpu": torch.cuda.get_device_name(), "stacks": args.stacks, "param_bytes": param_bytes, "peaks": peaks}
    args.snapshot.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {args.snapshot} ({args.snapshot.stat().st_size / 2**20:.2f} MiB): {json.dumps(meta)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
