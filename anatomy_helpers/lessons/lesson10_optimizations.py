"""Notebook 10: shrink the phase that runs out. Two steps whose peak lands in a known phase (the optimizer's, the
backward's), the category that dominates it, and the levers that act on that category, each measured by a real
tracked run (the levers themselves: ``step.OptimizerInBackward``, ``model.chunked_cross_entropy``,
``train.AdamWBF16State``, ``train.adamw_8bit``; the decision: ``prediction/levers.py``). Bytes unless a name says
otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ..core.data import get_batch
from ..core.model import ModelConfig
from ..core.tables import Col, format_table
from ..core.units import MiB, pick_unit
from ..prediction.cuda import cuda_warm_up
from ..prediction.levers import EFFECTS, Lever, dominant, levers
from ..tracking.profiler import load_memory_timeline, quiet_profiler
from ..tracking.trace import Trace
from ..training.step import StepPlan, run_step, step_flops
from ..training.train import make_model, make_optimizer, pick_device, track_steps
from ..ui.plots import plot_timelines

#: A step whose optimizer phase runs out: many parameters, one short sequence (Adam's state dominates its peak).
OPTIMIZER_BOUND = dict(n_layer=2, d_model=128, n_head=2, seq_len=8)
OPTIMIZER_BATCH = 1
#: A step whose backward runs out: a large vocabulary (its fp32 logits and their gradient dominate).
LOGITS_BOUND = dict(n_layer=1, d_model=32, n_head=2, seq_len=64, vocab_size=4096)
LOGITS_BATCH = 4
#: compile_memory on LOGITS_BOUND, recorded by scripts/record_compile_reference.py (package data: Colab has it too).
COMPILE_REFERENCE = Path(__file__).with_name("compile_reference.json")

BASELINE = Lever("baseline (AdamW)", (), "time only", "the step as it is")
#: Levers the notebook measures beside prediction/levers.py's: one that costs memory, and a library's 8-bit state.
KEEP_GRADIENTS = Lever(
    "zero_grad(set_to_none=False)",
    ("gradients",),
    "time only",
    "gradients zeroed, not freed: alive between steps",
    step={"set_to_none": False},
)
EIGHT_BIT = Lever(
    "8-bit state (bitsandbytes)",
    ("optimizer_state",),
    "numerics",
    "bitsandbytes' AdamW8bit: uint8 moments + a float32 scale per 256 from 4,096 elements on (min_8bit_size), "
    "float32 moments below",
    step={"optimizer": "adamw8bit"},
)
#: Lesson 03's implementations as levers (the baseline is torch's default: single-tensor on a CPU, foreach on CUDA).
SINGLE_TENSOR = Lever(
    "single-tensor optimizer", ("temporaries",), "time only", "a loop over parameters", step={"foreach": False}
)
FOREACH = Lever(
    "foreach optimizer", ("temporaries",), "time only", "each op on every parameter at once", step={"foreach": True}
)
#: torch.autograd.graph.save_on_cpu around the blocks (checkpointing.offload_context: pinned host memory on a GPU).
OFFLOAD = Lever(
    "save_on_cpu offload",
    ("activations",),
    "time only",
    "the blocks' saved tensors copied to pinned host memory in forward, back in backward; on a GPU only (on a CPU "
    "they are in host memory already, and save_on_cpu(pin_memory=True) would copy them)",
    config={"checkpoint": "offload"},
)
#: Gradient accumulation (lesson 08): the logits-bound batch as micro-batches of one row, one optimizer step.
MICRO_BATCHES = Lever(
    f"micro-batches x{LOGITS_BATCH}",
    ("activations", "temporaries"),
    "time only",
    f"{LOGITS_BATCH} micro-batches of batch/{LOGITS_BATCH} rows, gradients accumulated",
    step={"micro_batches": LOGITS_BATCH},
)
_LESSON_LEVERS = (BASELINE, KEEP_GRADIENTS, EIGHT_BIT, SINGLE_TENSOR, FOREACH, OFFLOAD, MICRO_BATCHES)
_OPTIMIZER_ARGS = ("optimizer", "fused", "foreach", "in_backward")  # a lever's options that make the optimizer
#: The lesson's two steps by name (the panel's choices): (configuration, batch size).
CONFIGS = {"optimizer-bound": (OPTIMIZER_BOUND, OPTIMIZER_BATCH), "logits-bound": (LOGITS_BOUND, LOGITS_BATCH)}


def has_bitsandbytes() -> bool:
    """Whether the optional 8-bit optimizer (bitsandbytes, the ``[levers]`` extra) is installed here."""
    return importlib.util.find_spec("bitsandbytes") is not None


def lever_named(name: str, cfg: dict) -> Lever:
    """The lever of prediction/levers.py (for ``cfg``) whose name starts with ``name``, or one of this lesson's."""
    for lever in [*levers(_config(cfg)), *_LESSON_LEVERS]:
        if lever.name.startswith(name):
            return lever
    raise ValueError(f"no lever named {name!r}")


