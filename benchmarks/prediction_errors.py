"""Predict, then measure: the closed form against the dry run on a sweep, and dry-run time and memory at scale.

    python benchmarks/prediction_errors.py            # the error table (63 configs) and the three big dry runs
    python benchmarks/prediction_errors.py --quick    # the first 8 configs
    python benchmarks/prediction_errors.py --random 30 --seed 1   # 30 configs drawn at random instead

The dry run equals the tracker's measurement byte for byte (tests/test_dryrun.py), so it is the measurement
here. Beside the closed form: what weights only, model states only and 16 bytes/param + Korthikanti say. The sweep
covers both blocks, manual and sdpa attention, odd head counts, fp32 and bf16, dropout under every checkpointing
policy, every optimizer and implementation, and vocabulary-heavy shapes at batch 1 (tied and untied), where the
head's and the embedding's V x h gradients decide the peak.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import torch

from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.core.tables import Col, format_table
from anatomy_helpers.prediction.dryrun import dry_run_config
from anatomy_helpers.prediction.estimate import estimate_step, impl_of, textbook_estimates

BASE = dict(n_layer=4, d_model=256, n_head=4, seq_len=128)
#: (ModelConfig changes, optimizer, foreach, fused, micro-batch)
SWEEP = [
    (dict(), "adamw", None, None, 8),
    (dict(attn_impl="sdpa"), "adamw", None, None, 8),
    (dict(dropout=0.1), "adamw", None, None, 8),
    (dict(dropout=0.1, attn_impl="sdpa"), "adamw", None, None, 8),
    (dict(dtype="bfloat16"), "adamw", None, None, 8),
    (dict(checkpoint="full"), "adamw", None, None, 8),
    (dict(checkpoint="every_k", checkpoint_every=2), "adamw", None, None, 8),
    (dict(checkpoint="selective"), "adamw", None, None, 8),
    (dict(checkpoint="attention"), "adamw", None, None, 8),
    (dict(checkpoint="offload"), "adamw", None, None, 8),
    (dict(block="llama"), "adamw", None, None, 8),
    (dict(block="llama", n_kv_head=2, attn_impl="sdpa"), "adamw", None, None, 8),
    (dict(), "sgd", None, None, 8),
    (dict(), "momentum", None, None, 8),
    (dict(), "adam", True, None, 8),
    (dict(), "adamw", None, True, 8),
    (dict(), "sgd", None, True, 8),
    (dict(seq_len=512, attn_impl="sdpa"), "adamw", None, None, 8),
    (dict(seq_len=512), "adamw", None, None, 8),
    (dict(n_layer=8, d_model=128), "adamw", None, None, 8),
    (dict(d_model=512, n_head=8), "adamw", None, None, 8),
    (dict(), "adamw", None, None, 2),
    (dict(seq_len=64), "adamw", None, None, 32),
    (dict(vocab_size=8000), "adamw", None, None, 8),
    (dict(vocab_size=32000, seq_len=256), "adamw", None, None, 8),
    (dict(block="llama", checkpoint="full"), "adamw", None, None, 8),
    (dict(dtype="bfloat16", attn_impl="sdpa", checkpoint="selective"), "adamw", None, None, 8),
    (dict(checkpoint="attention", attn_impl="sdpa"), "adamw", None, None, 8),
    (dict(n_layer=12, d_model=384, n_head=6, seq_len=256, attn_impl="sdpa", vocab_size=50304), "adamw", None, None, 8),
    (dict(block="llama", tie_embeddings=False, vocab_size=32000), "adamw", None, None, 8),
    (dict(dtype="bfloat16"), "momentum", True, None, 8),
    (dict(n_layer=8, checkpoint="every_k", checkpoint_every=4), "adamw", None, None, 8),
    (dict(dropout=0.1, checkpoint="full"), "adamw", None, None, 8),
    (dict(block="llama", n_kv_head=1, checkpoint="selective", attn_impl="sdpa"), "adam", True, None, 4),
    # vocabulary-heavy shapes at batch 1: the head's and the embedding's V x h gradients decide the peak
    (dict(vocab_size=32000), "sgd", None, None, 1),
    (dict(vocab_size=32000), "adamw", None, True, 1),
    (dict(vocab_size=32000, tie_embeddings=False), "sgd", None, None, 1),
    (dict(vocab_size=32000, tie_embeddings=False), "adamw", True, None, 1),
    (dict(n_layer=12, d_model=768, n_head=12, vocab_size=50304), "momentum", None, None, 1),
    (dict(block="llama", vocab_size=32000, dtype="bfloat16"), "adam", None, True, 1),
    (dict(block="llama", vocab_size=32000, tie_embeddings=False, attn_impl="sdpa"), "sgd", True, None, 1),
    (dict(vocab_size=16000, dropout=0.1, checkpoint="full"), "momentum", True, None, 1),
    # dropout under every checkpointing policy, both blocks
    (dict(dropout=0.1, checkpoint="attention"), "adamw", None, None, 8),
    (dict(dropout=0.1, checkpoint="attention", attn_impl="sdpa"), "adamw", None, True, 8),
    (dict(dropout=0.1, checkpoint="selective"), "adamw", None, None, 8),
    (dict(dropout=0.1, checkpoint="every_k", checkpoint_every=2), "sgd", None, None, 8),
    (dict(dropout=0.1, block="llama"), "adamw", True, None, 8),
    (dict(dropout=0.1, block="llama", checkpoint="attention"), "adamw", None, None, 8),
    (dict(dropout=0.1, block="llama", checkpoint="selective", n_kv_head=2), "momentum", None, None, 8),
    (dict(dropout=0.1, block="llama", checkpoint="full", attn_impl="sdpa"), "adam", None, True, 8),
    (dict(dropout=0.1, dtype="bfloat16", checkpoint="attention"), "adamw", None, None, 8),
    # the llama block under the other policies, odd head counts, bf16
    (dict(block="llama", checkpoint="selective"), "adamw", None, None, 8),
    (dict(block="llama", checkpoint="attention", n_kv_head=2), "sgd", None, True, 8),
    (dict(block="llama", checkpoint="every_k", checkpoint_every=2, dtype="bfloat16"), "adamw", None, None, 8),
    (dict(d_model=320, n_head=5, attn_impl="sdpa"), "adamw", None, True, 8),
    (dict(d_model=192, n_head=3), "adam", True, None, 8),
    (dict(d_model=320, n_head=5, block="llama", n_kv_head=1, attn_impl="sdpa"), "sgd", None, None, 4),
    (dict(d_model=192, n_head=3, checkpoint="selective", dropout=0.1, attn_impl="sdpa"), "adamw", True, None, 8),
    (dict(dtype="bfloat16", dropout=0.1, attn_impl="sdpa"), "momentum", None, True, 8),
    (dict(seq_len=256, dropout=0.1), "sgd", None, None, 4),
    # batch 1: the attention matmuls save views of q, k, v instead of copies
    (dict(seq_len=512, block="llama"), "adamw", None, None, 1),
    (dict(seq_len=512, dropout=0.1, checkpoint="full"), "sgd", None, None, 1),
    (dict(seq_len=512, dropout=0.1, attn_impl="sdpa", checkpoint="attention"), "momentum", None, None, 1),
]

#: Big shapes for the laptop claim: (name, config, micro-batch). Optimizer: AdamW, foreach (CUDA's default).
BIG = [
    ("GPT-2 small", dict(n_layer=12, d_model=768, n_head=12, seq_len=1024, vocab_size=50304, attn_impl="sdpa"), 8),
    ("GPT-2 XL", dict(n_layer=48, d_model=1600, n_head=25, seq_len=1024, vocab_size=50304, attn_impl="sdpa"), 8),
    ("7B (32 x 4096)", dict(n_layer=32, d_model=4096, n_head=32, seq_len=2048, vocab_size=32000, attn_impl="sdpa"), 1),
]


def label(changes: dict, optimizer: str, foreach, fused, batch: int) -> str:
    parts = [f"{k}={v}" for k, v in changes.items()] + [optimizer, impl_of(foreach, fused), f"b={batch}"]
    return " ".join(parts)


def error_table(sweep) -> tuple[str, list[float]]:
    rows, errors = [], []
    for changes, optimizer, foreach, fused, batch in sweep:
        cfg = ModelConfig(**{**BASE, **changes})
        trace = dry_run_config(cfg, optimizer=optimizer, foreach=foreach, fused=fused, batch_size=batch, steps=2)
        measured = trace.peak().bytes
        est = estimate_step(cfg, batch, optimizer, impl_of(foreach, fused)).peak
        book = textbook_estimates(cfg, batch, optimizer)
        err = (est - measured) / measured
        errors.append(abs(err))
        pct = [100 * (x - measured) / measured for x in (book.weights_only, book.model_states, book.sixteen_per_param)]
        rows.append((label(changes, optimizer, foreach, fused, batch), measured / 2**20, est / 2**20, 100 * err, *pct))
    cols = [
        Col("config", 70, align="<"),
        Col("measured", 9, ".2f"),
        Col("closed", 9, ".2f"),
        Col("err %", 7, "+.2f"),
        Col("weights %", 9, "+.0f"),
        Col("states %", 9, "+.0f"),
        Col("16B+K %", 9, "+.0f"),
    ]
    note = "(MiB; step peak; errors against the measurement)"
    footer = [
        f"{len(errors)} configs: closed form max |error| {100 * max(errors):.2f} %, "
        f"median {100 * statistics.median(errors):.2f} %; equal to the byte in {errors.count(0.0)} of {len(errors)}"
    ]
    return format_table(cols, rows, note=note, footer=footer), errors


def big_dry_runs() -> None:
    for name, changes, batch in BIG:
        cfg = ModelConfig(**changes)
        wall, cpu = time.perf_counter(), time.process_time()
        trace = dry_run_config(cfg, optimizer="adamw", foreach=True, batch_size=batch, steps=2)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
        est = estimate_step(cfg, batch, "adamw", "foreach").peak
        print(
            f"{name:16s} b={batch}: dry run {wall:5.2f} s wall, {cpu:5.2f} s CPU, peak RSS so far {rss:6.0f} MiB; "
            f"predicted step peak {trace.peak().bytes / 2**30:7.2f} GiB (closed form {est / 2**30:7.2f} GiB)"
        )


def random_sweep(n: int, seed: int) -> list:
    """``n`` configurations drawn at random (held out: the closed form was not written against them)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        heads, width = rng.choice([(2, 128), (3, 192), (4, 256), (5, 320), (6, 384)])
        block = rng.choice(["gpt2", "llama"])
        changes = dict(n_layer=rng.randint(1, 5), d_model=width, n_head=heads, block=block)
        changes.update(seq_len=rng.choice([32, 96, 128, 256]), vocab_size=rng.choice([59, 1000, 16000, 50304]))
        changes.update(attn_impl=rng.choice(["manual", "sdpa"]), dtype=rng.choice(["float32", "bfloat16"]))
        changes.update(dropout=rng.choice([0.0, 0.1]), tie_embeddings=rng.random() < 0.7)
        changes.update(checkpoint=rng.choice(["none", "full", "every_k", "selective", "attention"]))
        if changes["checkpoint"] == "every_k":
            changes["checkpoint_every"] = rng.randint(1, changes["n_layer"])
        if block == "llama" and heads % 2 == 0 and rng.random() < 0.5:
            changes["n_kv_head"] = heads // 2
        if block == "llama" and (width // heads) % 2:
            continue  # rotary embeddings need an even head width
        optimizer = rng.choice(["sgd", "momentum", "adam", "adamw"])
        foreach, fused = rng.choice([(None, None), (True, None), (None, True)])
        batch = rng.choice([1, 2, 4, 8])
        try:
            estimate_step(ModelConfig(**{**BASE, **changes}), batch, optimizer, impl_of(foreach, fused))
        except ValueError:
            continue  # a shape the closed form refuses by name: nothing to compare
        out.append((changes, optimizer, foreach, fused, batch))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first 8 configs only")
    parser.add_argument("--random", type=int, default=0, metavar="N", help="N random configs instead of the sweep")
    parser.add_argument("--seed", type=int, default=0, help="the seed of --random")
    args = parser.parse_args()
    torch.set_num_threads(2)
    dry_run_config(ModelConfig(**BASE), batch_size=1, steps=1)  # imports and first-call costs, not timed
    if args.random:
        print(error_table(random_sweep(args.random, args.seed))[0])
        return
    big_dry_runs()
    table, _ = error_table(SWEEP[:8] if args.quick else SWEEP)
    print(table)


if __name__ == "__main__":
    main()
