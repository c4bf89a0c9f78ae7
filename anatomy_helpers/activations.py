"""Activations: what the forward pass keeps for backward, measured and compared with the closed form.

Everything here works from measurements: :class:`~anatomy_helpers.tracker.StepTracker`'s
``trace.saved`` (every tensor autograd saved, in order, with the module that saved it) and, to
name the autograd op behind each saved tensor, a walk of the autograd graph. The one closed
form is Korthikanti et al. (2022)'s activation memory per transformer layer, kept here term by
term so a notebook can put it next to what was measured. Units are bytes unless a name says
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch
import torch.nn as nn

from .data import get_batch
from .plots import CATEGORY_COLORS, CourseFigure, pick_unit
from .tracker import PHASES, StepTracker, Trace
from .train import make_model, make_optimizer

# ---------------------------------------------------------------------------------------------
# The closed form: Korthikanti et al. 2022, activation bytes of one transformer layer
# ---------------------------------------------------------------------------------------------

#: The per-layer terms of the formula: (term, part of the layer, coefficient, unit), where the unit
#: is "sbh" (s*b*h) or "as^2b" (a*s*s*b) and the term's bytes are coefficient * unit.
#: 16-bit activations (2 bytes per element), 1-byte dropout masks, materialised attention.
KORTHIKANTI_TERMS = (
    ("QKV input", "attention", 2, "sbh"),
    ("Q and K", "attention", 4, "sbh"),
    ("softmax output", "attention", 2, "as^2b"),
    ("softmax dropout mask", "attention", 1, "as^2b"),
    ("dropout output", "attention", 2, "as^2b"),
    ("V", "attention", 2, "sbh"),
    ("out-proj input", "attention", 2, "sbh"),
    ("attn dropout mask", "attention", 1, "sbh"),
    ("fc1 input", "mlp", 2, "sbh"),
    ("GELU input", "mlp", 8, "sbh"),
    ("fc2 input", "mlp", 8, "sbh"),
    ("MLP dropout mask", "mlp", 1, "sbh"),
    ("LayerNorm inputs", "layernorm", 4, "sbh"),
)
#: Terms that are dropout masks: the formula counts them at 1 byte per element.
MASK_TERMS = ("softmax dropout mask", "attn dropout mask", "MLP dropout mask")
#: What a measured layer saves beyond the formula's terms.
EXTRA_TERMS = ("LayerNorm mean/rstd", "causal mask")


def korthikanti_terms(s: int, b: int, h: int, a: int) -> dict[str, int]:
    """Activation bytes of one transformer layer, per term of Korthikanti et al. (2022).

    ``s`` sequence length, ``b`` micro-batch, ``h`` hidden size, ``a`` attention heads.
    Assumes 16-bit activations, 1-byte dropout masks, standard (materialised) attention and a
    4h GELU MLP. The values sum to :func:`korthikanti_layer_bytes`.
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    per_unit = {"sbh": s * b * h, "as^2b": a * s * s * b}
    return {term: coef * per_unit[unit] for term, _, coef, unit in KORTHIKANTI_TERMS}


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> int:
    """``s*b*h*(34 + 5*a*s/h)``: activation bytes of one layer (16-bit, 1-byte masks), exactly."""
    return 34 * s * b * h + 5 * a * s * s * b


# ---------------------------------------------------------------------------------------------
# Naming the op behind each saved tensor: a second forward under our own saved-tensor hooks,
# then a walk of the autograd graph, matched by storage and view geometry.
# ---------------------------------------------------------------------------------------------


def _view_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _graph_saved(root) -> dict[tuple, list[tuple[int, str, str]]]:
    """view key -> [(sequence number, op name, attribute)] for every tensor saved in the graph."""
    found: dict[tuple, list[tuple[int, str, str]]] = {}
    seen: set = set()
    todo = [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)  # unpacks the saved tensor (a view of the same storage)
            except RuntimeError:  # already freed by a backward
                continue
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, torch.Tensor) and v.layout is torch.strided:
                    found.setdefault(_view_key(v), []).append(
                        (node._sequence_nr(), node.name(), attr[len("_saved_") :])
                    )
        todo.extend(fn for fn, _ in node.next_functions)
    for ops in found.values():
        ops.sort()
    return found


