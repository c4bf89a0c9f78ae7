"""What the course GPT keeps for backward, tensor by tensor: the closed form's terms (bytes).

Each term is one tensor (or one kind of tensor) a block saves or holds, written from the model's own code
(model.py) and torch's CPU kernels: which attention kernel runs and in which dtype, which reshapes copy, what each
module saves, what a checkpointing policy keeps, and what an attention core holds while it runs. Notation as in
``estimate``: ``N = b*s`` tokens, ``h`` hidden size, ``a`` heads, ``e`` bytes per element. :mod:`.estimate` builds
the phase moments and ``estimate_step`` from them.
"""

from __future__ import annotations

from ..core.model import ModelConfig, param_count


def elt(cfg: ModelConfig) -> int:
    return 2 if cfg.dtype == "bfloat16" else 4


def parameter_bytes(cfg: ModelConfig) -> int:
    """Parameters plus the buffers the model registers (causal masks, rotary tables): what is alive at rest."""
    e, s, L = elt(cfg), cfg.seq_len, cfg.n_layer
    buffers = L * s * s if cfg.attn_impl == "manual" else 0  # one (s, s) bool mask per layer
    if cfg.block == "llama":
        buffers += L * 2 * s * (cfg.head_dim // 2) * e  # cos and sin, (s, D/2) each, per layer
    return param_count(cfg) * e + buffers


def math_sdpa(cfg: ModelConfig) -> bool:
    """Whether CPU sdpa runs its math kernel (which materialises the scores, as the manual core does) rather than
    the flash kernel. It does with dropout, and where flash's checks refuse q: a Llama block of head width 2 and
    more than one head, whose rotary q comes out of ``torch.cat`` of two width-1 halves laid out heads-innermost
    (last-dimension stride a, not 1: ``check_last_dim_stride_equals_1_dense`` in aten's sdp_utils_cpp.h), but for
    one position (then its strides are contiguous ones)."""
    narrow = cfg.block == "llama" and cfg.head_dim == 2 and cfg.n_head > 1 and cfg.seq_len > 1
    return cfg.attn_impl == "sdpa" and (cfg.dropout > 0 or narrow)


def scores_materialised(cfg: ModelConfig) -> bool:
    """Whether the attention core holds the (b, a, s, s) scores: the manual core, or sdpa's math kernel."""
    return cfg.attn_impl == "manual" or math_sdpa(cfg)


def core_elt(cfg: ModelConfig) -> int:
    """Bytes per element of the attention core. CPU sdpa's math kernel casts q, k and v of a 16-bit model to fp32
    first (``_scaled_dot_product_attention_math`` in aten's transformers/attention.cpp)."""
    return 4 if math_sdpa(cfg) else elt(cfg)


def head_views(cfg: ModelConfig, b: int) -> bool:
    """Whether the core's matmuls reshape (B, a, s, D) views of q, k, v to (B*a, s, D) without a copy: at B = 1 or
    a = 1, where the two dimensions merged include one of size 1 (any strides do)."""
    return b == 1 or cfg.n_head == 1


def qkv_storages(cfg: ModelConfig, N: int) -> int:
    """Bytes of the storages behind the q, k, v that enter the attention core. GPT-2: views of the one qkv output
    (3Nh). Llama: q and k are rotary outputs; with grouped-query attention k and v are ``repeat_interleave``
    copies (Nh each), without it v is a view of the whole qkv output."""
    e, h, D = elt(cfg), cfg.d_model, cfg.head_dim
    if cfg.block != "llama" or cfg.kv_heads != cfg.n_head:
        return 3 * N * h * e
    return 2 * N * h * e + N * (cfg.n_head + 2 * cfg.kv_heads) * D * e


def matmul_qkv(cfg: ModelConfig, b: int, without_v: bool = False) -> int:
    """Bytes of the storages behind the q, k^T and v that the materialised core's two matmuls save (or only q's
    and k's). Reshaping a (B, a, s, D) view to (B*a, s, D) copies it, except at B = 1 or a = 1
    (:func:`head_views`), where the matmuls save views of q, k and v themselves (:func:`qkv_storages`); the
    math kernel makes a new scaled q and k^T there and keeps v a view. A 16-bit model's math kernel works on fp32
    copies."""
    e, h, N, ec = elt(cfg), cfg.d_model, b * cfg.seq_len, core_elt(cfg)
    if not head_views(cfg, b) or ec != e:
        return (2 if without_v else 3) * N * h * ec
    grouped = cfg.block == "llama" and cfg.kv_heads != cfg.n_head
    v = N * h * e if grouped else N * (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim * e  # a copy, or the qkv output
    if cfg.attn_impl == "manual":
        qk = qkv_storages(cfg, N) - v
        return qk if without_v else qk + v
    return 2 * N * h * e + (0 if without_v else v)


def block_terms(cfg: ModelConfig, b: int) -> dict[str, int]:
    """What one block saves for backward without checkpointing, by the module that saves it first (bytes).

    The keys are the block's submodules (``attn`` is the attention core, the block's own ops); each value counts
    every storage once, for the first module that saves it, as :func:`anatomy_helpers.prediction.saved.saved_rows` does:

    * a norm keeps its input and mean and rstd (LayerNorm: N each, in the model's dtype on CPU) or its input,
      the normalised input and the rms (RMSNorm); each Linear keeps its input; GELU its input; SwiGLU gate, silu,
      up;
    * the manual core keeps copies of q, k^T and v for the two matmuls (3Nh; at batch 1 views, :func:`matmul_qkv`),
      the softmax output and the inverted causal mask ``~mask`` (s x s bool); sdpa keeps q, k, v
      (:func:`qkv_storages`), its output and the fp32 log-sum-exp. With dropout CPU sdpa runs the math kernel,
      which keeps what the manual core does but no mask.
    * dropout on CPU keeps its noise in the model's dtype; the attention dropout's output is saved by att @ v.
    """
    e, s, h, a, F = elt(cfg), cfg.seq_len, cfg.d_model, cfg.n_head, cfg.mlp_ratio * cfg.d_model
    N, scores, ec, dropout = b * s, b * a * s * s, core_elt(cfg), cfg.dropout > 0
    llama, fused = cfg.block == "llama", not scores_materialised(cfg)
    norm = 2 * N * h * e + N * e if llama else N * h * e + 2 * N * e
    if fused:  # the flash kernel: q, k, v, its output (often the out-proj's input too) and the log-sum-exp
        core = qkv_storages(cfg, N) + N * h * e + 4 * b * a * s
    else:  # q, k^T, v for the two matmuls, the softmax output, (the dropout's output), (the causal mask)
        core = matmul_qkv(cfg, b) + scores * ec * (2 if dropout else 1) + (s * s if cfg.attn_impl == "manual" else 0)
    attn_noise = scores * e if dropout and cfg.attn_impl == "manual" else 0  # sdpa's noise is in its core
    terms = {"ln1": norm, "attn.qkv": N * h * e, "attn": core + (scores * ec if dropout and not attn_noise else 0)}
    terms["attn.attn_drop"] = attn_noise
    # flash's output takes q's layout: GPT-2's q is a transposed view, so the output already is (B, s, a, D) in
    # memory and is the out-proj's input; Llama's rotary q is contiguous, so y is copied, but with one head or one
    # position (a transpose that moves only a size-1 dimension keeps it contiguous)
    y_copied = llama and a > 1 and s > 1
    terms["attn.proj"] = 0 if fused and not y_copied else N * h * e
    terms["attn.resid_drop"] = N * h * e if dropout else 0
    terms["ln2"] = norm
    if llama:
        terms.update({"mlp.gate": N * h * e, "mlp": 3 * N * F * e})  # silu's input, its output, up's output
    else:
        terms.update({"mlp.fc": N * h * e, "mlp.gelu": N * F * e})
    terms.update({"mlp.proj": N * F * e, "mlp.drop": N * h * e if dropout else 0})
    return terms


def layer_activation_bytes(cfg: ModelConfig, b: int, policy: str | None = None) -> int:
    """What one block keeps for backward with no checkpointing (``policy`` "none") or under ``policy``.

    ``"none"`` and ``"offload"`` (which keeps everything on a CPU): the sum of :func:`block_terms`.
    ``"attention"`` keeps everything but the core's insides: the core's inputs q, k, v (their storages) and the
    out-projection's input instead. ``"selective"`` keeps the block's input and the outputs of its matrix
    multiplications: qkv, q k^T and att v (or the flash output and log-sum-exp), out-proj, fc (gate and up), the
    MLP's out-projection. ``"full"`` and ``"every_k"`` keep only each segment's input (:func:`activation_bytes`).
    """
    e, s, h, a, D = elt(cfg), cfg.seq_len, cfg.d_model, cfg.n_head, cfg.head_dim
    N, F, ec = b * s, cfg.mlp_ratio * cfg.d_model, core_elt(cfg)
    llama, materialised = cfg.block == "llama", scores_materialised(cfg)
    policy = cfg.checkpoint if policy is None else policy
    if policy in ("full", "every_k"):
        return 0
    if policy == "selective":
        qkv_out = N * (cfg.n_head + 2 * cfg.kv_heads) * D * e
        core = (b * a * s * s + N * h) * ec if materialised else N * h * e + 4 * b * a * s
        mlp = N * F * e * (2 if llama else 1) + N * h * e
        return N * h * e + qkv_out + core + N * h * e + mlp
    terms = block_terms(cfg, b)
    if policy == "attention":  # recomputed in backward from its inputs
        terms.update({"attn": qkv_storages(cfg, N), "attn.attn_drop": 0, "attn.proj": N * h * e})
    return sum(terms.values())


def embedding_activation_bytes(cfg: ModelConfig, b: int) -> int:
    """The embeddings' saved tensors: GPT-2's position ids (int64, s) and the embedding dropout's noise (Nh)."""
    pos = 8 * cfg.seq_len if cfg.block != "llama" else 0
    return pos + (b * cfg.seq_len * cfg.d_model * elt(cfg) if cfg.dropout > 0 else 0)


def head_activation_bytes(cfg: ModelConfig, b: int) -> int:
    """The final norm's, the LM head's input and the loss's saved tensors: fp32 log-probabilities (N x V) and the
    loss's 4-byte total weight. Freed at the head's backward."""
    e, N, h, V = elt(cfg), b * cfg.seq_len, cfg.d_model, cfg.vocab_size
    norm = 2 * N * h * e + N * e if cfg.block == "llama" else N * h * e + 2 * N * e
    return norm + N * h * e + N * V * 4 + 4


def segments(cfg: ModelConfig) -> list[int]:
    """Blocks per checkpointed segment under "full" or "every_k", in forward order."""
    k = cfg.checkpoint_every if cfg.checkpoint == "every_k" else 1
    return [min(k, cfg.n_layer - i) for i in range(0, cfg.n_layer, k)]


def activation_bytes(cfg: ModelConfig, b: int) -> int:
    """What the forward keeps for backward, at its end, under the config's checkpointing policy."""
    L, N, h = cfg.n_layer, b * cfg.seq_len, cfg.d_model
    edge = embedding_activation_bytes(cfg, b) + head_activation_bytes(cfg, b)
    if cfg.checkpoint in ("full", "every_k"):
        return len(segments(cfg)) * N * h * elt(cfg) + edge  # one input per segment
    return L * layer_activation_bytes(cfg, b) + edge


def block_parameter_bytes(cfg: ModelConfig) -> int:
    """Bytes of one block's parameters."""
    h, F, e = cfg.d_model, cfg.mlp_ratio * cfg.d_model, elt(cfg)
    if cfg.block == "llama":
        return (2 * h * h + 2 * h * cfg.kv_heads * cfg.head_dim + 3 * h * F + 2 * h) * e
    return (4 * h * h + 2 * h * F + 9 * h + F) * e


def reshape_copies(cfg: ModelConfig, b: int) -> tuple[int, int, int]:
    """Bytes of the copies of q, k^T and v that the manual core's matmuls make to reshape them to (B*a, s, D).

    None where the reshape is a view (:func:`head_views`). GPT-2's q, k, v are transposed views of the qkv output:
    each copied. Llama's rotary q and k are contiguous (viewed), but at head width 2, where ``torch.cat`` lays them
    out heads-innermost (:func:`math_sdpa`); its v is a view of the qkv output (copied) or, with grouped-query
    attention, a contiguous ``repeat_interleave`` output, as k then is."""
    one = b * cfg.seq_len * cfg.d_model * elt(cfg)
    if head_views(cfg, b):
        return 0, 0, 0
    if cfg.block != "llama":
        return one, one, one
    narrow, grouped = cfg.head_dim == 2 and cfg.seq_len > 1, cfg.kv_heads != cfg.n_head
    return (one if narrow else 0), (one if narrow and not grouped else 0), (0 if grouped else one)


def saving_core(cfg: ModelConfig, b: int) -> int:
    """The peak of the manual core run with autograd saving (no checkpointing), beyond q, k, v's storages.

    The copies of q and k^T stay (saved); the scores, scaled, and masked beside the inverted mask (two s^2 at a
    time); then what the core saves (the softmax output, with dropout its noise and output) beside v's copy, the
    output y and its contiguous copy (none with one head)."""
    s, N, h, e = cfg.seq_len, b * cfg.seq_len, cfg.d_model, elt(cfg)
    S, dropout = b * cfg.n_head * s * s * e, cfg.dropout > 0
    q, k, v = reshape_copies(cfg, b)
    y = N * h * e * (1 if cfg.n_head == 1 else 2)
    return q + k + s * s + max(2 * S, (3 if dropout else 1) * S + v + y)


def core_transients(cfg: ModelConfig, b: int, scores_kept: bool = False) -> int:
    """The peak of a materialised attention core run without saving (a checkpointed forward), beyond q, k, v.

    Manual: the scores, scaled, masked (the inverted mask), softmax: two at a time, or the copies of q and k^T
    beside the scores (:func:`reshape_copies`); with dropout three s^2 tensors (its noise); at its end the
    weights beside v's copy and the output, then the output beside its contiguous copy. CPU sdpa's
    math kernel: an output buffer and a float s x s causal mask beside two s^2 tensors (the scores plus the mask,
    softmax), three with dropout, or beside the scores and its scaled q, k^T and v (v a view at batch 1); a 16-bit
    model's q, k, v cast to fp32 first. ``scores_kept`` ("selective" keeps the product q k^T): the scores stay
    beside the later s^2 tensors."""
    e, s, h, ec, N = elt(cfg), cfg.seq_len, cfg.d_model, core_elt(cfg), b * cfg.seq_len
    S, dropout = b * cfg.n_head * s * s * ec, cfg.dropout > 0
    kept = S if scores_kept else 0
    if cfg.attn_impl == "sdpa":
        one, cast = N * h * ec, ec != e
        q, k, v = math_copies(cfg, b)
        held = (3 * one if cast else 0) + one + 4 * s * s  # the casts, the scaled q, the float mask
        # the product beside the scaled k^T and the copies its matmul made; the weights (a 16-bit model's also cast
        # back) beside the output and v's copy, then beside the output and its cast back
        end = S + (S * e // ec if cast else 0) + one + max(v, N * h * e if cast else 0)
        return held + max(one + q + k + S, kept + (3 if dropout else 2) * S, kept + end)
    q, k, v = reshape_copies(cfg, b)
    y = N * h * e  # the output of att @ v, then its contiguous copy beside it (none with one head)
    end = max(S + v + y, (2 if cfg.n_head > 1 else 1) * y)
    return max(q + k + S, kept + (3 * S if dropout else 2 * S + s * s), kept + end)


def math_copies(cfg: ModelConfig, b: int) -> tuple[int, int, int]:
    """Bytes of the copies CPU sdpa's math kernel makes to reshape its scaled q, scaled k^T and v to (B*a, s, D).

    Like :func:`reshape_copies`, but of the kernel's own tensors: the scaled q and k^T are new and dense in q's and
    k's memory order, and so are a 16-bit model's fp32 casts (v's too); float32 v is the model's own view. A
    tensor whose heads are laid out positions-first (GPT-2's q, k, v, Llama's v before any repeat) merges batch and
    heads as a view only at one position, where dense strides are contiguous ones; the strided float32 view of
    the qkv output never does. Views everywhere at :func:`head_views`."""
    one = b * cfg.seq_len * cfg.d_model * core_elt(cfg)
    if head_views(cfg, b):
        return 0, 0, 0
    single, cast = cfg.seq_len == 1, core_elt(cfg) != elt(cfg)
    v = 0 if single and cast else one
    if cfg.block != "llama":
        return (0 if single else one), (0 if single else one), v
    narrow, grouped = cfg.head_dim == 2 and cfg.seq_len > 1, cfg.kv_heads != cfg.n_head
    return (one if narrow else 0), (one if narrow and not grouped else 0), (0 if grouped else v)


def math_saving_core(cfg: ModelConfig, b: int, stop_at_v: bool = False) -> int:
    """The peak of CPU sdpa's math kernel run with autograd saving (a segment recomputed in backward), beyond q,
    k, v's storages (bytes); ``_scaled_dot_product_attention_math`` in aten's transformers/attention.cpp.

    Alive throughout: a 16-bit model's fp32 casts of q, k, v, the scaled q, the scaled k^T (or its copy), the
    copies the matmuls make (:func:`math_copies`), the float causal mask (s^2, fp32). Then the largest of: the
    product q k^T beside the scaled k^T it copied; that product beside the masked scores (the kernel adds the mask
    out of place wherever a dispatch mode runs, the tracker's as the dry run's: aten's ``areAnyTensorSubclassLike``);
    the end, where the softmax (with dropout its noise and output) is saved, the weights cast back
    to a 16-bit dtype, v's copy, the output and its cast back beside them. ``stop_at_v``: a recomputation that
    stops once the last tensor it needs is saved (checkpoint "attention": v or its copy), before the output."""
    e, s, N, h, ec = elt(cfg), cfg.seq_len, b * cfg.seq_len, cfg.d_model, core_elt(cfg)
    one, S, cast = N * h * ec, b * cfg.n_head * s * s * ec, ec != e
    q, k, v = math_copies(cfg, b)
    held = (3 * one if cast else 0) + 2 * one + q + 4 * s * s  # the scaled k^T, or its copy once it is freed
    end = (3 if cfg.dropout > 0 else 1) * S + (S * e // ec if cast else 0) + v
    end += 0 if stop_at_v else one + (N * h * e if cast else 0)  # the output, and its cast back
    return held + max(S + k, 2 * S, end)
