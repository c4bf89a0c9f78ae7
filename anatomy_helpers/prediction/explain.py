"""The anatomy of a learner's own run: :func:`explain` reads a CUDA memory snapshot or a torch.profiler trace of a
training script that used no course code and says, in the course's terms, what its steps held.

From the recording (:mod:`anatomy_helpers.prediction.explain_read`) to the answer, three stages:

1. **Steps and phases** (:func:`cut_steps`). Each event's stack (a snapshot) or time (a profiler trace) says
   forward (inside ``Module._call_impl``), backward (``Tensor.backward``, autograd's engine), optimizer
   (``torch/optim/``, ``zero_grad``) or none of these. A step starts at the first forward event after a
   backward or an optimizer event; every event up to its first forward since the last busy one (data loading)
   is that step's idle. *Heuristics*: events with no stack (backward's work on autograd's device thread when
   only Python stacks are recorded) take the phase of the events before them; anything the script does between
   the model's forward and ``backward()`` (the loss, if computed outside the model) counts as forward; with
   gradient accumulation each micro-batch is a step.
2. **Categories from lifetimes** (:func:`classify`), in the spirit of ``torch/profiler/_memory_profiler.py``'s
   categories (which infer them from data flow; a snapshot has only lifetimes and stacks). Per allocation:

   * alive before the recording began and still alive at its end: **parameters**, when the recording saw the
     optimizer's first step make its state; otherwise **unclassified** (parameters and earlier steps' optimizer
     state cannot be told apart). *Heuristic*: anything else the script put on the device before (a dataset)
     counts as parameters. A CUDA profile gives only the sum of what was alive before it: **unclassified**;
     a CPU profile does not see it at all;
   * made outside the step's code (data loading): **inputs**; made while a module is built: **parameters**;
   * made in forward, freed in the same step's backward: **activations**; freed in forward: **temporaries**;
     kept past backward (the loss, outputs the script holds): **temporaries**; never freed although later steps
     ran: **unclassified** (no tensor of a step lives that long: a library's workspace, named when its size is a
     cuBLAS workspace's, ``prediction/cuda_rules.py``);
   * made in backward: freed in backward: **temporaries** (what autograd passes between ops; made by
     ``torch/utils/checkpoint.py``'s recomputation: **recomputed**); freed by ``zero_grad``, or of a parameter's
     size, or alive at the end of the last step: **gradients**; else **unclassified**;
   * made in the optimizer phase: freed in its step: **temporaries**; alive into the next step: **optimizer
     state**.

   All of these are heuristics on lifetimes: a tensor that outlives its usual span (an activation kept for
   logging) is put where its lifetime says.
3. **The answer** (:class:`Explanation`): each phase's peak with its categories, step 1 against step 2 (optimizer
   state appearing, reserved memory and segments growing), allocated against reserved at the peak, the phase that
   would run out first on a named device (prediction/devices.py) and the catalogue's levers for the category that
   dominates it (prediction/levers.py).

Bytes everywhere; times in microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.model import ModelConfig
from ..core.tables import Col, format_table
from ..core.units import MiB
from ..tracking.events import CATEGORIES, PHASES, PhaseMark, Timeline
from ..tracking.trace import Trace
from .cuda_rules import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_SM90, CUBLASLT_WORKSPACE
from .devices import DEFAULT_GPU, Device, get_device
from .explain_read import (
    BWD,
    FWD,
    IDLE,
    LABELS,
    MODULE_INIT,
    OPT,
    RECOMPUTE,
    ZERO_GRAD,
    MemoryEvents,
    load_recording,
    snapshot_events,
)
from .explain_trace import trace_events
from .levers import levers

UNCLASSIFIED = "unclassified"
#: The course's categories and, last, what the lifetime rules cannot place (stated as such, never guessed).
EXPLAIN_CATEGORIES = (*CATEGORIES, UNCLASSIFIED)
_U = len(CATEGORIES)
_CAT = {c: i for i, c in enumerate(EXPLAIN_CATEGORIES)}
_IDLE, _FWD, _BWD, _OPT = (PHASES.index(p) for p in ("idle", "forward", "backward", "optimizer"))
NO_MODULE_KNOWN = "(no module: explained from a recording)"
WORKSPACES = {
    CUBLAS_WORKSPACE_SM90: "cuBLAS workspace (compute capability 9.0)",
    CUBLAS_WORKSPACE: "cuBLAS workspace",
    CUBLASLT_WORKSPACE: "cuBLASLt workspace",
}


class NoStepsError(ValueError):
    """A recording in which no training step (a forward and a backward) was found."""


def cut_steps(label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(step, phase index into PHASES) of every row from its label (explain_read's codes); step 0 is before the
    first forward (a recording that begins inside a step)."""
    n = len(label)
    step = np.zeros(n, dtype=np.int64)
    phase = np.zeros(n, dtype=np.int64)
    s, ph, last_busy = 0, _IDLE, -1
    for i, lab in enumerate(label.tolist()):
        if lab == FWD:
            if ph != _FWD:
                s, ph = s + 1, _FWD
                step[last_busy + 1 : i] = s  # the idle rows since the last busy one: this step's data loading
        elif lab == BWD:
            ph = _BWD
        elif lab == OPT:
            ph = _OPT
        elif lab == IDLE and ph != _FWD:
            ph = _IDLE
        step[i], phase[i] = s, ph
        if ph != _IDLE:
            last_busy = i
    return step, phase


