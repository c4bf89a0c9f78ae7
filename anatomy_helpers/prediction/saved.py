"""What autograd saved for backward, tensor by tensor, and how it compares with the closed form.

* :func:`saved_rows` reads a Trace's ``saved`` list and marks the first saver of each storage, so
  :func:`distinct_bytes` counts every storage once however many views of it were saved;
* :func:`saved_by_op` names the autograd op behind each saved tensor (a walk of the autograd graph),
  :func:`attach_ops` merges the two;
* :func:`compare_layer` sets one layer's measured bytes beside Korthikanti et al. (2022), term by term
  (:mod:`anatomy_helpers.prediction.formulas`).

Units are bytes unless a name says otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..core.tables import Col, format_table
from ..core.units import MiB
from ..tracking.events import HEAD, SavedTensor, model_part, model_parts
from ..tracking.trace import Trace
from .formulas import EXTRA_TERMS, KORTHIKANTI_TERMS, korthikanti_terms


@dataclass(frozen=True)
class OpSaved:
    """A tensor one forward saved, named by the autograd node that holds it (:func:`saved_by_op`)."""

    module: str  # named as the tracker names it
    op: str  # the backward node, e.g. "NativeLayerNormBackward0"
    attr: str  # the node's _saved_<attr>, e.g. "input", "result1"
    seq: int  # the node's sequence number: forward order
    shape: tuple
    dtype: object  # torch.dtype
    bytes: int  # of the view
    storage: int  # 0, 1, 2 ...: one number per distinct storage
    storage_bytes: int


@dataclass(frozen=True)
class SavedRow(SavedTensor):
    """A :class:`~anatomy_helpers.tracking.trace.SavedTensor` with its storage's first saver marked, and (after
    :func:`attach_ops`) the autograd op that saved it."""

    first: bool = True  # the first row that saved this storage
    same_as: int = 0  # the index of that first row
    op: str | None = None
    attr: str | None = None
    seq: int | None = None


@dataclass
class TermBytes:
    """Measured bytes of one formula term in one layer (distinct storages), their dtypes and row indices."""

    bytes: int = 0
    dtypes: set = field(default_factory=set)
    rows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TermComparison:
    """One term of one layer: the formula's bytes next to the measured bytes."""

    term: str
    part: str  # attention, mlp, layernorm, or extra
    formula: int
    measured: int
    dtype: str  # the measured tensors' dtypes, "/"-joined
    element_size: int | None  # bytes per element when the dtypes agree

    @property
    def difference(self) -> int:
        return self.measured - self.formula


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


