"""Will a training step fit on a GPU, which phase runs out first, and the cheapest fix: all predicted on this
machine's CPU with dry runs (:mod:`anatomy_helpers.dryrun`: the tracked step on fake tensors, exact for every
category but kernel scratch), so it works for models far larger than the machine. Lesson 06 teaches it and the CLI's
``predict`` command prints it.

Two further things a GPU adds, both stated as assumptions rather than measured:

* the **CUDA context** (the driver, the kernels' code, cuBLAS/cuDNN handles) takes memory outside PyTorch's
  allocator before any tensor exists; :data:`CUDA_CONTEXT_BYTES` is our allowance for it (0.5 GiB; it varies with
  the GPU, the driver and the libraries loaded, from ~0.3 to over 1 GiB);
* the **caching allocator** rounds requests and keeps segments, so it reserves more than the tensors need. We
  estimate that overhead by replaying the dry run's allocation record through the allocator simulator
  (:func:`anatomy_helpers.allocator.replay`): a simulation of the allocator's rules, not a measurement.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from .allocator import replay, replay_with_limit
from .dryrun import build_fake_model, course_batch, dry_run_config, gpt_loss
from .model import GPT, ModelConfig
from .tables import Col, format_table
from .trace import Trace
from .units import GiB, pick_unit

#: Our allowance for the CUDA context (outside the caching allocator): an assumption, see the module docstring.
CUDA_CONTEXT_BYTES = GiB // 2

#: Marketed memory of common GPUs, read as 10**9 bytes per GB (torch reports a little less or more: ECC, rounding;
#: "this GPU" reads the real figure with ``torch.cuda.mem_get_info``).
DEVICES = {
    "T4 16 GB": 16 * 10**9,
    "L4 24 GB": 24 * 10**9,
    "A100 40 GB": 40 * 10**9,
    "A100 80 GB": 80 * 10**9,
    "H100 80 GB": 80 * 10**9,
    "H200 141 GB": 141 * 10**9,
}

#: Optimizer implementations and the (foreach, fused) flags that pick them.
IMPLEMENTATION_FLAGS = {"single": (False, None), "foreach": (True, None), "fused": (None, True)}

#: The phases a fit report looks at, in time order.
STEP_PHASES = tuple((s, p) for s in (1, 2) for p in ("forward", "backward", "optimizer"))


def devices() -> dict[str, int]:
    """:data:`DEVICES`, plus ``"this GPU"`` (its total memory, from ``torch.cuda.mem_get_info``) when CUDA is here."""
    out = dict(DEVICES)
    if torch.cuda.is_available():
        out["this GPU"] = torch.cuda.mem_get_info()[1]
    return out


def usable_bytes(device: str | int) -> int:
    """A device's memory (a name in :func:`devices`, or bytes) minus :data:`CUDA_CONTEXT_BYTES`."""
    if isinstance(device, str):
        known = devices()
        if device not in known:
            raise ValueError(f"device must be one of {tuple(known)} or a number of bytes, got {device!r}")
        device = known[device]
    return int(device) - CUDA_CONTEXT_BYTES


@dataclass(frozen=True)
class PhaseNeed:
    """One phase of one step: its peak of tensor bytes (by category, at the peak) and the simulated allocator."""

    step: int
    phase: str
    tensors: int  # the dry run's peak of live tensor bytes in the phase (+ accumulated gradients, if any)
    reserved: int  # the uncapped simulated allocator's reserved bytes at that peak (its cache included)
    breakdown: dict[str, int]  # bytes per category at the tensor peak