@dataclass
class Lifetimes:
    """Each allocation of a recording: its rows (``alloc`` -1: alive before the recording; ``free`` -1: alive at
    its end), its bytes and its category (index into EXPLAIN_CATEGORIES), and why an unclassified one is."""

    alloc: np.ndarray
    free: np.ndarray
    size: np.ndarray
    category: np.ndarray
    reason: dict[int, str]  # allocation index -> why it is unclassified
    row_alloc: np.ndarray  # per row: the allocation it makes or frees


def _lifetimes(ev: MemoryEvents) -> tuple[list, list, list, np.ndarray]:
    open_at: dict[int, int] = {}
    alloc, free, size = [], [], []
    row_alloc = np.empty(len(ev), dtype=np.int64)
    for i, (a, d) in enumerate(zip(ev.addr.tolist(), ev.delta.tolist())):
        if d > 0:
            open_at[a] = len(alloc)
            alloc.append(i), free.append(-1), size.append(d)
            row_alloc[i] = len(alloc) - 1
        else:
            k = open_at.pop(a, None)
            if k is None:  # freed, never allocated here: alive before the recording
                alloc.append(-1), free.append(i), size.append(-d)
                k = len(alloc) - 1
            else:
                free[k] = i
            row_alloc[i] = k
    for b in ev.alive_before:
        alloc.append(-1), free.append(-1), size.append(b)
    return alloc, free, size, row_alloc


