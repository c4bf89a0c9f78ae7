"""Lesson 05, activation checkpointing, part 2: what a checkpointed model keeps, counted.

Per layer, term by term against Korthikanti et al. (2022) (:func:`compare_kept`), and across every-k segments, the
count behind Chen et al.'s sqrt(L) rule, measured on a narrow model (:func:`every_k_sweep`, :func:`every_k_panel`).
Part 1 (:mod:`anatomy_helpers.lessons.lesson05_checkpointing`) has the policy line-up and what each costs. Units are
bytes
unless a name says otherwise.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from ..core import checkpointing
from ..core.data import get_batch, seed_everything
from ..core.model import ModelConfig
from ..core.tables import Col, format_table
from ..core.units import MiB, pick_unit
from ..prediction.formulas import KORTHIKANTI_TERMS, korthikanti_terms
from ..prediction.saved import (
    SavedRow,
    TermComparison,
    activations_by_part,
    attach_ops,
    layer_terms,
    saved_by_op,
    saved_rows,
)
from ..tracking.tracker import StepTracker
from ..training.train import make_model, make_optimizer, pick_device
from ..ui.plots import FIGURE_WIDTH_IN, CourseFigure

# ---------------------------------------------------------------------------------------------
# What each policy keeps per layer, against Korthikanti et al. (2022)
# ---------------------------------------------------------------------------------------------

#: Korthikanti et al.'s configuration: 16-bit activations, dropout (so the masks exist), materialised attention.
KORTHIKANTI_SETUP = {"n_layer": 2, "dtype": "bfloat16", "dropout": 0.1, "attn_impl": "manual"}

#: What Korthikanti et al.'s selective recomputation ("attention" here) does not keep: the s^2 terms.
RECOMPUTED_BY_ATTENTION = ("softmax output", "softmax dropout mask", "dropout output")


@dataclass(frozen=True)
class KeptTensor:
    """A tensor a policy kept outside autograd's saved tensors (``checkpointing.keep_for_backward``)."""

    layer: int  # the block it belongs to: the one running, or else the next one to run
    storage: int  # the storage's address: views of one storage share it
    storage_bytes: int
    bytes: int  # the view's own bytes
    offset: int  # the view's storage offset (elements)
    dtype: torch.dtype


def track_kept(model: nn.Module, batch_size: int = 4, *, seed: int = 0):
    """Track one forward (with the loss) of ``model`` and name what it keeps for backward.

    Returns ``(trace, rows, kept)``: the trace, the saved tensors with the ops that saved them
    (``saved.attach_ops``) and the tensors the policy announced with ``keep_for_backward``.
    """
    device = next(model.parameters()).device
    x, y = get_batch(batch_size, model.cfg.seq_len, seed=seed, device=device)
    state = {"running": None, "done": 0}
    kept: list[KeptTensor] = []

    def enter(i):
        state["running"] = i

    def leave(i):
        state["running"], state["done"] = None, i + 1

    def listen(t: torch.Tensor) -> None:
        layer = state["running"] if state["running"] is not None else state["done"]
        st = t.untyped_storage()
        kept.append(KeptTensor(layer, st.data_ptr(), st.nbytes(), t.nbytes, t.storage_offset(), t.dtype))

    handles = []
    for i, block in enumerate(model.blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: enter(i)))
        handles.append(block.register_forward_hook(lambda m, a, o, i=i: leave(i)))
    undo = checkpointing.add_listener(listen)
    try:
        seed_everything(seed)
        with StepTracker(model, make_optimizer(model, "sgd")) as tracker:
            out = model(x, y)
        del out
    finally:
        undo()
        for h in handles:
            h.remove()
    trace = tracker.trace
    seed_everything(seed)
    rows = attach_ops(saved_rows(trace), saved_by_op(model, x, y))
    return trace, rows, kept