def saved_by_op(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None) -> list[dict]:
    """Run one forward of ``model`` and name the autograd op behind every tensor it saves.

    Returns one dict per saved tensor, in the order autograd saved them (the order of
    ``trace.saved`` for the same forward): ``module`` (named as the tracker names it), ``op``
    (the backward node, e.g. ``"NativeLayerNormBackward0"``), ``attr`` (the node's ``_saved_<attr>``,
    e.g. ``"input"``, ``"result1"``), ``seq`` (the node's sequence number: forward order), ``shape``,
    ``dtype``, ``bytes`` (of the view) and ``storage`` (0, 1, 2 ... one number per distinct storage).

    How: our own ``saved_tensors_hooks`` record what is saved and by which module; then a walk of
    the autograd graph from the loss (``grad_fn``, ``next_functions``, ``_saved_*`` attributes)
    finds which node holds each tensor, matched by storage, offset, shape, stride and dtype.
    """
    modules = {m: name or "model" for name, m in model.named_modules()}
    stack: list[str] = ["-"]
    handles = []

    def enter(name: str) -> None:
        stack.append(name)

    def leave() -> None:
        stack.pop()  # a forward hook must return None, or it would replace the module's output

    for mod, name in modules.items():
        handles.append(mod.register_forward_pre_hook(lambda m, args, name=name: enter(name)))
        handles.append(mod.register_forward_hook(lambda m, args, out: leave()))
    packed: list[tuple[str, torch.Tensor]] = []

    def pack(t):
        packed.append((stack[-1], t))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits, loss = model(idx, targets)
    finally:
        for h in handles:
            h.remove()
    root = (loss if loss is not None else logits).grad_fn
    found = _graph_saved(root)
    storages: dict[tuple, int] = {}
    rows = []
    for module, t in packed:
        key = _view_key(t)
        ops = found.get(key)
        seq, op, attr = ops.pop(0) if ops else (-1, "?", "?")
        st = storages.setdefault((t.device, t.untyped_storage().data_ptr()), len(storages))
        rows.append(
            {
                "module": module,
                "op": op,
                "attr": attr,
                "seq": seq,
                "shape": tuple(t.shape),
                "dtype": t.dtype,
                "bytes": t.nbytes,
                "storage": st,
                "storage_bytes": t.untyped_storage().nbytes(),
            }
        )
    return rows


def saved_rows(trace: Trace) -> list[dict]:
    """``trace.saved`` with each storage's first saver marked.

    Every row (which already has ``storage_bytes``, the whole storage behind the saved view)
    gets ``first`` (True for the first row that saved this storage) and ``same_as``
    (the index of that first row). Summing ``storage_bytes`` over first rows counts every
    storage once, however many views of it autograd saved.
    """
    first: dict[int, int] = {}
    out = []
    for i, r in enumerate(trace.saved):
        j = first.setdefault(r["storage"], i)
        out.append({**r, "first": j == i, "same_as": j})
    return out


def attach_ops(rows: list[dict], ops: list[dict]) -> list[dict]:
    """Merge :func:`saved_rows` of a tracked forward with :func:`saved_by_op` rows of the same forward.

    Checks that both list the same tensors (module, shape, dtype, bytes, storage size, in order)
    and group them into storages the same way; raises ValueError otherwise. Returns the rows
    with ``op``, ``attr`` and ``seq`` added.
    """
    if len(rows) != len(ops):
        raise ValueError(f"the tracker saw {len(rows)} saved tensors, the op walk {len(ops)}: not the same forward")
    pair: dict[int, int] = {}
    out = []
    for i, (s, o) in enumerate(zip(rows, ops)):
        for k in ("module", "shape", "dtype", "bytes", "storage_bytes"):
            if s[k] != o[k]:
                raise ValueError(f"saved tensor {i}: tracker has {k}={s[k]!r}, op walk has {o[k]!r}")
        if pair.setdefault(s["storage"], o["storage"]) != o["storage"]:
            raise ValueError(f"saved tensor {i}: the tracker and the op walk group storages differently")
        out.append({**s, "op": o["op"], "attr": o["attr"], "seq": o["seq"]})
    if len(set(pair.values())) != len(pair):
        raise ValueError("the tracker and the op walk group storages differently")
    return out


