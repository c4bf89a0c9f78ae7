"""CUDA's rules where they differ from the CPU kernels' in memory, applied to a CPU dry run as stated corrections.

A dry run (:mod:`anatomy_helpers.prediction.dryrun`) runs the CPU kernels' rules: what autograd saves, autocast's op
lists, the attention backend. Fake CUDA tensors cannot replace it (on a CPU-only torch build, autograd on fake CUDA
tensors aborts the process), so a prediction for a GPU takes the CPU trace and corrects it by the rules below, each read
from torch's source (the file and function are in its docstring; torch 2.13-era main):

* :func:`dropout_masks`: CUDA's fused dropout saves a bool mask (1 byte per element) where the CPU saves a noise
  tensor in the input's dtype.
* :func:`cublas_workspaces`: cuBLAS keeps one workspace per (handle, stream), allocated through the caching
  allocator and never freed: 8,320 KiB, or 32 MiB on compute capability 9.0.
* :func:`cublaslt_workspaces`: cuBLASLt, which runs a Linear with a bias (``addmm``), keeps its own 1 MiB per
  (handle, stream), also never freed.
* :func:`autocast_softmax`: CUDA autocast runs softmax in fp32 (CPU autocast does not), so the manual attention's
  saved probabilities are fp32 plus a 16-bit copy for ``att @ v``.
* :func:`sdpa_correction`: what the backend CUDA's ``scaled_dot_product_attention`` picks
  (:mod:`~anatomy_helpers.prediction.sdpa_rules`: by dtype, head dim and compute capability) saves against the CPU
  backend's.

What a rule cannot state exactly is refused with :class:`CudaRuleError`, not guessed. The corrections are bytes
per storage over that storage's lifetime (or from a moment on), so every phase peak is recomputed on the corrected
timeline. Where a stored GPU run measured a step the rules predict, every prediction for that compute capability says
what it measured, above the prediction or under it (:func:`~anatomy_helpers.prediction.cuda_checks.checked_text`).

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from ..core.checkpointing import recomputes_blocks
from ..core.model import GPT, ModelConfig
from ..core.units import KiB
from ..tracking.events import CATEGORIES
from ..tracking.trace import Trace
from .cuda_checks import checked_text
from .devices import Device
from .sdpa_rules import sdpa_choice

CPU_RULES = "CPU kernels"
CUDA_RULES = "CUDA rules from torch source ({}), {}"

#: cuBLAS workspace per (handle, stream): ``parseChosenWorkspaceSize`` in aten/src/ATen/cuda/CublasHandlePool.cpp
#: ("`:4096:2:16:8` default, 32MiB for Hopper": 4096 KiB x 2 + 16 KiB x 8, or 4096 KiB x 8 when major == 9 and
#: minor == 0).
CUBLAS_WORKSPACE = 4096 * KiB * 2 + 16 * KiB * 8  # 8,519,680 = 8,320 KiB
CUBLAS_WORKSPACE_SM90 = 4096 * KiB * 8  # 33,554,432 = 32 MiB
#: cuBLASLt's workspace per (handle, stream): ``getCUDABlasLtWorkspaceSize`` in CublasHandlePool.cpp
#: (``CUBLASLT_WORKSPACE_SIZE`` KiB, 1024 by default, capped at the cuBLAS workspace, which is larger on every GPU).
CUBLASLT_WORKSPACE = 1024 * KiB

#: Memory-efficient attention's logsumexp rows are padded to a multiple of this (``kAlignLSE`` in
#: aten/src/ATen/native/transformers/cuda/attention.cu, ``_efficient_attention_forward``).
EFFICIENT_LSE_ALIGN = 32
#: Flash pads a head dim that is not a multiple of this (``mha_fwd`` in flash_attn/flash_api.cpp pads q, k, v).
FLASH_HEAD_DIM_MULTIPLE = 8


class CudaRuleError(ValueError):
    """A configuration whose CUDA memory no rule here states exactly: the prediction is refused."""


@dataclass(frozen=True)
class Correction:
    """Bytes added (or taken, if negative) to ``category`` from timeline sample ``start`` to ``end`` (exclusive;
    ``end=None``: to the end of the trace)."""

    rule: str
    category: str
    nbytes: int
    start: int
    end: int | None = None


def _lifetime(trace: Trace, storage: int) -> tuple[int, int | None]:
    """Samples (alloc, free) of one storage in the trace; free None if alive at the end."""
    rows = np.flatnonzero(trace.alloc_ids == storage)
    start = int(rows[trace.alloc_deltas[rows] > 0][0])
    freed = rows[trace.alloc_deltas[rows] < 0]
    return start, (int(freed[0]) if len(freed) else None)


def _dropout_modules(cfg: ModelConfig) -> set[str]:
    with torch.device("meta"):
        model = GPT(cfg)
    return {name for name, m in model.named_modules() if isinstance(m, nn.Dropout)}


def dropout_masks(trace: Trace, cfg: ModelConfig) -> list[Correction]:
    """Every storage an ``nn.Dropout`` saved for backward: CPU noise in the input's dtype -> a CUDA bool mask.

    CPU: ``at::native::dropout`` (aten/src/ATen/native/Dropout.cpp) takes the fused path only where
    ``is_fused_kernel_acceptable`` holds (CUDA, XPU, lazy or privateuse1 tensors); on CPU ``_dropout_impl`` makes
    ``noise`` (``at::empty_like(input).bernoulli_(1 - p)``, divided by ``1 - p``) and returns ``input * noise``,
    whose backward saves the noise: input dtype, input shape. CUDA: ``native_dropout`` ->
    ``dropout_cuda`` (aten/src/ATen/native/cuda/Dropout.cu) returns ``(output, mask)`` with the mask
    ``at::empty_like(self, ... kBool)``, and ``native_dropout_backward`` needs only the mask and the scale.
    So each saved dropout storage shrinks from ``itemsize`` to 1 byte per element, over its lifetime. The saved
    tensors are counted from the trace (the modules that are ``nn.Dropout``), not from the config. Under a policy
    that recomputes blocks (full, every_k, selective) the masks remade in backward are saved under checkpoint's own
    hooks, not in ``trace.saved``: they stay at the CPU size, so the backward peak is overstated by at most one
    segment's masks (a stated upper bound).
    """
    if cfg.dropout == 0:
        return []
    names = _dropout_modules(cfg)
    out, seen = [], set()
    for s in trace.saved:
        if s.module in names and s.storage not in seen:
            seen.add(s.storage)
            numel = s.storage_bytes // s.dtype.itemsize
            start, end = _lifetime(trace, s.storage)
            out.append(Correction("dropout masks", s.category, numel - s.storage_bytes, start, end))
    return out


def cublas_workspace_bytes(capability: tuple[int, int]) -> int:
    """cuBLAS's workspace per (handle, stream) on a device of ``capability`` (see :data:`CUBLAS_WORKSPACE`)."""
    return CUBLAS_WORKSPACE_SM90 if tuple(capability) == (9, 0) else CUBLAS_WORKSPACE


