"""Lesson 05, activation checkpointing: what each policy keeps, what it recomputes, what it costs.

The policies themselves are core (:mod:`anatomy_helpers.core.checkpointing`, wired into the model through
``ModelConfig.checkpoint``). What is here only lesson 05 uses: the policy line-up and its table (peak, activations,
extra FLOPs, time), the memory-vs-time picture, the recomputations one by one, the gradient checks (with and without
RNG-state preservation), the budget exercise and the GPU comparison. Part 2
(:mod:`anatomy_helpers.lessons.lesson05_kept`) counts what a checkpointed model keeps: per layer against
Korthikanti et al.'s formula, and across every-k segments (the sqrt(L) rule). Units are bytes unless a name says
otherwise.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..core.data import get_batch, seed_everything
from ..core.tables import Col, format_table
from ..core.units import MiB, pick_unit
from ..prediction.cuda import cuda_run_under_limit
from ..tracking.trace import Trace
from ..training.budget import try_budget
from ..training.step import flop_counter, step_flops
from ..training.train import make_model, make_optimizer, track_steps
from ..ui.plots import CourseFigure, plot_timeline

# ---------------------------------------------------------------------------------------------
# The line-up
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """One checkpointing setting of the course model: ``ModelConfig.checkpoint`` and ``checkpoint_every``."""

    checkpoint: str
    every: int = 1  # blocks per checkpointed segment; only "every_k" reads it

    @property
    def label(self) -> str:
        return f"every {self.every}" if self.checkpoint == "every_k" else self.checkpoint

    @property
    def config(self) -> dict:
        """The ModelConfig fields (``make_model(**policy.config)``)."""
        return {"checkpoint": self.checkpoint, "checkpoint_every": self.every}


def lineup(every: int = 2) -> list[Policy]:
    """The lesson's policies, from keeping the most to keeping the least: none, offload, attention, selective,
    every ``every`` blocks, full."""
    names = ("none", "offload", "attention", "selective")
    return [*(Policy(n) for n in names), Policy("every_k", every), Policy("full")]


def policy_by_label(label: str, policies: list[Policy]) -> Policy:
    """The policy of ``policies`` whose label is ``label``; ValueError naming the labels otherwise."""
    for p in policies:
        if p.label == label:
            return p
    raise ValueError(f"policy must be one of {[p.label for p in policies]}, got {label!r}")


# ---------------------------------------------------------------------------------------------
# FLOPs: counted, not assumed
# ---------------------------------------------------------------------------------------------


def forward_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, dict[str, int]]:
    """FLOPs of one forward by module (``"blocks.0"``, ``"blocks.0.mlp.proj"`` ... and ``"total"``) and op name
    (``"mm"``, ``"addmm"``, ``"bmm"`` ...; ``"all"`` sums them). A module's count includes its children's."""
    with torch.no_grad(), flop_counter() as counter:
        model(x, y)
    out: dict[str, dict[str, int]] = {}
    for name, ops in counter.get_flop_counts().items():
        key = "total" if name == "Global" else name.partition(".")[2]
        if not key:  # the root module: the same as Global
            continue
        by_op = {str(op).split(".")[-1]: int(n) for op, n in ops.items()}
        by_op["all"] = sum(by_op.values())
        out[key] = by_op
    return out


# ---------------------------------------------------------------------------------------------
# Measuring every policy
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyRow:
    """What one policy costs on one model and batch (bytes, FLOPs; the step is the last one tracked)."""

    policy: Policy
    peak: int  # the step's peak of live tracked bytes
    peak_phase: str
    peak_module: str
    activations: int  # activations alive at the end of the step's forward pass
    recomputed: int  # the most recomputed bytes alive at once
    flops: int  # FLOPs of forward + backward (FlopCounterMode)
    flop_ratio: float  # flops / the "none" policy's flops
    time_ratio: float | None = None  # median warm step time / the "none" policy's (measured separately)

    @property
    def label(self) -> str:
        return self.policy.label


def measure_policies(
    policies: list[Policy],
    *,
    steps: int = 2,
    batch_size: int = 8,
    optimizer: str = "adamw",
    device=None,
    seed: int = 0,
    **model_config,
) -> tuple[list[PolicyRow], dict[str, Trace]]:
    """Track ``steps`` training steps of a fresh model (same seed, same batches) under each policy, and count the
    FLOPs of one forward + backward under each. The first policy must be ``"none"`` (the reference).

    Returns the rows (for the last step) and the traces by policy label.
    """
    if not policies or policies[0].checkpoint != "none":
        raise ValueError("the first policy must be 'none': the others are compared with it")
    traces: dict[str, Trace] = {}
    flops: dict[str, int] = {}
    for p in policies:
        model = make_model(device=device, **model_config, **p.config)
        traces[p.label] = track_steps(model, make_optimizer(model, optimizer), steps=steps, batch_size=batch_size)
        x, y = get_batch(batch_size, model.cfg.seq_len, seed=seed, device=next(model.parameters()).device)
        flops[p.label] = step_flops(model, x, y)
    base = flops[policies[0].label]
    rows = []
    for p in policies:
        trace = traces[p.label]
        pk = trace.peak(step=steps)
        rows.append(
            PolicyRow(
                policy=p,
                peak=pk.bytes,
                peak_phase=pk.phase,
                peak_module=pk.module,
                activations=trace.phase(steps, "forward").at_end["activations"],
                recomputed=int(trace.timeline.category("recomputed")[trace.window(steps)].max()),
                flops=flops[p.label],
                flop_ratio=flops[p.label] / base,
            )
        )
    return rows, traces


def time_policies(
    policies: list[Policy],
    *,
    batch_size: int = 8,
    warm: int = 2,
    timed: int = 5,
    optimizer: str = "adamw",
    device=None,
    seed: int = 0,
    **model_config,
) -> dict[str, float]:
    """Median seconds of a training step per policy label: ``warm`` untimed steps, then ``timed`` timed ones
    (untracked). The policies take turns step by step, so a busy moment of the machine hits all of them alike."""
    models = {p.label: make_model(device=device, seed=seed, **model_config, **p.config) for p in policies}
    opts = {label: make_optimizer(m, optimizer) for label, m in models.items()}
    dev = next(next(iter(models.values())).parameters()).device
    x, y = get_batch(batch_size, next(iter(models.values())).cfg.seq_len, seed=seed, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {label: [] for label in models}
    for i in range(warm + timed):
        for label, m in models.items():
            sync()
            start = time.perf_counter()
            m(x, y)[1].backward()
            opts[label].step()
            opts[label].zero_grad(set_to_none=True)
            sync()
            if i >= warm:
                times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def with_time_ratios(rows: list[PolicyRow], seconds: dict[str, float]) -> list[PolicyRow]:
    """The rows with ``time_ratio`` = each policy's median step time / the first row's (the "none" policy)."""
    base = seconds[rows[0].label]
    return [dataclasses.replace(r, time_ratio=seconds[r.label] / base) for r in rows]


def policy_table(rows: list[PolicyRow]) -> str:
    """Text table of the rows (MiB; the time ratio only if the rows have one)."""
    timed = all(r.time_ratio is not None for r in rows)
    cols = [Col("policy", 10, align="<"), Col("step peak", 10, ".2f"), Col("activations", 12, ".2f")]
    cols += [Col("recomputed", 11, ".2f"), Col("peak in", 30, align="<", gap="  "), Col("FLOP ratio", 11, ".3f")]
    if timed:
        cols.append(Col("time ratio", 11, ".2f"))
    table = []
    for r in rows:
        where = f"{r.peak_phase}, {r.peak_module}"
        cells = [r.label, r.peak / MiB, r.activations / MiB, r.recomputed / MiB, where, r.flop_ratio]
        table.append(cells + ([r.time_ratio] if timed else []))
    note = "(MiB; activations at the end of forward; ratios to 'none')"
    return format_table(cols, table, note=note)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (lower is better in each), by x."""
    front = []
    for i, (xi, yi) in enumerate(points):
        beaten = any(xj <= xi and yj <= yi and (xj, yj) != (xi, yi) for xj, yj in points)
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def plot_pareto(rows: list[PolicyRow], title: str | None = None):
    """Each policy a point: step time (x, ratio to "none") against step peak (y); the Pareto front drawn.

    The rows need time ratios (:func:`with_time_ratios`). Returns the Figure."""
    if any(r.time_ratio is None for r in rows):
        raise ValueError("the rows have no time ratios: measure them with time_policies and with_time_ratios")
    unit, scale = pick_unit(max(r.peak for r in rows))
    points = [(r.time_ratio, r.peak / scale) for r in rows]
    front = pareto_front(points)
    fig = CourseFigure(figsize=(7.5, 4.6), layout="constrained")
    ax = fig.add_subplot()
    fx, fy = zip(*(points[i] for i in front))
    ax.step(fx, fy, where="post", color="#555", linestyle="--", linewidth=1, label="Pareto front", zorder=1)
    labels: dict[tuple[float, float], list[str]] = {}  # policies at the same point share one label
    for i, (r, point) in enumerate(zip(rows, points)):
        ax.plot(*point, "o", color="#0072B2" if i in front else "#999", markersize=8, zorder=2)
        labels.setdefault(point, []).append(r.label)
    for point, names in labels.items():
        ax.annotate(", ".join(names), point, xytext=(6, 5), textcoords="offset points", fontsize=9)
    ax.set_xlabel("step time (x the time of 'none', median of warm steps)")
    ax.set_ylabel(f"step peak ({unit})")
    ax.margins(x=0.15, y=0.12)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title or "Memory against time: the policies on the front are the ones worth choosing")
    return fig


