"""``python -m anatomy_helpers explain FILE``: what a CUDA memory snapshot or a torch.profiler trace of a training
script says, in the course's terms (prediction/explain.py): steps, phases, each phase's peak by category, step 1
against step 2, allocated against reserved, the phase that runs out first on a GPU and the levers for it."""

from __future__ import annotations

import argparse
import json

from ..prediction.devices import DEFAULT_GPU, device_names
from ..prediction.explain import explain


def build_explain_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m anatomy_helpers explain",
        description="Explain a memory recording of a training script that used no course code: a CUDA memory "
        "snapshot (torch.cuda.memory._dump_snapshot, recorded with _record_memory_history) or a torch.profiler "
        "chrome trace (prof.export_chrome_trace, recorded with profile_memory=True).",
    )
    p.add_argument("file", help="the snapshot pickle or the chrome-trace JSON (.json or .json.gz)")
    p.add_argument(
        "--device", default=DEFAULT_GPU, help=f"the GPU to judge it on: {', '.join(device_names())} "
        f"(default: {DEFAULT_GPU})"
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the answer as JSON (bytes, microseconds)")
    return p


def explain_main(argv: list[str]) -> int:
    parser = build_explain_parser()
    args = parser.parse_args(argv)
    try:
        answer = explain(args.file, args.device)
    except ValueError as e:  # the file, its format, no steps, or the device: said by name, exit 2
        parser.error(str(e))
    print(json.dumps(answer.to_dict(), indent=2) if args.json else answer.table())
    return 0
