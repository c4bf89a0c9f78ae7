"""Lesson 06, prediction: will a training step fit on a GPU, which phase runs out first, and the cheapest fix.

Everything here is predicted on this machine's CPU with dry runs (:mod:`anatomy_helpers.dryrun`: the tracked step
on fake tensors, exact for every category but kernel scratch), so it works for models far larger than the machine.
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

import numpy as np
import torch
from matplotlib.patches import Patch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ..allocator import replay, replay_with_limit
from ..dryrun import build_fake_model, course_batch, dry_run_config, gpt_loss
from ..estimate import estimate_step, impl_of, textbook_estimates
from ..model import GPT, ModelConfig
from ..plots import CATEGORY_COLORS, CATEGORY_LABELS, CourseFigure
from ..tables import Col, format_table
from ..trace import CATEGORIES, Trace
from ..tracker import StepTracker
from ..train import make_model, make_optimizer, track_steps
from ..units import GiB, MiB, pick_unit

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

#: Model shapes for the panel (ModelConfig fields); ``block`` is chosen separately. The vocabulary is GPT-2's
#: (50,304, padded) for every shape but the toy, whose is the course text's.
SHAPES = {
    "toy (4 x 256)": dict(n_layer=4, d_model=256, n_head=4),
    "GPT-2 small (12 x 768)": dict(n_layer=12, d_model=768, n_head=12, vocab_size=50304),
    "GPT-2 medium (24 x 1024)": dict(n_layer=24, d_model=1024, n_head=16, vocab_size=50304),
    "1B (16 x 2048)": dict(n_layer=16, d_model=2048, n_head=32, vocab_size=50304),
}

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


# ---- three ways to know a step's memory ---------------------------------------------------------------------


@dataclass(frozen=True)
class MethodComparison:
    """One configuration's phase peaks (bytes), ``(step, phase) -> bytes``, by three methods."""

    label: str
    measured: dict[tuple[int, str], int]  # a real run, tracked (kernel_scratch=False: what the others predict)
    dry_run: dict[tuple[int, str], int]
    closed_form: dict[tuple[int, str], int]  # estimate.estimate_step
    dry_run_s: float  # wall time of the dry run (volatile)

    @property
    def peaks(self) -> tuple[int, int, int]:
        """The step peak (both steps) by each method: measured, dry run, closed form."""
        return max(self.measured.values()), max(self.dry_run.values()), max(self.closed_form.values())

    @property
    def closed_form_error(self) -> float:
        """(closed form - measured) / measured, of the step peak."""
        measured, _, closed = self.peaks
        return (closed - measured) / measured


def compare_methods(
    cfg: ModelConfig, batch_size: int = 8, optimizer: str = "adamw", foreach=None, fused=None, label: str = ""
) -> MethodComparison:
    """Measure two steps of ``cfg`` for real on CPU (tracked), dry-run them, and compute the closed form."""
    import time

    model = make_model(device="cpu", **{f: getattr(cfg, f) for f in cfg.__dataclass_fields__})
    opt = make_optimizer(model, optimizer, foreach=foreach, fused=fused)
    tracker = StepTracker(model, opt, kernel_scratch=False)
    real = track_steps(model, opt, steps=2, batch_size=batch_size, tracker=tracker)
    del model, opt, tracker
    start = time.perf_counter()
    dry = dry_run_config(cfg, optimizer=optimizer, foreach=foreach, fused=fused, batch_size=batch_size, steps=2)
    wall = time.perf_counter() - start
    closed = estimate_step(cfg, batch_size, optimizer, impl_of(foreach, fused)).phase_peaks
    return MethodComparison(
        label or describe(cfg, batch_size, optimizer, impl_of(foreach, fused), None),
        {k: real.peak(step=k[0], phase=k[1]).bytes for k in STEP_PHASES},
        {k: dry.peak(step=k[0], phase=k[1]).bytes for k in STEP_PHASES},
        {k: closed[k] for k in STEP_PHASES},
        wall,
    )


