"""Which kernel CUDA's ``scaled_dot_product_attention`` runs for the course GPT's attention, from torch's source:
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (torch 2.13-era main).

``select_sdp_backend`` tries the backends in ``priority_order`` and takes the first whose checks all pass:
flash, then memory-efficient, then math (cuDNN first only where ``check_prefer_cudnn_attention`` holds, below).
For the course's call (dense (B, a, s, D) tensors with the last stride 1, no mask, ``is_causal`` with as many
queries as keys, as many key heads as query heads: the Llama block repeats them), the checks that can fail are:

* **flash** (``can_use_flash_attention``): compute capability 8.0 to 12.1
  (``check_flash_attention_hardware_support``); fp16 or bf16 inputs (``check_dtypes_flash_attention`` ->
  ``check_dtypes_low_precision``; FP8 only after ``torch.backends.cuda`` opts into FA3, which the course never does);
  a head dim of at most 256 (``check_head_dim_size_flash``); and, while training on 8.6 to 8.9 (an A10, an L4) or
  12.0 to 12.1, a head dim of at most 192, or above 224 without dropout
  (``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``: flash's backward cannot take the rest).
* **memory-efficient** (``can_use_mem_efficient_attention``): compute capability 5.0 to 12.1
  (``check_mem_efficient_hardware_support``); fp16, fp32 or bf16 from 8.0 on, fp16 or fp32 below; a head dim that
  is a multiple of ``minimum_gemm_alignment`` (``check_head_dim_size_mem_efficient``: 4 from 8.0 on, raised to
  128 / bits per element where tensor cores are used: from 8.0 on, or 7.x with 16-bit inputs: so 8 for 16-bit
  inputs there, 4 for fp32 from 8.0 on, else 1), and q, k, v storage offsets aligned to as many elements from 8.0
  on (``check_data_ptr_alignment_mem_efficient``: the course's q, k, v start at multiples of the model width, so a
  head dim that passes the first check passes this one). No upper head dim on CUDA.
* **math**: always (enabled by default): what is left.

**cuDNN attention** comes first where ``check_prefer_cudnn_attention`` holds: a cuDNN runtime newer than 9.15.0 on
compute capability 9.x or 10.x (with CUDA < 13, 9.0 / 9.3 / 10.0 / 10.3 only), which depends on the installed
wheel, not on the GPU, so a prediction cannot know it. It is refused wherever flash is for the course's call (it
also needs 16-bit inputs, compute capability 8.0 to 12.1, a head dim of at most 256 and a multiple of 8) and, where
it runs, it saves (B, a, s, 1) fp32 statistics: flash's logsumexp's bytes. So the memory is flash's either way,
and :func:`sdpa_backend` says "flash". Every backend is assumed enabled (``torch.backends.cuda.enable_*_sdp``'s
defaults).

What each backend saves against the CPU's is ``cuda_rules.sdpa_correction``.
"""

from __future__ import annotations

from ..core.model import ModelConfig

#: Compute capabilities each fused backend runs on, inclusive (the ``SMVersion`` bounds in sdp_utils.cpp).
FLASH_ARCHS = ((8, 0), (12, 1))
EFFICIENT_ARCHS = ((5, 0), (12, 1))
#: Flash's largest head dim (``check_head_dim_size_flash``).
FLASH_MAX_HEAD_DIM = 256
#: Where flash's backward cannot take a head dim in (192, 224], nor in (224, 256] with dropout.
FLASH_TRAINING_GAP_ARCHS = (((8, 6), (8, 9)), ((12, 0), (12, 1)))
FLASH_TRAINING_GAP = (192, 224)

SIXTEEN_BIT = ("float16", "bfloat16")


