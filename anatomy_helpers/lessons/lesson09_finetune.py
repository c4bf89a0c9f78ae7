"""Lesson 09, fine-tuning: what full, frozen and LoRA fine-tunes keep, tensor by tensor, on a tiny real Llama; where
a real model's step peaks (the logits); what the rules of thumb would have said; the will-it-fit panel for
Hugging Face models. The fine-tuning step itself, its dry run and its fit are in
:mod:`anatomy_helpers.prediction.hf_step`, :mod:`anatomy_helpers.prediction.hf_fit` and (per rank)
:mod:`anatomy_helpers.distributed.hf_fit`.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from ..core.tables import Col, format_table
from ..core.units import GiB, KiB, pick_unit
from ..distributed.hf_fit import periodic_dry_run_hf_rank, will_it_fit_hf
from ..prediction.devices import DEFAULT_GPU
from ..prediction.formulas import korthikanti_layer_bytes
from ..prediction.hf import hf_config, meta_parameters, tiny_config
from ..prediction.hf_fit import MODEL_STATES
from ..prediction.hf_periodic import periodic_dry_run_hf
from ..prediction.hf_step import FineTune, make_hf_model
from ..prediction.saved import first_savers, saved_rows
from ..tracking.events import CATEGORIES
from ..tracking.trace import Trace
from ..ui.plots import plot_fit

#: The lesson's tiny model: Llama 3.2 1B's architecture (grouped-query attention, SwiGLU, RMSNorm, tied
#: embeddings) at 2 layers of width 128, a 256-token vocabulary; real random weights, runs in a second.
TINY_MODEL = "llama-3.2-1b"
TINY_HEAD_DIM = 16
#: The tiny runs' batch: 4 sequences of 32 tokens.
TINY_BATCH = dict(batch_size=4, seq_len=32)


def tiny_llama():
    """The lesson's tiny Llama configuration (hf.tiny_config of Llama 3.2 1B, head width 16)."""
    return tiny_config(TINY_MODEL, head_dim=TINY_HEAD_DIM)


def tiny_fine_tunes(lora_rank: int = 4) -> dict[str, FineTune]:
    """The four ways the lesson trains the tiny model: everything; everything but the embedding and the first
    layer; LoRA adapters on every linear layer of an fp32 base; the same on a bf16 base (as people run it)."""
    full = FineTune(**TINY_BATCH)
    lora = dataclasses.replace(full, method="lora", lora_rank=lora_rank, lora_alpha=2 * lora_rank)
    return {
        "full": full,
        "frozen": dataclasses.replace(full, method="frozen", freeze=("model.embed_tokens.", "model.layers.0.")),
        "LoRA": lora,
        "LoRA, bf16 base": dataclasses.replace(lora, dtype="bfloat16"),
    }


# ---- what each way of training keeps -------------------------------------------------------------------------


@dataclass(frozen=True)
class Trainable:
    """The parameters a fine-tune trains, counted from its model's tensors (built on the meta device)."""

    count: int  # elements
    bytes: int
    tensors: int
    total: int  # elements of every parameter, trained or not (shared tensors once)


def trainable(cfg, ft: FineTune) -> Trainable:
    """What ``ft`` trains in ``cfg``'s model: its ``requires_grad`` parameters, counted on a meta-device model."""
    with torch.device("meta"):
        model = make_hf_model(cfg, ft)
    params = list({id(p): p for p in model.parameters()}.values())
    train = [p for p in params if p.requires_grad]
    return Trainable(
        sum(p.numel() for p in train),
        sum(p.numel() * p.element_size() for p in train),
        len(train),
        sum(p.numel() for p in params),
    )


@dataclass(frozen=True)
class MethodRow:
    """One fine-tune's memory, read off its trace (bytes)."""

    method: str
    parameters: int  # alive at rest, frozen ones and buffers included
    gradients: int  # at their largest
    optimizer_state: int  # after step 2
    activations: int  # what step 2's forward keeps for backward, at its end
    peak: int
    peak_where: str  # step, phase