def cublas_workspaces(trace: Trace, capability: tuple[int, int]) -> list[Correction]:
    """One cuBLAS workspace from step 1's forward on, a second from step 1's backward on; never freed.

    ``getCurrentCUDABlasHandle`` (aten/src/ATen/cuda/CublasHandlePool.cpp) reserves a handle per thread and calls
    ``setWorkspaceForHandle``, which allocates ``getChosenWorkspaceSize()`` bytes through the CUDA caching
    allocator the first time a (handle, stream) pair is seen and keeps it in ``cublas_handle_stream_to_workspace``
    (freed only by ``clearCublasWorkspaces``, which a training step does not call). The forward's matmuls run on
    the Python thread; autograd runs a CUDA device's backward on its own worker thread
    (``Engine::start_device_threads``, torch/csrc/autograd/engine.cpp), whose pool window reserves a second handle
    while the first thread keeps its own: two pairs on the default stream. Put in ``kernel_scratch``: library
    memory no op returns. Stated approximation: the first workspace is counted from the forward's first sample
    (the first matmul comes a few ops later, far from any peak). cuBLASLt's own workspace is
    :func:`cublaslt_workspaces`.
    """
    nbytes = cublas_workspace_bytes(capability)
    forward, backward = trace.phase(1, "forward").start, trace.phase(1, "backward").start
    return [
        Correction("cuBLAS workspace", "kernel_scratch", nbytes, forward),
        Correction("cuBLAS workspace", "kernel_scratch", nbytes, backward),
    ]


