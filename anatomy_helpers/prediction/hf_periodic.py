"""A Hugging Face fine-tune's dry run at any depth from dry runs of the same model at 3, 4 and 5 decoder layers.

:func:`periodic_dry_run_hf` is :func:`~anatomy_helpers.prediction.periodic.periodic_trace` (the period of every
recorded row, the whole Trace rebuilt; see that module) given :func:`~anatomy_helpers.prediction.hf_step.dry_run_hf`
of the configuration cut to 3, 4 and 5 layers (:func:`~anatomy_helpers.prediction.hf_fixes.layers_of`): the same
Trace as the full-depth dry run, byte for byte (tests/test_hf_periodic.py), from 12 layers' work instead of
``num_hidden_layers``'. Its list of decoder layers is found in the model itself (:func:`block_list`: the
``nn.ModuleList`` of the classes its ``_no_split_modules`` names, e.g. ``model.layers`` or GPT-2's
``transformer.h``), so the rows' block indices are read from those module names.

The period is read from the three shallow depths, so what makes a deep layer differ from the shallow ones cannot
be seen there; it is refused by name before anything runs (:func:`refused_before_hf`), and the full dry run made
instead: a per-layer list in the configuration whose entries differ (``layer_types``: Gemma 2's sliding and full
attention alternating), a field that makes every k-th layer or the first k differ (:data:`LAYER_PATTERN_FIELDS`:
mixture of experts every k layers, the first k layers dense, a sliding window from some layer on), and a
fine-tune that names particular layers (a ``freeze`` prefix or a LoRA target inside the list of layers). What
differs within the shallow runs is found by periodic_trace's checks (NotPeriodic), and the full dry run made.
Depth 5 or less, or ``ANATOMY_FULL_DRY_RUN=1`` (fit.FULL_DRY_RUN_ENV, as for the course GPT): the full dry run.
A shallow dry run that is refused (DryRunError, ValueError) is not taken as the full one's answer: the full dry
run is made, and answers or refuses for itself.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from ..tracking.trace import Trace
from .dryrun import DryRunError
from .fit import FULL_DRY_RUN_ENV, full_dry_run_asked
from .hf import build_model, hf_config
from .hf_fixes import layers_of
from .hf_step import FineTune, dry_run_hf
from .periodic import DEPTHS, NotPeriodic, periodic_trace, too_shallow

#: Configuration fields that make some layers differ from the others: field -> (its values with which every layer
#: is alike, what another value does). Another value is refused by name (:func:`refused_before_hf`).
LAYER_PATTERN_FIELDS = {
    "first_k_dense_replace": ((None, 0), "the first k layers dense, the rest mixture of experts (DeepSeek)"),
    "decoder_sparse_step": ((None, 1), "mixture of experts every k-th layer (Qwen-MoE)"),
    "mlp_only_layers": ((None, []), "dense layers listed by index among mixture-of-experts ones (Qwen-MoE)"),
    "moe_layer_freq": ((None, 1), "mixture of experts every k-th layer (DeepSeek)"),
    "interleave_moe_layer_step": ((None, 1), "mixture of experts every k-th layer (Llama 4)"),
    "sliding_window_pattern": ((None, 1), "a sliding window in all but every k-th layer (Gemma 3)"),
    "attn_layer_period": ((None, 1), "attention every k-th layer, the others state-space (Jamba)"),
    "expert_layer_period": ((None, 1), "mixture of experts every k-th layer (Jamba)"),
    "num_kv_shared_layers": ((None, 0), "the last layers sharing earlier layers' keys and values (Gemma 3n)"),
}


def block_list(cfg, ft: FineTune) -> str | None:
    """The path of ``cfg``'s list of decoder layers in its model's module names (``model.layers``; GPT-2's
    ``transformer.h``): the ``nn.ModuleList`` holding the classes the model's ``_no_split_modules`` names (those
    FSDP shards one by one), read from the model built with 3 layers on the meta device. None: no such list."""
    with torch.device("meta"):
        model = build_model(
            layers_of(cfg, DEPTHS[0]),
            attn_implementation=ft.attn_implementation,
            dtype=ft.dtype,
            experts_implementation=ft.experts_implementation,
        )
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == DEPTHS[0]:
            if all(type(m).__name__ in layer_classes for m in module):
                return name
    return None


def _picks_layers(ft: FineTune, path: str) -> str | None:
    """The freeze prefix or LoRA target of ``ft`` that picks particular layers of the list at ``path`` (None:
    none does): a prefix inside the list (``model.layers.0.``); a LoRA target naming a layer (peft matches a
    listed target as the end of a module name: ``layers.0.self_attn.q_proj``), or a regular expression (peft's
    ``target_modules`` as one string) that names the list or holds a digit."""
    word = path.rsplit(".", 1)[-1]
    for prefix in ft.freeze:
        if prefix.startswith(f"{path}.") and len(prefix) > len(path) + 1:
            return f"freeze prefix {prefix!r}"
    if ft.method != "lora" or ft.lora_targets == "all-linear":
        return None
    if isinstance(ft.lora_targets, str):
        regex = ft.lora_targets
        return f"LoRA targets {regex!r} (a regular expression)" if word in regex or re.search(r"\d", regex) else None
    for target in ft.lora_targets:
        if re.search(rf"(^|\.){re.escape(word)}\.", target):
            return f"LoRA target {target!r}"
    return None


def refused_before_hf(cfg, ft: FineTune, path: str | None = "") -> str | None:
    """Why ``cfg``'s dry run under ``ft`` is made at full depth without trying the period (None: try it);
    ``path``: its list of decoder layers (:func:`block_list`; None: it has none; "": not looked for yet, so only
    the configuration is read)."""
    depth = cfg.num_hidden_layers
    if why := too_shallow(depth, "num_hidden_layers"):
        return why
    fields = cfg.to_dict()
    for name, value in fields.items():  # per-layer lists: Gemma 2's layer_types, SmolLM 3's no_rope_layers
        if isinstance(value, (list, tuple)) and len(value) == depth:
            kinds = list(dict.fromkeys(map(str, value)))
            if len(kinds) > 1:
                return f"its layers differ: {name} gives them {', '.join(kinds)}"
    for name, (alike, what) in LAYER_PATTERN_FIELDS.items():
        value = getattr(cfg, name, None)
        if value not in alike and not (isinstance(value, tuple) and list(value) in alike):
            return f"its layers differ: {name}={value!r}, {what}"
    if fields.get("use_sliding_window") and (fields.get("max_window_layers") or depth) < depth:
        return f"its layers differ: max_window_layers={fields['max_window_layers']} of {depth} use the sliding window"
    if path is None:
        return f"{type(cfg).__name__} has no list of decoder layers (an nn.ModuleList of its _no_split_modules)"
    picked = _picks_layers(ft, path) if path else None
    return f"{picked} picks particular layers of {path}" if picked else None


def hf_period(cfg, ft: FineTune, run_at: Callable[[int], Trace], check=None) -> tuple[Trace | None, str | None]:
    """The Trace ``run_at(cfg.num_hidden_layers)`` would give, built by periodic_trace from ``run_at(d)`` at 3, 4
    and 5 layers (``run_at(d)``: the same dry run of ``cfg`` cut to ``d`` layers: one device's, one rank's), and
    None; or (None, why it cannot be: :func:`refused_before_hf`, ``ANATOMY_FULL_DRY_RUN=1``, the period's checks, a
    shallow run refused), for the caller to make the full dry run. ``check(path, traces)``: the caller's own
    reason to refuse (None: none), given the layer list's path, before any run (``traces`` None) and after the
    build (``traces``: the Traces at 3, 4 and 5 layers and the built one)."""
    started = time.perf_counter()
    why = f"{FULL_DRY_RUN_ENV}=1 asks for it" if full_dry_run_asked() else refused_before_hf(cfg, ft)
    if why is None:  # the model built (3 layers, meta) only where the configuration leaves the period possible
        try:
            path = block_list(cfg, ft)
        except ValueError as e:  # the full dry run refuses it too, naming it
            path, why = "", f"its model was not built ({str(e).splitlines()[0]})"
        why = why or refused_before_hf(cfg, ft, path) or (check and check(path, None))
    if why is not None:
        return None, why
    traces: dict[int, Trace] = {}

    def shallow(d: int) -> Trace:
        traces[d] = run_at(d)
        return traces[d]

    try:
        trace = periodic_trace(shallow, cfg.num_hidden_layers, path.rsplit(".", 1)[-1], started=started)
    except NotPeriodic as e:
        return None, str(e)
    except (DryRunError, ValueError) as e:
        return None, f"a shallow dry run was refused ({str(e).splitlines()[0]})"
    why = check and check(path, [*traces.values(), trace])
    return (None, why) if why else (trace, None)


def periodic_dry_run_hf(cfg, ft: FineTune | None = None, steps: int = 2) -> tuple[Trace, str | None]:
    """``dry_run_hf(cfg, ft, steps)``'s Trace, built from its dry runs at 3, 4 and 5 decoder layers (see the
    module's docstring; :func:`hf_period`); and None, or why the full dry run was made instead (fit.dry_run_text
    says either in words). ``cfg``: anything hf.hf_config takes; ``ft``: default ``FineTune()``.

    The timeline (samples' steps, phases, modules, bytes per category), the allocations, phase marks, saved
    tensors and gradients equal the full dry run's; the wall times do not (they are spread evenly).
    """
    cfg, ft = hf_config(cfg), FineTune() if ft is None else ft
    trace, why = hf_period(cfg, ft, lambda d: dry_run_hf(layers_of(cfg, d), ft, steps))
    return (trace, None) if why is None else (dry_run_hf(cfg, ft, steps), why)
