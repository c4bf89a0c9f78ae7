"""Wall time and peak memory (RSS) of a two-step dry run of a full-size Hugging Face model (Llama 3.1 8B).

Target (issue 21): under 15 s and under 1.5 GB on a 2-core laptop. Each configuration runs in a fresh process, so
the time includes importing transformers, building the model on the meta device, the fake steps and checking every
op signature against the real kernels on the tiny twin (once per process). The machine's load is printed too: on
a shared machine the wall time is an upper bound, and the process's CPU time (user + system) is
what it would take on an idle core.

    python benchmarks/hf_dryrun.py [--model llama-3.1-8b] [--seq-len 2048] [--batch-size 1]
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, resource, sys, time
t0, c0 = time.perf_counter(), time.process_time()
from anatomy_helpers.prediction.hf_step import FineTune, dry_run_hf
from anatomy_helpers.prediction.hf import require_transformers
require_transformers()  # transformers itself (hf_step imports it only when called)
t_import, c_import = time.perf_counter() - t0, time.process_time() - c0
ft = FineTune(**json.loads(sys.argv[2]))
t1, c1 = time.perf_counter(), time.process_time()
trace = dry_run_hf(sys.argv[1], ft, steps=2)
t_run, c_run = time.perf_counter() - t1, time.process_time() - c1
usage = resource.getrusage(resource.RUSAGE_SELF)
rss = usage.ru_maxrss * 1024  # Linux: KiB
cpu = usage.ru_utime + usage.ru_stime  # CPU seconds of the whole process: what the wall time is on an idle core
print(json.dumps(dict(import_s=t_import, run_s=t_run, import_cpu=c_import, run_cpu=c_run, cpu_s=cpu, rss=rss,
                      peak=trace.peak().bytes)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    lora = dict(method="lora", lora_rank=16, lora_alpha=32)
    configs = {  # AdamW single-tensor (torch's CPU default) and foreach (predict --hf's default, a GPU's default)
        "full, bf16, AdamW": dict(dtype="bfloat16"),
        "full, bf16, AdamW foreach": dict(dtype="bfloat16", foreach=True),
        "full, bf16, AdamW, checkpointing": dict(dtype="bfloat16", gradient_checkpointing=True),
        "LoRA r=16 (bf16 base)": dict(dtype="bfloat16", **lora),
        "LoRA r=16 (bf16 base), foreach": dict(dtype="bfloat16", foreach=True, **lora),
    }
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    print(f"{args.model}, batch {args.batch_size} x {args.seq_len} tokens, 2 steps, on {os.cpu_count()} CPUs")
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min)")
    head = ("import s", "dry run s", "total s", "import CPU s", "run CPU s", "CPU s", "peak RSS GB", "peak GiB")
    widths = (9, 10, 8, 12, 9, 6, 12, 9)
    print(f"{'configuration':36s} " + " ".join(f"{h:>{w}s}" for h, w in zip(head, widths)))
    for name, fields in configs.items():
        fields = dict(fields, batch_size=args.batch_size, seq_len=args.seq_len)
        out = subprocess.run(
            [sys.executable, "-c", CHILD, args.model, json.dumps(fields)], env=env, capture_output=True, text=True
        )
        if out.returncode:
            print(f"{name:36s} failed: {out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        total = r["import_s"] + r["run_s"]
        print(
            f"{name:36s} {r['import_s']:9.1f} {r['run_s']:10.1f} {total:8.1f} {r['import_cpu']:12.1f} "
            f"{r['run_cpu']:9.1f} {r['cpu_s']:6.1f} {r['rss'] / 1e9:12.2f} {r['peak'] / 2**30:9.2f}",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
