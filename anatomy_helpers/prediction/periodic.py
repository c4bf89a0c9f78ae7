"""A dry run whose cost does not grow with depth: a step at ``n_layer`` L from three shallow ones.

:func:`periodic_trace` does it for any dry run given as a function of the depth (a rank of a parallel job, a
Hugging Face model: anything whose blocks are numbered in its module names); :func:`periodic_dry_run` for the
course GPT, as below.

A model's blocks repeat, so its training step's allocation sequence repeats block by block. :func:`periodic_dry_run`
dry-runs the same configuration at depths 3, 4 and 5 (:func:`~anatomy_helpers.prediction.dryrun.dry_run_config`,
its ops checked as there; at 3 the first and the last block each have a block in between as neighbour), and reads
every recorded sequence of the three traces as *rows*: the module names, the events (baseline storages and
timeline samples: step, phase, module, allocation id, bytes, category, the allocation's module, and for a free
made a few rows after its allocation, how many), the phase marks, the saved tensors and the gradients' parameters.

What it assumes, and checks. Each row's block index is written as its role (first block, last block, a block in
between), so the rows of the blocks in between look alike; an allocation a block's row frees or touches that its
own or a neighbouring block made is named by that block's offset (-1, 0, +1: a rank's FSDP2 all-gathers and
reduce-scatters belong to the next block, its input to the previous one). A storage alive before the step may grow
by the same bytes per block (DDP's one bucket holds every block's gradients). The rows at depth 4 must be those
at depth 3 with chunks inserted at some places, and the rows at depth 5 those at depth 3 with each chunk inserted
twice at the same places (where the alignments cut the same repeating rows at two nearby places, the span between
them is searched for one place that fits both depths; where none does, a span is joined with the next within a
few rows, and the block's rows may go in at several places of it: a rank's optimizer state, rows named by no block,
aligned at depths 4 and 5 in other proportions); every number of a row that is not inserted (module index,
allocation id, block index, sample index) must grow by the same step from depth 3 to 4 as from 4 to 5. Then the
rows at depth L are those at depth 3 with L - 3 copies of each chunk, each number moved on by its own steps (per
depth, and per copy as from the first copy inserted at depth 5 to the second: read there, not checked against a
sixth depth; the tests check the whole at depths 6 and 12), and the Trace is rebuilt from them through
:meth:`Trace.from_events`, as a recorder
builds it: its timeline, every phase, peak and category are computed on the whole extrapolated sequence, never by
scaling a peak. Only the wall times are not measured: samples are spread evenly over the time this function took.

Where it falls back to the full dry run (and says why, in the returned reason): depth 5 or less (nothing to save),
``checkpoint="every_k"`` with ``checkpoint_every`` > 1 (segments group blocks, so the step repeats every k blocks,
not every block), and any configuration whose rows break the assumptions above (blocks that differ, a first step
that differs in a way the per-block period does not capture: every_k with k > 1, tried, is refused by these
checks too). Gradient accumulation (``micro_batches``) passes through to ``dry_run_config``: each depth runs every
micro-batch, the saved tensors' rows carry their pass (micro-batch) so that one pass's blocks are never aligned
with the next pass's, and the period is read from the whole step. tests/test_periodic.py checks it byte for byte against
full-depth dry runs (both blocks, every policy, bf16, autocast, sdpa and manual attention, the optimizer in
backward, 2 and 4 micro-batches).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
import time
from collections.abc import Callable

import numpy as np

from ..core.model import ModelConfig
from ..tracking.events import Event, PhaseMark, SavedTensor
from ..tracking.trace import Trace
from .dryrun import dry_run_config

#: The depths recorded; the first is the one the others' rows are aligned to.
DEPTHS = (3, 4, 5)

#: Rows apart within which a free names how far back its storage was allocated (see _rows).
_NEAR = 8

#: The name of the course GPT's list of blocks (its modules are ``blocks.0``, ``blocks.1``...).
COURSE_BLOCKS = "blocks"


def _patterns(blocks: str) -> tuple[re.Pattern, re.Pattern]:
    """Regexes for a block's index in a module name, and for its role (F, M, L) once written as one."""
    word = re.escape(blocks)
    return re.compile(rf"(^|\.){word}\.(\d+)(?=\.|$)"), re.compile(rf"(^|\.){word}\.([FML])(?=\.|$)")


class NotPeriodic(Exception):
    """The recorded rows do not repeat block by block (the message says where)."""


