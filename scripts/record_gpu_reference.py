"""Record a real GPU memory snapshot of the course's first training steps, for learners without a GPU.

    python scripts/record_gpu_reference.py                  # 3 steps, batch 8 -> anatomy_helpers/lessons/gpu_reference/
    python scripts/record_gpu_reference.py --steps 2 --max-frames 8

Needs a CUDA GPU and refuses without one. It builds a fresh default model and AdamW (the model, seed and batches of
notebook 07 and ``track_steps``), records its first steps with ``torch.cuda.memory._record_memory_history`` (Python
stacks only) and writes:

* ``first_steps.pickle``: the snapshot, as ``torch.cuda.memory._dump_snapshot`` writes it (pytorch.org/memory_viz and
  ``torch.cuda._memory_viz`` open it);
* ``first_steps.json``: what was recorded (GPU, torch and CUDA versions, steps, batch) and each step's peak of
  allocated and reserved memory.

Notebook 07 opens both. ``--max-frames`` keeps only the innermost frames of each stack, to keep the file small enough
to commit (it warns above ``--warn-mib``). See CONTRIBUTING.md.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a clone without installing the package

from anatomy_helpers import get_batch, make_model, make_optimizer, train_step  # noqa: E402
from anatomy_helpers.core.units import MiB  # noqa: E402
from anatomy_helpers.prediction.snapshot import GPU_REFERENCE, record_cuda_snapshot  # noqa: E402


def trim_frames(snapshot: dict, max_frames: int) -> dict:
    """Keep the innermost ``max_frames`` frames of every block's and every event's stack (in place)."""
    for seg in snapshot.get("segments", []):
        for block in seg.get("blocks", []):
            if "frames" in block:
                block["frames"] = block["frames"][:max_frames]
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            if "frames" in event:
                event["frames"] = event["frames"][:max_frames]
    return snapshot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps to record (default 3, as notebook 07)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=GPU_REFERENCE, help=f"snapshot pickle (default {GPU_REFERENCE})")
    parser.add_argument("--max-frames", type=int, default=0, help="keep this many innermost frames (0: all)")
    parser.add_argument("--max-entries", type=int, default=100_000, help="allocator events to keep at most")
    parser.add_argument("--warn-mib", type=float, default=5.0, help="warn when the pickle is larger (MiB)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.max_frames < 0:
        parser.error("--steps and --batch-size must be positive, --max-frames 0 or more")
    if not torch.cuda.is_available():
        print(
            "record_gpu_reference.py records a real CUDA memory snapshot and needs a CUDA GPU, but "
            "torch.cuda.is_available() is False here; nothing was written.",
            file=sys.stderr,
        )
        return 1

    device = torch.device("cuda", torch.cuda.current_device())
    model = make_model(device=device)
    optimizer = make_optimizer(model, "adamw")
    seq_len = model.cfg.seq_len
    peaks: list[dict[str, int]] = []

    def steps() -> None:
        for i in range(args.steps):
            torch.cuda.reset_peak_memory_stats(device)
            train_step(model, optimizer, *get_batch(args.batch_size, seq_len, step=i, device=device))
            torch.cuda.synchronize(device)
            peaks.append(
                {
                    "step": i + 1,
                    "max_allocated": torch.cuda.max_memory_allocated(device),
                    "max_reserved": torch.cuda.max_memory_reserved(device),
                }
            )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    snapshot = record_cuda_snapshot(steps, args.out, max_entries=args.max_entries)
    if args.max_frames:
        with open(args.out, "wb") as f:
            pickle.dump(trim_frames(snapshot, args.max_frames), f)
    meta = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": "make_model() defaults, AdamW (make_optimizer)",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "max_frames": args.max_frames or "all",
        "peaks": peaks,
    }
    meta_path = args.out.with_suffix(".json")
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / MiB:.2f} MiB) and {meta_path}")
    for p in peaks:
        allocated, reserved = p["max_allocated"] / MiB, p["max_reserved"] / MiB
        print(f"  step {p['step']}: max allocated {allocated:.1f} MiB, max reserved {reserved:.1f} MiB")
    if size > args.warn_mib * MiB:
        print(f"the snapshot is over {args.warn_mib:g} MiB: too big to commit; try --max-frames 8", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