def cublaslt_workspaces(trace: Trace, cfg: ModelConfig) -> list[Correction]:
    """cuBLASLt's workspace (:data:`CUBLASLT_WORKSPACE`) from step 1's forward on, where a Linear with a bias runs;
    a second from step 1's backward on where the policy runs those Linears again in backward; never freed.

    A Linear with a bias is ``addmm`` (``linear`` flattens a contiguous 3-D input to 2-D); CUDA's
    ``addmm_out_cuda_impl`` (aten/src/ATen/native/cuda/Blas.cpp) takes the cuBLASLt path where
    ``isInputCompliesAddmmCudaLt`` holds (a 1-D bias, beta 1, both matrices more than one row and column; not
    disabled by ``DISABLE_ADDMM_CUDA_LT=1``), and ``gemm_and_bias`` (CUDABlas.cpp) asks ``getCUDABlasLtWorkspace``
    (CublasHandlePool.cpp) for its workspace: allocated through the caching allocator the first time a (handle,
    stream) pair asks, kept in ``cublaslt_handle_stream_to_workspace`` (shared with cuBLAS's only under
    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``). The GPT-2 block's Linears have biases (the Llama block's do not);
    ``full`` and ``every_k`` run whole blocks again on autograd's thread, with its own handle. Counted from the
    forward's first sample, as :func:`cublas_workspaces` counts its own.
    """
    if cfg.block != "gpt2" or min(cfg.seq_len, cfg.d_model) < 2:
        return []
    return cublaslt_threads(trace, 2 if cfg.checkpoint in ("full", "every_k") else 1)


def cublaslt_threads(trace: Trace, threads: int) -> list[Correction]:
    """:data:`CUBLASLT_WORKSPACE` for the forward's thread from step 1's forward on, and (``threads == 2``) for
    autograd's thread from step 1's backward on (see :func:`cublaslt_workspaces`)."""
    starts = [trace.phase(1, phase).start for phase in ("forward", "backward")[:threads]]
    return [Correction("cuBLASLt workspace", "kernel_scratch", CUBLASLT_WORKSPACE, start) for start in starts]