def classify(ev: MemoryEvents, step: np.ndarray, phase: np.ndarray) -> Lifetimes:
    """Every allocation's category by the rules of this module's docstring (heuristics, stated there)."""
    alloc, free, size, row_alloc = _lifetimes(ev)
    last = int(step.max()) if len(step) else 0
    flags = ev.flags.tolist()
    st, ph = step.tolist(), phase.tolist()
    cat = np.full(len(alloc), _U, dtype=np.int64)
    reason: dict[int, str] = {}
    made_state = False
    param_sizes: set[int] = set()
    for k, (i, j, b) in enumerate(zip(alloc, free, size)):
        if i < 0:
            continue
        a_step, a_ph = st[i], ph[i]
        f_same = j >= 0 and st[j] == a_step
        if a_ph == _IDLE:
            cat[k] = _CAT["parameters"] if flags[i] & MODULE_INIT else _CAT["inputs"]
            if flags[i] & MODULE_INIT:
                param_sizes.add(b)
        elif a_ph == _FWD:
            if f_same and ph[j] == _BWD:
                cat[k] = _CAT["activations"]
            elif j < 0 and a_step < last:
                reason[k] = f"made in step {a_step}'s forward, never freed" + _workspace(b)
            else:
                cat[k] = _CAT["temporaries"]
        elif a_ph == _OPT:
            if f_same and ph[j] in (_OPT, _IDLE):
                cat[k] = _CAT["temporaries"]
            else:
                cat[k] = _CAT["optimizer_state"]
                made_state = True
    first = min((st[i] for i in alloc if i >= 0 and st[i] > 0), default=1)
    saw_first_state = made_state and _state_in(cat, alloc, st, first)
    for k, (i, j, b) in enumerate(zip(alloc, free, size)):
        if i >= 0:
            continue
        if j >= 0:
            if flags[j] & ZERO_GRAD:
                cat[k] = _CAT["gradients"]
            else:
                reason[k] = f"alive before the recording began, freed in step {st[j]}'s {PHASES[ph[j]]}"
        elif ev.before_is_a_sum:
            reason[k] = (
                "alive before the profile began: parameters and whatever else the process held (a library's "
                "workspaces, earlier steps' state); a profile gives only their sum"
            )
        elif saw_first_state:
            cat[k] = _CAT["parameters"]
            param_sizes.add(b)
        else:
            reason[k] = (
                "alive before the recording began: parameters, and optimizer state from steps before it, which "
                "lifetimes cannot tell apart (the recording's first step makes no optimizer state: it began after the "
                "optimizer's first step, or the optimizer keeps none, as SGD without momentum)"
            )
    for k, (i, j, b) in enumerate(zip(alloc, free, size)):
        if i < 0 or ph[i] != _BWD:
            continue
        if flags[i] & RECOMPUTE:
            cat[k] = _CAT["recomputed"]
        elif j >= 0 and st[j] == st[i] and ph[j] == _BWD:
            cat[k] = _CAT["temporaries"]
        elif (j >= 0 and flags[j] & ZERO_GRAD) or b in param_sizes or (j < 0 and st[i] == last):
            cat[k] = _CAT["gradients"]
        else:
            reason[k] = f"made in step {st[i]}'s backward, kept past it, no parameter of its size" + _workspace(b)
    return Lifetimes(np.asarray(alloc), np.asarray(free), np.asarray(size), cat, reason, row_alloc)


def _state_in(cat: np.ndarray, alloc: list, st: list, first: int) -> bool:
    """Whether the recording's first step made optimizer state (so it saw the optimizer's first step)."""
    return any(c == _CAT["optimizer_state"] and i >= 0 and st[i] == first for c, i in zip(cat.tolist(), alloc))


def _workspace(nbytes: int) -> str:
    name = WORKSPACES.get(nbytes)
    return f" (the size of a {name}: prediction/cuda_rules.py)" if name else ""


# ---- the timeline ---------------------------------------------------------------------------------------------


