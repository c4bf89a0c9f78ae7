"""``python -m anatomy_helpers predict --hf MODEL ...``: will a Hugging Face fine-tune fit on a GPU
(:func:`anatomy_helpers.distributed.hf_fit.will_it_fit_hf`), per rank under DDP or ZeRO at a chosen world size
(a dry run of one rank of the sharded step on torch's fake process group).

MODEL is a shipped configuration's name (prediction/hf.py SHIPPED) or a local config.json (or its folder).
"""

from __future__ import annotations

import argparse

from ..distributed.hf_fit import search_fix_hf, will_it_fit_hf
from ..prediction.dryrun import DryRunError
from ..prediction.fit import IMPLEMENTATION_FLAGS, usable_device
from ..prediction.hf import ATTN_IMPLEMENTATIONS, DTYPES, SHIPPED, hf_config
from ..prediction.hf_step import FINE_TUNE_OPTIMIZERS, FineTune
from ..prediction.recipes import RECIPES, REFUSED, device_recipe
from .common import add_fit_options, check_world_options, device_of, fields_given, positive_int_arg, print_fit


def build_hf_predict_parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(
        prog="python -m anatomy_helpers predict --hf",
        description="Dry-run two fine-tuning steps of a Hugging Face causal LM (fake tensors: nothing is allocated, "
        "no weights are read) and say whether they fit on a GPU, and if not, which phase of which step runs out "
        "first. Under --world-size N the answer is rank 0's, from a dry run of the sharded step on torch's fake "
        "process group.",
    )
    p.add_argument(
        "--hf",
        required=True,
        metavar="MODEL",
        help=f"a config.json (or its folder), or one of {', '.join(SHIPPED)} (or its Hub name, e.g. Qwen/Qwen2.5-3B)",
    )
    p.add_argument("--seq-len", type=positive_int_arg, default=2048, help="tokens per sequence (default: 2048)")
    p.add_argument("--batch-size", type=positive_int_arg, default=1, help="sequences per step and rank (default: 1)")
    p.add_argument(
        "--dtype", choices=DTYPES, default=None,
        help="the weights' dtype (default: the device's recipe: bfloat16, or float32 + fp16 autocast below 8.0)",
    )  # fmt: skip
    p.add_argument(
        "--recipe", choices=(*RECIPES, *REFUSED), default=None,
        help="a named precision recipe (sets --dtype and --autocast; prediction/recipes.py)",
    )  # fmt: skip
    p.add_argument(
        "--attn", dest="attn_implementation", choices=ATTN_IMPLEMENTATIONS, default="sdpa",
        help="attention (default: sdpa)",
    )  # fmt: skip
    experts = ("grouped_mm", "batched_mm", "eager")
    p.add_argument(
        "--experts", dest="experts_implementation", choices=experts,
        help="mixture of experts: transformers' implementation (default: grouped_mm)",
    )  # fmt: skip
    p.add_argument("--gradient-checkpointing", action="store_true", help="HF's gradient_checkpointing_enable()")
    p.add_argument("--optimizer", choices=FINE_TUNE_OPTIMIZERS, default="adamw", help="optimizer (default: adamw)")
    p.add_argument("--lora-rank", type=positive_int_arg, default=None, help="train LoRA adapters of this rank (peft)")
    p.add_argument("--lora-alpha", type=positive_int_arg, default=None, help="with --lora-rank (default: 2 x rank)")
    p.add_argument("--lora-targets", nargs="+", default=None, metavar="MODULE",
                   help="with --lora-rank: peft's target modules (default: all-linear)")  # fmt: skip
    p.add_argument("--freeze", nargs="+", metavar="PREFIX", help="freeze parameters named with these prefixes")
    add_fit_options(p)
    return p


def _fine_tune(args, device) -> tuple[FineTune, str]:
    """The FineTune the options describe, and why its precision recipe was chosen ("" when the options chose it);
    ValueError naming the option for a bad combination."""

    lora = args.lora_rank is not None
    if args.freeze and lora:
        raise ValueError("--freeze and --lora-rank: choose one (LoRA already freezes the whole base model)")
    for option, value in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets)):
        if value is not None and not lora:
            raise ValueError(f"{option} needs --lora-rank")
    if args.batch_size % args.micro_batches:
        raise ValueError(
            f"--batch-size ({args.batch_size}) must be a multiple of --micro-batches ({args.micro_batches})"
        )
    check_world_options(args)
    if args.recipe is not None and (args.dtype or args.autocast):
        raise ValueError("--recipe sets --dtype and --autocast: give one or the other")
    foreach, fused = IMPLEMENTATION_FLAGS[args.impl] if args.optimizer != "adamw8bit" else (None, None)
    method = "lora" if lora else "frozen" if args.freeze else "full"
    fields = {k: v for k, v in fields_given(args, FineTune).items() if v is not None}  # None: FineTune's default
    fields |= dict(foreach=foreach, fused=fused, method=method, freeze=tuple(args.freeze or ()))
    why = ""
    if args.recipe in RECIPES:
        fields["dtype"], fields["autocast"] = RECIPES[args.recipe]
    elif args.dtype is None and args.autocast is None:
        fields["dtype"], fields["autocast"], why = device_recipe(method, device)
    if lora:
        fields["lora_alpha"] = args.lora_alpha or 2 * args.lora_rank
        if args.lora_targets:
            fields["lora_targets"] = tuple(args.lora_targets)
    return FineTune(**fields), why


def hf_predict_main(argv: list[str]) -> int:

    parser = build_hf_predict_parser()
    args = parser.parse_args(argv)
    try:  # every value is checked here, before the dry run
        device = usable_device(device_of(args))
        ft, why = _fine_tune(args, device)
    except ValueError as e:
        parser.error(str(e))
    if args.recipe in REFUSED:
        parser.exit(1, f"dry run refused: the {args.recipe} recipe: {REFUSED[args.recipe]}\n")
    try:
        hf_config(args.hf)
    except (ValueError, ImportError) as e:
        parser.error(f"--hf {args.hf}: {e}")
    try:
        report = will_it_fit_hf(args.hf, ft, device, world_size=args.world_size, zero=args.zero, why=why)
    except DryRunError as e:  # the step is refused by the dry run, not the options
        parser.exit(1, f"dry run refused: {e}\n")
    except (ValueError, ImportError) as e:  # e.g. a --freeze prefix or a LoRA target the model does not have
        parser.error(str(e))
    search = None
    if args.fix:
        search = search_fix_hf(args.hf, ft, device, world_size=args.world_size, zero=args.zero, base=report)
    fixes = search.fixes if search else []
    extra = {}
    if search is not None and args.json:
        extra["refused"] = {lv.name: lv.not_for_fine_tune for lv in search.refused}
        extra["one_device_fits"] = search.one_device
        more = search.more_gpus
        extra["more_gpus"] = None if more is None else {"setup": more.name, "peak_bytes": more.report.peak.tensors}
    if report.dry_run:  # which dry run answered (prediction/hf_periodic.py): before the answer, and in the JSON
        extra["dry_run"] = report.dry_run
        if not args.json:
            print(f"dry run: {report.dry_run}")
    print_fit(
        report,
        fixes,
        device,
        as_json=args.json,
        fix=args.fix,
        world_size=args.world_size,
        zero=args.zero,
        note=report.note,
        **extra,
    )
    if search is not None and not args.json and not report.fits:
        print(search.text(device.name))
    return 0