@dataclass(frozen=True)
class FitReport:
    """Whether two training steps fit on a device, phase by phase (bytes).

    The verdict comes from replaying the dry run's allocations through the caching-allocator simulator capped at
    the usable memory (``allocator.replay_with_limit``): it rounds, splits and caches as the real allocator does,
    and, like it, gives its cached free segments back and retries before it declares an out-of-memory error.
    """

    label: str
    device: str
    capacity: int
    usable: int  # capacity - CUDA_CONTEXT_BYTES
    phases: tuple[PhaseNeed, ...]  # step 1 and step 2, forward / backward / optimizer, in time order
    failure: tuple[int, str] | None  # (step, phase) where the capped simulated allocator ran out, or None
    reserved_extra: int = 0  # bytes kept out of the cap for tensors the dry run does not make (accumulation)
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.failure is None

    @property
    def peak(self) -> PhaseNeed:
        """The phase with the most live tensor bytes."""
        return max(self.phases, key=lambda p: p.tensors)

    @property
    def first_failure(self) -> PhaseNeed | None:
        """The phase that runs out first (None if both steps fit); step 0 means the model itself does not fit."""
        if self.failure is None:
            return None
        step, phase = self.failure
        found = [p for p in self.phases if (p.step, p.phase) == (step, phase)]
        return found[0] if found else PhaseNeed(step, phase, 0, 0, {})

    def verdict(self) -> str:
        """One sentence: fits (with the margin) or which phase of which step runs out first."""
        unit, scale = pick_unit(max(self.usable, self.peak.tensors))
        pk = self.peak
        head = f"{self.label} on {self.device}: "
        if self.failure is None:
            return (
                head + f"FITS. Peak {pk.tensors / scale:.2f} {unit} of tensors (step {pk.step} {pk.phase}) "
                f"within {self.usable / scale:.2f} {unit} usable"
            )
        step, phase = self.failure
        where = "before step 1 (the model itself)" if step == 0 else f"in step {step}'s {phase} pass"
        return (
            head + f"DOES NOT FIT: runs out first {where}; peak {pk.tensors / scale:.2f} {unit} of tensors "
            f"(step {pk.step} {pk.phase}) against {self.usable / scale:.2f} {unit} usable"
        )

    def table(self) -> str:
        unit, scale = pick_unit(max(self.usable, self.peak.tensors))
        cols = [Col("step", 4), Col("phase", 9, align="<", gap="  "), Col("tensors", 9, ".2f")]
        cols += [Col("reserved", 9, ".2f"), Col("tensors fit", 11)]
        rows = [
            (p.step, p.phase, p.tensors / scale, p.reserved / scale, "yes" if p.tensors <= self.usable else "NO")
            for p in self.phases
        ]
        kept = (
            f"; the allocator replay is capped {self.reserved_extra / scale:.2f} {unit} lower, kept for the "
            "accumulated gradients and the whole batch's inputs"
            if self.reserved_extra
            else ""
        )
        footer = [
            f"usable on {self.device}: {self.usable / scale:.2f} {unit} = {self.capacity / scale:.2f} {unit} "
            f"- {CUDA_CONTEXT_BYTES / scale:.2f} {unit} CUDA context (assumed){kept}",
            self.verdict(),
        ]
        if self.note:
            footer.append(self.note)
        note = f"({unit}; reserved: simulated caching allocator without a cap, at the phase's peak)"
        return format_table(cols, rows, note=note, footer=footer)


def phase_needs(trace: Trace, extra: dict[str, dict[str, int]] | None = None) -> tuple[PhaseNeed, ...]:
    """Step 1's and step 2's phases of a dry run: tensor peaks, and the simulated allocator's reserved bytes at them.

    ``extra`` adds bytes to a phase's tensors (phase name -> category -> bytes: what gradient accumulation keeps
    alive beyond a plain step of one micro-batch, see :func:`cheapest_fix`).
    """
    rep = replay(trace.allocation_record())
    n0 = len(trace.baseline_ids)  # the record's first rows are the storages alive at the start
    out = []
    for step, phase in STEP_PHASES:
        pk = trace.peak(step=step, phase=phase)
        reserved = int(rep.reserved[n0 + pk.index]) if len(rep.reserved) else 0
        breakdown = dict(pk.breakdown)
        add = (extra or {}).get(phase, {})
        for category, nbytes in add.items():
            breakdown[category] = breakdown.get(category, 0) + nbytes
        add = sum(add.values())
        out.append(PhaseNeed(step, phase, pk.bytes + add, reserved + add, breakdown))
    return tuple(out)


def describe(cfg: ModelConfig, batch_size: int, optimizer: str, implementation: str, autocast: str | None) -> str:
    """A short label of a configuration."""
    parts = [f"{cfg.block} {cfg.n_layer}x{cfg.d_model}", f"b={batch_size} s={cfg.seq_len}", cfg.dtype]
    if autocast:
        parts.append(f"autocast {autocast}")
    parts.append(f"{optimizer} ({implementation})")
    if cfg.checkpoint != "none":
        parts.append(f"checkpoint {cfg.checkpoint}")
    return ", ".join(parts)