def kept_formula(checkpoint: str, s: int, b: int, h: int, a: int) -> dict[str, int]:
    """Bytes per layer each policy keeps by Korthikanti et al.'s count (16-bit, 1-byte masks): every term without
    recomputation, all but the s^2 terms with selective recomputation ("attention"), the 2sbh block input with
    full recomputation."""
    terms = korthikanti_terms(s, b, h, a)
    if checkpoint == "none":
        return terms
    if checkpoint == "attention":
        return {t: 0 if t in RECOMPUTED_BY_ATTENTION else v for t, v in terms.items()}
    if checkpoint == "full":
        return {"block input": 2 * s * b * h}
    raise ValueError(f"the formula covers 'none', 'attention' and 'full', got {checkpoint!r}")


def compare_kept(
    checkpoint: str, rows: list[SavedRow], kept: list[KeptTensor], layer: int, s: int, b: int, h: int, a: int
) -> list[TermComparison]:
    """One layer under one policy, term by term: the formula's bytes (:func:`kept_formula`) next to what the layer
    measurably keeps, the saved tensors (each storage once, as ``saved.layer_terms`` counts them) plus the tensors
    the policy keeps itself: the block input (full), or Q, K and V, the views of the qkv output that the
    checkpointed attention core starts from (attention)."""
    # torch.utils.checkpoint saves its own inputs through a no-op autograd function that the op walk cannot name
    # ("?"): those are the tensors the policy announced, counted once, from the announcement
    measured = layer_terms([r for r in rows if r.op != "?"], layer)
    extra: dict[str, tuple[int, set]] = {}
    mine = [k for k in kept if k.layer == layer]
    for k in mine:
        if checkpoint == "attention":  # q, k, v: views of one storage at offsets 0, h and 2h
            offsets = sorted({m.offset for m in mine if m.storage == k.storage})
            term = "V" if k.offset == offsets[-1] else "Q and K"
        else:
            term = "block input"
        nbytes, dtypes = extra.get(term, (0, set()))
        extra[term] = (nbytes + k.bytes, dtypes | {k.dtype})
    formula = kept_formula(checkpoint, s, b, h, a)
    parts = {t: p for t, p, _, _ in KORTHIKANTI_TERMS}
    terms = list(formula) + [t for t in measured if t not in formula] + [t for t in extra if t not in formula]
    out = []
    for t in terms:
        m = measured.get(t)
        nbytes = (m.bytes if m else 0) + extra.get(t, (0, set()))[0]
        dtypes = (m.dtypes if m else set()) | extra.get(t, (0, set()))[1]
        sizes = {torch.empty(0, dtype=d).element_size() for d in dtypes}
        out.append(
            TermComparison(
                term=t,
                part=parts.get(t, "layer" if t == "block input" else "extra"),
                formula=formula.get(t, 0),
                measured=nbytes,
                dtype="/".join(sorted(str(d).replace("torch.", "") for d in dtypes)) or "-",
                element_size=sizes.pop() if len(sizes) == 1 else None,
            )
        )
    return out


def kept_table(comparisons: dict[str, list[TermComparison]]) -> str:
    """Text table: one row per term, a formula and a measured column per policy (bytes), totals at the foot."""
    labels = list(comparisons)
    terms: list[str] = []
    for rows in comparisons.values():
        terms += [c.term for c in rows if c.term not in terms]
    order = ["block input", *(t for t, *_ in KORTHIKANTI_TERMS)]
    terms.sort(key=lambda t: order.index(t) if t in order else len(order))
    cols = [Col("term", 21, align="<")]
    for label in labels:
        cols += [Col(f"{label} formula", max(11, len(label) + 8), ",d", gap="  "), Col("measured", 10, ",d")]
    table = []
    by = {label: {c.term: c for c in rows} for label, rows in comparisons.items()}
    for t in terms:
        cells: list = [t]
        for label in labels:
            c = by[label].get(t)
            cells += [c.formula if c else 0, c.measured if c else 0]
        table.append(cells)
    sums = ["one layer"]
    for label in labels:
        sums += [sum(c.formula for c in comparisons[label]), sum(c.measured for c in comparisons[label])]
    totals = "".join(col.cell(v) for col, v in zip(cols, sums))[len(cols[0].gap) :]
    return format_table(cols, table, note="(bytes)", footer=[totals.rstrip()])


