"""Lesson 06, prediction: three ways to know a step's memory (measured, dry run, closed form) side by side, the
textbook rules of thumb against a measured step, and the will-it-fit panel. The predictions themselves (will it
fit, which phase runs out first, the cheapest fix) are in :mod:`anatomy_helpers.prediction.fit`, which the CLI shares.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.model import ModelConfig
from ..core.tables import Col, format_table
from ..core.units import GiB, MiB, pick_unit
from ..prediction.cuda_rules import CudaRuleError, correction_series, cuda_corrections
from ..prediction.devices import DEFAULT_GPU, DEVICES, Device, get_device
from ..prediction.dryrun import dry_run_config
from ..prediction.estimate import estimate_step, impl_of, textbook_estimates
from ..prediction.explain_read import load_recording
from ..prediction.fit import STEP_PHASES, describe, dry_run_and_replay, will_it_fit
from ..prediction.snapshot import GPU_REFERENCE
from ..tracking.trace import Trace
from ..tracking.tracker import StepTracker
from ..training.train import make_model, make_optimizer, track_steps
from ..ui.plots import CATEGORY_COLORS, FIGURE_WIDTH_IN, CourseFigure, plot_fit

#: Model shapes for the panel (ModelConfig fields); ``block`` is chosen separately. The vocabulary is GPT-2's
#: (50,304, padded) for every shape but the toy, whose is the course text's.
SHAPES = {
    "toy (4 x 256)": dict(n_layer=4, d_model=256, n_head=4),
    "GPT-2 small (12 x 768)": dict(n_layer=12, d_model=768, n_head=12, vocab_size=50304),
    "GPT-2 medium (24 x 1024)": dict(n_layer=24, d_model=1024, n_head=16, vocab_size=50304),
    "1B (16 x 2048)": dict(n_layer=16, d_model=2048, n_head=32, vocab_size=50304),
}

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
    """Predicted step peak (dry run, closed form) against the measured one, with the y = x line, and each method's
    miss in bytes per configuration, written beside its marker (a zero is drawn as a zero, not as an empty axis)."""
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 4), layout="constrained")
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
    ys = np.arange(len(comparisons))
    misses = {"dry run": [c.peaks[1] - c.peaks[0] for c in comparisons]}
    misses["closed form"] = [c.peaks[2] - c.peaks[0] for c in comparisons]
    widest = max(1024, *(abs(b) for bs in misses.values() for b in bs))  # at least +-1 KiB, so 0 sits mid-axis
    styles = {"dry run": ("o", "none", CATEGORY_COLORS["parameters"], -0.15)}
    styles["closed form"] = ("o", CATEGORY_COLORS["activations"], CATEGORY_COLORS["activations"], 0.15)
    for name, values in misses.items():
        marker, face, edge, dy = styles[name]
        ax2.scatter(values, ys + dy, marker=marker, facecolors=face, edgecolors=edge, s=40, label=name)
        for v, y in zip(values, ys + dy):
            ax2.text(v + 0.1 * widest, y, f"{v:+,d} B" if v else "0 B", va="center", fontsize=7, color=edge)
    ax2.set_yticks(ys, [c.label for c in comparisons], fontsize=7)
    ax2.invert_yaxis()
    ax2.set_xlim(-widest * 1.2, widest * 1.6)
    ax2.axvline(0, color="black", linewidth=0.8)
    ax2.set_xlabel("predicted - measured step peak (bytes)")
    ax2.legend(fontsize=7, loc="lower right")
    ax2.set_title("How far each prediction missed", fontsize=10)
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
        act_why.append("counts the s^2 attention scores (sdpa on CPU keeps none)")
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
    device: str = DEFAULT_GPU,
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
    options = dict(optimizer=optimizer, implementation=implementation)
    options["autocast"] = None if autocast == "none" else autocast
    try:
        report = will_it_fit(cfg, batch_size, device=device, **options)
    except CudaRuleError as why:  # a combination no CUDA rule states: say so, and show what can be said
        total = get_device(device).total
        print(f"No prediction for {device}: {why}.\nShown instead: the dry run by the CPU kernels' rules against "
              f"{device}'s {total / GiB:.1f} GiB.")  # fmt: skip
        report = will_it_fit(cfg, batch_size, device=total, **options)
    print(report.table(brief=True))  # the figure stays in view; print(report) gives the whole answer
    fig = plot_fit(report)
    # what the verdict rests on, for the panel's digest (widgets.figure_digest): the device's memory changes the
    # verdict even where its line is off the scale of the bars
    fig.panel_numbers = (report.capacity, report.usable, report.fits)
    return fig


# ---- on a GPU: the prediction against the stored GPU run --------------------------------------------------------


def default_step_on_gpu(capability: tuple[int, int], warm: bool) -> list[tuple[int, int]]:
    """The course's default step (``make_model()`` defaults, batch 8, AdamW foreach: lesson 06's GPU cell and
    ``scripts/record_gpu_reference.py``) predicted for a GPU of ``capability``: per step (1, 2), (the prediction's
    peak of tensor bytes, the allocator simulator's peak of allocated bytes), both with CUDA's rules
    (:mod:`~anatomy_helpers.prediction.cuda_rules`). The simulator counts what ``memory_allocated`` counts: whole
    blocks, the 512-byte rounding and the large blocks it hands out unsplit (remainder <= 1 MiB). ``warm``: the
    cuBLAS workspaces exist before the step (lesson 06 runs a warm-up step first), so both leave them out."""
    cfg = ModelConfig()
    dev = Device("check", 2**40, tuple(capability))
    trace, rep, _ = dry_run_and_replay(cfg, 8, "adamw", "foreach", None)
    made_before = ("cuBLAS workspace", "cuBLASLt workspace") if warm else ()
    corrections = [c for c in cuda_corrections(trace, cfg, None, dev) if c.rule not in made_before]
    added = correction_series(trace, corrections).sum(axis=1)
    n0 = len(trace.baseline_ids)  # the record's first rows are the storages alive at the start
    out = []
    for step in (1, 2):
        first, last = max(trace.phase(step, "forward").start - 1, 0), trace.phase(step, "optimizer").end
        window = slice(first, last + 1)
        tensors = trace.timeline.total[window] + added[window]
        allocated = rep.allocated[n0 + first : n0 + last + 1] + added[window]
        out.append((int(tensors.max()), int(allocated.max())))
    return out


@dataclass(frozen=True)
class GpuGap:
    """Where the stored GPU run's default step differs from its prediction (bytes; see :func:`gpu_gap`)."""

    gpu: str  # the GPU the snapshot was recorded on
    measured: int  # the snapshot's peak of requested bytes (parameters made before recording began included)
    staging_at_peak: int  # of which: CUDA reduction kernels' staging buffers alive at that moment
    measured_without_staging: int  # the snapshot's peak with those buffers left out (it may fall at another moment)
    predicted: int  # the prediction's peak of tensor bytes for that GPU (a fresh process: workspaces made in it)
    host_step_counters: int  # Adam's step counters, which CUDA's foreach AdamW keeps on the host: 4 B a parameter


def reduction_staging(events: Sequence[dict]) -> set[int]:
    """Indices of the snapshot events (``alloc`` and ``free_completed`` only) that are a CUDA reduction's staging: a
    buffer, then a few bytes of semaphores, made and freed around one kernel with nothing between. ATen's reduce
    kernel (``aten/src/ATen/native/cuda/Reduce.cuh``, ``should_global_reduce``) takes both from the caching allocator
    when it splits a long reduction (a bias gradient summed over every position) across thread blocks: kernel
    scratch, which no dry run counts. The pattern is read from the events: a backward recorded without stacks names
    no op."""
    found = set()
    for i in range(len(events) - 3):
        a, b, c, d = events[i : i + 4]
        actions = (a["action"], b["action"], c["action"], d["action"])
        if actions == ("alloc", "alloc", "free_completed", "free_completed"):
            if c["addr"] == b["addr"] and d["addr"] == a["addr"] and b["size"] < a["size"]:
                found.update(range(i, i + 4))
    return found


def _snapshot_peak(events: Sequence[dict], skip: set[int], marked: set[int]) -> tuple[int, int]:
    """(peak of live requested bytes over ``events`` without those at ``skip``, the bytes alive at that peak that
    were allocated at an index in ``marked``)."""
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, index of its alloc)
    current = top = marked_at_top = 0
    for i, event in enumerate(events):
        if i in skip:
            continue
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], i)
            current += event["size"]
        else:
            current -= live.pop(event["addr"], (0, -1))[0]
        if current > top:
            top = current
            marked_at_top = sum(size for size, at in live.values() if at in marked)
    return top, marked_at_top


