"""``python -m anatomy_helpers.distributed``: per-rank memory of DDP, ZeRO-1 and FSDP2 from the command line.

Without torchrun it starts ``--world-size`` local ranks (:func:`~anatomy_helpers.distributed.world.run_world`); under
``torchrun --nproc-per-node N -m anatomy_helpers.distributed`` this process is one rank. Ranks started by
``run_world`` come here too (``--worker``). Either way rank 0 prints the per-rank table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from .ranks import STRATEGIES, RankJob, rank_process_group, run_job
from .world import check_jobs, format_rank_table, rank_row, rank_rows, run_world, worker_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m anatomy_helpers.distributed",
        description="Per-rank memory of DDP, ZeRO-1 and FSDP2 on the course GPT. Under torchrun every rank runs "
        "here; without it, --world-size local processes are started.",
    )
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # run_world's ranks: the folder with jobs.pkl
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.backend)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # under torchrun: this process is one rank
    try:
        jobs = [
            RankJob(s, steps=args.steps, batch_size=args.batch_size, micro_batches=args.micro_batches)
            for s in args.strategies
        ]
        if torchrun:
            check_jobs(jobs, int(os.environ["WORLD_SIZE"]))
        else:
            results = run_world(jobs, args.world_size, backend=args.backend or "gloo")
    except ValueError as e:  # a bad argument: a message and exit code 2, not a traceback
        parser.error(str(e))
    if torchrun:
        with rank_process_group(args.backend) as (rank, world_size, device):
            mine = [run_job(job, rank, world_size, device) for job in jobs]
            gathered = [None] * world_size if rank == 0 else None
            dist.gather_object([rank_row(r) for r in mine], gathered, dst=0)
        if rank == 0:
            print(format_rank_table([row for rows in zip(*gathered) for row in rows]))
        return 0
    print(format_rank_table(rank_rows(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