def method_row(method: str, trace: Trace) -> MethodRow:
    """The :class:`MethodRow` of ``trace`` (two steps, tracked or dry-run)."""
    cat = CATEGORIES.index("gradients")
    pk = trace.peak()
    return MethodRow(
        method,
        trace.baseline["parameters"],
        int(trace.timeline.bytes[:, cat].max(initial=0)),
        trace.phase(2, "optimizer").at_end["optimizer_state"],
        trace.phase(2, "forward").at_end["activations"],
        pk.bytes,
        f"step {pk.step} {pk.phase}",
    )


def methods_table(rows: list[MethodRow]) -> str:
    """One line per fine-tune: its model states, activations and peak (in the unit that suits the largest)."""
    unit, scale = pick_unit(max(r.peak for r in rows))
    cols = [Col("method", 22, align="<"), Col("params", 8, ".2f"), Col("grads", 8, ".2f"), Col("opt state", 9, ".2f")]
    cols += [Col("activations", 11, ".2f"), Col("peak", 8, ".2f"), Col("peak in", 18, align="<", gap="  ")]
    data = [
        (r.method, r.parameters / scale, r.gradients / scale, r.optimizer_state / scale, r.activations / scale,
         r.peak / scale, r.peak_where)
        for r in rows
    ]  # fmt: skip
    return format_table(cols, data, note=f"({unit}; activations: kept by step 2's forward, at its end)")


#: What kind of module saved a tensor, from its name (Llama's module names; peft's adapters).
KINDS = (
    "embedding",
    "norms",
    "linear layers",
    "attention core",
    "MLP activation",
    "LoRA A (its input)",
    "LoRA B (A's output)",
    "head and loss",
)
PEFT_PREFIX = "base_model.model."


def module_kind(name: str) -> str:
    """The :data:`KINDS` entry of a (Llama) module name as the tracker names it, peft's prefix or not."""
    name = "" if name == PEFT_PREFIX[:-1] else name.removeprefix(PEFT_PREFIX)
    parts = name.split(".")
    if "lora_A" in parts:
        return "LoRA A (its input)"
    if "lora_B" in parts:
        return "LoRA B (A's output)"
    last = parts[-1]
    if last == "embed_tokens":
        return "embedding"
    if last.endswith("norm"):
        return "norms"
    if last.endswith("_proj") or last == "base_layer":
        return "linear layers"
    if last == "self_attn":
        return "attention core"
    if last in ("mlp", "act_fn"):
        return "MLP activation"
    if name in ("model", "lm_head", ""):  # the final norm's output through the head, the logits, the loss
        return "head and loss"
    raise ValueError(f"no kind for module {name!r} (a Llama module name was expected)")


def module_layer(name: str) -> str:
    """``"layer i"`` for a module inside decoder layer i, else ``"embedding"`` or ``"head and loss"``."""
    found = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
    if found:
        return f"layer {found.group(1)}"
    return "embedding" if name.removeprefix(PEFT_PREFIX).endswith("embed_tokens") else "head and loss"


def saved_by(trace: Trace, key=module_kind, step: int = 1) -> dict[str, int]:
    """Activation bytes step ``step``'s forward saved for backward, each storage once under the module that saved
    it first, grouped by ``key`` of the module's name (:func:`module_kind` or :func:`module_layer`)."""
    rows = [r for r in saved_rows(trace) if r.step == step]
    out: dict[str, int] = {}
    for r in first_savers(rows):
        k = key(r.module)
        out[k] = out.get(k, 0) + r.storage_bytes
    return out


def saved_table(saved: dict[str, dict[str, int]], order=KINDS) -> str:
    """Rows: kinds (or layers) of module; columns: fine-tunes (``saved``: method -> :func:`saved_by`), KiB."""
    methods = list(saved)
    keys = [k for k in order if any(s.get(k, 0) for s in saved.values())]
    cols = [Col("saved by", 20, align="<")] + [Col(m, max(len(m), 8), ".1f") for m in methods]
    rows = [(k, *(saved[m].get(k, 0) / KiB for m in methods)) for k in keys]
    rows.append(("total", *(sum(saved[m].values()) / KiB for m in methods)))
    return format_table(cols, rows, note="(KiB saved for backward by step 1's forward, each storage once)")


# ---- a real model's step: the logits --------------------------------------------------------------------------