def same_memory(a: Trace, b: Trace) -> bool:
    """Whether two traces allocated exactly the same bytes per category, event by event."""
    return a.timeline.bytes.shape == b.timeline.bytes.shape and bool((a.timeline.bytes == b.timeline.bytes).all())


# ---------------------------------------------------------------------------------------------
# Recomputations, one by one
# ---------------------------------------------------------------------------------------------


def recompute_bumps(trace: Trace, step: int) -> list[int]:
    """The most recomputed bytes alive during each recomputation of ``step``'s backward (a recomputation: a run of
    samples with recomputed bytes alive, between moments with none)."""
    values = trace.timeline.category("recomputed")[trace.window(step, "backward")]
    bumps, top = [], 0
    for v in values.tolist():
        if v:
            top = max(top, v)
        elif top:
            bumps.append(top)
            top = 0
    return bumps + ([top] if top else [])


# ---------------------------------------------------------------------------------------------
# Gradients: the same with and without checkpointing
# ---------------------------------------------------------------------------------------------


def policy_gradients(policy: Policy, *, batch_size: int = 2, seed: int = 0, device=None, **model_config):
    """Every parameter's gradient after one forward + backward of a fresh model (weights and dropout draws from
    ``seed``) under ``policy``, in ``named_parameters`` order."""
    model = make_model(device=device, seed=seed, **model_config, **policy.config)
    x, y = get_batch(batch_size, model.cfg.seq_len, seed=seed, device=next(model.parameters()).device)
    seed_everything(seed)  # the dropout masks are drawn from here
    model(x, y)[1].backward()
    return [p.grad for _, p in model.named_parameters()]


