"""Tensor parallelism (and sequence parallelism) on the course GPT with torch's own ``parallelize_module``, and the
activations one rank keeps against Korthikanti et al.'s per-layer formulas.

t-way tensor parallelism (Megatron-LM, Shoeybi et al. 2019) splits each block's two GEMM pairs across t ranks:
``attn.qkv`` and ``mlp.fc`` by output columns (``ColwiseParallel``), ``attn.proj`` and ``mlp.proj`` by input rows
(``RowwiseParallel``, whose outputs are summed by an all-reduce). Each rank then computes ``n_head / t`` heads and
``4h / t`` MLP columns. Sequence parallelism (Korthikanti et al. 2022) also splits the LayerNorms and dropouts,
which TP leaves replicated, along the sequence (``SequenceParallel``): the all-reduce becomes a reduce-scatter and
an all-gather. Only the blocks are parallelised (:mod:`~anatomy_helpers.distributed.tp_plan`, which real ranks use
too); the embedding and the head stay replicated on every rank. The Llama block splits the same way (its fused
qkv of grouped-query attention, its SwiGLU's gate and up column-wise, the two projections row-wise); its terms,
which the paper does not cover, are derived here in the paper's style (:data:`LLAMA_TERMS`).

:func:`tp_dry_run` runs one rank of a t-way group on torch's fake process group and fake tensors (as
:mod:`~anatomy_helpers.distributed.fake_world` does for data parallelism), through the course's one step, and
:func:`layer_parts` reads what one block saved for backward, part by part. Bytes everywhere.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from ..core.checks import positive_int
from ..core.data import get_batch
from ..core.model import GPT, ModelConfig
from ..core.tables import Col, format_table
from ..prediction.dryrun import build_fake_model, check_ops, course_batch, twin_config
from ..prediction.fake_check import CheckedFakeTensorMode
from ..prediction.formulas import MASK_TERMS, korthikanti_terms
from ..training.step import StepPlan, run_step
from ..training.train import make_optimizer
from .fake_world import COLLECTIVE_NAMESPACES, check_no_process_group, fake_process_group
from .ranks import RankTracker, run_job
from .tp_plan import check_tp, parallelize_gpt, qkv_rank_order

#: The formula terms each rank holds 1/t of under plain TP (inside the column/row-split GEMM pairs); the others
#: (LayerNorm inputs, the QKV and fc1 inputs, the two residual dropout masks: 10 sbh) stay whole on every rank.
TP_SHARDED_TERMS = (
    "Q and K",
    "softmax output",
    "softmax dropout mask",
    "dropout output",
    "V",
    "out-proj input",
    "GELU input",
    "fc2 input",
)

#: Which module of a block saves each formula term (the attention core, the module ``attn`` itself, saves four).
TERM_MODULE = {
    "LayerNorm inputs": "ln1+ln2",
    "QKV input": "attn.qkv",
    "Q and K": "attn",
    "softmax output": "attn",
    "dropout output": "attn",
    "V": "attn",
    "softmax dropout mask": "attn.attn_drop",
    "out-proj input": "attn.proj",
    "attn dropout mask": "attn.resid_drop",
    "fc1 input": "mlp.fc",
    "GELU input": "mlp.gelu",
    "fc2 input": "mlp.proj",
    "MLP dropout mask": "mlp.drop",
}


def korthikanti_tp_terms(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool = False) -> dict[str, float]:
    """One layer's activation bytes on one of ``t`` ranks, per term: :func:`korthikanti_terms` with the sharded
    terms divided by t, and with sequence parallelism every term. They sum to the paper's closed forms,
    ``sbh (10 + 24/t + 5as/(ht))`` and ``sbh/t (34 + 5as/h)`` (section 4.2.2 and 4.2.3)."""
    whole = korthikanti_terms(s, b, h, a)
    return {term: v / t if sequence_parallel or term in TP_SHARDED_TERMS else v for term, v in whole.items()}


# ---- the Llama block: its terms in Korthikanti's style -----------------------------------------------------------

#: One Llama block's activations (model.py's LlamaBlock: RMSNorm, rotary grouped-query attention, SwiGLU, dropout),
#: derived in the style of Korthikanti et al. section 4.1 (which covers only GPT-2's block), from what autograd
#: saves in the block's code: 16-bit activations, 1-byte dropout masks, materialised attention, micro-batch b > 1.
#: ``F`` is the MLP width (the course's ``mlp_ratio * h``; Llama's own is about 8h/3). Rows: (term, the module that
#: saves it, bytes per unit, unit, sharded by plain TP). Under t-way TP the rows marked True (inside the column/row
#: split pairs: Q, K, V, the scores, the out-proj input, the SwiGLU's F-wide tensors) hold 1/t per rank; the others
#: (both norms' tensors, the qkv and gate/up inputs, the two residual dropout masks: 14 sbh) stay whole on every
#: rank. With sequence parallelism every row is 1/t. What the derivation found by measuring:
#:
#: * RMSNorm (unfused, as Llama's reference code) saves its input x and the normalised ``x * rms`` (the weight's
#:   multiply needs it), plus ``rms`` itself (b x s, left out as Korthikanti leaves out LayerNorm's mean/rstd);
#:   a fused RMSNorm kernel keeps only x and rms.
#: * rotary positions save nothing but the cos/sin tables (buffers): Q and K are the rotated copies.
#: * grouped-query attention: autograd keeps K and V *after* ``repeat_interleave`` (H heads, what the matmuls
#:   read), not the K/H of them before it; so K and V cost as much as without GQA. Only the qkv weight shrinks.
#: * gate and up read the same input, saved once; SwiGLU keeps SiLU's input (gate's output), SiLU's output and up's
#:   output for ``silu(g) * u``, and the product is the down projection's input: four F-wide tensors.
LLAMA_TERMS = (
    ("RMSNorm inputs", "ln1+ln2", 4, "sbh", False),
    ("RMSNorm normalised inputs", "ln1+ln2", 4, "sbh", False),
    ("QKV input", "attn.qkv", 2, "sbh", False),
    ("Q and K (rotated)", "attn", 4, "sbh", True),
    ("V (repeated to H heads)", "attn", 2, "sbh", True),
    ("softmax output", "attn", 2, "as^2b", True),
    ("softmax dropout mask", "attn.attn_drop", 1, "as^2b", True),
    ("dropout output", "attn", 2, "as^2b", True),
    ("out-proj input", "attn.proj", 2, "sbh", True),
    ("attn dropout mask", "attn.resid_drop", 1, "sbh", False),
    ("gate/up input", "mlp.gate", 2, "sbh", False),
    ("SiLU input (gate output)", "mlp", 2, "sbF", True),
    ("SiLU output", "mlp", 2, "sbF", True),
    ("up output", "mlp", 2, "sbF", True),
    ("down input", "mlp.proj", 2, "sbF", True),
    ("MLP dropout mask", "mlp.drop", 1, "sbh", False),
)
LLAMA_TERM_MODULE = {term: module for term, module, *_ in LLAMA_TERMS}


def llama_tp_terms(s: int, b: int, h: int, a: int, F: int, t: int, sequence_parallel: bool = False) -> dict[str, float]:
    """One Llama layer's activation bytes on one of ``t`` ranks, per term of :data:`LLAMA_TERMS` (``F`` the MLP
    width). They sum to ``sbh (14 + (8 + 8F/h)/t + 5as/(ht))`` under TP and ``sbh/t (22 + 8F/h + 5as/h)`` with
    sequence parallelism; at F = 4h, ``sbh (14 + 40/t + 5as/(ht))`` against GPT-2's ``sbh (10 + 24/t + ...)``."""
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("F", F), ("t", t)):
        positive_int(name, value)
    per_unit = {"sbh": s * b * h, "as^2b": a * s * s * b, "sbF": s * b * F}
    return {
        term: coef * per_unit[unit] / (t if sequence_parallel or sharded else 1)
        for term, _, coef, unit, sharded in LLAMA_TERMS
    }


