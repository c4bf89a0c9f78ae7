"""The optimizer step's memory: state, temporaries, and bytes per parameter (notebook 03).

* :func:`build_optimizer` makes the course optimizers in each implementation torch has:
  the single-tensor loop, foreach (multi-tensor) and fused;
* :class:`MasterWeightAdamW` trains a bf16 model with fp32 master weights (mixed precision);
* :func:`bytes_per_param` reads a Trace's optimizer phase (``Trace.optimizer_phase``);
* :func:`measure_setup` / :data:`TABLE_SETUPS` rebuild the bytes-per-parameter table from measurements;
* :func:`plot_bytes_per_param` and :func:`optimizer_bars` draw them (``plots.plot_optimizer_phase`` zooms
  on the phase itself).

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from ..core.tables import Col, format_table
from ..core.tensors import storage_bytes
from ..core.units import MiB, pick_unit
from ..tracking.trace import Trace
from ..training.train import OPTIMIZERS, make_model, make_optimizer, track_steps
from ..ui.plots import CATEGORY_COLORS, CATEGORY_LABELS, FIGURE_WIDTH_IN, CourseFigure

IMPLEMENTATIONS = ("single-tensor", "foreach", "fused")
MODEL_STATES = ("parameters", "gradients", "optimizer_state")


def build_optimizer(
    model: nn.Module, name: str = "adamw", implementation: str = "single-tensor", lr: float = 1e-3
) -> torch.optim.Optimizer:
    """The course optimizer ``name`` (as :func:`make_optimizer` makes it) in a chosen implementation.

    ``implementation``: "single-tensor" (a Python loop over parameters, torch's CPU default),
    "foreach" (each op runs on the whole list of parameters at once, torch's CUDA default) or
    "fused" (one kernel updates everything in place; Adam, AdamW and SGD support it on CPU and CUDA).
    Hyperparameters are exactly those of ``make_optimizer(model, name, lr)``.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "fused":
        return make_optimizer(model, name, lr=lr, fused=True)
    return make_optimizer(model, name, lr=lr, foreach=implementation == "foreach")


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW for a low-precision (e.g. bf16) model that keeps an fp32 master copy of every weight.

    Forward and backward run on the model's own (bf16) parameters, so the gradients land in bf16.
    ``step()`` then, per parameter: upcasts the gradient to fp32, applies the AdamW update
    (torch's single-tensor AdamW arithmetic) to the fp32 master weight, and copies the master back
    into the bf16 parameter (rounding it). ``zero_grad()`` is the usual one.

    State per parameter: ``master`` (fp32, made here at construction from the model's weights),
    and, created lazily in the first step like torch's Adam, ``exp_avg`` and ``exp_avg_sq`` (fp32).
    The step count is a plain Python int (torch's Adam keeps a 4-byte tensor instead).

    ``keep_fp32_grads``: True makes the fp32 copies of *all* gradients before updating any weight and
    keeps them to the end of the step (what fp32 gradient buffers cost: 4 bytes per parameter);
    False makes each fp32 gradient just before its parameter's update and drops it right after.
    Nothing else is allocated during the update: the fp32 gradient copy is reused for the denominator.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        keep_fp32_grads: bool = False,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.keep_fp32_grads = keep_fp32_grads
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["master"] = p.detach().to(torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            kept = [p.grad.to(torch.float32, copy=True) for p in params] if self.keep_fp32_grads else None
            for i, p in enumerate(params):
                g = kept[i] if kept is not None else p.grad.to(torch.float32, copy=True)
                self._update(p, g, group)
                del g
            del kept
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        """One AdamW update of p's fp32 master from fp32 gradient g (g is overwritten)."""
        state = self.state[p]
        master = state["master"]
        if "exp_avg" not in state:  # lazily, as torch's Adam does
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state["step"] += 1
        step = state["step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        master.mul_(1 - lr * wd)  # decoupled weight decay
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = torch.sqrt(exp_avg_sq, out=g)  # the gradient is no longer needed: reuse its memory
        denom.div_(bias_correction2_sqrt).add_(eps)
        master.addcdiv_(exp_avg, denom, value=-step_size)
        p.copy_(master)  # round the new weights into the model's dtype


@dataclass
class BytesPerParam:
    """Model states per parameter at an optimizer phase's peak (bytes / number of parameters)."""

    label: str
    num_params: int
    weights: float  # the parameters category, buffers left out
    gradients: float
    optimizer_state: float
    temporaries: float  # the optimizer's temporaries at its peak

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state + self.temporaries

    def as_bytes(self) -> dict[str, int]:
        """The same numbers back in bytes (exact integers)."""
        n = self.num_params
        return {k: round(getattr(self, k) * n) for k in ("weights", "gradients", "optimizer_state", "temporaries")}


def bytes_per_param(trace: Trace, model: nn.Module, step: int = 2, label: str = "") -> BytesPerParam:
    """Read weights, gradients, optimizer state and optimizer temporaries per parameter at ``step``'s
    optimizer-phase peak. Buffers (the attention mask) are taken out of the weights.
    """
    device = next(model.parameters()).device
    n = sum(p.numel() for p in model.parameters())
    ph = trace.optimizer_phase(step)
    weights = ph.peak["parameters"] - storage_bytes(model.buffers(), device)
    return BytesPerParam(
        label, n, weights / n, ph.peak["gradients"] / n, ph.peak["optimizer_state"] / n, ph.temporaries / n
    )


@dataclass(frozen=True)
class Setup:
    """One way to train: model dtype, optimizer, implementation, master weights."""

    label: str
    optimizer: str = "adamw"  # one of OPTIMIZERS
    implementation: str = "single-tensor"  # one of IMPLEMENTATIONS (ignored with master weights)
    dtype: str = "float32"  # the model's dtype: "float32" or "bfloat16"
    master_weights: bool = False  # fp32 master copies via MasterWeightAdamW (optimizer must be "adamw")
    keep_fp32_grads: bool = False  # with master weights: all fp32 gradients alive at once
    autocast: str | None = None  # "bfloat16": the forward runs under torch.autocast (fp32 weights and gradients)

    def build(self, device=None, **model_config) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A fresh seeded model (``model_config`` overrides ModelConfig fields) and its optimizer."""
        model = make_model(device=device, dtype=self.dtype, **model_config)
        if self.master_weights:
            if self.optimizer != "adamw":
                raise ValueError("master weights are implemented for AdamW only")
            reference = make_optimizer(model, "adamw")  # same lr and weight decay as the course's AdamW
            group = reference.param_groups[0]
            opt = MasterWeightAdamW(
                model.parameters(),
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                keep_fp32_grads=self.keep_fp32_grads,
            )
            return model, opt
        return model, build_optimizer(model, self.optimizer, self.implementation)


TABLE_SETUPS = (
    Setup("fp32, SGD", "sgd"),
    Setup("fp32, SGD + momentum", "momentum"),
    Setup("fp32, AdamW single-tensor", "adamw"),
    Setup("fp32, AdamW foreach", "adamw", "foreach"),
    Setup("fp32, AdamW fused", "adamw", "fused"),
    Setup("fp32 + bf16 autocast, AdamW", "adamw", autocast="bfloat16"),
    Setup("bf16, AdamW, no master copy", "adamw", dtype="bfloat16"),
    Setup("bf16 + fp32 master, grads upcast one by one", dtype="bfloat16", master_weights=True),
    Setup("bf16 + fp32 master, all fp32 grads kept", dtype="bfloat16", master_weights=True, keep_fp32_grads=True),
)
"""The rows of notebook 03's bytes-per-parameter table."""


def measure_setup(setup: Setup, steps: int = 2, batch_size: int = 2, device=None, **model_config) -> BytesPerParam:
    """Train ``steps`` tracked steps of a fresh model under ``setup``; bytes per parameter at the last step's
    optimizer peak."""
    model, opt = setup.build(device=device, **model_config)
    trace = track_steps(model, opt, steps=steps, batch_size=batch_size, autocast=setup.autocast)
    return bytes_per_param(trace, model, step=steps, label=setup.label)


def format_bytes_per_param(rows: list[BytesPerParam]) -> str:
    """The table as text: one row per setup, bytes per parameter."""
    cols = [Col("setup", max(len(r.label) for r in rows), align="<"), Col("weights", 8, ".2f"), Col("grads", 7, ".2f")]
    cols += [Col("opt state", 10, ".2f"), Col("temps", 7, ".2f"), Col("total", 7, ".2f")]
    table = [(r.label, r.weights, r.gradients, r.optimizer_state, r.temporaries, r.total) for r in rows]
    return format_table(cols, table, note="(bytes per parameter)")


def plot_bytes_per_param(rows: list[BytesPerParam], title: str | None = None):
    """Horizontal stacked bars of bytes per parameter (weights, gradients, optimizer state, temporaries)."""
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 0.45 * len(rows) + 1.8), layout="constrained")
    ax = fig.add_subplot()
    ys = np.arange(len(rows))
    left = np.zeros(len(rows))
    parts = [
        ("weights", "parameters", "weights"),
        ("gradients", "gradients", "gradients"),
        ("optimizer_state", "optimizer_state", "optimizer state"),
        ("temporaries", "temporaries", "optimizer temporaries"),
    ]
    for attr, cat, label in parts:
        vals = np.array([getattr(r, attr) for r in rows])
        ax.barh(ys, vals, left=left, color=CATEGORY_COLORS[cat], label=label)
        left += vals
    for y, r in zip(ys, rows):
        ax.text(r.total + 0.2, y, f"{r.total:.1f}", va="center", fontsize=8)
    for x in (16, 20):  # the textbook figures, labelled in a band above the first bar (inside the frame)
        ax.axvline(x, color="#555", linestyle=":", linewidth=0.8)
        ax.text(x, -1.0, f"{x} B", ha="center", va="center", fontsize=8, color="#555", backgroundcolor="white")
    ax.set_yticks(ys, [r.label for r in rows])
    ax.set_ylim(len(rows) - 0.5, -1.5)  # inverted: the first row on top, with the band for the labels above it
    ax.set_xlim(0, max(23.0, float(left.max()) + 3))  # room for the totals' labels right of the longest bar
    ax.set_xlabel("bytes per parameter at the optimizer-phase peak")
    ax.set_title(title or f"Bytes per parameter, measured ({rows[0].num_params:,}-parameter model)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def optimizer_bars(
    d_model: int = 128,
    n_layer: int = 2,
    implementation: str = "single-tensor",
    batch_size: int = 4,
    seq_len: int = 64,
    device=None,
):
    """Track two steps for each course optimizer on one model size; stacked bars of the model states.

    Each bar stacks parameters, gradients and optimizer state (as they stand when step 2's optimizer
    phase begins: every gradient alive) and, on top, the rest of the run's peak (activations,
    temporaries, inputs). Prints the numbers in MiB; returns the Figure. The function behind
    notebook 03's slider panel.
    """
    n_head = 4 if d_model % 4 == 0 else 1
    results, opt_peak = {}, {}
    for name in OPTIMIZERS:
        model = make_model(device=device, d_model=d_model, n_layer=n_layer, n_head=n_head, seq_len=seq_len)
        opt = build_optimizer(model, name, implementation)
        trace = track_steps(model, opt, steps=2, batch_size=batch_size)
        states = trace.at(trace.optimizer_phase(2).start - 1)
        pk = trace.peak()
        opt_peak[name] = trace.peak(step=2, phase="optimizer").bytes  # where the implementation's temporaries show
        results[name] = ({c: states[c] for c in MODEL_STATES}, pk.bytes, pk)
    n = sum(p.numel() for p in model.parameters())
    unit, scale = pick_unit(max(peak for _, peak, _ in results.values()))
    fig = CourseFigure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    xs = np.arange(len(results))
    bottom = np.zeros(len(results))
    for c in MODEL_STATES:
        vals = np.array([states[c] for states, _, _ in results.values()]) / scale
        ax.bar(xs, vals, bottom=bottom, color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c])
        bottom += vals
    rest = np.array([peak for _, peak, _ in results.values()]) / scale - bottom
    ax.bar(xs, rest, bottom=bottom, color="white", edgecolor="#777", hatch="//", label="rest of the peak")
    for x, (_, peak, _) in zip(xs, results.values()):
        ax.text(x, peak / scale, f"{peak / scale:.1f}", ha="center", va="bottom", fontsize=8)
    ax.plot(xs, [opt_peak[name] / scale for name in results], linestyle="none", marker="D", color="black",
            markersize=6, label="step 2's optimizer-phase peak")  # fmt: skip
    ax.set_xticks(xs, list(results))
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(0, max(peak for _, peak, _ in results.values()) / scale * 1.15)
    ax.set_title(f"d_model {d_model}, {n_layer} layers ({n:,} params), {implementation}: model states and peak")
    ax.legend(loc="upper left", fontsize=8)
    print(f"{n:,} parameters = {4 * n / MiB:.2f} MiB in fp32; {implementation} implementation")
    for name, (states, peak, pk) in results.items():
        parts = ", ".join(f"{CATEGORY_LABELS[c]} {states[c] / MiB:.2f}" for c in MODEL_STATES)
        print(
            f"  {name:<9} {parts}; peak {peak / MiB:.2f} MiB in step {pk.step} {pk.phase}; "
            f"optimizer phase {opt_peak[name] / MiB:.2f} MiB"
        )
    return fig
