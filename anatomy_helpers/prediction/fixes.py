"""Will a change make the step fit: :func:`cheapest_fix`, the catalogue's levers
(:mod:`anatomy_helpers.prediction.levers`) each verified by a dry run under the same capped allocator simulator as
:func:`anatomy_helpers.prediction.fit.will_it_fit`, ranked by the catalogue's one key; :func:`fixes_table` prints
them. Lesson 06 and the CLI's ``predict --fix``.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from ..core.model import ModelConfig
from ..core.tables import Col, format_table
from ..core.units import pick_unit
from .fit import FitRequest, fit_run
from .flops import config_step_flops
from .levers import EFFECTS, Fix, combined, levers, rank_key, ranked, try_levers

__all__ = ["EFFECTS", "Fix", "cheapest_fix", "config_step_flops", "fixes_table", "rank_key"]


def cheapest_fix(cfg: ModelConfig | None = None, batch_size: int = 8, **options) -> list[Fix]:
    """The catalogue's levers (:func:`levers`) that lower the step's peak, each checked by another dry run under
    the same capped allocator simulator as :func:`~anatomy_helpers.prediction.fit.will_it_fit`, ranked by
    :func:`rank_key`: the ones that fit first, then by what they change (:data:`EFFECTS`), then by extra FLOPs.
    A step that already fits needs no change: the list is empty. ``options``: the other fields of
    :class:`~anatomy_helpers.prediction.fit.FitRequest`, by keyword, as for ``will_it_fit``.

    Micro-batches (time only: the same global batch): the global batch dry-run in 2, 4, 8... micro-batches one by
    one, as ``track_steps(..., micro_batches=k)`` runs them (exact: :func:`~anatomy_helpers.prediction.fit.fit_run`),
    up to the first that fits. A smaller global batch: the micro-batch's size without accumulation (the largest
    that fits). Mixed
    precision follows the device: bf16 autocast from compute capability 8.0, fp16 autocast with a GradScaler on a
    T4 (7.5); the fp32 parameters stay the master weights (pure 16-bit weights need a custom optimizer, which
    ``dry_run_config`` cannot build: not offered). With ``micro_batches=m`` every candidate keeps it, and the
    accumulation candidates try 2m, 4m, ... micro-batches. Where no one lever fits, the list starts with a
    combination of levers that does (:func:`~anatomy_helpers.prediction.levers.combined`), if there is one.
    """
    request = FitRequest(cfg if cfg is not None else ModelConfig(), batch_size, **options)
    dev = request.check()
    base = fit_run(request, dev)
    if base.fits:
        return []
    catalogue = levers(request.cfg, batch_size=batch_size, micro_batches=request.micro_batches, device=dev)
    fixes = ranked(try_levers(request, dev, catalogue), base)
    if not any(f.fits for f in fixes):  # no one lever fits: the cheapest combination that does, first
        both = combined(request, dev, catalogue)
        fixes = fixes if both is None else [both, *fixes]
    return fixes


def fixes_table(fixes: list[Fix]) -> str:
    """The candidates, ranked as :func:`cheapest_fix` ranks them ("-": FLOPs the count cannot see)."""
    unit, scale = pick_unit(max(f.report.peak.tensors for f in fixes))
    cols = [
        Col("rank", 4),
        Col("change", max(34, *(len(f.name) for f in fixes)), align="<", gap="  "),  # combinations are longer
        Col("peak", 8, ".2f"),
        Col("fits", 5),
        Col("extra FLOPs", 11, "+.0%"),
        Col("changes", max(map(len, EFFECTS)), align="<", gap="  "),  # "trained parameters": LoRA (hf_fit.py)
        Col("note", 60, align="<", gap="  "),
    ]
    rows = [
        (i, f.name, f.report.peak.tensors / scale, "yes" if f.fits else "no", f.extra_flops, f.effect, f.note)
        for i, f in enumerate(fixes, 1)
    ]
    note = f"({unit} of tensors at the peak; fits: simulated allocator under the cap; extra FLOPs per sequence)"
    return format_table(cols, rows, note=note)