def block_tp_terms(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool = False) -> dict[str, float]:
    """The per-term formula of ``cfg``'s block on one of ``t`` ranks: Korthikanti's (GPT-2) or :data:`LLAMA_TERMS`."""
    s, h, a = cfg.seq_len, cfg.d_model, cfg.n_head
    if cfg.block == "llama":
        return llama_tp_terms(s, b, h, a, cfg.mlp_ratio * h, t, sequence_parallel)
    return korthikanti_tp_terms(s, b, h, a, t, sequence_parallel)


def tp_whole_sbh(cfg: ModelConfig) -> float:
    """What plain tensor parallelism leaves whole on every rank, per layer, in units of ``sbh`` bytes, at ``cfg``'s
    own activation width: the formula's unsharded terms (GPT-2: the LayerNorm inputs, the QKV and fc1 inputs, the
    two residual dropout masks; Llama: :data:`LLAMA_TERMS`' whole rows), each 2-byte term at the model's element
    size, masks at 1 byte, and no mask at dropout 0. The paper's count (16-bit, dropout on) is 10 for GPT-2's
    block; an fp32 block with dropout 0 keeps 16."""
    elem = torch.empty(0, dtype=cfg.torch_dtype).element_size()
    sharded = {term for term, *_, split in LLAMA_TERMS if split} if cfg.block == "llama" else set(TP_SHARDED_TERMS)
    whole = 0.0
    for term, v in block_tp_terms(cfg, 1, 1).items():
        if term in sharded or (not cfg.dropout and term in DROPOUT_TERMS):
            continue
        whole += v if term in MASK_TERMS else v * elem / 2
    return whole / (cfg.seq_len * cfg.d_model)