def _config(cfg: dict):

    return ModelConfig(**cfg)


def run_lever(
    cfg: dict, batch_size: int, lever: Lever, steps: int = 2, device=None
) -> tuple[Trace, torch.optim.Optimizer]:
    """``steps`` tracked AdamW steps of ``cfg`` with ``lever`` applied: (the trace, the optimizer)."""
    model = make_model(device=device, **cfg, **lever.config)
    opt_kw = {k: v for k, v in lever.step.items() if k in _OPTIMIZER_ARGS}
    optimizer = make_optimizer(model, opt_kw.pop("optimizer", "adamw"), **opt_kw)
    plan = {k: v for k, v in lever.step.items() if k not in _OPTIMIZER_ARGS}
    return track_steps(model, optimizer, steps, batch_size, **plan), optimizer


@dataclass(frozen=True)
class LeverRun:
    """One lever's tracked run (:func:`run_lever`): its trace, the parameters its optimizer steps, and on CUDA
    ``torch.cuda.max_memory_allocated`` over the run minus what was allocated before it (None on a CPU)."""

    trace: Trace
    num_params: int
    max_allocated: int | None


_RUNS: dict[tuple, LeverRun] = {}  # lever_run's cache: the last _KEEP runs
_KEEP = 64
_WARM: set[str] = set()  # CUDA devices whose cuBLAS workspaces exist (cuda_warm_up)


def lever_run(cfg: dict, batch_size: int, lever: Lever, device=None) -> LeverRun:
    """:func:`run_lever` (two steps), cached per (``cfg``, ``batch_size``, the lever's name, the device): the notebook's
    cells and its panel that show the same run measure it once (a tracked run of the course GPT is deterministic).

    On CUDA the peak counter is reset before the model is built, after one warm-up step per device (the cuBLAS
    workspaces, kept for the life of the process, would otherwise count in the first run only)."""
    dev = pick_device(device)
    key = (tuple(sorted(cfg.items())), batch_size, lever.name, str(dev))
    if key not in _RUNS:
        cuda = dev.type == "cuda"
        if cuda:
            if str(dev) not in _WARM:
                cuda_warm_up(dev)
                _WARM.add(str(dev))
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
        trace, optimizer = run_lever(cfg, batch_size, lever, device=dev)
        n = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
        if cuda:
            torch.cuda.synchronize(dev)
        allocated = torch.cuda.max_memory_allocated(dev) - before if cuda else None
        del optimizer
        if len(_RUNS) >= _KEEP:
            del _RUNS[next(iter(_RUNS))]
        _RUNS[key] = LeverRun(trace, n, allocated)
    return _RUNS[key]


@dataclass(frozen=True)
class LeverRow:
    """One lever's measured step (bytes at the peak of the whole run)."""

    name: str
    peak: int
    phase: str  # where the peak is now
    dominant: str  # the category holding the most bytes there
    state_per_param: float  # optimizer-state bytes per parameter after the run
    gradients_at_peak: int
    extra_flops: float  # forward + backward FLOPs relative to the baseline's, minus 1 (FlopCounterMode)
    changes_training: bool  # numerics or dynamics: EFFECTS other than "time only"
    max_allocated: int | None = None  # CUDA: torch.cuda.max_memory_allocated over the run (LeverRun)


def measure_levers(
    cfg: dict, batch_size: int, names: list[str], device=None
) -> tuple[list[LeverRow], dict[str, Trace]]:
    """Each named lever (``lever_named``) run for real on ``cfg`` (:func:`lever_run`): its row and its trace, the
    baseline first."""
    x, y = get_batch(batch_size, cfg["seq_len"], step=0)
    base_flops = step_flops(make_model(device="cpu", **cfg), x, y)
    rows, traces = [], {}
    for name in names:
        lever = lever_named(name, cfg)
        run = lever_run(cfg, batch_size, lever, device=device)
        trace = run.trace
        pk = trace.peak()
        flops = step_flops(make_model(device="cpu", **cfg, **lever.config), x, y)
        rows.append(
            LeverRow(
                name=lever.name,
                peak=pk.bytes,
                phase=pk.phase,
                dominant=max(pk.breakdown, key=pk.breakdown.get),
                state_per_param=trace.at(len(trace.timeline) - 1)["optimizer_state"] / run.num_params,
                gradients_at_peak=pk.breakdown["gradients"],
                extra_flops=flops / base_flops - 1,
                changes_training=EFFECTS.index(lever.effect) > 0,
                max_allocated=run.max_allocated,
            )
        )
        traces[lever.name] = trace
    return rows, traces