def _role_name(name: str, depth: int, blocks: str = COURSE_BLOCKS) -> tuple[str, int]:
    """``name`` with its block index written as a role (F first, L last, M in between), and that index (-1: none);
    ``blocks``: the name of the model's list of blocks."""
    match = _patterns(blocks)[0].search(name)
    if match is None:
        return name, -1
    b = int(match.group(2))
    role = "F" if b == 0 else "L" if b == depth - 1 else "M"
    return name[: match.start(2)] + role + name[match.end(2) :], b


def _named(role_name: str, block: int, blocks: str = COURSE_BLOCKS) -> str:
    """The name back from its role form and block index."""
    if block < 0:
        return role_name
    match = _patterns(blocks)[1].search(role_name)
    return role_name[: match.start(2)] + str(block) + role_name[match.end(2) :]


def _loose(row):
    """A row with a baseline storage's bytes left out: a storage alive before the step may grow with depth (DDP's
    one bucket holds every block's gradients); its bytes are then checked as a number (they must grow by one step
    per block)."""
    if isinstance(row, tuple) and len(row) == 9 and row[0] is True:  # an event row of a baseline storage
        return row[:4] + (None,) + row[5:]
    return tuple(map(_loose, row)) if isinstance(row, tuple) else row


def _aligned(a: list, b: list, what: str, loose: bool = False) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Align ``b`` to ``a`` (``b`` must be ``a`` with rows inserted): the index in ``b`` of each row of ``a``, and
    the places rows were inserted, as (position in ``a``, how many). Rows that differ are aligned again with
    baseline storages' bytes left out (:func:`_loose`)."""
    where = np.zeros(len(a), dtype=np.int64)
    runs = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            where[i1:i2] = np.arange(j1, j2)
        elif tag == "insert":
            runs.append((i1, j2 - j1))
        elif tag == "replace" and not loose:
            sub, inserted = _aligned([_loose(r) for r in a[i1:i2]], [_loose(r) for r in b[j1:j2]], what, True)
            where[i1:i2] = sub + j1
            runs.extend((i1 + p, k) for p, k in inserted)
        else:
            raise NotPeriodic(f"the {what} of a deeper run are not the shallower run's with blocks inserted ({tag})")
    return where, runs


def _regions(runs1: list[tuple[int, int]], runs2: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans [i1, i2) of rows of the shallowest run that the deeper runs insert one block's rows into, from the
    places ``runs1`` and ``runs2`` (position, rows) where they inserted rows. A place both use is a span of no rows;
    a place only one uses is spanned with the nearest place only the other uses (the same repeating rows can be
    cut into chunks at different places at two depths)."""
    p1, p2 = {p for p, _ in runs1}, {p for p, _ in runs2}
    only1, only2 = sorted(p1 - p2), sorted(p2 - p1)
    if bool(only1) != bool(only2):
        raise NotPeriodic("rows are inserted at a place at one depth and at no place near it at the other")
    spans = [[p, p] for p in p1 & p2]
    for p in only1:
        q = min(only2, key=lambda q: abs(q - p))
        spans.append([min(p, q), max(p, q)])
    for q in only2:
        p = min(only1, key=lambda p: abs(q - p))
        spans.append([min(p, q), max(p, q)])
    spans.sort()
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo < merged[-1][1] or (merged and lo == merged[-1][1] and lo > merged[-1][0]):
            merged[-1][1] = max(merged[-1][1], hi)
        elif not merged or [lo, hi] != merged[-1]:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _copies(rows: list, at4: np.ndarray, at5: np.ndarray, y: int, m: int) -> tuple[list, list[np.ndarray]]:
    """``m`` copies of a block's ``rows`` (inserted as one run, or as two split at ``y``: every block's first run
    before every second one), each row's numbers moved on per depth and per copy: ``at4``, the rows' numbers at
    depth 4; ``at5``, the twice as many rows' at depth 5 (each run twice)."""
    n = len(rows)
    first = np.concatenate([at5[:y], at5[2 * y : y + n]])  # depth 5's first copy of each run
    second = np.concatenate([at5[y : 2 * y], at5[y + n : 2 * n]])  # and its second
    toks, nums = [], []
    for part in (slice(0, y), slice(y, n)):
        for j in range(m):  # copy j
            toks.extend(rows[part])
            nums.append((at4 + (m - 1) * (first - at4) + j * (second - first))[part])
    return toks, nums