def methods_table(comparison: MethodComparison) -> str:
    """Phase by phase: measured, dry run, closed form (MiB) and the closed form's error."""
    cols = [Col("step", 4), Col("phase", 9, align="<", gap="  "), Col("measured", 9, ".3f")]
    cols += [Col("dry run", 9, ".3f"), Col("closed form", 11, ".3f"), Col("error", 7, "+.2%")]
    rows = []
    for (step, phase), m in comparison.measured.items():
        d, c = comparison.dry_run[(step, phase)], comparison.closed_form[(step, phase)]
        rows.append((step, phase, m / MiB, d / MiB, c / MiB, (c - m) / m))
    return format_table(cols, rows, note="(MiB; error: closed form vs measured)")


def sweep_table(comparisons: list[MethodComparison]) -> str:
    """One line per configuration: the step peak by each method and the closed form's error."""
    cols = [Col("config", 46, align="<"), Col("measured", 9, ".2f"), Col("dry run", 9, ".2f")]
    cols += [Col("closed", 9, ".2f"), Col("error", 7, "+.2%")]
    rows = [(c.label, *(x / MiB for x in c.peaks), c.closed_form_error) for c in comparisons]
    return format_table(cols, rows, note="(MiB, step peak)")


def plot_predicted_vs_measured(comparisons: list[MethodComparison], title: str | None = None):
    """Predicted step peak (dry run, closed form) against the measured one, with the y = x line, and the closed
    form's error per configuration."""
    fig = CourseFigure(figsize=(10, 4), layout="constrained")
    ax, ax2 = fig.subplots(1, 2)
    measured = np.array([c.peaks[0] for c in comparisons]) / MiB
    dry = np.array([c.peaks[1] for c in comparisons]) / MiB
    closed = np.array([c.peaks[2] for c in comparisons]) / MiB
    top = max(measured.max(), dry.max(), closed.max()) * 1.05
    ax.plot([0, top], [0, top], color="#999999", linewidth=1, label="predicted = measured")
    ax.scatter(measured, dry, s=60, facecolors="none", edgecolors=CATEGORY_COLORS["parameters"], label="dry run")
    ax.scatter(measured, closed, s=14, color=CATEGORY_COLORS["activations"], label="closed form")
    ax.set_xlabel("measured step peak (MiB)")
    ax.set_ylabel("predicted step peak (MiB)")
    ax.legend(fontsize=8)
    ax.set_title("Predicted vs measured", fontsize=10)
    errors = np.array([100 * c.closed_form_error for c in comparisons])
    ax2.barh(np.arange(len(errors)), errors, color=CATEGORY_COLORS["activations"])
    ax2.set_yticks(np.arange(len(errors)), [c.label for c in comparisons], fontsize=7)
    ax2.invert_yaxis()
    ax2.axvline(0, color="black", linewidth=0.8)
    ax2.set_xlabel("closed form error vs measured (%)")
    ax2.set_title("Closed form error (the dry run's is 0)", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


@dataclass(frozen=True)
class TextbookRow:
    """A rule of thumb beside what it claims to predict, measured (bytes)."""

    rule: str
    textbook: int
    measured: int
    why: str


def textbook_comparison(cfg: ModelConfig, batch_size: int, trace: Trace, optimizer: str = "adamw") -> list[TextbookRow]:
    """estimate.textbook_estimates term by term beside the same quantity read from a (dry-run or real) trace."""
    book = textbook_estimates(cfg, batch_size, optimizer)
    at_rest = trace.phase(2, "optimizer").peak.breakdown
    states = at_rest["parameters"] + at_rest["gradients"] + at_rest["optimizer_state"]
    acts = trace.phase(1, "forward").at_end["activations"]
    fp32, dropout = cfg.dtype == "float32", cfg.dropout > 0
    act_why = ["assumes 16-bit activations (ours are fp32: x2)"] if fp32 else []
    if not dropout:
        act_why.append("counts dropout masks (no dropout here)")
    if cfg.attn_impl == "sdpa" and not dropout:
        act_why.append("counts the s^2 attention scores (sdpa keeps none)")
    act_why.append("leaves out the head's logits and loss (fp32, N x V)")
    return [
        TextbookRow(
            "weights only",
            book.weights_only,
            trace.baseline["parameters"],
            "leaves out the model's buffers (causal masks, rotary tables)",
        ),
        TextbookRow(
            "model states (P + G + O)",
            book.model_states,
            states,
            "exact at the optimizer step, where every gradient and the whole state are alive",
        ),
        TextbookRow("activations (Korthikanti)", book.korthikanti, acts, "; ".join(act_why)),
        TextbookRow(
            "16 B/param + Korthikanti",
            book.sixteen_per_param,
            trace.peak().bytes,
            "the peak is in backward: the logits' gradients and temporaries join states and activations",
        ),
    ]


def textbook_table(rows: list[TextbookRow]) -> str:
    unit, scale = pick_unit(max(max(r.textbook, r.measured) for r in rows))
    cols = [Col("rule of thumb", 26, align="<"), Col("textbook", 9, ".2f"), Col("measured", 9, ".2f")]
    cols += [Col("off by", 8, "+.0%"), Col("why they differ", 90, align="<", gap="  ")]
    data = [
        (r.rule, r.textbook / scale, r.measured / scale, (r.textbook - r.measured) / r.measured, r.why) for r in rows
    ]
    return format_table(cols, data, note=f"({unit})")


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


def plot_fit(report: FitReport, title: str | None = None):
    """Stacked bars (tensor bytes by category at each phase's peak) for step 1 and step 2, the allocator's
    overhead on top (hatched), and the device's usable memory as a line."""
    unit, scale = pick_unit(max(report.usable, report.peak.reserved))
    fig = CourseFigure(figsize=(9, 4.2), layout="constrained")
    ax = fig.add_subplot()
    xs = np.arange(len(report.phases))
    shown = [c for c in CATEGORIES if any(p.breakdown.get(c, 0) for p in report.phases)]
    bottom = np.zeros(len(xs))
    for c in shown:
        vals = np.array([p.breakdown.get(c, 0) for p in report.phases]) / scale
        ax.bar(xs, vals, bottom=bottom, color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c], width=0.7)
        bottom += vals
    over = np.array([max(p.reserved - p.tensors, 0) for p in report.phases]) / scale
    ax.bar(
        xs,
        over,
        bottom=bottom,
        color="white",
        edgecolor="#888888",
        hatch="//",
        width=0.7,
        label="reserved, not allocated (simulated, uncapped)",
    )
    ax.axhline(report.usable / scale, color="black", linestyle="--", linewidth=1.2)
    ax.axhline(report.capacity / scale, color="black", linestyle=":", linewidth=1)
    ax.text(len(xs) - 0.5, report.usable / scale, f"usable on {report.device}", ha="right", va="bottom", fontsize=8)
    fail = report.first_failure
    if fail is not None and fail in report.phases:
        i = report.phases.index(fail)
        ax.annotate(
            "runs out first",
            (i, report.usable / scale),
            xytext=(i, report.usable / scale * 0.55),
            ha="center",
            fontsize=8,
            arrowprops=dict(arrowstyle="->"),
        )
    ax.set_xticks(xs, [f"step {p.step}\n{p.phase}" for p in report.phases])
    ax.set_xlabel("phase of the training step")
    ax.set_ylabel(f"peak memory ({unit})")
    handles, labels = ax.get_legend_handles_labels()
    handles.append(Patch(facecolor="none", edgecolor="none"))
    labels.append("--- usable, ··· capacity")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(title or f"Will it fit? {report.label} on {report.device}", fontsize=9)
    return fig


def fit_panel(
    shape: str = "toy (4 x 256)",
    block: str = "gpt2",
    batch_size: int = 8,
    seq_len: int = 128,
    dtype: str = "float32",
    autocast: str = "none",
    optimizer: str = "adamw",
    implementation: str = "foreach",
    checkpoint: str = "none",
    device: str = "T4 16 GB",
):
    """The notebook's slider panel: dry-run a configuration, print the fit table, return the plot."""
    cfg = ModelConfig(
        **SHAPES[shape],
        block=block,
        seq_len=seq_len,
        dtype=dtype,
        checkpoint=checkpoint,
        attn_impl="sdpa" if shape != "toy (4 x 256)" else "manual",
    )
    report = will_it_fit(
        cfg,
        batch_size,
        optimizer=optimizer,
        implementation=implementation,
        autocast=None if autocast == "none" else autocast,
        device=device,
    )
    print(report.table())
    return plot_fit(report)


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