# ---------------------------------------------------------------------------------------------
# Every k blocks: the sqrt(L) rule
# ---------------------------------------------------------------------------------------------

#: A narrow, cheap model for sweeps over many layers (fused attention: no s^2 term; MLP 1h wide).
SWEEP_MODEL = {"d_model": 32, "n_head": 2, "seq_len": 32, "attn_impl": "sdpa", "mlp_ratio": 1}


def segment_sizes(n_layer: int, k: int) -> list[int]:
    """Blocks per checkpointed segment when ``n_layer`` blocks run in segments of ``k`` (the last may be short)."""
    return [min(k, n_layer - start) for start in range(0, n_layer, k)]


def every_k_model(n_layer: int, k: int, block_input: int, block_activations: int) -> int:
    """Most bytes kept for backward at once under every-k checkpointing, by counting.

    When backward reaches segment ``j`` (0-based), the inputs of segments ``0..j`` are still kept and the segment's
    blocks have been recomputed: ``j * x + size_j * A`` (the segment's own input is its first block's LayerNorm
    input, so it is inside ``A``). The maximum over segments is ``(L/k - 1) x + k A`` when k divides L.
    """
    return max(j * block_input + size * block_activations for j, size in enumerate(segment_sizes(n_layer, k)))


@dataclass
class EveryKSweep:
    """Every-k checkpointing of one model for several k: what was measured, and the two numbers that explain it."""

    n_layer: int
    ks: list[int]
    measured: list[int]  # most activations + recomputed bytes alive at once in the step, per k
    block_input: int  # x: one block's input, (b, s, h) in the model's dtype
    block_activations: int  # A: what one block saves without checkpointing (measured)
    constant: int  # what stays alive through the whole backward, whatever k (the position ids)

    def model(self, k: int) -> int:
        """:func:`every_k_model` plus the constant."""
        return every_k_model(self.n_layer, k, self.block_input, self.block_activations) + self.constant

    def approx(self, k: float) -> float:
        """The textbook form ``(L / k) x + k A``."""
        return self.n_layer / k * self.block_input + k * self.block_activations

    @property
    def best_k(self) -> int:
        return self.ks[int(np.argmin(self.measured))]

    @property
    def sqrt_rule(self) -> float:
        """Chen et al.'s sqrt(L): the best k when a layer keeps as much inside as its input."""
        return math.sqrt(self.n_layer)

    @property
    def weighted_rule(self) -> float:
        """sqrt(L x / A): where ``(L / k) x + k A`` is smallest."""
        return math.sqrt(self.n_layer * self.block_input / self.block_activations)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def every_k_sweep(
    n_layer: int = 24, ks: list[int] | None = None, batch_size: int = 2, device=None, **model_config
) -> EveryKSweep:
    """Track forward + backward of a fresh :data:`SWEEP_MODEL` with ``n_layer`` blocks under every-k checkpointing
    for each k of ``ks`` (by default the divisors of ``n_layer``: equal segments), and once (one block, without
    checkpointing) to measure what a block saves. Each (configuration, k) is measured once per process: the
    slider panel comes back to the same points often."""
    config = {**SWEEP_MODEL, **model_config, "n_layer": n_layer}
    ks = sorted(set(ks or divisors(n_layer)))
    if not all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= n_layer for k in ks):
        raise ValueError(f"every k must be a whole number from 1 to n_layer ({n_layer}), got {ks}")
    device = pick_device(device)
    key = (str(device), batch_size, tuple(sorted(config.items())))
    one_block = _measured(key, 0)
    measured = [_measured(key, k) for k in ks]
    element = torch.empty(0, dtype=ModelConfig(**config).torch_dtype).element_size()
    block_input = batch_size * config["seq_len"] * config["d_model"] * element
    constant = config["seq_len"] * 8  # the position ids (int64), saved by the position embedding until the end
    return EveryKSweep(n_layer, ks, measured, block_input, one_block, constant)