@dataclass(frozen=True)
class LogitsAtPeak:
    """The vocabulary-sized tensors alive at a trace's peak: ``batch x seq x vocab`` elements each."""

    elements: int  # batch * seq_len * vocab_size, from the config
    fp32_bytes: int  # one fp32 copy of the logits (or of their gradient)
    alive: list[tuple[int, str]]  # (bytes, category) of each vocabulary-sized storage alive at the peak
    peak: int

    @property
    def total(self) -> int:
        return sum(b for b, _ in self.alive)


def logits_at_peak(trace: Trace, cfg, ft: FineTune) -> LogitsAtPeak:
    """The storages of ``batch x seq_len x vocab`` elements (2 or 4 bytes each) alive at the peak of ``trace``.

    Model states are left out (an embedding table of ``vocab x hidden`` elements has as many when the hidden
    size equals batch x seq_len); among activations and temporaries nothing else has that many elements while
    the vocabulary is larger than the model's widths. The sizes come from the configuration, not the trace."""
    cfg = hf_config(cfg)
    n = ft.batch_size // ft.micro_batches * ft.seq_len * cfg.vocab_size
    pk = trace.peak()
    alive = [
        (a.bytes, a.category)
        for a in trace.live_allocations(pk.index)
        if a.bytes in (2 * n, 4 * n) and a.category not in MODEL_STATES
    ]
    return LogitsAtPeak(n, 4 * n, alive, pk.bytes)


# ---- what the rules of thumb say ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleRow:
    """A fine-tune's dry-run peak beside what the usual rules give for its model (bytes)."""

    label: str
    parameters: int  # elements of the whole model
    dry_run: int  # the dry run's peak
    weights_only: int  # parameters x bytes of the weights' dtype (accelerate estimate-memory's model size)
    times_four: int  # 4 x weights only ("training with Adam": the Hub's memory calculator)
    sixteen_per_param: int  # 16 bytes per parameter (ZeRO's mixed-precision Adam), no activations
    formula: int  # 16 B/param + Korthikanti et al.'s activations, L x sbh(34 + 5as/h)

    @property
    def rules(self) -> dict[str, int]:
        return {
            "weights only": self.weights_only,
            "x4": self.times_four,
            "16 B/param": self.sixteen_per_param,
            "16 B/param + act.": self.formula,
        }

    def off_by(self, rule: str) -> float:
        """(rule - dry run) / dry run."""
        return (self.rules[rule] - self.dry_run) / self.dry_run


def rules_of_thumb(cfg, ft: FineTune, trace: Trace, label: str) -> RuleRow:
    """The rules of thumb for ``cfg``'s model at ``ft``'s batch and sequence length, beside ``trace``'s peak. The
    rules see only the model (the parameter count, the weights' dtype, the shape for the activations), not how
    it is trained: a LoRA fine-tune gets the same numbers as a full one."""
    cfg = hf_config(cfg)
    n = meta_parameters(cfg)
    weights = n * torch.empty(0, dtype=getattr(torch, ft.dtype)).element_size()
    rows = ft.batch_size // ft.micro_batches
    layer = korthikanti_layer_bytes(ft.seq_len, rows, cfg.hidden_size, cfg.num_attention_heads)
    return RuleRow(label, n, trace.peak().bytes, weights, 4 * weights, 16 * n, 16 * n + cfg.num_hidden_layers * layer)


def rules_table(rows: list[RuleRow]) -> str:
    """Each fine-tune: the dry run's peak, then each rule and how far off it is (GiB)."""
    rules = list(rows[0].rules)
    cols = [Col("configuration", 34, align="<"), Col("params", 7, ".2f"), Col("dry run", 8, ".2f")]
    for r in rules:
        cols += [Col(r, max(len(r), 6), ".2f", gap="  "), Col("off", 5, "+.0%")]
    data = [
        (r.label, r.parameters / 1e9, r.dry_run / GiB, *(v for k in rules for v in (r.rules[k] / GiB, r.off_by(k))))
        for r in rows
    ]
    return format_table(cols, data, note="(GiB; params in billions; off: rule vs dry run)")


# ---- the will-it-fit panel ------------------------------------------------------------------------------------

#: The panel's models: the shipped ones up to 4 B parameters, the sizes a learner fine-tunes on a free Colab
#: runtime, smallest first after the two the lesson starts with (the panel opens on the first); the 7 B and 8 B
#: models are the CLI's (README's "Will it fit?").
PANEL_MODELS = (
    "llama-3.2-1b",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "smollm2-1.7b",
    "qwen2.5-3b",
    "llama-3.2-3b",
    "phi-3.5-mini",
)