#: How many ways of placing a block's rows :func:`_spread` tries before giving up.
_SPREAD_TRIES = 20_000


def _spread(at3: tuple, at4: tuple, at5: tuple, m: int) -> tuple[list, list[np.ndarray]] | None:
    """The rows (tokens, numbers) at depth DEPTHS[0] + ``m`` of a span of the shallowest run whose block's rows
    are inserted at several places in it (each place's run of rows once at depth 4 and twice at depth 5, as one run
    or two, as :func:`_extrapolate` reads one place); ``at3``, ``at4``, ``at5``: the span's (tokens, numbers) at
    DEPTHS. Each row of the span must keep its place with its numbers grown by the same step per block. None: no
    such placing found (in :data:`_SPREAD_TRIES` tries)."""
    (r0, q0), (r1, q1), (r2, q2) = at3, at4, at5
    tries = [0]

    def go(i: int, a: int, b: int):  # the runs before row i of r0 (at a in r1, at b in r2), then the rest
        ends = [len(r1)] if i == len(r0) else [e for e in range(a, len(r1)) if r1[e] == r0[i]]
        for e in ends:
            run, n = r1[a:e], e - a
            f = b + 2 * n  # where row i is at depth 5
            if i == len(r0) and f != len(r2):
                continue
            if i < len(r0) and (f >= len(r2) or r2[f] != r0[i] or not np.array_equal(q1[e] - q0[i], q2[f] - q1[e])):
                continue
            for y in [n, *range(1, n)] if n else [0]:
                tries[0] += 1
                if tries[0] > _SPREAD_TRIES:
                    return None
                if r2[b:f] != run[:y] * 2 + run[y:] * 2:
                    continue
                rest = go(i + 1, e + 1, f + 1) if i < len(r0) else ([], [])
                if rest is None:
                    continue
                toks, nums = _copies(run, q1[a:e], q2[b:f], y, m)
                if i < len(r0):
                    toks.append(r0[i])
                    nums.append((q0[i] + m * (q1[e] - q0[i]))[None])
                return toks + rest[0], nums + rest[1]
        return None

    return go(0, 0, 0)


def _extrapolate(toks: list[list], nums: list[np.ndarray], m: int, what: str) -> tuple[list, np.ndarray]:
    """The rows (tokens, numbers) at depth DEPTHS[0] + ``m`` from those at DEPTHS (see the module's docstring)."""
    t0, t1, t2 = toks
    n0, n1, n2 = nums
    w1, runs1 = _aligned(t0, t1, what)
    w2, runs2 = _aligned(t0, t2, what)
    out_t: list = []
    out_n: list[np.ndarray] = []

    def fixed(i1: int, i2: int) -> None:  # rows of the shallowest run that no block is inserted into
        d1, d2 = n1[w1[i1:i2]] - n0[i1:i2], n2[w2[i1:i2]] - n1[w1[i1:i2]]
        if not np.array_equal(d1, d2):
            raise NotPeriodic(f"the {what}' numbers do not grow by the same step per block")
        out_t.extend(t0[i1:i2])
        out_n.append(n0[i1:i2] + m * d1)

    def bounds(w: np.ndarray, length: int, i1: int, i2: int) -> tuple[int, int]:
        return (int(w[i1 - 1]) + 1 if i1 else 0), (int(w[i2]) if i2 < len(w) else length)

    def block(i1: int, i2: int) -> tuple[list, list[np.ndarray]] | str:
        """The rows of the span [i1, i2) at depth DEPTHS[0] + m, or why its rows do not repeat."""
        r0, q0 = t0[i1:i2], n0[i1:i2]
        s1, e1 = bounds(w1, len(t1), i1, i2)
        s2, e2 = bounds(w2, len(t2), i1, i2)
        r1, q1, r2, q2 = t1[s1:e1], n1[s1:e1], t2[s2:e2], n2[s2:e2]
        k = len(r1) - len(r0)
        if k <= 0 or len(r2) - len(r0) != 2 * k:
            return f"the {what} do not gain the same rows per block from depth to depth"
        # where, in the shallowest run's rows, the block's rows go (x), and where they split in two (y): rows
        # inserted at one place may be two runs of each block, every block's first run before every second one, as
        # an optimizer's first step makes every parameter's state, then every parameter's temporaries (y = k: one
        # run; the others are tried only where no single run fits)
        places = itertools.chain(
            ((x, k) for x in range(len(r0) + 1)), ((x, y) for x in range(len(r0) + 1) for y in range(1, k))
        )
        for x, y in places:
            chunk = r1[x : x + k]
            if r1 != r0[:x] + chunk + r0[x:] or r2 != r0[:x] + chunk[:y] * 2 + chunk[y:] * 2 + r0[x:]:
                continue
            head = (q0[:x], q1[:x], q2[:x])
            tail = (q0[x:], q1[x + k :], q2[x + 2 * k :])
            if not all(np.array_equal(b - a, c - b) for a, b, c in (head, tail)):
                continue
            toks_out, nums_out = _copies(chunk, q1[x : x + k], q2[x : x + 2 * k], y, m)
            toks_out = list(r0[:x]) + toks_out + list(r0[x:])
            nums_out.insert(0, head[0] + m * (head[1] - head[0]))
            nums_out.append(tail[0] + m * (tail[1] - tail[0]))
            return toks_out, nums_out
        spread = _spread((r0, q0), (r1, q1), (r2, q2), m)  # a span joined from two: the block's rows at two places
        return spread or f"the {what} inserted per block do not repeat with the same numbers' steps"

    # a span whose rows do not repeat is tried again joined with the next span, where that starts within _NEAR
    # rows: rows that look alike (a rank's optimizer state, named by no block) can be aligned with a block's rows
    # cut at two nearby places, in other proportions at depths 4 and 5
    regions, done, j = _regions(runs1, runs2), 0, 0
    while j < len(regions):
        i1, i2 = regions[j]
        found = first = block(i1, i2)
        while isinstance(found, str) and j + 1 < len(regions) and regions[j + 1][0] - i2 <= _NEAR:
            j += 1
            i2 = regions[j][1]
            found = block(i1, i2)
        if isinstance(found, str):
            raise NotPeriodic(first)
        fixed(done, i1)
        out_t.extend(found[0])
        out_n.extend(found[1])
        done, j = i2, j + 1
    fixed(done, len(t0))
    return out_t, np.concatenate(out_n) if out_n else n0[:0]


