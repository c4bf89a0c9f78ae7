"""The pieces of a Hugging Face fine-tune's will-it-fit (the one entry is
:func:`anatomy_helpers.distributed.hf_fit.will_it_fit_hf`, one device or per rank): the request's check, its label,
and :data:`HF_RULES`; a trace becomes the course GPT's :class:`~anatomy_helpers.prediction.fit.FitReport` through
:func:`~anatomy_helpers.prediction.fit.trace_fit_report`, for a trace of the
models of :mod:`anatomy_helpers.prediction.hf`.

The same pieces: a two-step dry run (:func:`~anatomy_helpers.prediction.hf_step.dry_run_hf`: the fine-tuning step
on fake tensors, byte for byte the tracked real step, micro-batches included), its allocations replayed through
the caching-allocator simulator capped at the device's usable memory, and the same
:class:`~anatomy_helpers.prediction.fit.FitReport`. One difference, and one thing found elsewhere:

* **Device rules.** The CUDA rules of :mod:`anatomy_helpers.prediction.cuda_rules` (dropout masks, cuBLAS and
  cuBLASLt workspaces, autocast's softmax, SDPA's backend) are stated for the course's GPT, op by op. On one named
  GPU, :mod:`anatomy_helpers.prediction.hf_cuda_rules` applies those that can be stated for a Hugging Face
  architecture and names the rest in the report's rules line; per rank, and on a device given by its size, the
  phase needs follow the CPU kernels' rules (:data:`HF_RULES`), as the course GPT's ranks do. The report's
  assumptions say so, with the step's own (:func:`hf_assumptions`).
* **Data parallelism**: per rank under DDP or ZeRO, :func:`anatomy_helpers.distributed.hf_fit.will_it_fit_hf`
  dry-runs one rank of the sharded step on torch's fake process group, the engine lesson 08's per-rank tables run,
  and reports it through :func:`~anatomy_helpers.prediction.fit.trace_fit_report` too.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from .cuda_rules import CPU_RULES
from .fit import usable_device
from .hf import hf_config
from .hf_step import FineTune

#: The model states (a trace's categories).
MODEL_STATES = ("parameters", "gradients", "optimizer_state")
#: The rules of a Hugging Face step where CUDA's are not applied: per rank, or on a device given only by its size
#: (hf_cuda_rules.py applies them on one named GPU).
HF_RULES = (
    f"{CPU_RULES}, not CUDA's: CUDA's rules are applied to a Hugging Face step on one named GPU only, not per rank "
    "or on a device given by its size"
)


def hf_assumptions(ft: FineTune) -> tuple[str, ...]:
    """What a Hugging Face fine-tune's report assumes about its step (the :class:`FitReport`'s assumptions):
    unpadded full-length sequences (hf_step.HF_ASSUMPTIONS), no key/value cache, checkpointing, precision."""
    checkpointing = "on (HF's gradient_checkpointing_enable())" if ft.gradient_checkpointing else "off"
    weights = f"{ft.dtype} weights" + (
        " (the frozen base; LoRA adapters as peft makes them)" if ft.method == "lora" else ""
    )
    return (
        f"sequences: every row {ft.seq_len} tokens, full length: no padding, no attention_mask (a padded batch "
        "with an attention_mask costs more: transformers builds a (batch, 1, s, s) mask, growing with s squared; "
        "not modelled)",
        "use_cache=False: the dry run turns transformers' key/value cache off, as a training loop should "
        "(model.config.use_cache = False; gradient checkpointing turns it off too); left on, the forward also "
        "returns every layer's keys and values, memory this prediction does not hold",
        f"gradient checkpointing: {checkpointing}",
        f"precision: {weights}, {f'{ft.autocast} autocast' if ft.autocast else 'no autocast'}, "
        f"{ft.optimizer} state in its parameters' dtype",
    )


def describe_hf(cfg, ft: FineTune, name: str | None = None) -> str:
    """A short label of a fine-tune of ``cfg``."""
    how = {"full": "full", "frozen": f"frozen {', '.join(ft.freeze)}", "lora": f"LoRA r={ft.lora_rank}"}[ft.method]
    parts = [name or f"{cfg.model_type} ({type(cfg).__name__})", how, f"b={ft.batch_size} s={ft.seq_len}", ft.dtype]
    if ft.autocast:
        parts.append(f"autocast {ft.autocast}")
    impl = "fused" if ft.fused else "foreach" if ft.foreach else "single"
    parts += [f"{ft.attn_implementation} attention", f"{ft.optimizer} ({impl})"]
    if ft.gradient_checkpointing:
        parts.append("gradient checkpointing")
    if ft.micro_batches > 1:
        parts.append(f"{ft.micro_batches} micro-batches")
    return ", ".join(parts)


def check_request(model, fine_tune: FineTune, device):
    """(the config, the Device) of a will-it-fit request; ValueError naming the argument that is wrong."""
    cfg = hf_config(model)
    if not isinstance(fine_tune, FineTune):
        raise ValueError(f"fine_tune must be a FineTune, got {type(fine_tune).__name__}")
    return cfg, usable_device(device)