#: DTensor's warning on CPU meshes (torch/distributed/tensor/_random.py), silenced inside :func:`tp_dry_run` only.
DTENSOR_RNG_WARNING = "DTensor random operators may not have complete support on cpu device mesh"


# ---- one rank, dry-run -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TPRun:
    """One rank of a t-way TP group: its trace (one tracked step after a warm-up) and the collectives it issued."""

    t: int
    sequence_parallel: bool
    trace: object  # Trace
    collectives: list


def tp_dry_run(cfg: ModelConfig, t: int, *, sequence_parallel: bool = False, batch_size: int = 4) -> TPRun:
    """Dry-run rank 0 of a ``t``-way tensor-parallel group of the course GPT (every rank trains the same
    ``batch_size`` rows), on torch's fake process group and fake tensors; ops checked as every dry run's."""
    from torch.distributed.device_mesh import init_device_mesh  # loaded where a rank or a mesh is built

    check_tp(cfg, t)
    check_no_process_group()

    def run(cfg: ModelConfig, rows: int):
        with fake_process_group(t, 0):
            mesh = init_device_mesh("cpu", (t,))
            mode = CheckedFakeTensorMode()
            gpt = build_fake_model(lambda: GPT(cfg), mode)
            mode.calls.clear()
            with mode, warnings.catch_warnings():
                # DTensor warns that its random ops (the sequence-parallel dropouts) "may not have complete
                # support" on a CPU mesh; a dry run draws no random numbers (fake tensors hold none), so the
                # warning says nothing about what is measured here. Only that message, only here.
                warnings.filterwarnings("ignore", message=DTENSOR_RNG_WARNING, category=UserWarning)
                parallelize_gpt(gpt, mesh, sequence_parallel)
                opt = make_optimizer(gpt, "adamw")
                plan = StepPlan(rows, batch=lambda i: course_batch(rows, cfg.seq_len), read_loss=False)
                run_step(gpt, opt, plan, 0)  # warm-up: the optimizer state exists
                with RankTracker(gpt, opt) as tracker:
                    run_step(gpt, opt, plan, 1)
        calls = {k: c for k, c in mode.calls.items() if c.func.namespace not in COLLECTIVE_NAMESPACES}
        return TPRun(t, sequence_parallel, tracker.trace, tracker.collectives), calls

    result, calls = run(cfg, batch_size)
    twin = dataclasses.replace(twin_config(cfg), d_model=cfg.n_head * 8)
    check_ops(calls, f"rank 0 of {t}-way TP", lambda: run(twin, min(batch_size, 2))[1])
    return result


