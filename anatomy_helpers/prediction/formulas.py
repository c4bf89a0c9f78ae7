"""Closed-form memory arithmetic for the course GPT: numbers you can get without building a model.

Each function takes a ``ModelConfig`` (or anything with the same fields) and only
reads its fields, so it is cheap even for configurations far too big to allocate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..checks import positive_int

if TYPE_CHECKING:  # imported for the type hint only: model.py imports this module
    from ..model import ModelConfig


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters of ``GPT(cfg)``, each shared tensor counted once.

    The GPT-2 parameter count as Narayanan et al. 2021 write it ("Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM"),
    P = 12Lh^2 (1 + 13/(12h) + (v + s)/(12Lh)), plus the final LayerNorm's 2h. Here
    h is the hidden size, v the vocabulary, L the blocks, s the context and r*h the
    MLP width (r = 4 in GPT-2):

    * each block: attention qkv + proj is 4h^2 weights + 4h biases, the MLP is
      2rh^2 weights + (r + 1)h biases, and two LayerNorms are 4h, so
      (4 + 2r)h^2 + (9 + r)h, which is the familiar 12h^2 + 13h for r = 4;
    * the token embedding is h*v, shared with the LM head (weight tying), so counted once;
    * the learned position embedding is s*h; the final LayerNorm is 2h.

    For r = 4: ``h*v + L*(12h^2 + 13h) + 2h + s*h``. An untied LM head adds another ``h*v``.
    ``cfg.block == "llama"``: :func:`llama_param_count`.
    """
    if getattr(cfg, "block", "gpt2") == "llama":
        return llama_param_count(cfg)
    h, v, L, s, r = cfg.d_model, cfg.vocab_size, cfg.n_layer, cfg.seq_len, cfg.mlp_ratio
    head = 0 if getattr(cfg, "tie_embeddings", True) else h * v
    per_block = (4 + 2 * r) * h * h + (9 + r) * h
    return h * v + L * per_block + 2 * h + s * h + head


def llama_param_count(cfg: ModelConfig) -> int:
    """Number of parameters of the Llama-block GPT: no biases, no position embedding (rotary has no weights).

    With ``d = h / a`` the head width, ``k`` key/value heads and ``F = r*h`` the MLP width:

    * attention: q and the output projection are ``h^2`` each, k and v are ``h*k*d`` each: ``2h^2 + 2hkd``;
    * SwiGLU MLP: gate, up and down are ``h*F`` each: ``3hF``;
    * two RMSNorms: ``2h``; the final RMSNorm ``h``;
    * the token embedding ``h*v``, plus ``h*v`` again for an untied LM head.
    """
    h, v, L, r = cfg.d_model, cfg.vocab_size, cfg.n_layer, cfg.mlp_ratio
    k = cfg.n_head if cfg.n_kv_head is None else cfg.n_kv_head
    d = h // cfg.n_head
    per_block = 2 * h * h + 2 * h * k * d + 3 * h * (r * h) + 2 * h
    head = 0 if cfg.tie_embeddings else h * v
    return h * v + L * per_block + h + head


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