def autocast_softmax(trace: Trace, cfg: ModelConfig, autocast: str | None) -> list[Correction]:
    """The manual attention's softmax under CUDA autocast: saved in fp32, plus a 16-bit copy for ``att @ v``.

    aten/src/ATen/autocast_mode.h lists ``softmax``, ``log_softmax`` (fp32_set_opt_dtype) and ``layer_norm``
    (fp32) among the ops CUDA autocast runs in fp32; CPU autocast's lists (aten/src/ATen/autocast_mode.cpp,
    ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``) do not, so on CPU the softmax runs on the 16-bit scores and its
    one 16-bit output is saved by softmax's backward and by the bmm with v. On CUDA the output is fp32 (saved by
    softmax), and the bmm (lower precision) saves its own 16-bit cast unless dropout came in between (then the
    dropout's 16-bit output, already in the CPU trace, is what it saves). layer_norm and log_softmax change
    nothing in the course GPT: their inputs are fp32 already (the fp32 residual stream, ``logits.float()``).
    Refused: a bfloat16 model under autocast (every layer_norm would be cast up), and the manual attention inside
    SDPA's math backend. Not modelled: the transient fp32 copy of the scores (forward) and fp32 gradient
    (backward) around softmax, freed within the op's neighbourhood.
    """
    if autocast is None:
        return []
    if cfg.dtype != "float32":
        raise CudaRuleError(
            f"autocast over a {cfg.dtype} model: CUDA autocast casts every layer_norm and softmax input up to fp32, "
            "which no rule here models; predict the fp32 model with autocast instead"
        )
    if cfg.attn_impl != "manual":
        return []
    if recomputes_blocks(cfg.checkpoint):
        raise CudaRuleError(
            f"autocast with the manual attention and checkpoint={cfg.checkpoint!r}: the softmax outputs recomputed "
            "in backward are saved under checkpoint's own hooks, out of the trace's sight, so CUDA's fp32 softmax "
            "cannot be applied to them; use attn_impl='sdpa' or another policy"
        )
    out, seen = [], set()
    for s in trace.saved:
        # the manual attention's softmax output: the only 4-D (B, a, s, s) 16-bit tensor its module saves
        is_probs = s.module.endswith(".attn") and len(s.shape) == 4 and s.shape[-1] == s.shape[-2] == cfg.seq_len
        if is_probs and s.dtype.itemsize == 2 and s.storage not in seen:
            seen.add(s.storage)
            start, end = _lifetime(trace, s.storage)
            extra = s.storage_bytes if cfg.dropout else 2 * s.storage_bytes  # fp32 (+2 B/elem) [+ 16-bit copy]
            out.append(Correction("autocast softmax in fp32", s.category, extra, start, end))
    found = {s.module for s in trace.saved if s.storage in seen}
    if found != {f"blocks.{i}.attn" for i in range(cfg.n_layer)}:
        raise CudaRuleError(
            f"the softmax outputs of the manual attention were found in {sorted(found)}, not one set per block: "
            "CUDA autocast's fp32 softmax cannot be applied to this trace"
        )
    return out