def same_gradients(a: list[torch.Tensor], b: list[torch.Tensor], exact: bool = True) -> bool:
    """Whether two lists of gradients are bit for bit the same (``exact=False``: equal to rounding, for GPUs, where
    not every kernel promises a fixed order of its sums; bit-identity is checked on CPU only)."""
    if len(a) != len(b):
        return False
    same = torch.equal if exact else (lambda g, h: torch.allclose(g, h, rtol=1e-4, atol=1e-6))
    return all(same(g, h) for g, h in zip(a, b))


@dataclass(frozen=True)
class BlockGradients:
    """One block's gradients with and without ``torch.utils.checkpoint`` (same weights, input, seed)."""

    preserve_rng_state: bool
    identical: bool  # every gradient bit for bit the same as without checkpointing
    differing: int  # gradient elements that differ
    total: int  # gradient elements


def block_gradients(
    preserve_rng_state: bool, *, dropout: float = 0.1, batch_size: int = 2, seed: int = 0, device=None, **model_config
) -> BlockGradients:
    """Run block 0 of a fresh model with dropout twice on the same input and seed: plainly, then through
    ``torch.utils.checkpoint(..., use_reentrant=False, preserve_rng_state=preserve_rng_state)`` directly (not
    through the course model's policies, which always preserve the state when there is dropout); compare the
    gradients of the block's input and parameters."""
    model = make_model(device=device, seed=seed, dropout=dropout, **model_config)
    block = model.blocks[0]
    dev = next(model.parameters()).device
    x = torch.randn(batch_size, model.cfg.seq_len, model.cfg.d_model, device=dev, dtype=model.cfg.torch_dtype)
    weight = torch.randn_like(x)  # a loss that weighs every output differently

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        inp = x.detach().requires_grad_()
        seed_everything(seed)
        if checkpointed:
            out = checkpoint(block, inp, use_reentrant=False, preserve_rng_state=preserve_rng_state)
        else:
            out = block(inp)
        (out * weight).sum().backward()
        found = [inp.grad] + [p.grad.clone() for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        return found

    plain, ckpt = grads(False), grads(True)
    differing = sum(int((a != b).sum()) for a, b in zip(plain, ckpt))
    total = sum(a.numel() for a in plain)
    return BlockGradients(preserve_rng_state, differing == 0, differing, total)


# ---------------------------------------------------------------------------------------------
# Where the peak is
# ---------------------------------------------------------------------------------------------


def plot_peak_moment(trace: Trace, step: int, title: str | None = None):
    """Step ``step`` of ``trace`` with the moment the forward ends and the step's peak marked. Returns the Figure."""
    fig = plot_timeline(trace, title=title)
    ax = fig.axes[0]
    boundary = trace.phase(step, "forward").end
    ax.axvline(boundary, color="black", linestyle=":", linewidth=1.2)
    ax.text(boundary, ax.get_ylim()[1] * 0.78, " forward ends", fontsize=8, ha="left")
    return fig


# ---------------------------------------------------------------------------------------------
# The budget exercise
# ---------------------------------------------------------------------------------------------


def cheapest_fitting(rows: list[PolicyRow], budget: int) -> PolicyRow | None:
    """The row with the fewest FLOPs among those whose peak fits ``budget`` (ties: the lower peak); None if none
    fits."""
    fitting = [r for r in rows if r.peak <= budget]
    return min(fitting, key=lambda r: (r.flops, r.peak)) if fitting else None


def check_policy_choice(
    choice: str | None,
    budget: int,
    rows: list[PolicyRow],
    *,
    steps: int = 2,
    batch_size: int = 8,
    optimizer: str = "adamw",
    device=None,
    **model_config,
) -> bool | None:
    """Run the policy labelled ``choice`` under ``budget`` bytes (``budget.try_budget``) and say whether it fits and
    whether it is the cheapest one that fits (fewest extra FLOPs, from ``rows``). Returns True when it is, False
    when not, None without a choice (then nothing runs and nothing is revealed)."""
    policies = [r.policy for r in rows]
    if choice is None:
        print(
            f"no choice yet: put one of {[p.label for p in policies]} in my_choice and re-run this cell; it then "
            "runs your policy under the budget."
        )
        return None
    policy = policy_by_label(choice, policies)
    run = try_budget(
        budget, batch_size, optimizer, policy.checkpoint, steps, device, checkpoint_every=policy.every, **model_config
    )
    print(f"{choice}: {run.summary()}")
    best = cheapest_fitting(rows, budget)
    if not run.passed:
        print(f"{choice} does not fit: look at the step peaks in the table again.")
        return False
    if best is not None and best.label != choice and best.flops < rows[policies.index(policy)].flops:
        print(f"{choice} fits, but another policy fits too with fewer extra FLOPs.")
        return False
    print(f"{choice} fits, and no policy that fits recomputes fewer FLOPs. Well chosen.")
    return True


# ---------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaPeak:
    """One policy on a GPU: the tracker's step peak and the caching allocator's, from the same run (bytes)."""

    label: str
    tracked: int  # the tracker's peak of the last step
    allocated: int  # max_memory_allocated() during that step, minus what was allocated before the model was built


def cuda_peaks(policies: list[Policy], *, steps: int = 2, batch_size: int = 8, device=None, **model_config):
    """Per policy, a fresh model trained ``steps`` tracked steps on the GPU; the last step's tracked peak beside
    ``torch.cuda.max_memory_allocated()`` (reset before each step). Needs CUDA."""

    out = []
    for p in policies:
        run = cuda_run_under_limit(None, steps=steps, batch_size=batch_size, device=device, **model_config, **p.config)
        last = run.step_stats[-1]
        out.append(CudaPeak(p.label, run.trace.peak(step=steps).bytes, last.max_allocated - run.before.allocated))
    return out


def format_cuda_peaks(rows: list[CudaPeak]) -> str:
    """Text table of :func:`cuda_peaks` (MiB)."""
    cols = [Col("policy", 10, align="<"), Col("tracked", 9, ".2f"), Col("max_memory_allocated", 21, ".2f")]
    table = [(r.label, r.tracked / MiB, r.allocated / MiB) for r in rows]
    return format_table(cols, table, note="(MiB, step peak)")