def saved_by_op(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None) -> list[OpSaved]:
    """Run one forward of ``model`` and name the autograd op behind every tensor it saves.

    Returns one :class:`OpSaved` per saved tensor on ``idx``'s device, in the order autograd saved them (the order
    of ``trace.saved`` for the same forward).

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
        # The device's memory only, as the step tracker counts it: on a GPU, fused attention also saves its RNG seed
        # and offset, which are CPU scalars.
        if t.device == idx.device:
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
        storage = t.untyped_storage()
        # By address; an empty storage has none of its own (torch 2.11's checkpoint saves a 0-element tensor per call).
        where = storage.data_ptr() if storage.nbytes() else ("empty", storage._cdata)
        st = storages.setdefault((t.device, where), len(storages))
        rows.append(OpSaved(module, op, attr, seq, tuple(t.shape), t.dtype, t.nbytes, st, storage.nbytes()))
    return rows


def saved_rows(trace: Trace) -> list[SavedRow]:
    """``trace.saved`` with each storage's first saver marked.

    Every row (which already has ``storage_bytes``, the whole storage behind the saved view)
    gets ``first`` (True for the first row that saved this storage) and ``same_as``
    (the index of that first row). Summing ``storage_bytes`` over first rows counts every
    storage once, however many views of it autograd saved.
    """
    first: dict[int, int] = {}
    out = []
    for i, r in enumerate(trace.saved):
        j = first.setdefault(r.storage, i)
        out.append(SavedRow(**vars(r), first=j == i, same_as=j))
    return out


def attach_ops(rows: list[SavedRow], ops: list[OpSaved]) -> list[SavedRow]:
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
            if getattr(s, k) != getattr(o, k):
                raise ValueError(f"saved tensor {i}: tracker has {k}={getattr(s, k)!r}, op walk has {getattr(o, k)!r}")
        if pair.setdefault(s.storage, o.storage) != o.storage:
            raise ValueError(f"saved tensor {i}: the tracker and the op walk group storages differently")
        out.append(dataclasses.replace(s, op=o.op, attr=o.attr, seq=o.seq))
    if len(set(pair.values())) != len(pair):
        raise ValueError("the tracker and the op walk group storages differently")
    return out


def first_savers(rows: Iterable[SavedRow], category: str | None = "activations") -> list[SavedRow]:
    """The rows that saved a storage first (one row per distinct storage), of one category (None: all)."""
    return [r for r in rows if r.first and (category is None or r.category == category)]


def distinct_bytes(rows: Iterable[SavedRow], category: str | None = "activations") -> int:
    """Bytes of the distinct storages behind ``rows`` (from :func:`saved_rows`), each counted once.

    Only storages of ``category`` count (None: all).
    """
    return sum(r.storage_bytes for r in first_savers(rows, category))


def activations_by_part(rows: Iterable[SavedRow]) -> dict[str, int]:
    """Activation bytes per part of the model (:func:`~anatomy_helpers.tracking.trace.model_part`), each storage once.

    A storage counts for the module that saved it first (the part whose backward needs it),
    in forward order: embeddings, blocks.0 ... blocks.L-1, head (the loss included).
    """
    out: dict[str, int] = {}
    for r in first_savers(rows):
        part = model_part(r.module) or HEAD
        out[part] = out.get(part, 0) + r.storage_bytes
    # the highest block index, not the number of blocks seen: rows of some blocks only (a prefix, a filter)
    # must not lose the higher ones
    n_layer = max((int(k.split(".")[1]) + 1 for k in out if k.startswith("blocks.")), default=0)
    return {k: out[k] for k in model_parts(n_layer) if k in out}


def saved_table(rows: list[SavedRow], prefix: str | None = None) -> str:
    """Text table of saved tensors (rows from :func:`saved_rows`, with or without :func:`attach_ops`).

    Only modules whose name starts with ``prefix`` (all by default). One line per tensor
    autograd saved: "bytes" is the saved view, "storage" says "new" for a storage seen for the
    first time and "= #k" when row k already saved a view of the same storage; "counted" is what
    the line adds to the activations (the whole storage, once). The footer sums the counted bytes.
    """
    chosen = [(i, r) for i, r in enumerate(rows) if prefix is None or r.module.startswith(prefix)]
    named = all(r.op is not None for _, r in chosen)
    cols = [Col("#", 3), Col("module", 25, align="<", gap="  ")]
    if named:
        cols.append(Col("saved by op.attr", max([len(r.op) + len(r.attr) + 2 for _, r in chosen] + [17]), align="<"))
    cols += [Col("shape", 18, align="<"), Col("dtype", 8, align="<"), Col("bytes", 11, ",d")]
    cols += [Col("storage", 8, align="<", gap="  "), Col("counted", 11)]
    table = []
    for i, r in chosen:
        if r.category != "activations":
            counted = r.category.rstrip("s")
        else:
            counted = f"{r.storage_bytes:,}" if r.first else "-"
        op = [f"{r.op}.{r.attr}"] if named else []
        dtype = str(r.dtype).replace("torch.", "")
        table.append((i, r.module, *op, str(r.shape), dtype, r.bytes, "new" if r.first else f"= #{r.same_as}", counted))
    acts = distinct_bytes(r for _, r in chosen)
    n = len(first_savers(r for _, r in chosen))
    footer = [f"activations: {n} distinct storages, {acts:,} bytes ({acts / MiB:.2f} MiB)"]
    return format_table(cols, table, footer=footer)


def korthikanti_role(row: SavedRow, bmm_rank: int = 0) -> str:
    """Which term of the formula (or which extra) a saved activation of one layer is.

    ``row`` comes from :func:`attach_ops`. ``bmm_rank`` says which of the attention module's
    batched matmuls saved it (0: Q @ K^T, 1: probabilities @ V). Returns "other" for anything
    the formula has no term for and that is not a known extra.
    """
    leaf = row.module.split(".", 2)[2] if row.module.startswith("blocks.") else row.module
    op, attr = row.op, row.attr
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


def layer_terms(rows: list[SavedRow], layer: int) -> dict[str, TermBytes]:
    """Measured activation bytes of block ``layer`` by formula term (and extra), distinct storages.

    Each storage counts once, for the term of the row that saved it first.
    """
    prefix = f"blocks.{layer}."
    bmm_seqs = sorted({r.seq for r in rows if r.module == f"blocks.{layer}.attn" and r.op.startswith("Bmm")})
    out: dict[str, TermBytes] = {}
    for i, r in enumerate(rows):
        if not r.module.startswith(prefix) or r.category != "activations" or not r.first:
            continue
        rank = bmm_seqs.index(r.seq) if r.seq in bmm_seqs else 0
        term = korthikanti_role(r, rank)
        t = out.setdefault(term, TermBytes())
        t.bytes += r.storage_bytes
        t.dtypes.add(r.dtype)
        t.rows.append(i)
    return out


def compare_layer(rows: list[SavedRow], layer: int, s: int, b: int, h: int, a: int) -> list[TermComparison]:
    """One layer, term by term: formula bytes next to measured bytes.

    Returns :class:`TermComparison` rows in the formula's order, then the extras the formula leaves out
    (formula 0), then any "other".
    """
    measured = layer_terms(rows, layer)
    formula = korthikanti_terms(s, b, h, a)
    parts = {t: p for t, p, _, _ in KORTHIKANTI_TERMS}
    terms = list(formula) + [t for t in EXTRA_TERMS if t in measured] + [t for t in measured if t == "other"]
    out = []
    for t in terms:
        m = measured.get(t, TermBytes())
        dtypes = sorted(str(d).replace("torch.", "") for d in m.dtypes)
        sizes = {torch.empty(0, dtype=d).element_size() for d in m.dtypes}
        out.append(
            TermComparison(
                term=t,
                part=parts.get(t, "extra"),
                formula=formula.get(t, 0),
                measured=m.bytes,
                dtype="/".join(dtypes) or "-",
                element_size=sizes.pop() if len(sizes) == 1 else None,
            )
        )
    return out


def comparison_table(comparison: list[TermComparison]) -> str:
    """Text table of :func:`compare_layer`'s rows with totals and the measured/formula ratio (bytes)."""
    cols = [Col("term", 22, align="<"), Col("part", 10, align="<"), Col("formula", 12, ",d"), Col("measured", 12, ",d")]
    cols += [Col("dtype", 10, align="<", gap="  "), Col("difference", 12, "+,d")]
    rows = [(c.term, c.part, c.formula, c.measured, c.dtype, c.difference) for c in comparison]
    f = sum(c.formula for c in comparison)
    m = sum(c.measured for c in comparison)
    # the totals line is written with the columns' own cells, so it lines up with them (format_table drops the
    # first column's gap from every line)
    total = "".join(col.cell(v) for col, v in zip(cols, ("one layer", "", f, m, "", m - f)))[len(cols[0].gap) :]
    footer = [total.rstrip(), f"measured / formula = {m / f:.3f}"]
    return format_table(cols, rows, footer=footer)