def first_savers(rows: Iterable[dict], category: str | None = "activations") -> list[dict]:
    """The rows that saved a storage first (one row per distinct storage), of one category (None: all)."""
    return [r for r in rows if r["first"] and (category is None or r["category"] == category)]


def distinct_bytes(rows: Iterable[dict], category: str | None = "activations") -> int:
    """Bytes of the distinct storages behind ``rows`` (from :func:`saved_rows`), each counted once.

    Only storages of ``category`` count (None: all).
    """
    return sum(r["storage_bytes"] for r in first_savers(rows, category))


def block_of(module: str) -> str:
    """The part of the model a module belongs to: "embeddings", "blocks.<i>", or "head + loss"."""
    parts = module.split(".")
    if parts[0] == "blocks" and len(parts) > 1:
        return f"blocks.{parts[1]}"
    if parts[0] in ("tok_emb", "pos_emb", "drop"):
        return "embeddings"
    return "head + loss"


def activations_by_block(rows: Iterable[dict]) -> dict[str, int]:
    """Activation bytes per part of the model (:func:`block_of`), each storage counted once.

    A storage counts for the module that saved it first (the block whose backward needs it),
    in forward order: embeddings, blocks.0 ... blocks.L-1, head + loss.
    """
    out: dict[str, int] = {}
    for r in first_savers(rows):
        part = block_of(r["module"])
        out[part] = out.get(part, 0) + r["storage_bytes"]
    order = [
        "embeddings",
        *sorted((k for k in out if k.startswith("blocks.")), key=lambda k: int(k[7:])),
        "head + loss",
    ]
    return {k: out[k] for k in order if k in out}


def _fmt_bytes(n: int) -> str:
    return f"{n:,}"