@dataclass
class Explained:
    """A recording's samples as a :class:`Trace` (the course's window and peak queries) and the bytes the rules
    could not place: the Trace's ``timeline.bytes`` holds the course's categories, its ``timeline.total`` every
    byte (``unclassified`` included, per sample)."""

    events: MemoryEvents
    trace: Trace
    unclassified: np.ndarray
    lifetimes: Lifetimes

    def at(self, index: int) -> dict[str, int]:
        """Bytes per category of EXPLAIN_CATEGORIES after sample ``index``."""
        return {**self.trace.at(index), UNCLASSIFIED: int(self.unclassified[index])}

    def reasons_at(self, index: int) -> dict[str, int]:
        """The unclassified bytes alive after sample ``index``, by why each is unclassified."""
        lt = self.lifetimes
        born = np.where(lt.alloc < 0, -1, lt.alloc)
        alive = (born <= index) & ((lt.free < 0) | (lt.free > index))
        out: dict[str, int] = {}
        for k, why in lt.reason.items():
            if alive[k]:
                out[why] = out.get(why, 0) + int(lt.size[k])
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def explain_events(ev: MemoryEvents) -> Explained:
    """Cut ``ev`` into steps and phases, classify its allocations and build the timeline (see the module's rules)."""
    if len(ev) == 0:
        raise NoStepsError(f"{ev.source}: the recording holds no allocation or free")
    step, phase = cut_steps(ev.label)
    if not (phase == _FWD).any() or not (phase == _BWD).any():
        raise NoStepsError(
            f"{ev.source}: no training step found (a forward followed by a backward): {_label_counts(ev)}"
        )
    lt = classify(ev, step, phase)
    n, k = len(ev), len(EXPLAIN_CATEGORIES)
    before = np.zeros(k, dtype=np.int64)
    np.add.at(before, lt.category[lt.alloc < 0], lt.size[lt.alloc < 0])
    deltas = np.zeros((n, k), dtype=np.int64)
    deltas[np.arange(n), lt.category[lt.row_alloc]] = ev.delta
    nbytes = before + np.cumsum(deltas, axis=0)
    t0 = float(ev.time_us[0])
    tl = Timeline(
        time_s=(ev.time_us - t0) / 1e6,
        step=step,
        phase=phase,
        module=np.zeros(n, dtype=np.int64),
        bytes=nbytes[:, :_U],
        module_names=[NO_MODULE_KNOWN],
        cuda_reserved=ev.reserved,
    )
    tl.total = nbytes.sum(axis=1)  # every byte, the unclassified ones included
    key = step * len(PHASES) + phase
    changes = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    marks = [PhaseMark(int(i), float(tl.time_s[i]), int(step[i]), PHASES[phase[i]]) for i in changes]
    device = "cpu" if ev.reserved is None else "cuda"  # only a CUDA recording has the allocator's reserved bytes
    return Explained(ev, Trace.from_samples(tl, marks, device=device), nbytes[:, _U].copy(), lt)


def _label_counts(ev: MemoryEvents) -> str:
    counts = np.bincount(ev.label, minlength=len(LABELS))
    return ", ".join(f"{c:,} events {name}" for name, c in zip(LABELS, counts.tolist()) if c)


# ---- the answer -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseRow:
    """One phase of one step: its span (microseconds on the recording's clock), its peak and what made it up."""

    step: int
    phase: str
    start_us: float
    end_us: float
    peak: int  # bytes alive at the phase's peak (every category, unclassified included)
    reserved: int | None  # the allocator's reserved bytes at that moment (None: the format does not say)
    breakdown: dict[str, int]  # bytes per EXPLAIN_CATEGORIES name at the peak


@dataclass(frozen=True)
class StepRow:
    """One training step: its peak, the most it reserved, the optimizer state it made and the segments it grew."""

    step: int
    peak: int
    peak_phase: str
    reserved_max: int | None
    reserved_growth: int | None  # reserved bytes at the step's end minus at its start: new segments
    state_made: int  # bytes of optimizer state allocated in this step


