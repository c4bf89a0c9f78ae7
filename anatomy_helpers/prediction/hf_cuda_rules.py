"""CUDA's rules for a Hugging Face fine-tune on one named GPU: each rule :mod:`anatomy_helpers.prediction.cuda_rules`
states for the course GPT, applied to the CPU dry run of a Hugging Face model where it can be stated for that
architecture, and named in the report's rules line where it cannot (never dropped in silence).

* **cuBLAS workspaces** (``cuda_rules.cublas_workspaces``): one per (handle, stream), whatever the model: applied.
* **cuBLASLt workspaces** (``cuda_rules.cublaslt_workspaces``): where the model has a Linear with a bias (or
  transformers' ``Conv1D``, GPT-2's, which calls ``addmm`` with its bias): applied, from the forward's thread; a
  second from autograd's thread where ``gradient_checkpointing`` runs those layers again in backward. Found on the
  model built on the meta device (:func:`addmm_bias_modules`).
* **Dropout masks** (``cuda_rules.dropout_masks``): stated only where the model has no dropout (every
  ``nn.Dropout`` at p = 0 and no attention dropout in its config): then it changes nothing. Otherwise named, not
  applied: the course's rule maps the course GPT's dropout modules, not a Hugging Face model's (nor the
  attention's dropout inside SDPA, which the CPU runs in SDPA's math backend).
* **SDPA's backend** (:mod:`~anatomy_helpers.prediction.sdpa_rules`): the backend CUDA would pick for the model's
  head dim, dtype and GPU is named; what it saves against the CPU kernel is stated for the course GPT's call only
  (a Hugging Face model may pass an attention mask, which flash refuses), so it is not applied. Where CUDA would
  run the math backend (bf16 below compute capability 8.0: a T4), the line says the prediction is low: math saves
  the (B, a, s, s) probabilities that the CPU's fused kernel does not.
* **Autocast's fp32 op lists** (``cuda_rules.autocast_softmax``): stated for the course GPT's softmax only; under
  autocast a Hugging Face model's ops (its norms, its softmax in eager attention) are not mapped: named.

Per rank (data parallelism) none is applied: the rank's dry run follows the CPU kernels' rules
(``prediction.hf_fit.HF_RULES``), as the course GPT's ranks do.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .cuda_checks import NOT_CHECKED
from .cuda_rules import CUDA_RULES, Correction, cublas_workspaces, cublaslt_threads
from .devices import Device
from .hf_step import FineTune, make_hf_model
from .sdpa_rules import choose_backend

#: Config attributes that hold an attention dropout probability (transformers' names across architectures).
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop")


def addmm_bias_modules(cfg, ft: FineTune) -> list[str]:
    """The modules of ``ft``'s model that run ``addmm`` with a bias (a Linear with a bias, transformers' Conv1D):
    built on the meta device (no memory)."""
    with torch.device("meta"):
        model = make_hf_model(cfg, ft)
    return [
        name
        for name, m in model.named_modules()
        if (isinstance(m, nn.Linear) and m.bias is not None) or type(m).__name__ == "Conv1D"
    ]


def dropout_in(cfg, ft: FineTune) -> list[str]:
    """Where ``ft``'s model drops out in training: ``nn.Dropout`` modules with p > 0 and attention dropout
    attributes of its config above 0 (names, empty where it has none)."""
    with torch.device("meta"):
        model = make_hf_model(cfg, ft)
    found = [name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    found += [f"config.{key}" for key in ATTENTION_DROPOUT_KEYS if (getattr(cfg, key, 0) or 0) > 0]
    return found


def head_dim(cfg) -> int:
    """The attention's head dim: the config's own ``head_dim`` where it has one, else width / heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def hf_cuda_rules(trace, cfg, ft: FineTune, device: Device) -> tuple[list[Correction], str]:
    """(the corrections CUDA's rules add to ``trace``, a dry run of ``ft`` on ``cfg``; the rules line naming what
    was applied and what was not) for ``device``, a GPU with a compute capability (see the module docstring)."""
    if device.capability is None:
        raise ValueError(f"{device.name} has no compute capability: its rules are the CPU kernels'")
    corrections = list(cublas_workspaces(trace, device.capability))
    applied, named = ["cuBLAS workspace"], []
    biased = addmm_bias_modules(cfg, ft)
    if biased:
        corrections += cublaslt_threads(trace, 2 if ft.gradient_checkpointing else 1)
        applied.append("cuBLASLt workspace")
    dropped = dropout_in(cfg, ft)
    if dropped:
        shown = ", ".join(dropped[:3]) + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "")
        named.append(f"dropout masks ({shown}: mapped for the course GPT's modules only)")
    if ft.attn_implementation == "sdpa":
        dtype = ft.autocast or ft.dtype
        backend, refused = choose_backend(head_dim(cfg), dtype, 0.1 if dropped else 0.0, device.capability)
        if backend == "math":  # a real difference, not a detail: say which way the prediction is off
            named.append(
                f"SDPA's math backend ({refused[-1]}): it saves the (B, a, s, s) attention probabilities, which "
                "this prediction leaves out: it is low"
            )
        else:
            named.append(
                f"SDPA's {backend} backend (what it saves against the CPU kernel: stated for the course GPT only)"
            )
    if ft.autocast is not None:
        named.append(f"{ft.autocast} autocast's fp32 op lists (mapped for the course GPT's softmax only)")
    checked = f"{NOT_CHECKED.replace('this GPU', 'a Hugging Face model')}"
    text = CUDA_RULES.format(", ".join(applied), checked)
    if named:
        text += "; not applied, the CPU kernels' instead: " + "; ".join(named)
    return corrections, text


__all__ = ["addmm_bias_modules", "dropout_in", "head_dim", "hf_cuda_rules"]