def will_it_fit(
    cfg: ModelConfig | None = None,
    batch_size: int = 8,
    *,
    optimizer: str = "adamw",
    implementation: str = "foreach",
    autocast: str | None = None,
    device: str | int = "T4 16 GB",
) -> FitReport:
    """Dry-run two steps of ``cfg``; say whether they fit on ``device`` and, if not, which phase runs out first.

    ``implementation`` is the optimizer's ("single", "foreach": torch's CUDA default, "fused"). Usable memory is
    the device's minus :data:`CUDA_CONTEXT_BYTES`; the verdict replays the dry run's allocations through the
    caching-allocator simulator capped at it (see :class:`FitReport`). Kernel scratch (cuBLAS workspaces, attention
    kernels' scratch) is not in a dry run: keep a margin.
    """
    cfg = cfg if cfg is not None else ModelConfig()
    return _fit(cfg, batch_size, optimizer, implementation, autocast, device)


def _fit(cfg, batch_size, optimizer, implementation, autocast, device, grads=0, inputs=0, label_suffix="", note=""):
    if implementation not in IMPLEMENTATION_FLAGS:
        raise ValueError(f"implementation must be one of {tuple(IMPLEMENTATION_FLAGS)}, got {implementation!r}")
    usable = usable_bytes(device)  # checks the device name first
    foreach, fused = IMPLEMENTATION_FLAGS[implementation]
    trace = dry_run_config(
        cfg, optimizer=optimizer, foreach=foreach, fused=fused, batch_size=batch_size, autocast=autocast, steps=2
    )
    name = device if isinstance(device, str) else f"{device / GiB:.1f} GiB"
    capacity = devices()[device] if isinstance(device, str) else int(device)
    label = describe(cfg, batch_size, optimizer, implementation, autocast) + label_suffix
    both = {"gradients": grads, "inputs": inputs}
    extra = {"forward": both, "backward": both, "optimizer": {"inputs": inputs}}
    limit = usable - grads - inputs
    capped = replay_with_limit(trace.allocation_record(), limit) if limit > 0 else None
    failure = (0, "idle") if capped is None else None if capped.passed else (capped.step, capped.phase)
    return FitReport(label, name, capacity, usable, phase_needs(trace, extra), failure, grads + inputs, note)


# ---- the cheapest fix --------------------------------------------------------------------------------------


_FLOPS: dict[tuple, int] = {}


def step_flops(cfg: ModelConfig, batch_size: int, autocast: str | None = None) -> int:
    """FLOPs of one forward + backward of ``cfg`` (matrix multiplications and attention, as torch's
    ``FlopCounterMode`` counts them), on fake tensors: checkpointing's recomputation is counted, the optimizer
    (element-wise, a few FLOPs per parameter) is not; nor are element-wise ops (what "selective" recomputes)."""
    key = (repr(cfg), batch_size, autocast)
    if key not in _FLOPS:
        _FLOPS[key] = _count_flops(cfg, batch_size, autocast)
    return _FLOPS[key]


def _count_flops(cfg: ModelConfig, batch_size: int, autocast: str | None) -> int:
    mode = FakeTensorMode()
    model = build_fake_model(lambda: GPT(cfg), mode)
    mixed = torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else None
    with mode, FlopCounterMode(display=False) as counter:
        batch = course_batch(batch_size, cfg.seq_len)
        if mixed is not None:
            with mixed:
                loss = gpt_loss(model, batch)
        else:
            loss = gpt_loss(model, batch)
        loss.backward()
    return int(counter.get_total_flops())


@dataclass(frozen=True)
class Fix:
    """One candidate change, verified by a dry run, and what it costs."""

    name: str
    report: FitReport
    extra_flops: float  # FLOPs per global batch relative to the original, minus 1 (0.33 = a third more)
    changes_training: bool  # True when the maths of training changes (another optimizer), not only its cost
    note: str
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step

    @property
    def fits(self) -> bool:
        return self.report.fits


def _fix_sort_key(fix: Fix):
    # fewer micro-batches first at equal FLOPs: small matrix multiplications use a GPU less well
    return (not fix.fits, fix.changes_training, round(fix.extra_flops, 3), fix.micro_batches, fix.report.peak.tensors)


