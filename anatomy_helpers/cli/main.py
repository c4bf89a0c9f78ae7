"""``python -m anatomy_helpers``: track a few training steps and report where the memory went.

``python -m anatomy_helpers predict ...``: dry-run two steps of a configuration and say whether it fits on a GPU
(which phase of which step runs out first), without running it (notebook 06; ``--json`` for a machine-readable
answer, ``--fix`` for the ranked candidate fixes). ``predict --hf MODEL ...``: the same for a Hugging Face
model's fine-tune (cli_hf.py). ``python -m anatomy_helpers explain FILE``: a CUDA memory snapshot or a
torch.profiler trace of the learner's own script, in the course's terms (cli/explain.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from matplotlib.backend_bases import FigureCanvasBase

from ..core.checkpointing import CHECKPOINT_POLICIES
from ..core.data import check_text_seq_len
from ..core.model import ATTENTION_IMPLS, DTYPES, ModelConfig
from ..distributed import one_fit
from ..prediction.fit import MAX_LAYERS, FitRequest, will_it_fit
from ..prediction.fixes import cheapest_fix
from ..training.train import OPTIMIZERS, make_model, make_optimizer, pick_device, track_steps
from ..ui.plots import plot_timeline
from .common import (
    add_fit_options,
    check_world_options,
    device_of,
    fields_given,
    positive_int_arg,
    print_fit,
    seed_arg,
)
from .explain import explain_main
from .hf import hf_predict_main


def _check_out_path(out: str) -> None:
    """Raise ValueError unless the timeline can be saved at ``out``: checked before any training."""
    formats = FigureCanvasBase.get_supported_filetypes()  # suffix -> description, e.g. "png"
    path = Path(out)
    if not out or not path.name:
        raise ValueError(f"--out needs a file name, got {out!r}")
    if path.is_dir():
        raise ValueError(f"--out {out!r} is a directory; give a file name such as {str(path / 'timeline.png')!r}")
    if not path.parent.is_dir():
        raise ValueError(f"--out {out!r}: the directory {str(path.parent)!r} does not exist")
    if path.suffix.lower().lstrip(".") not in formats:
        problem = f"matplotlib cannot write {path.suffix!r} files" if path.suffix else "no suffix to pick the format"
        raise ValueError(f"--out {out!r}: {problem}; use one of {', '.join('.' + f for f in sorted(formats))}")


def _add_step_options(p: argparse.ArgumentParser, layers_help: str = "transformer blocks") -> None:
    """The options both commands share: the model's sizes, its attention, dtype and dropout, the batch and the
    optimizer (defaults: ModelConfig's)."""
    d = ModelConfig()
    p.add_argument(
        "--layers", dest="n_layer", metavar="LAYERS", type=positive_int_arg, default=d.n_layer,
        help=f"{layers_help} (default: {d.n_layer})",
    )  # fmt: skip
    p.add_argument("--d-model", type=positive_int_arg, default=d.d_model, help=f"hidden size (default: {d.d_model})")
    p.add_argument(
        "--heads", dest="n_head", metavar="HEADS", type=positive_int_arg, default=d.n_head,
        help=f"attention heads (default: {d.n_head})",
    )  # fmt: skip
    p.add_argument(
        "--seq-len", type=positive_int_arg, default=d.seq_len, help=f"sequence length (default: {d.seq_len})"
    )
    p.add_argument("--batch-size", type=positive_int_arg, default=8, help="sequences per optimizer step (default: 8)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="optimizer (default: adamw)")
    p.add_argument(
        "--attn", dest="attn_impl", choices=ATTENTION_IMPLS, default=d.attn_impl,
        help=f"attention (default: {d.attn_impl})",
    )  # fmt: skip
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype, help=f"model dtype (default: {d.dtype})")
    p.add_argument("--dropout", type=float, default=d.dropout, help=f"dropout probability (default: {d.dropout})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m anatomy_helpers",
        description="Track N training steps of the course's toy transformer and print where the memory went "
        "(a phase x category table in MiB, the peak and the module it happened in), then save the timeline plot.",
        epilog="Other commands: 'predict' (will a configuration fit on a GPU, without running it: predict --help) "
        "and 'explain FILE' (a memory snapshot or profiler trace of your own script: explain --help).",
    )
    _add_step_options(p)
    p.add_argument("--steps", type=positive_int_arg, default=3, help="training steps to track (default: 3)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA if available, else CPU)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed for weights and batches, in [0, 2**32) (default: 0)")
    p.add_argument(
        "--out", default="timeline.png", help="file for the timeline plot; .png, .svg, .pdf ... (default: timeline.png)"
    )
    return p


def build_predict_parser() -> argparse.ArgumentParser:

    d = ModelConfig()
    p = argparse.ArgumentParser(
        prog="python -m anatomy_helpers predict",
        description="Dry-run two training steps (fake tensors: nothing is allocated) and say whether they fit on a "
        "GPU, and if not, which phase of which step runs out first. For a Hugging Face model's fine-tune: "
        "predict --hf MODEL, MODEL a shipped configuration (e.g. qwen2.5-1.5b, or its Hub name Qwen/Qwen2.5-1.5B) "
        "or a config.json; its options: predict --hf qwen2.5-1.5b --help.",
    )
    p.add_argument("--block", choices=("gpt2", "llama"), default="gpt2", help="block (default: gpt2)")
    _add_step_options(p, f"transformer blocks, at most {MAX_LAYERS}")
    p.add_argument(
        "--kv-heads", dest="n_kv_head", metavar="KV_HEADS", type=positive_int_arg, default=None,
        help="llama: key/value heads (default: heads)",
    )  # fmt: skip
    p.add_argument(
        "--mlp-ratio",
        type=positive_int_arg,
        default=d.mlp_ratio,
        help=f"MLP width / hidden size (default: {d.mlp_ratio})",
    )
    p.add_argument(
        "--untied", dest="tie_embeddings", action="store_false",
        help="an LM head of its own (default: tied to the embedding)",
    )  # fmt: skip
    p.add_argument(
        "--vocab", dest="vocab_size", metavar="VOCAB", type=positive_int_arg, default=d.vocab_size,
        help=f"vocabulary (default: {d.vocab_size})",
    )  # fmt: skip
    p.add_argument("--checkpoint", choices=CHECKPOINT_POLICIES, default="none", help="(default: none)")
    p.add_argument(
        "--checkpoint-every", type=positive_int_arg, default=None, help="with --checkpoint every_k: blocks per "
        "checkpointed segment (default: 1)"
    )  # fmt: skip
    add_fit_options(p)
    return p


def _predict_config(args) -> ModelConfig:
    """The ModelConfig the options describe; ValueError (ModelConfig's own) for a bad combination."""
    if args.checkpoint_every is not None and args.checkpoint != "every_k":
        raise ValueError("--checkpoint-every needs --checkpoint every_k")
    fields = fields_given(args, ModelConfig)
    return ModelConfig(**fields | dict(checkpoint_every=fields["checkpoint_every"] or 1))


def predict_main(argv: list[str]) -> int:

    if any(a == "--hf" or a.startswith("--hf=") for a in argv):  # a Hugging Face model: cli_hf.py
        return hf_predict_main(argv)
    parser = build_predict_parser()
    args = parser.parse_args(argv)
    try:  # every value is checked here, before any dry run
        cfg = _predict_config(args)
        device = device_of(args)
        kw = dict(optimizer=args.optimizer, implementation=args.impl, autocast=args.autocast, device=device)
        FitRequest(cfg, args.batch_size, micro_batches=args.micro_batches, **kw).check()
        check_world_options(args)
        per_rank = args.world_size > 1
        if per_rank:
            _check_rank_options(args, argv)
    except ValueError as e:
        parser.error(str(e))
    if per_rank:  # rank 0 of the sharded step, dry-run on torch's fake process group: the one per-rank engine
        report = one_fit.will_it_fit(
            cfg, args.batch_size, device=device, world_size=args.world_size, zero=args.zero,
            micro_batches=args.micro_batches,
        )  # fmt: skip
        print_fit(report, [], device, as_json=args.json, world_size=args.world_size, zero=args.zero, note=report.note)
        return 0
    report = will_it_fit(cfg, args.batch_size, micro_batches=args.micro_batches, **kw)
    fixes = cheapest_fix(cfg, args.batch_size, micro_batches=args.micro_batches, **kw) if args.fix else []
    if not args.json:  # which dry run answered (prediction/periodic.py), before the answer
        print(f"dry run: {report.dry_run}")
    print_fit(report, fixes, device, as_json=args.json, fix=args.fix, dry_run=report.dry_run)
    return 0


def _check_rank_options(args, argv: list[str]) -> None:
    """Per rank, the course GPT trains as lessons 08 and 11's ranks do (AdamW, fp32, torch's CPU default optimizer
    implementation, no fix search): ValueError naming an option given that a rank's dry run does not take."""
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    refused = [o for o in ("--impl", "--autocast", "--fix") if o in given]
    if args.optimizer != "adamw":
        refused.insert(0, "--optimizer")
    if refused:
        raise ValueError(
            f"with --world-size > 1 the course GPT's ranks train as lessons 08 and 11's do (AdamW, fp32, torch's "
            f"default optimizer implementation; no --fix search): {', '.join(refused)} is not modelled per rank"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["predict"]:
        return predict_main(argv[1:])
    if argv[:1] == ["explain"]:
        return explain_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_out_path(args.out)  # before training, not after it
        device = pick_device(args.device)
        config = fields_given(args, ModelConfig)
        ModelConfig(**config)  # check the combination before building anything
        check_text_seq_len(args.seq_len, "--seq-len")  # a real run draws its batches from the course text
    except (ValueError, RuntimeError) as e:
        parser.error(str(e))
    try:
        model = make_model(device=device, seed=args.seed, **config)
    except ValueError as e:  # e.g. the parameters alone would not fit in this machine's RAM
        parser.error(str(e))
    optimizer = make_optimizer(model, args.optimizer)
    print(
        f"{model.num_params():,} parameters, {args.optimizer}, batch {args.batch_size} x {args.seq_len} tokens, "
        f"{args.attn_impl} attention, {args.dtype}, on {device}",
        flush=True,
    )
    trace = track_steps(model, optimizer, args.steps, args.batch_size, seed=args.seed, progress=True)
    print(trace.table())
    times = trace.step_times_s()
    print("wall time per step: " + ", ".join(f"step {s} {t * 1e3:.0f} ms" for s, t in times.items()))
    fig = plot_timeline(trace)
    fig.savefig(args.out, dpi=120)
    print(f"timeline written to {args.out}")
    if device.type == "cuda":
        print(f"CUDA max_memory_allocated: {torch.cuda.max_memory_allocated(device) / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
