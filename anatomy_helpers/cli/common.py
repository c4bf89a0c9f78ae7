"""What both prediction commands share (``cli/main.py`` for the course GPT, ``cli/hf.py`` for Hugging Face models):
argparse types that check through checks.py, the options of a fit question (micro-batches, optimizer
implementation, autocast, the GPU, --json, --fix), and the JSON form of a fit report and its fixes (bytes)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..core.checks import int_in, positive_int, positive_number
from ..distributed.hf_fit import ZERO_STRATEGIES
from ..prediction.devices import DEFAULT_GPU, DEVICES, gib_device
from ..prediction.fit import IMPLEMENTATION_FLAGS
from ..prediction.fixes import fixes_table
from ..training.step import AUTOCAST_CHOICES


def _argument(parse, check, what: str):
    """An argparse ``type``: ``parse`` the text (``what`` is expected), then ``check`` the value (checks.py says
    why it is refused)."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            return check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("the value ")) from None

    return convert


positive_int_arg = _argument(int, lambda v: positive_int("the value", v), "a whole number")
seed_arg = _argument(int, lambda v: int_in("the value", v, 0, 2**32, "2**32"), "a whole number")
positive_gib_arg = _argument(float, lambda v: positive_number("the value", v), "a number of GiB")


def fields_given(args: argparse.Namespace, config_class) -> dict:
    """The parsed options that set a field of the dataclass ``config_class``: each such option's ``dest`` is the
    field's name (``--layers`` sets ``n_layer``), so a config is built from its options without a list of them."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return {name: value for name, value in vars(args).items() if name in names}


def report_answer(report, device) -> dict:
    """A FitReport as a JSON-ready dict (bytes): the verdict, each phase and the peak's breakdown."""
    return {
        "config": report.label,
        "device": report.device,
        "capacity_bytes": report.capacity,  # as a process sees it (the fit's figure)
        "driver_bytes": device.driver_total,  # nvidia-smi's, for a named GPU (None otherwise)
        "usable_bytes": report.usable,
        "compute_capability": None if device.capability is None else ".".join(map(str, device.capability)),
        "rules": report.rules,
        "fits": report.fits,
        "too_close_to_call": report.close,
        "verdict": report.verdict(),
        "decided_by": "the simulated caching allocator's reserved bytes, capped at usable_bytes",
        "assumptions": list(report.assumption_lines()),
        "runs_out_first": None if report.failure is None else dict(zip(("step", "phase"), report.failure)),
        "phases": [
            dict(step=p.step, phase=p.phase, tensor_bytes=p.tensors, reserved_bytes=p.reserved) for p in report.phases
        ],
        "peak_breakdown_bytes": report.peak.breakdown,
    }


def fixes_answer(fixes) -> list[dict]:
    """Ranked fixes (prediction/fixes.py Fix) as JSON-ready dicts."""
    return [
        dict(
            change=f.name,
            fits=f.fits,
            peak_bytes=f.report.peak.tensors,
            extra_flops=f.extra_flops,
            changes=f.effect,
            changes_training=f.changes_training,
        )
        for f in fixes
    ]


#: What ``--fix`` prints for a step that fits as it is (the catalogue's rule: nothing is ranked then).
FITS_AS_IT_IS = "fits as it is: no change needed"


def print_fit(report, fixes, device, *, as_json: bool, fix: bool = False, **extra) -> None:
    """Print a fit report and its ranked fixes (``fix``: they were asked for): as tables, or (``as_json``) as one
    JSON object with ``extra``'s keys added. A step that fits ranks no fix: ``fix`` then prints
    :data:`FITS_AS_IT_IS`."""
    if as_json:
        print(json.dumps(report_answer(report, device) | extra | {"fixes": fixes_answer(fixes)}, indent=2))
        return

    print(report.table())
    if fixes:
        print(fixes_table(fixes))
    elif fix and report.fits:
        print(FITS_AS_IT_IS)


def add_fit_options(p: argparse.ArgumentParser) -> None:
    """The options both ``predict`` commands take: gradient accumulation, the optimizer's implementation, autocast,
    the device (a named GPU, :data:`~anatomy_helpers.prediction.devices.DEFAULT_GPU` unless given, or a size in
    GiB), data parallelism (``--world-size``, ``--zero``: the answer is rank 0's, from the one per-rank engine),
    ``--json`` and ``--fix``."""

    p.add_argument(
        "--micro-batches", type=positive_int_arg, default=1, help="gradient accumulation: micro-batches per step, "
        "dividing --batch-size (default: 1)"
    )  # fmt: skip
    p.add_argument("--impl", choices=tuple(IMPLEMENTATION_FLAGS), default="foreach", help="(default: foreach)")
    autocasts = tuple(c for c in AUTOCAST_CHOICES if c is not None)
    p.add_argument("--autocast", choices=autocasts, default=None, help="mixed precision (default: off)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument(
        "--gpu",
        type=str.lower,
        choices=tuple(DEVICES),
        default=DEFAULT_GPU,
        help=f"the device (default: {DEFAULT_GPU}, a free Colab runtime's GPU)",
    )
    gpu.add_argument("--gpu-gib", type=positive_gib_arg, default=None, help="a device of this many GiB instead")
    p.add_argument("--world-size", type=positive_int_arg, default=1, help="data-parallel ranks (default: 1)")
    p.add_argument("--zero", type=int, choices=tuple(ZERO_STRATEGIES), default=None,
                   help="ZeRO stage with --world-size > 1 (default: 0, DDP)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    p.add_argument("--fix", action="store_true", help="also dry-run and rank the candidate fixes (a dry run each)")


def check_world_options(args) -> None:
    """ValueError for ``--zero`` without ranks to shard across."""
    if args.zero is not None and args.world_size == 1:
        raise ValueError(f"--zero {args.zero} shards across ranks: it needs --world-size > 1")


def device_of(args):
    """The Device ``--gpu`` or ``--gpu-gib`` names."""

    return DEVICES[args.gpu] if args.gpu_gib is None else gib_device(args.gpu_gib)