def cheapest_fix(
    cfg: ModelConfig | None = None,
    batch_size: int = 8,
    *,
    optimizer: str = "adamw",
    implementation: str = "foreach",
    autocast: str | None = None,
    device: str | int = "T4 16 GB",
) -> list[Fix]:
    """Candidate changes that lower the peak, each checked by another dry run, ranked: the ones that fit first,
    then those that keep the training maths, then by extra FLOPs (measured with ``FlopCounterMode``).

    * **Micro-batches with gradient accumulation** (global batch kept; 2, 4, 8, ... dividing the batch, up to the
      first that fits): ``dry_run_config`` has no micro-batches,
      so we dry-run the smaller batch and add the whole gradient bytes to its forward and backward, and the rest
      of the global batch's inputs (``track_steps`` slices micro-batches out of it) to every phase: an upper bound
      (from the second micro-batch on, the accumulated gradients are alive throughout; tests/test_prediction.py
      checks it against ``track_steps(micro_batches=k)``); parameters, gradients and optimizer state are
      unchanged; the same FLOPs per global batch (smaller matrix multiplications run less efficiently: a time
      cost FLOPs do not show);
    * **Activation checkpointing**: "attention" (only where the ``s^2`` scores are kept), "selective", "full";
    * **The fused optimizer** (no temporaries; same maths) and **SGD with momentum** (half of Adam's state; another
      optimizer: changes training);
    * **bf16 autocast** (mixed precision: the fp32 parameters stay the master weights, activations are bf16).
      Pure bf16 parameters with a separate fp32 master copy needs a custom optimizer, which ``dry_run_config``
      cannot build: not offered.
    """
    cfg = cfg if cfg is not None else ModelConfig()
    kw = dict(optimizer=optimizer, implementation=implementation, autocast=autocast, device=device)
    base_flops = step_flops(cfg, batch_size, autocast)
    fixes = []

    def add(name, new_cfg, b, note, changes_training=False, grads=0, inputs=0, micro=1, **over):
        run = {**kw, **over}
        suffix = f" x {micro} micro-batches" if micro > 1 else ""
        report = _fit(
            new_cfg,
            b,
            run["optimizer"],
            run["implementation"],
            run["autocast"],
            run["device"],
            grads,
            inputs,
            suffix,
            note,
        )
        flops = micro * step_flops(new_cfg, b, run["autocast"])
        fixes.append(Fix(name, report, flops / base_flops - 1, changes_training, note, micro))

    k = 2
    while k <= batch_size and not any(f.fits and f.micro_batches > 1 for f in fixes):  # the fewest that fit
        if batch_size % k == 0:
            grads = _gradient_bytes(cfg)
            add(
                f"micro-batch {batch_size // k} x {k} (accumulate)",
                cfg,
                batch_size // k,
                "gradients added to every forward/backward (upper bound); same global batch",
                grads=grads,
                inputs=2 * 8 * cfg.seq_len * (batch_size - batch_size // k),  # x and y (int64) of the whole batch
                micro=k,
            )
        k *= 2
    scores_kept = cfg.attn_impl == "manual" or cfg.dropout > 0  # sdpa without dropout keeps no s^2 scores
    for policy in ("attention", "selective", "full") if scores_kept else ("selective", "full"):
        if cfg.checkpoint != policy:
            add(f"checkpoint={policy}", replace(cfg, checkpoint=policy), batch_size, "recomputes in backward")
    if implementation != "fused" and optimizer in ("adam", "adamw"):
        add("fused optimizer", cfg, batch_size, "no optimizer temporaries; same maths", implementation="fused")
    if optimizer in ("adam", "adamw"):
        add(
            "SGD with momentum",
            cfg,
            batch_size,
            "one state buffer instead of two: another optimizer",
            changes_training=True,
            optimizer="momentum",
        )
    if autocast is None and cfg.dtype == "float32":
        add("bf16 autocast", cfg, batch_size, "fp32 master weights, bf16 activations", autocast="bfloat16")
    return sorted(fixes, key=_fix_sort_key)


def _gradient_bytes(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def fixes_table(fixes: list[Fix]) -> str:
    """The candidates, ranked as :func:`cheapest_fix` ranks them."""
    unit, scale = pick_unit(max(f.report.peak.tensors for f in fixes))
    cols = [
        Col("rank", 4),
        Col("change", 34, align="<", gap="  "),
        Col("peak", 8, ".2f"),
        Col("fits", 5),
        Col("extra FLOPs", 11, "+.0%"),
        Col("note", 60, align="<", gap="  "),
    ]
    rows = [
        (
            i,
            f.name,
            f.report.peak.tensors / scale,
            "yes" if f.fits else "no",
            f.extra_flops,
            ("CHANGES TRAINING: " if f.changes_training else "") + f.note,
        )
        for i, f in enumerate(fixes, 1)
    ]
    return format_table(cols, rows, note=f"({unit} of tensors at the peak; fits: simulated allocator under the cap)")
