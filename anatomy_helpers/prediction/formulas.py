"""Closed-form memory arithmetic for the course GPT: numbers you can get without building a model.

Each function takes a ``ModelConfig`` (or anything with the same fields) and only
reads its fields, so it is cheap even for configurations far too big to allocate.
"""

from __future__ import annotations

from ..core.checks import positive_int

# ---- activations: Korthikanti et al. 2022, bytes of one transformer layer -------------------------------------
# "Reducing Activation Recomputation in Large Transformer Models", section 4.1.

#: The per-layer terms of the formula: (term, part of the layer, coefficient, unit), where the unit
#: is "sbh" (s*b*h) or "as^2b" (a*s*s*b) and the term's bytes are coefficient * unit.
#: 16-bit activations (2 bytes per element), 1-byte dropout masks, materialised attention.
KORTHIKANTI_TERMS = (
    ("QKV input", "attention", 2, "sbh"),
    ("Q and K", "attention", 4, "sbh"),
    ("softmax output", "attention", 2, "as^2b"),
    ("softmax dropout mask", "attention", 1, "as^2b"),
    ("dropout output", "attention", 2, "as^2b"),
    ("V", "attention", 2, "sbh"),
    ("out-proj input", "attention", 2, "sbh"),
    ("attn dropout mask", "attention", 1, "sbh"),
    ("fc1 input", "mlp", 2, "sbh"),
    ("GELU input", "mlp", 8, "sbh"),
    ("fc2 input", "mlp", 8, "sbh"),
    ("MLP dropout mask", "mlp", 1, "sbh"),
    ("LayerNorm inputs", "layernorm", 4, "sbh"),
)


#: Terms that are dropout masks: the formula counts them at 1 byte per element.
MASK_TERMS = ("softmax dropout mask", "attn dropout mask", "MLP dropout mask")


#: What a measured layer saves beyond the formula's terms.
EXTRA_TERMS = ("LayerNorm mean/rstd", "causal mask")


def korthikanti_terms(s: int, b: int, h: int, a: int) -> dict[str, int]:
    """Activation bytes of one transformer layer, per term of Korthikanti et al. (2022).

    ``s`` sequence length, ``b`` micro-batch, ``h`` hidden size, ``a`` attention heads.
    Assumes 16-bit activations, 1-byte dropout masks, standard (materialised) attention and a
    4h GELU MLP. The values sum to :func:`korthikanti_layer_bytes`.
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a)):
        positive_int(name, value)
    per_unit = {"sbh": s * b * h, "as^2b": a * s * s * b}
    return {term: coef * per_unit[unit] for term, _, coef, unit in KORTHIKANTI_TERMS}


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> int:
    """``s*b*h*(34 + 5*a*s/h)``: activation bytes of one layer (16-bit, 1-byte masks), exactly."""
    return 34 * s * b * h + 5 * a * s * s * b


# ---- model states per rank: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
# Models", section 5 (the stages), as lesson 08 measures them on torch.distributed's DDP, ZeroRedundancyOptimizer, FSDP2

#: Lesson 08's strategies (distributed/ranks.py STRATEGIES) and the ZeRO stage each one is.
ZERO_STAGE = {"ddp": 0, "ddp_bucket_view": 0, "zero1": 1, "fsdp2_zero2": 2, "fsdp2_zero3": 3}


def zero_model_states(
    strategy: str, n_params: int, world_size: int, *, param_bytes: int = 4, grad_bytes: int = 4, state_bytes: int = 8
) -> dict[str, float]:
    """Model states per rank by the ZeRO paper's stages (bytes): DP holds everything; ZeRO-1 divides the optimizer
    state by N, ZeRO-2 also the gradients, ZeRO-3 also the parameters. The paper's 16 bytes per parameter are
    mixed-precision Adam (2 + 2 + 12); the defaults here are the course's own split for fp32 AdamW (4 + 4 + 8)."""
    stage = ZERO_STAGE[strategy]
    n = world_size
    return {
        "parameters": n_params * param_bytes / (n if stage >= 3 else 1),
        "gradients": n_params * grad_bytes / (n if stage >= 2 else 1),
        "optimizer_state": n_params * state_bytes / (n if stage >= 1 else 1),
    }