def _within(capability: tuple[int, int], bounds: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    return bounds[0] <= tuple(capability) <= bounds[1]


def query_dtype(cfg: ModelConfig, autocast: str | None) -> str:
    """The dtype SDPA sees: autocast's (SDPA is on CUDA autocast's lower-precision list) or the model's."""
    return autocast if autocast is not None else cfg.dtype


def minimum_gemm_alignment(dtype: str, capability: tuple[int, int]) -> int:
    """``minimum_gemm_alignment`` in sdp_utils.cpp: the multiple of a head dim memory-efficient attention needs."""
    major = capability[0]
    tensor_cores = major >= 8 or (major >= 7 and dtype in SIXTEEN_BIT)  # use_tensor_cores
    align = 4 if major >= 8 else 1
    return max(align, 128 // (16 if dtype in SIXTEEN_BIT else 32)) if tensor_cores else align


def flash_refusal(d: int, dtype: str, dropout: float, capability: tuple[int, int]) -> str | None:
    """Why flash attention does not take a call of head dim ``d`` in ``dtype`` (the first failing check, named),
    or None if it does."""
    cap = tuple(capability)
    if not _within(cap, FLASH_ARCHS):
        return f"flash runs on compute capability 8.0 to 12.1, not {cap[0]}.{cap[1]}"
    if dtype not in SIXTEEN_BIT:
        return f"flash takes fp16 or bf16 inputs, not {dtype}"
    if d > FLASH_MAX_HEAD_DIM:
        return f"flash takes head dims up to {FLASH_MAX_HEAD_DIM}, not {d}"
    low, high = FLASH_TRAINING_GAP
    if any(_within(cap, archs) for archs in FLASH_TRAINING_GAP_ARCHS):
        if low < d <= high or (d > high and dropout):
            return (
                f"flash's backward on compute capability {cap[0]}.{cap[1]} takes head dims up to {low}, or above "
                f"{high} without dropout, not {d}{' with dropout' if d > high else ''}"
            )
    return None


def efficient_refusal(d: int, dtype: str, capability: tuple[int, int]) -> str | None:
    """Why memory-efficient attention does not take a call of head dim ``d`` in ``dtype`` (named), or None."""
    cap = tuple(capability)
    if not _within(cap, EFFICIENT_ARCHS):
        return f"memory-efficient attention runs on compute capability 5.0 to 12.1, not {cap[0]}.{cap[1]}"
    if dtype == "bfloat16" and cap < (8, 0):
        return f"memory-efficient attention takes bf16 from compute capability 8.0 on, not on {cap[0]}.{cap[1]}"
    align = minimum_gemm_alignment(dtype, cap)
    if d % align:
        return f"memory-efficient attention needs a head dim that is a multiple of {align} here, not {d}"
    return None


def choose_backend(d: int, dtype: str, dropout: float, capability: tuple[int, int]) -> tuple[str, list[str]]:
    """(the backend CUDA runs for a dense causal call of head dim ``d``: "flash", "efficient" or "math"; why each
    backend before it was refused)."""
    refused = []
    for backend, why in (
        ("flash", flash_refusal(d, dtype, dropout, capability)),
        ("efficient", efficient_refusal(d, dtype, capability)),
    ):
        if why is None:
            return backend, refused
        refused.append(why)
    return "math", refused


def sdpa_choice(cfg: ModelConfig, autocast: str | None, capability: tuple[int, int]) -> tuple[str, list[str]]:
    """:func:`choose_backend` for the course model's attention."""
    return choose_backend(cfg.head_dim, query_dtype(cfg, autocast), cfg.dropout, capability)


def sdpa_backend(cfg: ModelConfig, autocast: str | None, capability: tuple[int, int]) -> str:
    """The backend CUDA's ``scaled_dot_product_attention`` picks for the course model (see the module docstring):
    "flash" (or cuDNN attention, which saves the same bytes), "efficient" or "math"."""
    return sdpa_choice(cfg, autocast, capability)[0]


__all__ = [
    "choose_backend",
    "efficient_refusal",
    "flash_refusal",
    "minimum_gemm_alignment",
    "query_dtype",
    "sdpa_backend",
    "sdpa_choice",
]