def saved_table(rows: list[dict], prefix: str | None = None) -> str:
    """Text table of saved tensors (rows from :func:`saved_rows`, with or without :func:`attach_ops`).

    Only modules whose name starts with ``prefix`` (all by default). One line per tensor
    autograd saved: "bytes" is the saved view, "storage" says "new" for a storage seen for the
    first time and "= #k" when row k already saved a view of the same storage; "counted" is what
    the line adds to the activations (the whole storage, once). The footer sums the counted bytes.
    """
    chosen = [(i, r) for i, r in enumerate(rows) if prefix is None or r["module"].startswith(prefix)]
    named = all("op" in r for _, r in chosen)
    width = max([len(r["op"]) + len(r["attr"]) + 3 for _, r in chosen] + [18]) if named else 0
    head = f"{'#':>3}  {'module':<25}" + (f"{'saved by op.attr':<{width}}" if named else "")
    head += f"{'shape':<19}{'dtype':<9}{'bytes':>11}  {'storage':<8}{'counted':>11}"
    lines = [head, "-" * len(head)]
    for i, r in chosen:
        dtype = str(r["dtype"]).replace("torch.", "")
        storage = "new" if r["first"] else f"= #{r['same_as']}"
        if r["category"] != "activations":
            counted = r["category"].rstrip("s")
        else:
            counted = _fmt_bytes(r["storage_bytes"]) if r["first"] else "-"
        op = f"{r['op'] + '.' + r['attr']:<{width}}" if named else ""
        lines.append(
            f"{i:>3}  {r['module']:<25}{op}{str(r['shape']):<19}{dtype:<9}"
            f"{_fmt_bytes(r['bytes']):>11}  {storage:<8}{counted:>11}"
        )
    acts = distinct_bytes(r for _, r in chosen)
    n = len(first_savers(r for _, r in chosen))
    lines.append("-" * len(head))
    lines.append(f"activations: {n} distinct storages, {_fmt_bytes(acts)} bytes ({acts / 2**20:.2f} MiB)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Measuring a forward pass
# ---------------------------------------------------------------------------------------------


def track_forward(model: nn.Module, batch_size: int = 8, seq_len: int | None = None, *, seed: int = 0):
    """Track one forward pass (with loss) of ``model`` on a course batch.

    Returns ``(trace, x, y)``. The graph is dropped before returning, so nothing stays alive.
    ``seq_len`` defaults to the model's context length. A throwaway SGD optimizer satisfies the
    tracker (it is never stepped).
    """
    device = next(model.parameters()).device
    x, y = get_batch(batch_size, seq_len or model.cfg.seq_len, seed=seed, device=device)
    with StepTracker(model, make_optimizer(model, "sgd")) as tracker:
        out = model(x, y)
    del out
    return tracker.trace, x, y


def forward_activation_bytes(model: nn.Module, batch_size: int, seq_len: int | None = None) -> int:
    """Bytes of the distinct storages one forward (with loss) saves as activations, measured."""
    trace, _, _ = track_forward(model, batch_size, seq_len)
    return distinct_bytes(saved_rows(trace))


def forward_samples(trace: Trace, step: int = 1) -> np.ndarray:
    """Timeline sample indices of ``step``'s forward phase."""
    tl = trace.timeline
    return np.flatnonzero((tl.step == step) & (tl.phase == PHASES.index("forward")))


def block_boundaries(trace: Trace, step: int = 1) -> dict[str, int]:
    """Sample index at which each part of the forward starts: ``blocks.<i>`` and ``ln_f``.

    A part starts at the first memory event inside one of its modules. The activation bytes
    live just before ``blocks.<i+1>`` starts, minus those just before ``blocks.<i>``, are what
    block i added.
    """
    idx = forward_samples(trace, step)
    names = trace.timeline.module_names
    out: dict[str, int] = {}
    for i in idx.tolist():
        name = names[trace.timeline.module[i]]
        part = "ln_f" if name == "ln_f" else block_of(name)
        if part.startswith("blocks.") or part == "ln_f":
            out.setdefault(part, i)
    return out


def activations_at_block_starts(trace: Trace, step: int = 1) -> dict[str, int]:
    """Live activation bytes just before each block (and ``ln_f``) starts in ``step``'s forward."""
    acts = trace.timeline.category("activations")
    return {
        part: int(acts[i - 1]) if i > 0 else trace.baseline["activations"]
        for part, i in block_boundaries(trace, step).items()
    }


def plot_activation_buildup(trace: Trace, rows: list[dict] | None = None, step: int = 1, title: str | None = None):
    """Left: live activation bytes through the forward pass, block boundaries marked.
    Right: activation bytes saved by each part of the model (first saver of each storage).

    ``rows`` default to ``trace.saved``. Returns the Figure.
    """
    rows = trace.saved if rows is None else rows
    idx = forward_samples(trace, step)
    if len(idx) == 0:
        raise ValueError(f"the trace has no forward samples in step {step}")
    acts = trace.timeline.category("activations")[idx]
    parts = activations_by_block(rows)
    unit, scale = pick_unit(max(int(acts.max()), max(parts.values(), default=0)))
    fig = CourseFigure(figsize=(11, 4), layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=[1.6, 1])
    xs = np.arange(len(idx))
    color = CATEGORY_COLORS["activations"]
    ax.fill_between(xs, acts / scale, step="post", color=color, alpha=0.35, linewidth=0)
    ax.step(xs, acts / scale, where="post", color=color, label="activations (live)")
    bounds = block_boundaries(trace, step)
    top = acts.max() / scale
    starts = [(name, int(np.searchsorted(idx, i))) for name, i in bounds.items()]
    for k, (name, x0) in enumerate(starts):
        ax.axvline(x0, color="#333", linestyle="--", linewidth=0.8)
        x1 = starts[k + 1][1] if k + 1 < len(starts) else len(idx)
        label = name.replace("blocks.", "block ") if name != "ln_f" else "head"
        ax.text((x0 + x1) / 2, top * 1.04, label, ha="center", va="bottom", fontsize=8)
        if x0 > 0:
            ax.plot([x0 - 1], [acts[x0 - 1] / scale], "o", color="black", markersize=4)
    ax.set_ylim(0, top * 1.15)
    ax.set_xlim(0, len(idx) - 1)
    ax.set_xlabel("memory event in the forward pass (allocation or free)")
    ax.set_ylabel(f"live activation bytes ({unit})")
    ax.set_title("Activations pile up block by block")
    names = list(parts)
    vals = np.array([parts[n] for n in names]) / scale
    ys = np.arange(len(names))
    bx.barh(ys, vals, color=color)
    for y, v in zip(ys, vals):
        bx.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    bx.set_yticks(ys, [n.replace("blocks.", "block ") for n in names])
    bx.invert_yaxis()
    bx.margins(x=0.2)
    bx.set_xlabel(f"activation bytes saved ({unit})")
    bx.set_title("Saved for backward, by part")
    if title:
        fig.suptitle(title)
    return fig


def plot_saved_by_module(rows: list[dict], prefix: str = "blocks.0"):
    """Horizontal bars: activation bytes each sub-module under ``prefix`` saved first (MiB). Returns the Figure."""
    sub: dict[str, int] = {}
    for r in first_savers(rows):
        if r["module"].startswith(prefix):
            sub[r["module"]] = sub.get(r["module"], 0) + r["storage_bytes"]
    names = list(sub)
    unit, scale = pick_unit(max(sub.values(), default=0))
    fig = CourseFigure(figsize=(8, 0.35 * len(names) + 1.5), layout="constrained")
    ax = fig.add_subplot()
    vals = np.array([sub[n] for n in names]) / scale
    ys = np.arange(len(names))
    ax.barh(ys, vals, color=CATEGORY_COLORS["activations"])
    for y, v in zip(ys, vals):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    ax.set_yticks(ys, names)
    ax.invert_yaxis()
    ax.margins(x=0.15)
    ax.set_xlabel(f"activation bytes saved, distinct storages ({unit})")
    ax.set_title(f"What {prefix} saves for backward, by sub-module")
    return fig


# ---------------------------------------------------------------------------------------------
# Scaling with batch size and sequence length
# ---------------------------------------------------------------------------------------------


def fit_line(xs: list[int], ys: list[int]) -> tuple[Fraction, Fraction, bool]:
    """Exact line through the first two points: ``(slope, intercept, all_points_on_it)``."""
    if len(xs) < 2:
        raise ValueError("a line needs at least two points")
    slope = Fraction(ys[1] - ys[0], xs[1] - xs[0])
    intercept = ys[0] - slope * xs[0]
    return slope, intercept, all(slope * x + intercept == y for x, y in zip(xs, ys))


def fit_quadratic(xs: list[int], ys: list[int]) -> tuple[tuple[Fraction, Fraction, Fraction], bool]:
    """Exact ``c0 + c1*x + c2*x**2`` through the first three points: ``((c0, c1, c2), all_points_on_it)``."""
    if len(xs) < 3:
        raise ValueError("a quadratic needs at least three points")
    (x0, x1, x2), (y0, y1, y2) = xs[:3], ys[:3]
    d01 = Fraction(y1 - y0, x1 - x0)
    d12 = Fraction(y2 - y1, x2 - x1)
    c2 = (d12 - d01) / (x2 - x0)
    c1 = d01 - c2 * (x0 + x1)
    c0 = y0 - c1 * x0 - c2 * x0 * x0
    return (c0, c1, c2), all(c0 + c1 * x + c2 * x * x == y for x, y in zip(xs, ys))


@dataclass
class Scaling:
    """Measured activation bytes of one model configuration over batch sizes and sequence lengths."""

    attn_impl: str
    config: dict  # make_model keyword arguments
    seq_len: int  # sequence length of the batch sweep
    batch_size: int  # batch size of the sequence-length sweep
    batch_sizes: list[int] = field(default_factory=list)
    batch_bytes: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    seq_bytes: list[int] = field(default_factory=list)

    def batch_fit(self) -> tuple[Fraction, Fraction, bool]:
        """(bytes per sample, batch-independent bytes, exactly affine?)."""
        return fit_line(self.batch_sizes, self.batch_bytes)

    def seq_fit(self) -> tuple[tuple[Fraction, Fraction, Fraction], bool]:
        """((c0, c1, c2), exactly quadratic?) for bytes = c0 + c1*s + c2*s^2."""
        return fit_quadratic(self.seq_lens, self.seq_bytes)

    def summary(self) -> str:
        lines = [f"{self.attn_impl}: {self.config}"]
        if len(self.batch_sizes) >= 2:
            slope, intercept, ok = self.batch_fit()
            lines.append(
                f"  seq {self.seq_len}, batch {self.batch_sizes}: bytes = {_num(slope)} * b + {_num(intercept)}"
                + ("  (exact at every point)" if ok else "  (NOT a line)")
            )
        if len(self.seq_lens) >= 3:
            (c0, c1, c2), ok = self.seq_fit()
            lines.append(
                f"  batch {self.batch_size}, seq {self.seq_lens}: "
                f"bytes = {_num(c0)} + {_num(c1)} * s + {_num(c2)} * s^2"
                + ("  (exact at every point)" if ok else "  (NOT a quadratic)")
            )
        return "\n".join(lines)


def _num(q: Fraction) -> str:
    return f"{q.numerator:,}" if q.denominator == 1 else f"{float(q):,.2f}"


def _even_points(top: int, n: int = 4) -> list[int]:
    return sorted({max(1, round(top * k / n)) for k in range(1, n + 1)})


def measure_scaling(
    attn_impl: str = "manual",
    batch_sizes: Iterable[int] = (1, 2, 3, 4),
    seq_lens: Iterable[int] = (32, 64, 96, 128),
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device=None,
    iterate: Callable = iter,
    **config,
) -> Scaling:
    """Measure forward activation bytes over ``batch_sizes`` (at ``seq_len``) and ``seq_lens`` (at ``batch_size``).

    One model is built (``make_model(attn_impl=..., seq_len=max(seq_lens, seq_len), **config)``) and
    fed shorter sequences for the sequence sweep. ``batch_size`` defaults to the largest batch,
    ``seq_len`` to the longest sequence. ``iterate`` wraps the list of runs (e.g. ``progress``).
    """
    batch_sizes, seq_lens = sorted(set(batch_sizes)), sorted(set(seq_lens))
    batch_size = batch_size or batch_sizes[-1]
    seq_len = seq_len or seq_lens[-1]
    model = make_model(device=device, attn_impl=attn_impl, seq_len=max(seq_len, seq_lens[-1]), **config)
    res = Scaling(attn_impl, {"attn_impl": attn_impl, **config}, seq_len, batch_size)
    runs = [("b", b, seq_len) for b in batch_sizes] + [("s", batch_size, s) for s in seq_lens]
    cache: dict[tuple[int, int], int] = {}
    for kind, b, s in iterate(runs):
        if (b, s) not in cache:
            cache[b, s] = forward_activation_bytes(model, b, s)
        if kind == "b":
            res.batch_sizes.append(b)
            res.batch_bytes.append(cache[b, s])
        else:
            res.seq_lens.append(s)
            res.seq_bytes.append(cache[b, s])
    return res


def plot_scaling(results: list[Scaling], title: str | None = None):
    """Activation bytes vs batch size (left) and sequence length (right): measured points, exact fits.

    The fitted curves are the exact line / quadratic through the measured points; for a fit with
    an s^2 term its linear part is drawn dotted, so the gap is the quadratic term. Returns the Figure.
    """
    fig = CourseFigure(figsize=(11, 4), layout="constrained")
    ax, bx = fig.subplots(1, 2)
    color = CATEGORY_COLORS["activations"]
    styles = {"manual": ("o", "-"), "sdpa": ("s", "--")}
    top = max(max(r.batch_bytes + r.seq_bytes) for r in results)
    unit, scale = pick_unit(top)
    for r in results:
        marker, line = styles.get(r.attn_impl, ("^", "-."))
        ax.plot(r.batch_sizes, np.array(r.batch_bytes) / scale, marker, color=color, label=f"{r.attn_impl}: measured")
        if len(r.batch_sizes) >= 2:
            slope, intercept, _ = r.batch_fit()
            xs = np.linspace(0, max(r.batch_sizes), 50)
            ax.plot(xs, (float(slope) * xs + float(intercept)) / scale, line, color=color, label=f"{r.attn_impl}: fit")
        bx.plot(r.seq_lens, np.array(r.seq_bytes) / scale, marker, color=color, label=f"{r.attn_impl}: measured")
        if len(r.seq_lens) >= 3:
            (c0, c1, c2), _ = r.seq_fit()
            xs = np.linspace(0, max(r.seq_lens), 80)
            fit = float(c0) + float(c1) * xs + float(c2) * xs * xs
            bx.plot(xs, fit / scale, line, color=color, label=f"{r.attn_impl}: fit a + b·s + c·s²")
            if c2 != 0:
                lin = float(c0) + float(c1) * xs
                bx.plot(xs, lin / scale, ":", color="#333", zorder=4, label=f"{r.attn_impl}: its linear part")
    r0 = results[0]
    ax.set_xlabel("batch size b")
    ax.set_ylabel(f"activation bytes saved ({unit})")
    ax.set_title(f"Linear in batch size (seq_len {r0.seq_len})")
    bx.set_xlabel("sequence length s (tokens)")
    bx.set_ylabel(f"activation bytes saved ({unit})")
    bx.set_title(f"Sequence length (batch {r0.batch_size})")
    for a in (ax, bx):
        a.set_xlim(left=0)
        a.set_ylim(bottom=0)
        a.legend(fontsize=8)
    cfg = ", ".join(f"{k} {v}" for k, v in r0.config.items() if k != "attn_impl")
    fig.suptitle(title or f"Forward activations, measured ({cfg})")
    return fig


def activation_scaling(
    batch_size: int = 4,
    seq_len: int = 128,
    n_layer: int = 2,
    d_model: int = 128,
    attn_impl: str = "manual",
    device=None,
):
    """Measure a ``n_layer`` x ``d_model`` model (4 heads) at 4 batch sizes up to ``batch_size`` and 4
    sequence lengths up to ``seq_len``; print the exact fits and plot them. The function behind
    notebook 01's slider panel. Returns the Figure.
    """
    res = measure_scaling(
        attn_impl,
        _even_points(batch_size),
        _even_points(seq_len),
        device=device,
        n_layer=n_layer,
        d_model=d_model,
        n_head=4,
    )
    print(res.summary())
    return plot_scaling([res])


# ---------------------------------------------------------------------------------------------
# Measured layer vs the formula, term by term
# ---------------------------------------------------------------------------------------------


def korthikanti_role(row: dict, bmm_rank: int = 0) -> str:
    """Which term of the formula (or which extra) a saved activation of one layer is.

    ``row`` comes from :func:`attach_ops`. ``bmm_rank`` says which of the attention module's
    batched matmuls saved it (0: Q @ K^T, 1: probabilities @ V). Returns "other" for anything
    the formula has no term for and that is not a known extra.
    """
    leaf = row["module"].split(".", 2)[2] if row["module"].startswith("blocks.") else row["module"]
    op, attr = row["op"], row["attr"]
    if leaf in ("ln1", "ln2"):
        return "LayerNorm inputs" if attr == "input" else "LayerNorm mean/rstd"
    simple = {
        "attn.qkv": "QKV input",
        "attn.attn_drop": "softmax dropout mask",
        "attn.proj": "out-proj input",
        "attn.resid_drop": "attn dropout mask",
        "mlp.fc": "fc1 input",
        "mlp.gelu": "GELU input",
        "mlp.proj": "fc2 input",
        "mlp.drop": "MLP dropout mask",
    }
    if leaf in simple:
        return simple[leaf]
    if leaf == "attn":
        if op.startswith("MaskedFill"):
            return "causal mask"
        if op.startswith("Softmax"):
            return "softmax output"
        if op.startswith("Bmm"):
            if bmm_rank == 0:
                return "Q and K"
            return "V" if attr == "mat2" else "dropout output"
    return "other"


def layer_terms(rows: list[dict], layer: int) -> dict[str, dict]:
    """Measured activation bytes of block ``layer`` by formula term (and extra), distinct storages.

    Each storage counts once, for the term of the row that saved it first. Returns
    ``{term: {"bytes": int, "dtypes": set of dtypes, "rows": [row indices]}}``.
    """
    prefix = f"blocks.{layer}."
    bmm_seqs = sorted({r["seq"] for r in rows if r["module"] == f"blocks.{layer}.attn" and r["op"].startswith("Bmm")})
    out: dict[str, dict] = {}
    for i, r in enumerate(rows):
        if not r["module"].startswith(prefix) or r["category"] != "activations" or not r["first"]:
            continue
        rank = bmm_seqs.index(r["seq"]) if r["seq"] in bmm_seqs else 0
        term = korthikanti_role(r, rank)
        t = out.setdefault(term, {"bytes": 0, "dtypes": set(), "rows": []})
        t["bytes"] += r["storage_bytes"]
        t["dtypes"].add(r["dtype"])
        t["rows"].append(i)
    return out


def compare_layer(rows: list[dict], layer: int, s: int, b: int, h: int, a: int) -> list[dict]:
    """One layer, term by term: formula bytes next to measured bytes.

    Returns a list of dicts (term, part, formula, measured, dtype, element_size, difference) in
    the formula's order, then the extras the formula leaves out (formula 0), then any "other".
    """
    measured = layer_terms(rows, layer)
    formula = korthikanti_terms(s, b, h, a)
    parts = {t: p for t, p, _, _ in KORTHIKANTI_TERMS}
    terms = list(formula) + [t for t in EXTRA_TERMS if t in measured] + [t for t in measured if t == "other"]
    out = []
    for t in terms:
        m = measured.get(t, {"bytes": 0, "dtypes": set()})
        dtypes = sorted(str(d).replace("torch.", "") for d in m["dtypes"])
        sizes = {torch.empty(0, dtype=d).element_size() for d in m["dtypes"]}
        out.append(
            {
                "term": t,
                "part": parts.get(t, "extra"),
                "formula": formula.get(t, 0),
                "measured": m["bytes"],
                "dtype": "/".join(dtypes) or "-",
                "element_size": sizes.pop() if len(sizes) == 1 else None,
                "difference": m["bytes"] - formula.get(t, 0),
            }
        )
    return out


def comparison_table(comparison: list[dict]) -> str:
    """Text table of :func:`compare_layer`'s rows with totals and the measured/formula ratio."""
    head = f"{'term':<22}{'part':<11}{'formula':>12}{'measured':>12}  {'dtype':<10}{'difference':>12}"
    lines = [head, "-" * len(head)]
    for c in comparison:
        lines.append(
            f"{c['term']:<22}{c['part']:<11}{_fmt_bytes(c['formula']):>12}{_fmt_bytes(c['measured']):>12}  "
            f"{c['dtype']:<10}{c['difference']:>+12,}"
        )
    f = sum(c["formula"] for c in comparison)
    m = sum(c["measured"] for c in comparison)
    lines.append("-" * len(head))
    lines.append(f"{'one layer':<33}{_fmt_bytes(f):>12}{_fmt_bytes(m):>12}  {'':<10}{m - f:>+12,}")
    lines.append(f"measured / formula = {m / f:.3f}")
    return "\n".join(lines)


def plot_formula_vs_measured(comparison: list[dict], title: str | None = None):
    """Paired horizontal bars per term: the formula (grey), the measurement (activations colour).

    Returns the Figure.
    """
    terms = [c["term"] for c in comparison]
    unit, scale = pick_unit(max(max(c["formula"], c["measured"]) for c in comparison))
    fig = CourseFigure(figsize=(9, 0.34 * len(terms) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    ys = np.arange(len(terms))
    f = np.array([c["formula"] for c in comparison]) / scale
    m = np.array([c["measured"] for c in comparison]) / scale
    ax.barh(ys - 0.2, f, height=0.4, color="#bbbbbb", label="formula (16-bit, 1-byte masks)")
    ax.barh(ys + 0.2, m, height=0.4, color=CATEGORY_COLORS["activations"], label="measured")
    for y, c in zip(ys, comparison):
        if c["difference"]:
            ax.text(
                max(c["formula"], c["measured"]) / scale,
                y,
                f"  {c['difference'] / scale:+.3f}",
                va="center",
                fontsize=8,
            )
    ax.set_yticks(ys, terms)
    ax.invert_yaxis()
    ax.margins(x=0.15)
    ax.set_xlabel(f"bytes per layer ({unit})")
    ax.set_title(title or "One layer: Korthikanti et al. formula vs measured")
    ax.legend(loc="lower right", fontsize=8)
    return fig