def layer_parts(trace, layer: int = 0) -> dict[str, int]:
    """Activation bytes block ``layer`` saved for backward in the tracked step, by module (distinct storages, each
    for the module that saved it first; the two LayerNorms together as "ln1+ln2"). DTensors by their local shard."""
    prefix = f"blocks.{layer}."
    step = max(s.step for s in trace.saved)
    seen: set[int] = set()
    out: dict[str, int] = {}
    for s in trace.saved:
        if s.step != step or s.category != "activations" or not s.module.startswith(prefix) or s.storage in seen:
            continue
        seen.add(s.storage)
        name = s.module[len(prefix) :]
        name = "ln1+ln2" if name in ("ln1", "ln2") else name
        out[name] = out.get(name, 0) + s.storage_bytes
    return out


def formula_parts(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool = False) -> dict[str, float]:
    """:func:`block_tp_terms` summed by the module that saves each term (:data:`TERM_MODULE`,
    :data:`LLAMA_TERM_MODULE`)."""
    where = LLAMA_TERM_MODULE if cfg.block == "llama" else TERM_MODULE
    out: dict[str, float] = {}
    for term, v in block_tp_terms(cfg, b, t, sequence_parallel).items():
        out[where[term]] = out.get(where[term], 0) + v
    return out


# ---- measured against the formula, part by part ------------------------------------------------------------------

#: Why a measured part differs from Korthikanti's term (a short name: the reason).
GAP_REASONS = {
    "mask dtype": "CPU dropout keeps its mask in the activation dtype, not in 1 byte (the fused CUDA kernel's)",
    "causal mask": "masked_fill saves ~mask (s x s bool), which the formula leaves out",
    "LN mean/rstd": "LayerNorm's mean and rstd (b x s each, per LayerNorm), which the formula leaves out",
    "RMS": "RMSNorm's rms (b x s, per RMSNorm), which the formula leaves out",
    "gathered input": "torch's ColwiseParallel all-gathers the sequence shards before the GEMM and autograd saves "
    "the whole input; Megatron's sequence parallelism saves the shard and gathers it again in backward",
    "activation width": "the formula counts 16-bit activations (2 bytes an element); a model in a wider dtype (fp32: "
    "4 bytes) keeps every term but the masks that many times larger",
    "no dropout": "dropout 0: no dropout keeps a mask, and attention's matmul reads the softmax output itself, so "
    "the formula's masks and its dropout output are not kept",
}
#: The formula's terms that exist only with dropout on: the three masks and the attention dropout's output.
DROPOUT_TERMS = (*MASK_TERMS, "dropout output")


@dataclass(frozen=True)
class TPPart:
    """One part of a block on one rank of a t-way group (bytes): measured, the formula, and the known gap."""

    module: str
    measured: int
    formula: float
    known_gap: int  # what GAP_REASONS accounts for: measured == formula + known_gap when the rules hold
    why: str  # the keys of GAP_REASONS that make the gap, joined by " + ", or ""