def format_levers(rows: list[LeverRow]) -> str:
    """The measured levers, one row each: the peak, where it is now, state bytes per parameter, FLOPs, numerics."""
    unit, scale = pick_unit(max(r.peak for r in rows))
    cols = [
        Col("lever", 30, align="<"),
        Col("peak", 8, ".2f"),
        Col("vs base", 8, "+.0%"),
        Col("peak in", 10, align="<", gap="  "),
        Col("dominant", 16, align="<", gap="  "),
        Col("state B/param", 13, ".2f"),
        Col("extra FLOPs", 11, "+.0%"),
        Col("changes training", 16, align="<", gap="  "),
    ]
    cuda = any(r.max_allocated is not None for r in rows)  # a column of the allocator's peak on a GPU
    cols += [Col("max_memory_allocated", 20, ".2f")] if cuda else []
    base = rows[0].peak
    table = [
        (
            r.name,
            r.peak / scale,
            r.peak / base - 1,
            r.phase,
            r.dominant,
            r.state_per_param,
            r.extra_flops,
            "yes" if r.changes_training else "no",
            *([None if r.max_allocated is None else r.max_allocated / scale] if cuda else []),
        )
        for r in rows
    ]
    return format_table(cols, table, note=f"({unit} at each run's peak; FLOPs of forward + backward, FlopCounterMode)")


def format_verified(category: str, verified) -> str:
    """prediction/levers.py's ranking of the levers that lower the peak (``category`` dominates it), verified by dry
    runs ("-": extra FLOPs the count cannot see)."""
    unit, scale = pick_unit(max(v.before.tensors for v in verified))
    cols = [
        Col("rank", 4),
        Col("lever", 30, align="<", gap="  "),
        Col("peak after", 10, ".2f"),
        Col("saved", 8, ".2f"),
        Col("peak in", 10, align="<", gap="  "),
        Col("extra FLOPs", 11, "+.0%"),
        Col("changes", 10, align="<", gap="  "),
    ]
    table = [
        (i, v.lever.name, v.after.tensors / scale, v.saved / scale, v.after.phase, v.extra_flops, v.lever.effect)
        for i, v in enumerate(verified, 1)
    ]
    return format_table(cols, table, note=f"(levers lowering a peak dominated by {category}; {unit}; dry runs)")


def worth_listing(verified, fraction: float = 0.005) -> tuple[list, list]:
    """``verify_levers``' ranking split into the levers that save at least ``fraction`` of the peak (listed) and
    those that save less (a few bytes: ``sdpa`` on a step without attention scores to speak of), which a table in
    MiB would show as saving 0.00. Returns (listed, left out), each in the ranking's order."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction is the share of the peak a lever must save, in [0, 1): got {fraction!r}")
    listed = [v for v in verified if v.saved >= fraction * v.before.tensors]
    return listed, [v for v in verified if v not in listed]


@dataclass(frozen=True)
class InBackwardPeak:
    """Where the peak of a step run with the optimizer step in backward lies (sample indices of its trace)."""

    step: int
    phase: str  # the tracker's phase at the peak: "optimizer" when one parameter's step is running
    optimizer_pieces: int  # how many optimizer phases the tracker marked in that step (one per parameter stepped)
    backward_after: bool  # a backward phase of the same step runs after the peak: the peak is inside backward


def in_backward_peak(trace: Trace) -> InBackwardPeak:
    """The peak of ``trace`` (a step with ``OptimizerInBackward``): the tracker marks each parameter's step, run from
    backward, as an optimizer phase between backward's pieces, so "peak in optimizer" can lie inside backward."""
    pk = trace.peak()
    pieces = [ph for ph in trace.phases() if ph.step == pk.step]
    return InBackwardPeak(
        pk.step,
        pk.phase,
        sum(ph.phase == "optimizer" for ph in pieces),
        any(ph.phase == "backward" and ph.start > pk.index for ph in pieces),
    )