def _rows(tr: Trace, depth: int, blocks: str = COURSE_BLOCKS) -> dict[str, tuple[list, np.ndarray]]:
    """Every sequence of ``tr`` as (tokens, numbers) rows."""
    names = tr.timeline.module_names
    roles = [_role_name(n, depth, blocks) for n in names]
    seqs: dict[str, tuple[list, list]] = {}
    seqs["module names"] = ([r for r, _ in roles], [(b,) for _, b in roles])
    ids = np.r_[tr.baseline_ids, tr.alloc_ids].astype(np.int64)
    deltas = np.r_[tr.baseline_bytes, tr.alloc_deltas].astype(np.int64)
    n0 = len(tr.baseline_ids)
    tl = tr.timeline
    step = np.r_[np.zeros(n0, dtype=np.int64), tl.step]
    phase = np.r_[np.zeros(n0, dtype=np.int64), tl.phase]
    module = np.r_[np.zeros(n0, dtype=np.int64), tl.module]
    first = np.zeros(len(ids), dtype=bool)
    _, born = np.unique(ids, return_index=True)
    first[born] = True
    # how many rows back the storage a row frees was allocated, when that is a few (a storage that lives long can
    # outlive blocks, so its distance grows with depth): it tells apart rows that look alike otherwise
    back = np.arange(len(ids)) - born[np.searchsorted(np.unique(ids), ids)]
    back = np.where(back <= _NEAR, back, -1)
    cat, amod = tr.alloc_category[ids], tr.alloc_module[ids]
    role_of = _patterns(blocks)[1]

    def allocated_by(i: int):  # a neighbouring block's module as its offset (rows free the previous and next's)
        (name, b), here = roles[amod[i]], roles[module[i]][1]
        if b < 0 or here < 0 or abs(b - here) > 1:
            return name
        match = role_of.search(name)
        return b - here, name[: match.start(2)] + "~" + name[match.end(2) :]

    seqs["events"] = (
        [
            (i < n0, int(step[i]), int(phase[i]), roles[module[i]][0], int(deltas[i]), int(cat[i]),
             allocated_by(i), bool(first[i]), int(back[i]))
            for i in range(len(ids))
        ],
        list(zip(module.tolist(), ids.tolist(), amod.tolist(), deltas.tolist())),
    )  # fmt: skip
    ev = seqs["events"][0]

    def near(i: int):  # the event row at ``i`` (a mark's neighbours tell apart marks that look alike otherwise)
        return ev[i] if 0 <= i < len(ev) else None

    seqs["phase marks"] = (
        [(m.step, m.phase, near(n0 + m.index - 1), near(n0 + m.index)) for m in tr.phase_marks],
        [(m.index,) for m in tr.phase_marks],
    )
    saved = [(s, _role_name(s.module, depth, blocks)) for s in tr.saved]
    rows = [(s.step, r, s.shape, str(s.dtype), s.bytes, s.storage_bytes, s.category) for s, (r, _) in saved]
    seqs["saved tensors"] = (
        [(*row, n) for row, n in zip(rows, _passes(rows))],
        [(b, s.storage) for s, (_, b) in saved],
    )
    grads = [(a, _role_name(p, depth, blocks)) for a, p in tr.grad_param.items()]
    seqs["gradients"] = ([r for _, (r, _) in grads], [(b, a) for a, (_, b) in grads])
    return {k: (t, np.array(n, dtype=np.int64).reshape(len(t), -1)) for k, (t, n) in seqs.items()}