def sdpa_correction(trace: Trace, cfg: ModelConfig, autocast: str | None, capability) -> list[Correction]:
    """What CUDA's SDPA backend saves against the CPU's, for ``attn_impl="sdpa"``.

    Without dropout the CPU runs its flash kernel (``_scaled_dot_product_flash_attention_cpu``), which saves q,
    k, v, the output and a (B, a, s) fp32 logsumexp: the same tensors CUDA's flash saves (``mha_fwd`` in
    aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp: ``softmax_lse`` (b, a, s) fp32; its philox
    seed and offset are CPU tensors without dropout). Memory-efficient attention pads the logsumexp's last
    dimension to a multiple of :data:`EFFICIENT_LSE_ALIGN`: that padding is the correction. Refused: dropout (the
    CPU's sdp_utils_cpp.cpp refuses flash with dropout and runs the math backend, which saves the (B, a, s, s)
    probabilities and noise, while CUDA's flash/efficient kernels save a philox seed and offset: no stated
    mapping here), the math backend on CUDA (:func:`~anatomy_helpers.prediction.sdpa_rules.sdpa_choice` says why
    flash and memory-efficient attention were refused), and flash with a head dim that is not a multiple of
    :data:`FLASH_HEAD_DIM_MULTIPLE` (``mha_fwd`` pads q, k and v: copies not modelled).
    """
    if cfg.attn_impl != "sdpa":
        return []
    backend, refused = sdpa_choice(cfg, autocast, capability)
    if cfg.dropout:
        raise CudaRuleError(
            "attn_impl='sdpa' with dropout: CPU runs SDPA's math backend (it saves the attention probabilities), "
            f"CUDA its {backend} kernel (it saves a random seed instead); no rule here maps one onto the other"
        )
    if backend == "math":
        raise CudaRuleError(f"CUDA would run SDPA's math backend ({'; '.join(refused)}): what it saves is not modelled")
    if backend == "flash" and cfg.head_dim % FLASH_HEAD_DIM_MULTIPLE:
        raise CudaRuleError(
            f"CUDA's flash attention pads head dim {cfg.head_dim} to a multiple of {FLASH_HEAD_DIM_MULTIPLE} (copies "
            "of q, k and v): not modelled"
        )
    if backend == "flash":
        return []
    out = []
    for s in trace.saved:
        if s.module.endswith(".attn") and s.dtype == torch.float32 and len(s.shape) == 3:  # (B, a, s) logsumexp
            b, a, t = s.shape
            pad = -(-t // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN - t
            if pad:
                start, end = _lifetime(trace, s.storage)
                out.append(Correction("SDPA efficient logsumexp", s.category, 4 * b * a * pad, start, end))
    return out


def cuda_corrections(trace: Trace, cfg: ModelConfig, autocast: str | None, device: Device) -> list[Correction]:
    """All the rules above for ``device`` (one with a compute capability); CudaRuleError where one refuses."""
    if device.capability is None:
        raise ValueError(f"{device.name} has no compute capability: its rules are the CPU kernels'")
    if cfg.checkpoint == "offload":
        raise CudaRuleError(
            "checkpoint='offload' on CUDA moves saved tensors to host memory (save_on_cpu), which a CPU dry run "
            "cannot show (there it is a no-op, checkpointing.offload_context): no rule here states the GPU's share"
        )
    return [
        *dropout_masks(trace, cfg),
        *cublas_workspaces(trace, device.capability),
        *cublaslt_workspaces(trace, cfg),
        *autocast_softmax(trace, cfg, autocast),
        *sdpa_correction(trace, cfg, autocast, device.capability),
    ]


def rules_text(
    corrections: list[Correction] | None, sdpa: str | None = None, capability: tuple[int, int] | None = None
) -> str:
    """The rules line of a prediction: "CPU kernels" (None) or the CUDA rules that changed something, the SDPA
    backend CUDA would run (``sdpa``, from ``sdpa_rules.sdpa_backend``) where the model uses SDPA, and what the
    stored GPU runs of this ``capability`` measured against the prediction (``cuda_checks.checked_text``)."""
    if corrections is None:
        return CPU_RULES
    used = list(dict.fromkeys(c.rule for c in corrections if c.nbytes))
    if sdpa is not None:
        used.append(f"SDPA's {sdpa} backend")
    return CUDA_RULES.format(", ".join(used) or "none changed this step", checked_text(capability))


def correction_series(trace: Trace, corrections: list[Correction]) -> np.ndarray:
    """(samples, categories) bytes the corrections add at each timeline sample."""
    out = np.zeros((len(trace.timeline), len(CATEGORIES)), dtype=np.int64)
    for c in corrections:
        out[c.start : c.end, CATEGORIES.index(c.category)] += c.nbytes
    return out


def corrected_peak(trace: Trace, series: np.ndarray, step: int, phase: str) -> tuple[int, int, dict[str, int]]:
    """(bytes, sample, bytes per category) at the corrected peak of one phase: the trace's window of the phase
    (the moment just before it included, as :meth:`Trace.peak` counts it) on the corrected timeline; a phase run
    more than once in the step (gradient accumulation's forward and backward, once per micro-batch): the highest
    of its runs, the first where two are as high, as :meth:`Trace.peak` takes it."""
    trace.phase(step, phase)  # ValueError where the step has no such phase
    best = None
    for ph in trace.phases():
        if ph.step != step or ph.phase != phase:
            continue
        first = max(ph.start - 1, 0)
        total = trace.timeline.total[first : ph.end + 1] + series[first : ph.end + 1].sum(axis=1)
        i = first + int(np.argmax(total))
        if best is None or total[i - first] > best[0]:
            best = (int(total[i - first]), i)
    nbytes, i = best
    breakdown = {c: int(b) for c, b in zip(CATEGORIES, trace.timeline.bytes[i] + series[i])}
    return nbytes, i, breakdown


__all__ = [
    "CUBLAS_WORKSPACE",
    "CUBLAS_WORKSPACE_SM90",
    "CUBLASLT_WORKSPACE",
    "Correction",
    "CudaRuleError",
    "autocast_softmax",
    "corrected_peak",
    "correction_series",
    "cublas_workspace_bytes",
    "cublas_workspaces",
    "cublaslt_threads",
    "cublaslt_workspaces",
    "cuda_corrections",
    "dropout_masks",
    "rules_text",
    "sdpa_correction",
]
