"""Every shipped Hugging Face model: its parameters, the dry-run peak of a stated fine-tuning step beside what the
usual rules of thumb say, and how long the dry run takes (issue 21's table).

The step: batch 1 x 2048 tokens, bf16 weights, AdamW (foreach, as ``predict --hf`` runs it by default), SDPA
attention (Gemma 2: eager, transformers refuses SDPA with its logit softcapping), two steps; full fine-tuning and
LoRA r=16 (alpha 32, all linear layers, bf16 base); GPT-2 at 1,024 tokens, its longest. Beside the dry run's peak
(the largest number of bytes of live tensors over the two steps, kernel scratch not included): the weights alone in
bf16 (2 bytes/parameter, what ``accelerate estimate-memory`` and the Hub's calculator list as the model's size) and
the 16 bytes/parameter rule for mixed-precision Adam (fp16/bf16 weights and gradients, fp32 master weights and two
moments: ZeRO paper, Rajbhandari et al. 2020, section 3.1). Each dry run runs in a fresh process, so its CPU time
includes importing torch and transformers and checking every op signature against the real kernels on the tiny twin;
CPU seconds (user + system) are what the run takes on one idle core, whatever the machine's load.

    python benchmarks/hf_models_table.py [--models gpt2 llama-3.2-1b ...] [--seq-len 2048]
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, resource, sys
from anatomy_helpers.prediction.hf import meta_parameters
from anatomy_helpers.prediction.hf_step import FineTune, dry_run_hf
name, fields = sys.argv[1], json.loads(sys.argv[2])
trace = dry_run_hf(name, FineTune(**fields), steps=2)
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps(dict(params=meta_parameters(name), peak=trace.peak().bytes, cpu_s=usage.ru_utime + usage.ru_stime,
                      rss=usage.ru_maxrss * 1024)))
"""

GIB = 2**30


def dry_run(name: str, fields: dict, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, name, json.dumps(fields)], env=env, capture_output=True, text=True
    )
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from anatomy_helpers.prediction.hf import SHIPPED, hf_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHIPPED), choices=list(SHIPPED), metavar="NAME")
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    base = dict(batch_size=1, seq_len=args.seq_len, dtype="bfloat16", optimizer="adamw", foreach=True)
    lora = dict(method="lora", lora_rank=16, lora_alpha=32)
    print(f"batch 1 x {args.seq_len} tokens, bf16 weights, AdamW (foreach), 2 steps; GiB = 2^30 bytes")
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min, {os.cpu_count()} CPUs)")
    head = (
        f"{'model':16s} {'parameters':>15s} {'weights bf16':>12s} {'16 B/param':>10s} {'full peak':>9s} "
        f"{'x 16 B/p':>8s} {'CPU s':>6s} {'LoRA peak':>9s} {'x weights':>9s} {'CPU s':>6s} {'max RSS GB':>10s}"
    )
    print(head)
    print("-" * len(head))
    for name in args.models:
        attn = {"attn_implementation": "eager"} if name.startswith("gemma") else {}
        seq = min(args.seq_len, hf_config(name).max_position_embeddings)  # GPT-2: 1,024 positions
        if seq != args.seq_len:
            print(f"({name}: {seq} tokens, the most its position table holds)")
        full = dry_run(name, {**base, **attn, "seq_len": seq}, env)
        low = dry_run(name, {**base, **attn, **lora, "seq_len": seq}, env)
        if "error" in full or "error" in low:
            print(f"{name:16s} failed: {full.get('error') or low.get('error')}")
            continue
        n = full["params"]
        weights, rule = 2 * n, 16 * n
        print(
            f"{name:16s} {n:15,d} {weights / GIB:12.2f} {rule / GIB:10.2f} {full['peak'] / GIB:9.2f} "
            f"{full['peak'] / rule:8.2f} {full['cpu_s']:6.1f} {low['peak'] / GIB:9.2f} {low['peak'] / weights:9.2f} "
            f"{low['cpu_s']:6.1f} {max(full['rss'], low['rss']) / 1e9:10.2f}",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