@dataclass
class Explanation:
    """What :func:`explain` says of a recording (bytes)."""

    source: str
    kind: str
    device: str
    usable: int  # bytes the device leaves PyTorch's allocator (devices.py: total - CUDA context)
    phases: list[PhaseRow]
    steps: list[StepRow]
    peak: PhaseRow
    unclassified_at_peak: dict[str, int]  # why, -> bytes
    runs_out_first: PhaseRow
    need_kind: str  # "reserved" or "allocated": which figure runs_out_first is judged by
    dominant: str
    levers: list[tuple[str, str, str]]  # (name, effect, note) from the lever catalogue
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        need = self.runs_out_first.reserved if self.need_kind == "reserved" else self.runs_out_first.peak
        return need <= self.usable

    def to_dict(self) -> dict:
        """The answer as plain data for ``--json`` (bytes, microseconds)."""
        row = lambda r: r.__dict__  # noqa: E731
        return {
            "source": self.source,
            "kind": self.kind,
            "device": self.device,
            "usable_bytes": self.usable,
            "steps": [row(s) for s in self.steps],
            "phases": [row(p) for p in self.phases],
            "peak": row(self.peak),
            "unclassified_at_peak": self.unclassified_at_peak,
            "runs_out_first": {**row(self.runs_out_first), "judged_by": self.need_kind, "fits": self.fits},
            "dominant": self.dominant,
            "levers": [{"name": n, "effect": e, "note": t} for n, e, t in self.levers],
            "notes": self.notes,
        }

    def table(self, times: bool = True) -> str:
        """The phase x category table, the step-1-against-step-2 lines, the peak, the device and the levers; the
        recording is named by its file name. ``times=False`` leaves out each phase's span in ms (a wall time: a
        notebook compares every other figure of the table from run to run)."""
        shown = [c for c in EXPLAIN_CATEGORIES if any(p.breakdown[c] >= MiB / 200 for p in self.phases)]
        cols = [Col("step", 4), Col("phase", 9, align="<"), *([Col("ms", 7, ".1f")] if times else [])]
        cols += [Col(c.replace("_", " "), max(9, len(c)), ".2f") for c in shown]
        cols += [Col("total", 8, ".2f"), Col("reserved", 8, ".2f")]
        rows = [
            (p.step, p.phase, *([(p.end_us - p.start_us) / 1e3] if times else []),
             *(p.breakdown[c] / MiB for c in shown), p.peak / MiB, None if p.reserved is None else p.reserved / MiB)
            for p in self.phases
        ]  # fmt: skip
        out = [f"{self.kind}: {Path(self.source).name}", format_table(cols, rows, note="(MiB at each phase's peak)")]
        out += [_step_line(s) for s in self.steps]
        out.append(_peak_line(self.peak))
        out += [f"  unclassified: {b / MiB:.2f} MiB {why}" for why, b in self.unclassified_at_peak.items()]
        r = self.runs_out_first
        need = r.reserved if self.need_kind == "reserved" else r.peak
        verdict = "fits" if self.fits else "does NOT fit"
        out.append(
            f"on {self.device} ({self.usable / MiB:,.0f} MiB usable): step {r.step}'s {r.phase} runs out first, "
            f"{need / MiB:.1f} MiB {self.need_kind}: {verdict} ({(self.usable - need) / MiB:+,.1f} MiB)"
        )
        out.append(f"levers for its dominant category, {self.dominant} (the catalogue's, prediction/levers.py):")
        out += [f"  {n} [{e}]: {t}" for n, e, t in self.levers] or ["  none acts on it"]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


def _step_line(s: StepRow) -> str:
    res = "" if s.reserved_max is None else f", reserved up to {s.reserved_max / MiB:.1f} MiB"
    grew = "" if s.reserved_growth is None else f" (segments grew {s.reserved_growth / MiB:+.1f} MiB)"
    state = f", made {s.state_made / MiB:.2f} MiB of optimizer state" if s.state_made else ""
    return f"step {s.step}: peak {s.peak / MiB:.2f} MiB in {s.peak_phase}{res}{grew}{state}"


def _peak_line(p: PhaseRow) -> str:
    if p.reserved is None:
        return f"peak: {p.peak / MiB:.2f} MiB in step {p.step}'s {p.phase} (reserved: not in this format)"
    gap = p.reserved - p.peak
    return (
        f"peak: {p.peak / MiB:.2f} MiB allocated in step {p.step}'s {p.phase}, {p.reserved / MiB:.2f} MiB reserved: "
        f"{gap / MiB:.2f} MiB ({gap / max(p.reserved, 1):.0%}) reserved but not allocated (block rounding, cached "
        "free blocks: fragmentation)"
    )