def gpu_gap(snapshot_path: str | Path | None = None) -> GpuGap:
    """The stored GPU run's default step (3 steps from a fresh process, ``scripts/record_gpu_reference.py``) against
    its prediction, byte for byte: the snapshot's peak, the reduction staging alive at it, the peak without that
    staging, today's prediction for that GPU's compute capability, and the Adam step counters the GPU keeps on the
    host where the dry run (one device) counts them. Reads ``lessons/gpu_reference/first_steps.pickle`` by default
    (and the ``.json`` beside it, for the GPU)."""
    path = Path(snapshot_path) if snapshot_path is not None else GPU_REFERENCE
    _, snapshot = load_recording(path)
    gpu = json.loads(path.with_suffix(".json").read_text())["gpu"]
    events = [e for e in snapshot["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    staging = reduction_staging(events)
    measured, staged = _snapshot_peak(events, set(), staging)
    without, _ = _snapshot_peak(events, staging, set())
    model = make_model()  # the parameters and buffers existed before the recording began: not in its events
    made_before = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))
    known = [d for d in DEVICES.values() if gpu.removeprefix("NVIDIA ").startswith(d.name.split()[0])]
    if len({d.capability for d in known}) != 1:
        raise ValueError(f"{path}: no one compute capability known for the GPU it names, {gpu!r}")
    predicted = max(tensors for tensors, _ in default_step_on_gpu(known[0].capability, warm=False))
    return GpuGap(
        gpu=gpu,
        measured=measured + made_before,
        staging_at_peak=staged,
        measured_without_staging=without + made_before,
        predicted=predicted,
        host_step_counters=4 * sum(1 for _ in model.parameters()),
    )
