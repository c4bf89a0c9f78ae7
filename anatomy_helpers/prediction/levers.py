"""Which lever shrinks the phase that runs out: read a trace's peak (its phase and the category that dominates it),
list the levers that act on that category, and verify each with a dry run of the course GPT, ranked by what it
costs. Lesson 10.

A lever is a change of the step (a model option, an optimizer, where the optimizer runs); each lowers some
categories of memory and costs something else: recomputed FLOPs (counted with ``FlopCounterMode``, see
:func:`~anatomy_helpers.prediction.fixes.config_step_flops`) or different numerics / training dynamics
(:data:`~anatomy_helpers.prediction.fixes.EFFECTS`). Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..model import ModelConfig
from ..tracking.events import Peak
from ..tracking.trace import Trace
from .dryrun import dry_run_config
from .fixes import EFFECTS, config_step_flops


@dataclass(frozen=True)
class Lever:
    """One change of the step and the categories it acts on.

    ``config``: ModelConfig fields it sets; ``step``: the other options of ``dry_run_config`` it sets
    (``optimizer``, ``in_backward``, ``fused``, ``autocast``). ``effect``: one of EFFECTS.
    """

    name: str
    acts_on: tuple[str, ...]  # the categories it shrinks
    effect: str
    note: str
    config: dict = field(default_factory=dict)
    step: dict = field(default_factory=dict)

    def applies(self, cfg: ModelConfig, optimizer: str, step: dict) -> bool:
        """False where the configuration already does what the lever does (or the lever does not fit it)."""
        if any(getattr(cfg, k) == v for k, v in self.config.items()):
            return False
        if any(step.get(k) == v for k, v in self.step.items()):
            return False
        if "optimizer" in self.step and optimizer not in ("adam", "adamw"):
            return False  # the state levers replace Adam's two moments
        return not (self.step.get("fused") and (optimizer == "adamw_bf16" or step.get("in_backward")))


def levers(cfg: ModelConfig) -> list[Lever]:
    """Every lever of lesson 10 for ``cfg`` (the chunk of the chunked loss: a quarter of one sequence, at least 1)."""
    chunk = max(1, cfg.seq_len // 4)
    return [
        Lever(
            "optimizer step in backward",
            ("gradients",),
            "time only",
            "each gradient freed once its parameter is stepped; no global-norm clipping, no accumulation",
            step={"in_backward": True},
        ),
        Lever(
            "bf16 optimizer state",
            ("optimizer_state",),
            "numerics",
            "Adam's moments stored in bf16: 4 instead of 8 bytes per parameter",
            step={"optimizer": "adamw_bf16"},
        ),
        Lever(
            "SGD with momentum",
            ("optimizer_state",),
            "optimizer",
            "one state buffer instead of two: another optimizer",
            step={"optimizer": "momentum"},
        ),
        Lever("fused optimizer", ("temporaries",), "time only", "no optimizer temporaries", step={"fused": True}),
        Lever(
            f"chunked loss ({chunk} tokens)",
            ("activations", "temporaries"),
            "time only",
            "the LM head and the loss per chunk, recomputed in backward: logits of one chunk alive",
            config={"loss_chunk": chunk},
        ),
        Lever("sdpa attention", ("activations",), "time only", "no s x s scores kept", config={"attn_impl": "sdpa"}),
        Lever(
            "checkpoint=selective",
            ("activations",),
            "time only",
            "element-wise ops recomputed in backward",
            config={"checkpoint": "selective"},
        ),
        Lever(
            "checkpoint=full", ("activations",), "time only", "blocks recomputed in backward", {"checkpoint": "full"}
        ),
        Lever(
            "bf16 autocast",
            ("activations",),
            "numerics",
            "16-bit matmuls and saved inputs",
            step={"autocast": "bfloat16"},
        ),
    ]


def dominant(trace: Trace) -> tuple[Peak, str]:
    """The trace's peak (its phase: ``peak.phase``) and the category holding the most bytes there."""
    peak = trace.peak()
    return peak, max(peak.breakdown, key=peak.breakdown.get)


@dataclass(frozen=True)
class Verified:
    """A lever dry-run: the peak before and after, where the peak is now, and what it costs."""

    lever: Lever
    before: Peak
    after: Peak
    extra_flops: float  # FLOPs of a forward + backward relative to the original, minus 1

    @property
    def saved(self) -> int:
        return self.before.bytes - self.after.bytes


def verify_levers(
    cfg: ModelConfig, batch_size: int = 8, optimizer: str = "adamw", *, only_dominant: bool = True, **step
) -> tuple[Trace, str, list[Verified]]:
    """Dry-run ``cfg`` as given, then each lever that acts on the dominant category at its peak (every lever with
    ``only_dominant=False``); returns (the trace, the dominant category, the verified levers ranked).

    Ranked: those that lower the peak first, then by what they change (EFFECTS: time only first), then by extra
    FLOPs, then by the peak left. ``step``: ``in_backward``, ``fused``, ``foreach``, ``autocast`` of the original.
    """
    trace = dry_run_config(cfg, optimizer=optimizer, batch_size=batch_size, **step)
    peak, category = dominant(trace)
    base_flops = config_step_flops(cfg, batch_size)
    out = []
    for lever in levers(cfg):
        if (only_dominant and category not in lever.acts_on) or not lever.applies(cfg, optimizer, step):
            continue
        new_cfg = replace(cfg, **lever.config)
        options = {"optimizer": optimizer, **step, **lever.step}
        if options["optimizer"] == "adamw_bf16":
            options.pop("foreach", None)
        after = dry_run_config(new_cfg, batch_size=batch_size, **options).peak()
        flops = config_step_flops(new_cfg, batch_size)
        out.append(Verified(lever, peak, after, flops / base_flops - 1))
    out.sort(key=lambda v: (v.saved <= 0, EFFECTS.index(v.lever.effect), round(v.extra_flops, 3), v.after.bytes))
    return trace, category, out
