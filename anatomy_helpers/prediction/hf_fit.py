"""Will a Hugging Face fine-tune fit on a GPU: :func:`will_it_fit_hf`, the course GPT's will-it-fit
(:mod:`anatomy_helpers.prediction.fit`) for the models of :mod:`anatomy_helpers.prediction.hf`.

The same pieces: a two-step dry run (:func:`~anatomy_helpers.prediction.hf_step.dry_run_hf`: the fine-tuning step
on fake tensors, byte for byte the tracked real step, micro-batches included), its allocations replayed through
the caching-allocator simulator capped at the device's usable memory, and the same
:class:`~anatomy_helpers.prediction.fit.FitReport`. Two differences:

* **Device rules.** The CUDA rules of :mod:`anatomy_helpers.prediction.cuda_rules` (dropout masks, cuBLAS
  workspaces, autocast's softmax, SDPA's backend) are stated for the course's GPT, op by op. For a Hugging Face
  model the phase needs follow the CPU kernels' rules, as for a device given by its size; the report says so.
* **Data parallelism.** Under DDP, ZeRO-1, ZeRO-2 or ZeRO-3 at ``world_size`` ranks, each rank runs the
  fine-tune's step on its own batch (``FineTune.batch_size`` is the per-rank batch; the global batch is
  ``world_size`` times it). The dry run is of that one-rank step; its model states are then divided as the ZeRO
  formulas say (:func:`~anatomy_helpers.prediction.formulas.zero_model_states`, the formulas lesson 08 measured on
  gloo ranks): ZeRO-1 divides the optimizer state by the world size, ZeRO-2 also the gradients, ZeRO-3 also the
  parameters (the frozen ones too). Only trainable parameters have gradients and optimizer state (LoRA: the
  adapters'), because that is what the dry run holds. Activations are the dry run's, unchanged. This is the formula
  applied to a dry run, **not** a dry run of the sharded step: ZeRO-3's gathered layer parameters, the gradient
  buckets and the collectives' buffers are not counted.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..checks import one_of, positive_int
from ..tracking.events import CATEGORIES
from ..tracking.trace import Trace
from .allocator import replay
from .cuda_rules import CPU_RULES
from .devices import Device
from .fit import FitReport, allocator_failure, phase_needs, size_text, usable_device
from .formulas import zero_model_states
from .hf import hf_config
from .hf_step import FineTune, dry_run_hf

#: ``zero`` stage -> the strategy name of lesson 08's formulas (prediction/formulas.py ZERO_STAGE).
ZERO_STRATEGIES = {0: "ddp", 1: "zero1", 2: "fsdp2_zero2", 3: "fsdp2_zero3"}
#: The model states the ZeRO formulas divide.
MODEL_STATES = ("parameters", "gradients", "optimizer_state")
HF_RULES = f"{CPU_RULES} (cuda_rules.py states CUDA's rules for the course's GPT only, not for Hugging Face models)"


@dataclass(frozen=True)
class RankStates:
    """One rank's model states (bytes): the dry run's whole ones and the ZeRO formula's share of them."""

    strategy: str  # a key of prediction/formulas.py ZERO_STAGE
    world_size: int
    whole: dict[str, int]  # what the one-rank dry run holds: parameters, gradients, optimizer_state
    per_rank: dict[str, float]  # zero_model_states of ``whole``

    def factor(self, category: str) -> float:
        """The share of ``category`` one rank keeps (1 or 1 / world_size)."""
        whole = self.whole[category]
        return self.per_rank[category] / whole if whole else 1.0

    def text(self) -> str:
        parts = ", ".join(f"{c.replace('_', ' ')} {size_text(round(self.per_rank[c]))}" for c in MODEL_STATES)
        return (
            f"per rank of {self.world_size} under {self.strategy}: {parts}, by the ZeRO formulas lesson 08 measured "
            "(formulas.zero_model_states) applied to the dry run of one rank's step, not a dry run of the "
            "sharded step (ZeRO-3's gathered layers, gradient buckets and collective buffers are not counted)"
        )


def rank_states(trace: Trace, world_size: int, zero: int) -> RankStates:
    """The model states of ``trace`` (a one-rank dry run) and one rank's share under ZeRO stage ``zero`` (0: DDP).

    Whole states, from the trace: the parameters at the end (frozen ones included, and the buffers, which the
    tracker files as parameters), the gradients at their
    largest (all of them, accumulated; only trainable parameters have one), the optimizer state at the end."""

    at_end = trace.phases()[-1].at_end
    grads = int(trace.timeline.bytes[:, CATEGORIES.index("gradients")].max(initial=0))
    whole = {"parameters": at_end["parameters"], "gradients": grads, "optimizer_state": at_end["optimizer_state"]}
    strategy = ZERO_STRATEGIES[zero]
    # zero_model_states takes a count and bytes per parameter: one "parameter" of the whole bytes gives the totals
    per_rank = zero_model_states(
        strategy,
        1,
        world_size,
        param_bytes=whole["parameters"],
        grad_bytes=whole["gradients"],
        state_bytes=whole["optimizer_state"],
    )
    return RankStates(strategy, world_size, whole, per_rank)