@functools.lru_cache(maxsize=512)
def _measured(key: tuple, k: int) -> int:
    """k = 0: what one block saves without checkpointing (a one-block model); k >= 1: the most activations +
    recomputed bytes alive at once in forward + backward under every-k checkpointing (kernel scratch is neither,
    so the tracker skips measuring it)."""
    device, batch_size, items = key
    config = dict(items)
    if k == 0:
        model = make_model(device=device, **{**config, "n_layer": 1})
    else:
        model = make_model(device=device, checkpoint="every_k", checkpoint_every=k, **config)
    x, y = get_batch(batch_size, config["seq_len"], device=device)
    with StepTracker(model, make_optimizer(model, "sgd"), kernel_scratch=False) as tracker:  # no scratch: faster
        model(x, y)[1].backward()
    trace = tracker.trace
    if k == 0:
        return activations_by_part(saved_rows(trace))["blocks.0"]
    return int((trace.timeline.category("activations") + trace.timeline.category("recomputed")).max())


def plot_every_k(sweep: EveryKSweep, k: int | None = None, title: str | None = None):
    """Measured bytes kept for backward against k, the count (:meth:`EveryKSweep.model`) at every k, the
    ``(L/k) x + kA`` curve, the measured minimum, sqrt(L) and sqrt(L x / A); ``k`` is marked. Returns the Figure."""
    unit, scale = pick_unit(max(sweep.measured))
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 4.4), layout="constrained")
    ax = fig.add_subplot()
    every = np.arange(1, sweep.n_layer + 1)
    smooth = np.linspace(1, sweep.n_layer, 400)
    ax.plot(smooth, [sweep.approx(v) / scale for v in smooth], color="#999", linewidth=1, label="(L/k) x + k A")
    ax.plot(every, [sweep.model(int(v)) / scale for v in every], ".", color="#555", markersize=4, label="counted")
    ax.plot(sweep.ks, np.array(sweep.measured) / scale, "o-", color="#D55E00", label="measured")
    best = sweep.best_k
    low = min(sweep.measured) / scale
    ax.plot([best], [low], "v", color="black", markersize=10, label=f"measured minimum: k = {best}")
    for value, style, name in ((sweep.sqrt_rule, ":", "sqrt(L)"), (sweep.weighted_rule, "--", "sqrt(L x / A)")):
        ax.axvline(value, color="#0072B2", linestyle=style, linewidth=1.2, label=f"{name} = {value:.2f}")
    if k is not None:
        ax.axvline(k, color="#009E73", linewidth=6, alpha=0.25, label=f"your k = {k}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sweep.ks, [str(v) for v in sweep.ks])
    ax.set_xlabel("k: blocks per checkpointed segment (log scale)")
    ax.set_ylabel(f"most bytes kept for backward ({unit})")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or f"Every-k checkpointing of {sweep.n_layer} blocks (x = block input, A = one block's saves)")
    return fig


def every_k_panel(n_layer: int = 24, k: int = 4, device=None):
    """Sweep every-k checkpointing of an ``n_layer``-block :data:`SWEEP_MODEL` (the divisors of n_layer, and
    ``k``), print where the minimum falls against sqrt(L) and sqrt(L x / A), and plot it. Returns the Figure."""
    if k > n_layer:
        print(f"k = {k} is more than the {n_layer} blocks: k = {n_layer} (one segment)")
        k = n_layer
    sweep = every_k_sweep(n_layer, [*divisors(n_layer), k], device=device)
    mine = sweep.measured[sweep.ks.index(k)]
    print(
        f"L = {n_layer}: x = {sweep.block_input:,} bytes, A = {sweep.block_activations:,} bytes (A/x = "
        f"{sweep.block_activations / sweep.block_input:.1f}); measured minimum at k = {sweep.best_k} "
        f"({min(sweep.measured) / MiB:.3f} MiB); sqrt(L) = {sweep.sqrt_rule:.2f}, sqrt(L x / A) = "
        f"{sweep.weighted_rule:.2f}; your k = {k}: {mine / MiB:.3f} MiB"
    )
    return plot_every_k(sweep, k)