def loss_gap(cfg: dict, names: tuple[str, ...], steps: int = 30, batch_size: int = 8) -> dict[str, list[float]]:
    """The loss of ``steps`` untracked steps of ``cfg`` with each optimizer ``name`` (same seed, same batches)."""

    out = {}
    for name in names:
        model = make_model(device="cpu", **cfg)
        optimizer = make_optimizer(model, name)
        out[name] = [run_step(model, optimizer, StepPlan(batch_size=batch_size), i) for i in range(steps)]
    return out


def update_gap(cfg: dict, options: dict, steps: int = 5, batch_size: int = 8) -> float:
    """The largest absolute difference between the parameters after ``steps`` untracked AdamW steps of ``cfg`` on
    the CPU with ``options`` (``make_optimizer``'s keywords: ``fused=True``, ``in_backward=True``) and with torch's
    default implementation (same seed, same batches): 0.0 when the updates agree bit for bit."""
    trained = []
    for opts in ({}, options):
        model = make_model(device="cpu", **cfg)
        optimizer = make_optimizer(model, "adamw", **opts)
        for i in range(steps):
            run_step(model, optimizer, StepPlan(batch_size=batch_size, read_loss=False), i)
        trained.append([p.detach() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*trained))


def compile_memory(cfg: dict, batch_size: int, device=None) -> dict[str, int]:
    """The peak of torch.profiler's memory timeline (bytes) over two profiled training steps, eager and under
    ``torch.compile`` (inductor), the same model, batch and optimizer: the tracker cannot see inside a compiled graph
    (its dispatch mode makes Dynamo skip every frame), the profiler's allocator events can. Compiling takes tens of
    seconds to minutes on a CPU; the notebook runs it only when asked (else :func:`stored_compile_memory`)."""

    peaks = {}
    for name in ("eager", "compiled"):
        model = make_model(device=device, **cfg)
        optimizer = make_optimizer(model, "adamw")
        runner = torch.compile(model) if name == "compiled" else model
        plan = StepPlan(batch_size, read_loss=False)
        run_step(runner, optimizer, plan, 0)  # compiled (or warmed up) outside the profile
        on = next(model.parameters()).device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on.type == "cuda" else [])
        with (
            quiet_profiler(),
            profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof,
        ):
            for i in range(1, 3):
                run_step(runner, optimizer, plan, i)
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            where = "cpu" if on.type == "cpu" else f"cuda:{on.index or 0}"
            prof.export_memory_timeline(f"{tmp}/timeline.json", device=where)
            peaks[name] = int(load_memory_timeline(f"{tmp}/timeline.json").total.max())
    return peaks


def stored_compile_memory(path: Path = COMPILE_REFERENCE) -> dict | None:
    """The recorded :func:`compile_memory` of the notebook's logits-bound step (``peaks``: bytes, eager and compiled,
    with what they were measured on: ``torch``, ``platform``, ``recorded``, ``seconds``), or None if none is stored.
    ValueError if the record is of another configuration than the notebook's."""
    if not path.exists():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))
    if record["config"] != LOGITS_BOUND or record["batch_size"] != LOGITS_BATCH:
        raise ValueError(
            f"{path.name} was recorded for {record['config']} batch {record['batch_size']}, not the notebook's "
            f"{LOGITS_BOUND} batch {LOGITS_BATCH}: run scripts/record_compile_reference.py again"
        )
    return record


# ---- the one-liners: save_on_cpu, micro-batches, the optimizer's implementation -----------------------------

#: (the step, the lever) of each one-liner row: each against the baseline of its step.
ONE_LINERS = (
    ("logits-bound", OFFLOAD.name),
    ("logits-bound", MICRO_BATCHES.name),
    ("optimizer-bound", SINGLE_TENSOR.name),
    ("optimizer-bound", FOREACH.name),
    ("optimizer-bound", "fused optimizer"),
)


@dataclass(frozen=True)
class OneLiner:
    """A lever that is one line of code, measured against its step's baseline (bytes)."""

    name: str
    config: str  # a key of CONFIGS
    peak: int
    baseline: int  # the baseline's peak
    phase: str  # where the peak is now
    optimizer_temporaries: int  # step 2's optimizer-phase temporaries at that phase's peak (Trace.optimizer_phase)
    max_allocated: int | None  # CUDA: LeverRun.max_allocated, this run and the baseline's
    baseline_max_allocated: int | None