def _passes(rows: list[tuple]) -> list[int]:
    """Each saved-tensor row's pass of its step: how many times its step's first row has come so far (from 1).
    Gradient accumulation runs a step's forward once per micro-batch, each saving the same rows; numbered, the
    passes cannot be aligned into one another (a block of one pass matched to the next pass's)."""
    first: dict = {}
    seen: dict = {}
    out = []
    for row in rows:
        step = row[0]
        first.setdefault(step, row)
        if row == first[step]:
            seen[step] = seen.get(step, 0) + 1
        out.append(seen[step])
    return out


def _build(rows: dict[str, tuple[list, np.ndarray]], like: Trace, started: float, blocks: str = COURSE_BLOCKS) -> Trace:
    """The Trace a recorder would build from these rows (``like``: a recorded trace, for its device and dtypes)."""
    names = [_named(r, int(b), blocks) for r, (b,) in zip(*rows["module names"])]
    toks, nums = rows["events"]
    is_base = np.array([t[0] for t in toks], dtype=bool)
    n_baseline = int(is_base.sum())
    if is_base[n_baseline:].any():
        raise NotPeriodic("the baseline storages are not all before the step's samples")
    ids = nums[:, 1]
    order, where = np.unique(ids, return_index=True)
    if not np.array_equal(order, np.arange(len(order))) or not np.all(np.diff(where) > 0):
        raise NotPeriodic("the allocation ids are not numbered in the order the storages first appear")
    alloc_category = np.array([toks[i][5] for i in where], dtype=np.int64)
    alloc_module = nums[where, 2]
    n = len(toks)
    total_ns = int((time.perf_counter() - started) * 1e9)
    time_ns = np.arange(n, dtype=np.int64) * total_ns // max(n, 1)
    cols = {
        "time_ns": time_ns,
        "alloc_id": ids,
        "delta": nums[:, 3],
        "step": np.array([t[1] for t in toks], dtype=np.int64),
        "phase": np.array([t[2] for t in toks], dtype=np.int64),
        "module": nums[:, 0],
    }
    events = np.stack([cols[f] for f in Event._fields], axis=1)
    marks = [
        PhaseMark(index=int(i) + n_baseline, time_s=float(time_ns[min(int(i) + n_baseline, n - 1)]) / 1e9,
                  step=s, phase=ph)
        for (s, ph, *_), (i,) in zip(*rows["phase marks"])
    ]  # fmt: skip
    dtypes = {str(s.dtype): s.dtype for s in like.saved}
    saved = [
        SavedTensor(step=st, module=_named(r, int(b), blocks), shape=shape, dtype=dtypes[dt], bytes=nb,
                    storage=int(a), storage_bytes=sb, category=c)
        for (st, r, shape, dt, nb, sb, c, _), (b, a) in zip(*rows["saved tensors"])
    ]  # fmt: skip
    grad_param = {int(a): _named(r, int(b), blocks) for r, (b, a) in zip(*rows["gradients"])}
    return Trace.from_events(
        events=events,
        n_baseline=n_baseline,
        start_ns=0,
        alloc_category=alloc_category,
        alloc_module=alloc_module,
        module_names=names,
        phase_marks=marks,
        saved=saved,
        grad_param=grad_param,
        device=like.device,
        duration_s=total_ns / 1e9,
        kernel_scratch_recorded=like.kernel_scratch_recorded,
    )