def sharded_record(trace: Trace, states: RankStates):
    """``trace``'s allocation record with each model-state allocation and free scaled to one rank's share
    (rounded to whole bytes), and the (samples, categories) bytes this changes at each timeline sample."""
    rec = trace.allocation_record()
    factors = np.ones(len(CATEGORIES))
    for c in MODEL_STATES:
        factors[CATEGORIES.index(c)] = states.factor(c)
    scaled = np.rint(rec.bytes * factors[rec.category]).astype(np.int64)
    change = np.zeros((len(rec.bytes), len(CATEGORIES)), dtype=np.int64)
    change[np.arange(len(rec.bytes)), rec.category] = scaled - rec.bytes
    n0 = len(trace.baseline_ids)  # one row per timeline sample after the baseline's rows
    return replace(rec, bytes=scaled), np.cumsum(change, axis=0)[n0:]


def describe_hf(cfg, ft: FineTune, name: str | None = None) -> str:
    """A short label of a fine-tune of ``cfg``."""
    how = {"full": "full", "frozen": f"frozen {', '.join(ft.freeze)}", "lora": f"LoRA r={ft.lora_rank}"}[ft.method]
    parts = [name or f"{cfg.model_type} ({type(cfg).__name__})", how, f"b={ft.batch_size} s={ft.seq_len}", ft.dtype]
    if ft.autocast:
        parts.append(f"autocast {ft.autocast}")
    impl = "fused" if ft.fused else "foreach" if ft.foreach else "single"
    parts += [f"{ft.attn_implementation} attention", f"{ft.optimizer} ({impl})"]
    if ft.gradient_checkpointing:
        parts.append("gradient checkpointing")
    if ft.micro_batches > 1:
        parts.append(f"{ft.micro_batches} micro-batches")
    return ", ".join(parts)


def check_request(model, fine_tune: FineTune, device, world_size: int, zero: int | None):
    """(the config, the Device) of a will-it-fit request; ValueError naming the argument that is wrong."""
    cfg = hf_config(model)
    if not isinstance(fine_tune, FineTune):
        raise ValueError(f"fine_tune must be a FineTune, got {type(fine_tune).__name__}")
    dev = usable_device(device)
    positive_int("world_size", world_size)
    one_of("zero", zero, (None, *ZERO_STRATEGIES))
    if zero is not None and world_size == 1:
        raise ValueError(f"zero={zero} shards across ranks: it needs world_size > 1")
    return cfg, dev


def will_it_fit_hf(
    model,
    fine_tune: FineTune | None = None,
    device: str | int | Device = "a100-80",
    *,
    world_size: int = 1,
    zero: int | None = None,
    trace: Trace | None = None,
) -> FitReport:
    """Dry-run two steps of ``fine_tune`` (default: ``FineTune()``) on ``model`` (a shipped name, a config.json or
    a config: hf.hf_config); say whether they fit on ``device`` (fit.py's devices) and, if not, which phase runs
    out first.

    ``world_size > 1``: data parallelism, ``fine_tune`` being what each rank runs; ``zero`` the ZeRO stage (0:
    DDP, the default; 1, 2, 3). One rank's model states follow the ZeRO formulas (module docstring), so the
    report is per rank. ``trace``: the dry run of ``fine_tune`` on ``model``, if already made (it is not checked).
    """
    fine_tune = FineTune() if fine_tune is None else fine_tune
    cfg, dev = check_request(model, fine_tune, device, world_size, zero)
    trace = dry_run_hf(cfg, fine_tune, steps=2) if trace is None else trace
    label = describe_hf(cfg, fine_tune, model if isinstance(model, str) else None)
    if world_size == 1:
        record, series, note = trace.allocation_record(), None, ""
    else:
        states = rank_states(trace, world_size, zero or 0)
        record, series = sharded_record(trace, states)
        note = states.text()
    rep = replay(record)
    failure = allocator_failure(record, rep, dev.usable)
    needs = phase_needs(trace, None, rep, series, series_in_rep=True)
    return FitReport(label, dev.name, dev.total, dev.usable, needs, failure, 0, note, dev.context_note(), HF_RULES)