def one_liners(device=None, configs: dict = CONFIGS) -> list[OneLiner]:
    """The :data:`ONE_LINERS`, each a real tracked run (cached: :func:`lever_run`); ``configs``: the two steps by
    the names of :data:`CONFIGS` (the logits-bound batch a multiple of the micro-batches' count)."""
    rows = []
    for config, name in ONE_LINERS:
        cfg, batch = configs[config]
        base = lever_run(cfg, batch, BASELINE, device=device)
        run = lever_run(cfg, batch, lever_named(name, cfg), device=device)
        pk = run.trace.peak()
        rows.append(
            OneLiner(
                name,
                config,
                pk.bytes,
                base.trace.peak().bytes,
                pk.phase,
                run.trace.optimizer_phase(2).temporaries,
                run.max_allocated,
                base.max_allocated,
            )
        )
    return rows


def format_one_liners(rows: list[OneLiner]) -> str:
    """The one-liners in bytes: the peak, the baseline's, the difference, where the peak is, optimizer temporaries."""
    cuda = any(r.max_allocated is not None for r in rows)
    cols = [Col("lever", 24, align="<"), Col("step", 15, align="<", gap="  "), Col("peak", 12, ",d")]
    cols += [Col("baseline", 12, ",d"), Col("difference", 12, "+,d"), Col("peak in", 10, align="<", gap="  ")]
    cols += [Col("optimizer temps", 15, ",d")]
    cols += [Col("max_memory_allocated", 21, ",d"), Col("baseline's", 12, ",d")] if cuda else []
    table = [
        (r.name, r.config, r.peak, r.baseline, r.peak - r.baseline, r.phase, r.optimizer_temporaries)
        + ((r.max_allocated, r.baseline_max_allocated) if cuda else ())
        for r in rows
    ]
    return format_table(cols, table, note="(bytes; optimizer temps: step 2's optimizer phase)")


# ---- the panel: a step and a lever, before and after -------------------------------------------------------

#: The levers the panel offers (names lever_named knows; bitsandbytes' 8-bit state where it is installed).
PANEL_LEVERS = (
    "optimizer step in backward",
    "bf16 optimizer state",
    "SGD with momentum",
    "fused optimizer",
    FOREACH.name,
    "chunked loss",
    "checkpoint=full",
    "sdpa attention",
    OFFLOAD.name,
    MICRO_BATCHES.name,
    KEEP_GRADIENTS.name,
)


def panel_levers() -> list[str]:
    """:data:`PANEL_LEVERS`, with the 8-bit state after the bf16 one where bitsandbytes is installed."""
    names = list(PANEL_LEVERS)
    if has_bitsandbytes():
        names.insert(2, "8-bit state")
    return names


def lever_panel(config: str = "optimizer-bound", lever: str = "optimizer step in backward", device=None):
    """One of the lesson's steps (``config``: a key of :data:`CONFIGS`) before and after ``lever`` (a name
    :func:`lever_named` knows): prints each peak (bytes and MiB), its phase and dominant category (and on CUDA
    ``max_memory_allocated``), and returns both timelines on one y-scale. Runs are cached (:func:`lever_run`), so a
    setting seen before costs only the figure. A lever the step cannot take (micro-batches of a one-row batch)
    says why and shows the baseline alone. The function behind notebook 10's panel."""
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {tuple(CONFIGS)}, got {config!r}")

    cfg, batch = CONFIGS[config]
    chosen = lever_named(lever, cfg)
    runs = {BASELINE.name: lever_run(cfg, batch, BASELINE, device=device)}
    refused = ""
    try:
        runs[chosen.name] = lever_run(cfg, batch, chosen, device=device)
    except ValueError as e:  # the step cannot take it (StepPlan's check): say why, show the baseline alone
        refused = f"  {chosen.name} does not apply to this step: {e}"
    print(f"the {config} step, batch {batch}: each run's peak, the phase holding it, the category dominating it")
    for name, run in runs.items():  # lines short enough not to wrap in a notebook's output
        pk, category = dominant(run.trace)
        print(f"  {name:<28} {pk.bytes:>11,} B ({pk.bytes / MiB:5.2f} MiB)  step {pk.step} {pk.phase:<9} {category}")
        if run.max_allocated is not None:
            print(f"  {'':<28} {run.max_allocated:>11,} B: CUDA max_memory_allocated")
    if refused:
        print(refused)
    else:
        before, after = (run.trace.peak().bytes for run in runs.values())
        print(f"  the lever moves the peak by {after - before:+,} B ({after / before - 1:+.0%})")
    traces = {name: run.trace for name, run in runs.items()}
    return plot_timelines(traces, title=f"the {config} step: {chosen.name}")