def explain_recording(ex: Explained, device: str | int | Device = DEFAULT_GPU) -> Explanation:
    """The answer for an explained recording on ``device`` (a devices.py name, bytes or a Device)."""
    dev = get_device(device)
    tr, tl = ex.trace, ex.trace.timeline
    reserved = tl.cuda_reserved
    rows = []
    for ph in tr.phases():
        if ph.phase == "idle" or ph.step == 0:
            continue
        i = ph.peak.index
        rows.append(
            PhaseRow(ph.step, ph.phase, float(ex.events.time_us[ph.start]), float(ex.events.time_us[ph.end]),
                     int(tl.total[i]), None if reserved is None else int(reserved[i]), ex.at(i))
        )  # fmt: skip
    steps = []
    state = ex.lifetimes.category == _CAT["optimizer_state"]
    made = ex.lifetimes.alloc[state]
    for s in tr.training_steps():
        mine = [r for r in rows if r.step == s]
        top = max(mine, key=lambda r: r.peak)
        w = tr.window(step=s)
        res_max = None if reserved is None else int(reserved[w].max())
        start = ex.events.reserved_before if w[0] == 0 else None
        if reserved is not None and start is None:
            start = reserved[w[0] - 1] if w[0] else reserved[0]
        growth = None if reserved is None else int(reserved[w[-1]] - start)
        made_here = int(ex.lifetimes.size[state][(made >= 0) & (tl.step[np.maximum(made, 0)] == s)].sum())
        steps.append(StepRow(s, top.peak, top.phase, res_max, growth, made_here))
    peak = max(rows, key=lambda r: r.peak)
    need_kind = "reserved" if reserved is not None else "allocated"
    first = max(rows, key=lambda r: (r.reserved if need_kind == "reserved" else r.peak, r.peak))
    dominant = max(CATEGORIES, key=first.breakdown.get)
    chosen = [(lv.name, lv.effect, lv.note) for lv in levers(ModelConfig(), device=dev) if dominant in lv.acts_on]
    notes = list(ex.events.notes)
    if first.breakdown[UNCLASSIFIED] > first.breakdown[dominant]:
        notes.append(f"at step {first.step}'s {first.phase} peak the unclassified bytes outweigh {dominant}")
    if ex.events.kind.endswith("CUDA memory snapshot"):
        notes.append(
            "allocated = the bytes tensors asked for (a snapshot's events record requested sizes); "
            "torch.cuda.max_memory_allocated counts whole blocks (rounded to 512 bytes, large ones unsplit), a "
            "few MiB more"
        )
    if ex.events.oom_rows:
        notes.append(f"the recording holds {len(ex.events.oom_rows)} out-of-memory event(s)")
    notes.append(
        f"judged on {dev.name} by the bytes this recording holds: on a GPU other than the one it was recorded on, "
        "cuBLAS's workspaces, kernels and the allocator's rounding may differ"
    )
    notes.append("levers are the course catalogue's for its GPT: check that each applies to your model")
    return Explanation(
        ex.events.source, ex.events.kind, dev.name, dev.usable, rows, steps, peak,
        ex.reasons_at(_peak_index(tr, peak)), first, need_kind, dominant, chosen, notes,
    )  # fmt: skip


def _peak_index(tr: Trace, row: PhaseRow) -> int:
    return tr.phase(row.step, row.phase).peak.index


def explain(path: str | Path, device: str | int | Device = DEFAULT_GPU) -> Explanation:
    """Explain the recording at ``path``: a CUDA memory snapshot pickle (``torch.cuda.memory._dump_snapshot``) or a
    torch.profiler chrome trace (``prof.export_chrome_trace``, recorded with ``profile_memory=True``). ``device``:
    the GPU to judge it on (prediction/devices.py; default a T4). ValueError naming the file for anything it
    cannot read (:class:`~anatomy_helpers.prediction.explain_read.RecordingError`) or without a training step
    (:class:`NoStepsError`). Bytes everywhere."""
    return explain_recording(load_explained(path), device)


def load_explained(path: str | Path) -> Explained:
    """The recording at ``path`` read, cut into steps and phases and classified (what :func:`explain` answers
    from, and what ``ui/explain_plot.py`` draws); the same errors as :func:`explain`."""
    kind, obj = load_recording(path)
    ev = snapshot_events(obj, str(path)) if kind == "snapshot" else trace_events(obj, str(path))
    return explain_events(ev)