def panel_fine_tune(lora_rank: int, batch_size: int, seq_len: int) -> FineTune:
    """The panel's fine-tune: bf16 weights and AdamW; full when ``lora_rank`` is 0, else LoRA of that rank
    (alpha twice the rank) on every linear layer."""
    if lora_rank == 0:
        return FineTune(batch_size=batch_size, seq_len=seq_len, dtype="bfloat16")
    return FineTune(
        batch_size=batch_size, seq_len=seq_len, dtype="bfloat16", method="lora", lora_rank=lora_rank,
        lora_alpha=2 * lora_rank,
    )  # fmt: skip


#: The dry runs this kernel made, by (the configuration as JSON, the fine-tune, world size, ZeRO stage); at most
#: :data:`KEEP` of them.
_DRY_RUNS: dict[tuple[str, FineTune, int, int], Trace] = {}
KEEP = 32


def dry_run(model, ft: FineTune, world_size: int = 1, zero: int = 0) -> Trace:
    """``dry_run_hf(model, ft, steps=2)``'s Trace (``world_size > 1``: rank 0's under ZeRO stage ``zero``,
    distributed/hf_fit.dry_run_hf_rank), made once per kernel for each configuration and fine-tune: the lesson's
    cells and its panel share them, so moving a control back to a value already seen replays that dry run
    instead of making it again. ``model``: anything hf.hf_config takes. On one device and per rank it is built
    from dry runs at 3, 4 and 5 layers where the step repeats layer by layer (prediction/hf_periodic.py,
    distributed/hf_fit.periodic_dry_run_hf_rank: the same bytes, saved tensors and phases as the full-depth dry
    run; only its wall times are spread evenly, and nothing here reads them)."""
    cfg = hf_config(model)
    key = (cfg.to_json_string(), ft, world_size, zero if world_size > 1 else 0)
    if key not in _DRY_RUNS:
        if len(_DRY_RUNS) >= KEEP:
            del _DRY_RUNS[next(iter(_DRY_RUNS))]  # the oldest
        if world_size == 1:
            _DRY_RUNS[key] = periodic_dry_run_hf(cfg, ft, steps=2)[0]
        else:
            _DRY_RUNS[key] = periodic_dry_run_hf_rank(cfg, ft, world_size, zero)[0]
    return _DRY_RUNS[key]


def fit_panel_hf(
    model: str = "llama-3.2-1b",
    device: str = DEFAULT_GPU,
    world_size: int = 2,
    zero: int = 3,
    lora_rank: int = 0,
    batch_size: int = 4,
    seq_len: int = 1024,
):
    """The notebook's panel: will ``model``'s fine-tune (:func:`panel_fine_tune`) fit on ``device``, per rank of
    ``world_size`` under ZeRO stage ``zero`` (0: DDP)? Prints the fit table, returns the plot; its
    ``panel_used`` holds the settings the dry run was made with, read from the fine-tune it built (the browser test
    checks them against the controls)."""
    positions = hf_config(model).max_position_embeddings
    if seq_len > positions:
        raise ValueError(f"{model} has {positions:,} positions: a sequence of {seq_len:,} tokens does not fit in it")
    ft = panel_fine_tune(lora_rank, batch_size, seq_len)
    report = will_it_fit_hf(
        model, ft, device, world_size=world_size, zero=zero if world_size > 1 else None,
        trace=dry_run(model, ft, world_size, zero),
    )  # fmt: skip
    print(report.table(brief=True))  # the figure stays in view; print(report) gives the whole answer
    ranks = f", per rank of {world_size} under {'DDP' if zero == 0 else f'ZeRO-{zero}'}" if world_size > 1 else ""
    fig = plot_fit(report, title=f"Will it fit? {report.label} on {report.device}{ranks}")
    fig.panel_numbers = (report.capacity, report.usable, report.fits)  # the verdict, for widgets.figure_digest
    used = {"lora_rank": ft.lora_rank if ft.method == "lora" else 0, "batch_size": ft.batch_size, "seq_len": ft.seq_len}
    fig.panel_used = used | ({"world_size": world_size, "zero": zero} if world_size > 1 else {"world_size": 1})
    return fig
