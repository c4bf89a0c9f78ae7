"""The backward pass, block by block: activations released, gradients appearing.

The helpers here read a :class:`~anatomy_helpers.tracking.tracker.Trace` and split two of
its categories, activations and gradients, by *model part*: the embeddings, each
transformer block (``blocks.0`` ...) and the head (final LayerNorm, LM head and
the loss). Units are bytes everywhere unless a name says otherwise.

Who owns what:

* an **activation** belongs to the part whose module *saved* it for backward
  first (``trace.saved``): that is the part whose backward releases it. The sum of
  the embeddings, say, is allocated by the model's own forward but saved by
  ``blocks.0.ln1``, so it belongs to ``blocks.0``;
* a **gradient** belongs to the part that owns its parameter. The tracker records
  which parameter each gradient storage belongs to (``trace.grad_param``); for a
  gradient without that record, the module that was current when it was allocated
  is used instead (in backward, the module whose saved tensor autograd unpacked
  last, which is the right part for this model's parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.data import get_batch
from ..core.units import MiB, pick_unit
from ..tracking.events import ACTIVATIONS, GRADIENTS, ROOT, model_part, model_parts
from ..tracking.trace import Trace
from ..training.step import StepHooks, StepPlan
from ..training.train import make_model, make_optimizer, track_steps
from ..ui.plots import CATEGORY_COLORS, FIGURE_WIDTH_IN, PHASE_SHADES, CourseFigure, plot_timeline


def _n_layer(trace: Trace) -> int:
    blocks = {p for p in map(model_part, trace.timeline.module_names) if p and p.startswith("blocks.")}
    return 1 + max((int(b.split(".")[1]) for b in blocks), default=-1)


# ---- splitting a trace by model part ----------------------------------------------------------------------------
def allocation_parts(trace: Trace) -> dict[int, str]:
    """The model part of every activation and gradient allocation: ``{allocation id: part}``.

    Activations go to the part whose module saved them first; gradients to the part that
    owns their parameter (``trace.grad_param``), else to the part of the module
    current when they were allocated.
    """
    names = trace.timeline.module_names
    first_saver: dict[int, str] = {}
    for s in trace.saved:
        first_saver.setdefault(s.storage, s.module)
    grad_param = trace.grad_param
    out: dict[int, str] = {}
    for aid, cat in enumerate(trace.alloc_category.tolist()):
        if cat == ACTIVATIONS:
            part = model_part(first_saver.get(aid, names[trace.alloc_module[aid]]))
        elif cat == GRADIENTS:
            owner = grad_param.get(aid)
            part = model_part(owner.rpartition(".")[0] or ROOT) if owner else model_part(names[trace.alloc_module[aid]])
        else:
            continue
        if part is not None:
            out[aid] = part
    return out


def live_by_part(trace: Trace) -> tuple[list[str], np.ndarray]:
    """Live activation and gradient bytes per model part after every sample of the trace.

    Returns ``(parts, live)`` with ``parts`` in forward order and ``live`` of shape
    ``(n_samples + 1, 2, len(parts))``: row 0 is the moment tracking began, row ``i + 1``
    is after timeline sample ``i``; axis 1 is (activations, gradients).
    """
    parts = model_parts(_n_layer(trace))
    index = {p: j for j, p in enumerate(parts)}
    owner = allocation_parts(trace)
    rec = trace.allocation_record()
    n = len(trace.timeline)
    deltas = np.zeros((n + 1, 2, len(parts)), dtype=np.int64)
    for sample, aid, nbytes, cat in zip(
        rec.sample.tolist(), rec.alloc_id.tolist(), rec.bytes.tolist(), rec.category.tolist()
    ):
        part = owner.get(aid)
        if part is None:
            continue
        deltas[sample + 1, 0 if cat == ACTIVATIONS else 1, index[part]] += nbytes
    return parts, np.cumsum(deltas, axis=0)


@dataclass
class BackwardProfile:
    """Activation and gradient bytes per model part at each sample of one step's backward.

    ``activations[k, j]`` / ``gradients[k, j]``: live bytes of part ``parts[j]`` after
    timeline sample ``samples[k]``. ``before`` holds the same two rows just before backward
    began (the end of the forward pass).
    """

    step: int
    parts: list[str]  # forward order
    samples: np.ndarray  # timeline indices of the backward phase
    activations: np.ndarray  # (n_samples, n_parts)
    gradients: np.ndarray  # (n_samples, n_parts)
    activations_before: np.ndarray  # (n_parts,) at the end of forward
    gradients_before: np.ndarray  # (n_parts,)

    def released_at(self) -> dict[str, int | None]:
        """Per part, the timeline sample from which its activations are zero to the end of backward.

        None for a part whose activations are still alive when backward ends (or that had none).
        """
        out = {}
        for j, part in enumerate(self.parts):
            col = self.activations[:, j]
            if col[-1] != 0 or self.activations_before[j] == 0:
                out[part] = None
                continue
            nonzero = np.flatnonzero(col)
            k = nonzero[-1] + 1 if len(nonzero) else 0
            out[part] = int(self.samples[k])
        return out

    def gradients_from(self) -> dict[str, int | None]:
        """Per part, the first timeline sample of backward with any of its gradient bytes alive (None: never)."""
        out = {}
        for j, part in enumerate(self.parts):
            nonzero = np.flatnonzero(self.gradients[:, j])
            out[part] = int(self.samples[nonzero[0]]) if len(nonzero) else None
        return out

    def gradients_complete_at(self) -> dict[str, int | None]:
        """Per part, the first timeline sample from which its gradient bytes stay at their final value."""
        out = {}
        for j, part in enumerate(self.parts):
            col = self.gradients[:, j]
            if col[-1] == 0:
                out[part] = None
                continue
            differs = np.flatnonzero(col != col[-1])
            out[part] = int(self.samples[differs[-1] + 1 if len(differs) else 0])
        return out


def backward_profile(trace: Trace, step: int = 1) -> BackwardProfile:
    """Per-part activation and gradient bytes through the backward phase of ``step``."""
    parts, live = live_by_part(trace)
    samples = trace.window(step, "backward")
    if len(samples) == 0:
        raise ValueError(f"step {step} has no backward samples; training steps recorded: {trace.training_steps()}")
    before = live[samples[0]]  # row samples[0] of `live` is the state after sample samples[0] - 1
    rows = live[samples + 1]
    return BackwardProfile(step, parts, samples, rows[:, 0], rows[:, 1], before[0], before[1])


# ---- plots --------------------------------------------------------------------------------------------------------
def _shades(color: str, n: int) -> list:
    """``n`` shades of ``color``, from a light tint through the colour itself to a dark shade."""
    rgb = np.array([int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    out = []
    for t in np.linspace(0.0, 1.0, n) if n > 1 else [0.5]:
        if t <= 0.5:  # tint: mix with white
            out.append(tuple(1 - (0.3 + 1.4 * t) * (1 - rgb)))
        else:  # shade: mix with black
            out.append(tuple(rgb * (1 - 1.1 * (t - 0.5))))
    return out


def plot_backward_parts(profile: BackwardProfile, title: str | None = None, mark: int | None = None):
    """Two stacked-area panels over one step's backward: activations and gradients per model part.

    Activations are stacked in forward order (embeddings at the bottom), so backward peels
    them off the top; gradients in backward order (head at the bottom), so each new part
    lands on top. Each part is a shade of the category's course colour, the same shade in
    both panels. The two panels have their own scales. ``mark``: a timeline sample to mark
    with a dotted line (e.g. the step's peak). Returns the Figure.
    """
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 6), layout="constrained")
    ax_a, ax_g = fig.subplots(2, 1, sharex=True)
    xs = np.arange(len(profile.samples))
    n = len(profile.parts)
    panels = (
        (ax_a, profile.activations, "activations", range(n)),
        (ax_g, profile.gradients, "gradients", range(n - 1, -1, -1)),
    )
    for ax, data, cat, order in panels:
        keep = [j for j in order if data[:, j].any()]
        colors = _shades(CATEGORY_COLORS[cat], n)
        unit, scale = pick_unit(max(data.sum(axis=1).max(), 1))
        ax.stackplot(
            xs,
            *(data[:, j] / scale for j in keep),
            colors=[colors[j] for j in keep],
            labels=[profile.parts[j] for j in keep],
            step="post",
            edgecolor="white",
            linewidth=0.4,
        )
        ax.set_ylabel(f"live {cat} ({unit})")
        ax.set_ylim(0, max(data.sum(axis=1).max(), 1) / scale * 1.08)
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(
            handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="model part"
        )
        if mark is not None and profile.samples[0] <= mark <= profile.samples[-1]:
            ax.axvline(int(np.searchsorted(profile.samples, mark)), color="black", linestyle=":", linewidth=1.2)
    ax_a.set_title(title or f"Step {profile.step}'s backward by model part: activations released, gradients appearing")
    ax_g.set_xlabel("memory event within backward (allocation or free)")
    ax_g.set_xlim(xs[0], xs[-1])
    return fig


def plot_category(trace: Trace, category: str, step: int):
    """One category's live bytes through one step, phases shaded and each phase's maximum marked.

    Returns the Figure.
    """
    tl = trace.timeline
    idx = np.flatnonzero(tl.step == step)
    if len(idx) == 0:
        raise ValueError(f"no samples for step {step}; steps recorded: {trace.steps}")
    values = tl.category(category)[idx]
    unit, scale = pick_unit(max(values.max(), 1))
    fig = CourseFigure(figsize=(FIGURE_WIDTH_IN, 3.2), layout="constrained")
    ax = fig.add_subplot()
    xs = np.arange(len(idx))
    ax.fill_between(xs, values / scale, step="post", color=CATEGORY_COLORS[category], linewidth=0)
    top = values.max() / scale * 1.25 or 1
    for ph in trace.phases():
        if ph.step != step or ph.phase == "idle":
            continue
        x0, x1 = ph.start - idx[0], ph.end - idx[0]
        ax.axvspan(x0, x1 + 1, color=PHASE_SHADES[ph.phase], zorder=0, linewidth=0)
        k = x0 + int(np.argmax(values[x0 : x1 + 1]))
        ax.annotate(
            f"{ph.phase}: max {values[k] / scale:.2f} {unit}",
            (k, values[k] / scale),
            xytext=(4, 4),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_xlim(0, len(idx) - 1)
    ax.set_ylim(0, top)
    ax.set_xlabel(f"memory event within step {step} (allocation or free)")
    ax.set_ylabel(f"live {category.replace('_', ' ')} ({unit})")
    ax.set_title(f"{category.replace('_', ' ').capitalize()} through step {step}")
    return fig


def backward_peak_panel(n_layer: int = 4, batch_size: int = 8, device=None):
    """Track forward + backward of a fresh model, print where the peak lands, plot the timeline.

    The function behind notebook 02's slider panel. Returns the Figure of :func:`plot_timeline`
    (the peak annotated).
    """
    model = make_model(device=device, n_layer=n_layer)
    trace = track_steps(model, make_optimizer(model, "sgd"), steps=1, batch_size=batch_size, optimizer_step=False)
    pk = trace.peak()
    b = pk.breakdown
    window = trace.window(1, pk.phase)
    print(
        f"{n_layer} layers, batch {batch_size}: peak {pk.bytes / MiB:.2f} MiB in {pk.phase} "
        f"(event {pk.index - window[0] + 1} of {len(window)}), in {pk.module}: activations "
        f"{b['activations'] / MiB:.2f}, gradients {b['gradients'] / MiB:.2f}, "
        f"temporaries {b['temporaries'] / MiB:.2f} MiB"
    )
    return plot_timeline(trace, title=f"Forward and backward, {n_layer} layers, batch {batch_size}")


# ---- three ways to keep a graph alive: the course's step with one line changed (track_steps(..., hooks=...)) ----


class RetainGraph(StepHooks):
    """``loss.backward(retain_graph=True)``: backward frees none of the graph's saved tensors; they die with the
    loss, when the loop drops it at the end of the step."""

    def backward(self, loss):
        loss.backward(retain_graph=True)


class KeepLoss(StepHooks):
    """``losses.append(loss)``: each (micro-)batch's loss tensor, after its backward, kept in a list that lives
    through all steps (instead of ``loss.item()``, a Python float)."""

    def __init__(self):
        self.losses: list = []

    def after_backward(self, loss):
        self.losses.append(loss)


class KeepValLoss(StepHooks):
    """``val_losses.append(val_loss)`` without ``torch.no_grad()``: at the start of each step a validation loss on
    another batch (``get_batch(..., step=10_000 + step)``), never backpropagated: its whole graph stays alive."""

    def __init__(self):
        self.val_losses: list = []

    def before_step(self, model, plan: StepPlan, step: int):
        seq_len = getattr(model, "module", model).cfg.seq_len
        device = next(model.parameters()).device
        vx, vy = get_batch(plan.batch_size, seq_len, step=10_000 + step, seed=plan.seed, device=device)
        self.val_losses.append(model(vx, vy)[1])  # grad mode is on: its whole graph stays alive
        del vx, vy