def trace_differences(fast: Trace, full: Trace) -> list[str]:
    """What differs between two traces, wall times aside (empty: the same); for the tests and the benchmark."""
    a, b = fast.timeline, full.timeline
    checks = {
        "module names": a.module_names == b.module_names,
        **{f"timeline.{f}": np.array_equal(getattr(a, f), getattr(b, f)) for f in ("step", "phase", "module", "bytes")},
        **{
            f: np.array_equal(getattr(fast, f), getattr(full, f))
            for f in ("alloc_ids", "alloc_deltas", "alloc_category", "alloc_module", "baseline_ids", "baseline_bytes")
        },
        "baseline": fast.baseline == full.baseline,
        "phases": fast.phases() == full.phases(),  # each phase's span, peak (bytes, moment, module, breakdown), end
        "step peaks": [fast.peak(step=s) for s in full.steps] == [full.peak(step=s) for s in full.steps],
        "peak": fast.peak() == full.peak(),
        "phase marks": [(m.index, m.step, m.phase) for m in fast.phase_marks]
        == [(m.index, m.step, m.phase) for m in full.phase_marks],
        "saved": fast.saved == full.saved,
        "grad_param": fast.grad_param == full.grad_param,
        "table": fast.table() == full.table(),
    }
    return [name for name, same in checks.items() if not same]


def too_shallow(depth: int, name: str = "n_layer") -> str | None:
    """Why a model ``depth`` blocks deep is dry-run in full (None: it is deep enough for the period); ``name``:
    what its configuration calls the depth."""
    if depth <= DEPTHS[-1]:
        return f"{name} {depth} is at most {DEPTHS[-1]}, the deepest run the period is read from"
    return None


def _refused_before(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` is dry-run in full without trying the period (None: try it)."""
    if why := too_shallow(cfg.n_layer):
        return why
    if cfg.checkpoint == "every_k" and cfg.checkpoint_every > 1:
        return f"checkpoint every_k with checkpoint_every {cfg.checkpoint_every} > 1 groups blocks into segments"
    return None


def periodic_trace(
    run_at: Callable[[int], Trace], depth: int, blocks: str = COURSE_BLOCKS, started: float | None = None
) -> Trace:
    """The Trace ``run_at(depth)`` would record, built from ``run_at(d)`` for d in :data:`DEPTHS` (see the module's
    docstring); raises NotPeriodic where the recorded rows do not repeat block by block.

    ``run_at(d)``: the same step's Trace with ``d`` blocks (a dry run of any model: the course GPT, one rank of a
    parallel job, a Hugging Face model); ``blocks``: the name of its list of blocks in module names (``blocks``
    for the course GPT: ``blocks.3.attn``; ``layers`` for most Hugging Face models: ``model.layers.3.mlp``);
    ``depth`` > the deepest of DEPTHS. ``started``: a ``time.perf_counter()`` the evenly spread wall times count
    from (default: now).
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth <= DEPTHS[-1]:
        raise ValueError(f"depth must be an integer above {DEPTHS[-1]}, the deepest run the period is read from")
    started = time.perf_counter() if started is None else started
    traces = [run_at(d) for d in DEPTHS]
    rows = [_rows(tr, d, blocks) for tr, d in zip(traces, DEPTHS)]
    out = {k: _extrapolate([r[k][0] for r in rows], [r[k][1] for r in rows], depth - DEPTHS[0], k) for k in rows[0]}
    return _build(out, traces[0], started, blocks)


def periodic_dry_run(cfg: ModelConfig, **run) -> tuple[Trace, str | None]:
    """``dry_run_config(cfg, **run)``'s Trace, built from dry runs at depths 3, 4 and 5; and None, or why it ran
    the full dry run instead (see the module's docstring). ``run``: dry_run_config's other keywords.

    The timeline (samples' steps, phases, modules, bytes per category), the allocations, phase marks, saved
    tensors and gradients equal the full dry run's; the wall times do not (they are spread evenly).
    """
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    started = time.perf_counter()
    why = _refused_before(cfg)
    if why is None:
        try:
            trace = periodic_trace(lambda d: dry_run_config(dataclasses.replace(cfg, n_layer=d), **run), cfg.n_layer,
                                   started=started)  # fmt: skip
            return trace, None
        except NotPeriodic as e:
            why = str(e)
    return dry_run_config(cfg, **run), f"full dry run: {why}"