def term_gaps(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool = False) -> dict[str, dict[str, float]]:
    """The known gaps of one block on one of ``t`` ranks, by the module they fall in: ``{module: {reason: bytes}}``
    (reasons are keys of :data:`GAP_REASONS`; a module without a gap is absent). Each rule from the model's own
    configuration: its activation dtype (the formula's terms are 16-bit, its masks 1 byte), whether dropout is on
    (with dropout 0 there is no mask and no dropout output), its attention (the manual one saves the causal mask),
    its norms' statistics and sequence parallelism's gathered inputs."""
    s, h = cfg.seq_len, cfg.d_model
    llama = cfg.block == "llama"
    elem = torch.empty(0, dtype=cfg.torch_dtype).element_size()
    where = LLAMA_TERM_MODULE if llama else TERM_MODULE
    gaps: dict[str, dict[str, float]] = {}

    def add(module: str, reason: str, value: float) -> None:
        if value:
            mine = gaps.setdefault(module, {})
            mine[reason] = mine.get(reason, 0) + value

    for term, v in block_tp_terms(cfg, b, t, sequence_parallel).items():
        if not cfg.dropout and term in DROPOUT_TERMS:
            add(where[term], "no dropout", -v)  # nothing of it is kept
        elif term in MASK_TERMS:  # the formula counts 1 byte per mask element
            add(where[term], "mask dtype", v * (elem - 1))
        else:  # the formula counts 2 bytes per element
            add(where[term], "activation width", v * (elem - 2) / 2)
    if cfg.attn_impl == "manual":
        add("attn", "causal mask", s * s)
    norm_stats = 1 if llama else 2  # per token: RMSNorm's rms; LayerNorm's mean and rstd
    add("ln1+ln2", "RMS" if llama else "LN mean/rstd", 2 * norm_stats * b * (s // t if sequence_parallel else s) * elem)
    if sequence_parallel:
        formula = formula_parts(cfg, b, t, sequence_parallel)
        for module in ("attn.qkv", "mlp.gate") if llama else ("attn.qkv", "mlp.fc"):  # ColwiseParallel's inputs
            add(module, "gathered input", (2 * s * b * h - formula[module]) * elem / 2)  # the whole input, not 1/t
    return gaps


def compare_tp_layer(run: TPRun, cfg: ModelConfig, batch_size: int, layer: int = 0) -> list[TPPart]:
    """Block ``layer`` of a :func:`tp_dry_run` part by part against :func:`formula_parts` (GPT-2's or Llama's
    block, the paper's 16-bit terms), with the gap each known difference makes (:func:`term_gaps`: a model in
    fp32 or with dropout 0 has gaps of its own, and names only the masks it keeps)."""
    b = batch_size
    if cfg.block == "llama" and b == 1 and cfg.kv_heads == cfg.n_head:
        raise ValueError(
            "the Llama terms assume a micro-batch b > 1 or grouped-query attention: at b = 1 with one key/value head "
            "per query head the core's matmul keeps v as a view of the whole qkv output (its q and k columns too)"
        )
    measured = layer_parts(run.trace, layer)
    formula = formula_parts(cfg, b, run.t, run.sequence_parallel)
    gaps = term_gaps(cfg, b, run.t, run.sequence_parallel)
    rows = []
    for module in sorted(set(measured) | set(formula)):
        mine = gaps.get(module, {})
        gap = sum(mine.values())
        if gap != int(gap):
            raise AssertionError(f"{module}: a gap of {gap} bytes is not whole")  # the rules give whole bytes
        why = " + ".join(mine)
        rows.append(TPPart(module, measured.get(module, 0), formula.get(module, 0.0), int(gap), why))
    return rows


def format_tp_layer(parts: list[TPPart]) -> str:
    """One block's parts on one rank: measured, formula, and the known gap with its reason (GAP_REASONS)."""

    cols = [
        Col("part", 15, align="<"),
        Col("measured", 9, ",d"),
        Col("formula", 9, ",.0f"),
        Col("known gap", 9, "+,d"),
        Col("why", 14, align="<", gap="  "),
    ]
    rows = [[p.module, p.measured, p.formula, p.known_gap, p.why or "-"] for p in parts]
    rows.append(
        ["total", sum(p.measured for p in parts), sum(p.formula for p in parts), sum(p.known_gap for p in parts), ""]
    )
    return format_table(cols, rows, note="(bytes, one block, one rank)")


# ---- the split model computes what the whole one does (real ranks) ----------------------------------------------


@dataclass(frozen=True)
class TPEquality:
    """One real rank: the loss of the parallelised model and of the whole one on the same batch, and the largest
    gradient difference over all parameters, relative to that parameter's largest gradient."""

    strategy: str
    rank: int
    loss: float
    whole_loss: float
    max_grad_error: float
    n_grads: int  # parameters compared (every one of the model's)


@dataclass
class TPEqualityJob:
    """A job for :func:`~anatomy_helpers.distributed.world.run_world`: every rank builds the course GPT ``model``
    (ModelConfig overrides; dropout must be 0: DTensor draws its masks otherwise) twice from one seed, parallelises
    one copy over all ranks (:func:`~anatomy_helpers.distributed.tp_plan.parallelize_gpt`), runs forward and
    backward of both on the same batch and compares the loss and every gradient (DTensor shards gathered with
    ``full_tensor``, the qkv rows taken back out of rank order)."""

    model: dict
    sequence_parallel: bool = False
    batch_size: int = 4
    micro_batches: int = 1  # run_world's check reads it: every rank trains the same rows

    @property
    def strategy(self) -> str:  # what run_world keys the results by
        block = ModelConfig(**self.model).block
        return f"{'tp_sp' if self.sequence_parallel else 'tp'}_equality_{block}"

    def run_rank(self, rank: int, world_size: int, device: torch.device) -> TPEquality:
        from torch.distributed.device_mesh import init_device_mesh  # loaded where a rank or a mesh is built

        cfg = ModelConfig(**self.model)
        if cfg.dropout:
            raise ValueError(f"TPEqualityJob needs dropout 0 (the two models draw different masks), got {cfg.dropout}")
        torch.manual_seed(0)
        whole = GPT(cfg).to(device)
        split = GPT(cfg).to(device)
        split.load_state_dict(whole.state_dict())
        parallelize_gpt(split, init_device_mesh(device.type, (world_size,)), self.sequence_parallel)
        x, y = get_batch(self.batch_size, cfg.seq_len, device=device)
        # the course's step stopped after backward (gradients kept, no optimizer step): its loss, read
        plan = StepPlan(batch=lambda i: (x, y), optimizer_step=False)
        losses = [run_step(model, torch.optim.SGD(model.parameters()), plan, 0) for model in (split, whole)]
        order = qkv_rank_order(cfg.d_model, world_size, cfg.kv_heads * cfg.head_dim).to(device)
        reference = dict(whole.named_parameters())
        error = 0.0
        for name, p in split.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            ref = reference[name].grad
            ref = ref[order] if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias") else ref
            error = max(error, ((grad - ref).abs().max() / ref.abs().max()).item())
        return TPEquality(self.strategy, rank, losses[0], losses[1], error, len(reference))


def format_llama_terms(cfg: ModelConfig, b: int, degrees: tuple[int, ...] = (2, 8)) -> str:
    """:data:`LLAMA_TERMS` of ``cfg``'s block, micro-batch ``b``: each term on one rank at each TP degree (bytes,
    16-bit, plain TP), and whether TP splits it ("1/t") or every rank keeps it whole."""

    if cfg.block != "llama":
        raise ValueError(f"LLAMA_TERMS are the Llama block's terms; this model's block is {cfg.block!r}")
    per_t = {t: block_tp_terms(cfg, b, t) for t in degrees}
    cols = [Col("term", 26, align="<"), Col("module", 15, align="<"), Col("split", 5, align="<")]
    cols += [Col(f"t={t}", 9, ",.0f") for t in degrees]
    rows = [
        [term, module, "1/t" if sharded else "whole"] + [per_t[t][term] for t in degrees]
        for term, module, *_, sharded in LLAMA_TERMS
    ]
    rows.append(["total", "", ""] + [sum(per_t[t].values()) for t in degrees])
    return format_table(cols, rows, note="(bytes, one block, one rank, the formula)")


@dataclass
class LabelledJob:
    """A :class:`~anatomy_helpers.distributed.ranks.RankJob` whose results :func:`~anatomy_helpers.distributed.
    world.run_world` files under ``label`` instead of its strategy, so that one world (one start of the processes)
    can run one strategy on two models, e.g. "tp" on GPT-2's block and on Llama's."""

    job: object  # RankJob
    label: str

    @property
    def strategy(self) -> str:
        return self.label

    @property
    def batch_size(self) -> int:
        return self.job.batch_size

    @property
    def micro_batches(self) -> int:
        return self.job.micro_batches

    def run_rank(self, rank: int, world_size: int, device: torch.device):

        return dataclasses.replace(run_job(self.job, rank, world_size, device), strategy=self.label)
