"""The closed form: a step's memory predicted from the model's structure, tensor by tensor, without running it.

Every term below is one tensor (or one kind of tensor) that the course GPT keeps, written from the model's own
code (model.py) and torch's kernels: what autograd saves per layer, what a checkpointing policy keeps, what an
optimizer allocates. Notation as in ``formulas``: ``N = b*s`` tokens, ``h`` hidden size, ``F = r*h`` the MLP width,
``a`` heads, ``V`` vocabulary, ``e`` bytes per element of the model's dtype. Bytes everywhere.

A phase's peak is the largest of a few named moments (:func:`forward_moments`, :func:`backward_moments`): the
loss, the last block's MLP and attention core (forward inside the core, checkpointed or not; backward as the
gradients arrive), the first block's (where a block's parameters outweigh what it keeps) and its qkv projection, a
recomputed segment (at its MLP or its attention core), Llama's final RMSNorm, and the embedding, where a tied
embedding's gradient meets the LM head's.
The per-block terms are what each module saves on CPU (:func:`block_terms`). Checked against what a real forward
saved (saved.py) and against the dry run (which equals the measurement byte for byte) by tests/test_estimate.py;
benchmarks/prediction_errors.py prints the error table of its sweep (step peaks equal to the byte), and against the
dry run on seeded random configurations by tests/test_closed_form_property.py. Autocast and gradient accumulation
are not modelled (:func:`estimate_step` refuses them), nor forward inside CPU sdpa's math kernel without
checkpointing (refused where a bound says it may decide the peak: :func:`math_core_cap`). Beside it,
:func:`textbook_estimates` gives what the usual rules of thumb say.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.model import ModelConfig, param_count
from .formulas import korthikanti_layer_bytes

IMPLEMENTATIONS = ("single", "foreach", "fused")  # torch's optimizer implementations (single = the for-loop)


@dataclass(frozen=True)
class StepEstimate:
    """Predicted peaks (bytes) of each phase of step 1 and of a later step, and the model states behind them.

    Step 1's optimizer phase reads up to 4 bytes per parameter tensor high: its measured peak comes before Adam's
    4-byte ``step`` counters are counted."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # what the forward keeps for backward, at its end
    phase_peaks: dict[tuple[int, str], int]  # (1 or 2, "forward" | "backward" | "optimizer") -> bytes

    @property
    def peak(self) -> int:
        return max(self.phase_peaks.values())

    def step_peak(self, step: int) -> int:
        return max(v for (s, _), v in self.phase_peaks.items() if s == step)


def _elt(cfg: ModelConfig) -> int:
    return 2 if cfg.dtype == "bfloat16" else 4


def parameter_bytes(cfg: ModelConfig) -> int:
    """Parameters plus the buffers the model registers (causal masks, rotary tables): what is alive at rest."""
    e, s, L = _elt(cfg), cfg.seq_len, cfg.n_layer
    buffers = L * s * s if cfg.attn_impl == "manual" else 0  # one (s, s) bool mask per layer
    if cfg.block == "llama":
        buffers += L * 2 * s * (cfg.head_dim // 2) * e  # cos and sin, (s, D/2) each, per layer
    return param_count(cfg) * e + buffers


def param_sizes(cfg: ModelConfig) -> list[int]:
    """Elements of each parameter tensor, in the order ``model.parameters()`` gives them (the optimizer's order)."""
    h, F, V = cfg.d_model, cfg.mlp_ratio * cfg.d_model, cfg.vocab_size
    qkv = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    head = [] if cfg.tie_embeddings else [V * h]  # a tied LM head is the embedding's tensor
    if cfg.block == "llama":  # ln1, qkv, proj, ln2, gate, up, down; the final RMSNorm
        return [V * h] + [h, qkv * h, h * h, h, F * h, F * h, h * F] * cfg.n_layer + [h] + head
    block = [h, h, qkv * h, qkv, h * h, h, h, h, F * h, F, h * F, h]  # LN, qkv, proj, LN, fc, proj (w, b)
    return [V * h, cfg.seq_len * h] + block * cfg.n_layer + [h, h] + head


def n_param_tensors(cfg: ModelConfig) -> int:
    """How many parameter tensors the model has (Adam keeps one 4-byte ``step`` per tensor)."""
    return len(param_sizes(cfg))


#: The optimizers the closed form models: the course's names (train.OPTIMIZER_NAMES) but 8-bit AdamW.
MODELLED_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adamw_bf16")


def check_optimizer(cfg: ModelConfig, optimizer: str) -> None:
    """ValueError for an optimizer name the closed form does not model, saying why; a misspelling is no SGD."""
    if optimizer == "adamw8bit":
        raise ValueError(
            "estimate_step does not model adamw8bit: bitsandbytes' block-wise 8-bit state and its kernels' "
            "temporaries depend on its backend and on tensor sizes (small tensors keep float32 state); measure it "
            "(train.track_steps), a dry run cannot follow it either"
        )
    if optimizer not in MODELLED_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {MODELLED_OPTIMIZERS}, got {optimizer!r}")
    if optimizer == "adamw_bf16" and cfg.dtype != "float32":
        raise ValueError(
            f"estimate_step models adamw_bf16 on a float32 model only, got dtype {cfg.dtype!r}: on a 16-bit model "
            "its update widens the gradient and mixes dtypes in place, temporaries the closed form does not write "
            "out; dry-run it instead (dryrun.dry_run_config)"
        )


def optimizer_state_bytes(cfg: ModelConfig, optimizer: str) -> int:
    """Adam(W): two moments in the parameters' dtype + a 4-byte step per tensor; ``adamw_bf16``: two bf16 moments
    (its step count is a Python int); momentum: one buffer; SGD: none. ValueError for a name not modelled."""
    check_optimizer(cfg, optimizer)
    n = param_count(cfg)
    if optimizer in ("adam", "adamw"):
        return 2 * n * _elt(cfg) + 4 * n_param_tensors(cfg)
    if optimizer == "adamw_bf16":
        return 2 * n * 2
    return n * _elt(cfg) if optimizer == "momentum" else 0


def _math_sdpa(cfg: ModelConfig) -> bool:
    """Whether CPU sdpa runs its math kernel (which materialises the scores, as the manual core does) rather than
    the flash kernel. It does with dropout, and where flash's checks refuse q: a Llama block of head width 2 and
    more than one head, whose rotary q comes out of ``torch.cat`` of two width-1 halves laid out heads-innermost
    (last-dimension stride a, not 1: ``check_last_dim_stride_equals_1_dense`` in aten's sdp_utils_cpp.h), but for
    one position (then its strides are contiguous ones)."""
    narrow = cfg.block == "llama" and cfg.head_dim == 2 and cfg.n_head > 1 and cfg.seq_len > 1
    return cfg.attn_impl == "sdpa" and (cfg.dropout > 0 or narrow)


def _materialised(cfg: ModelConfig) -> bool:
    """Whether the attention core holds the (b, a, s, s) scores: the manual core, or sdpa's math kernel."""
    return cfg.attn_impl == "manual" or _math_sdpa(cfg)


def _core_elt(cfg: ModelConfig) -> int:
    """Bytes per element of the attention core. CPU sdpa's math kernel casts q, k and v of a 16-bit model to fp32
    first (``_scaled_dot_product_attention_math`` in aten's transformers/attention.cpp)."""
    return 4 if _math_sdpa(cfg) else _elt(cfg)


def _head_views(cfg: ModelConfig, b: int) -> bool:
    """Whether the core's matmuls reshape (B, a, s, D) views of q, k, v to (B*a, s, D) without a copy: at B = 1 or
    a = 1, where the two dimensions merged include one of size 1 (any strides do)."""
    return b == 1 or cfg.n_head == 1


def _qkv_storages(cfg: ModelConfig, N: int) -> int:
    """Bytes of the storages behind the q, k, v that enter the attention core. GPT-2: views of the one qkv output
    (3Nh). Llama: q and k are rotary outputs; with grouped-query attention k and v are ``repeat_interleave``
    copies (Nh each), without it v is a view of the whole qkv output."""
    e, h, D = _elt(cfg), cfg.d_model, cfg.head_dim
    if cfg.block != "llama" or cfg.kv_heads != cfg.n_head:
        return 3 * N * h * e
    return 2 * N * h * e + N * (cfg.n_head + 2 * cfg.kv_heads) * D * e


def _matmul_qkv(cfg: ModelConfig, b: int, without_v: bool = False) -> int:
    """Bytes of the storages behind the q, k^T and v that the materialised core's two matmuls save (or only q's
    and k's). Reshaping a (B, a, s, D) view to (B*a, s, D) copies it, except at B = 1 or a = 1
    (:func:`_head_views`), where the matmuls save views of q, k and v themselves (:func:`_qkv_storages`); the
    math kernel makes a new scaled q and k^T there and keeps v a view. A 16-bit model's math kernel works on fp32
    copies."""
    e, h, N, ec = _elt(cfg), cfg.d_model, b * cfg.seq_len, _core_elt(cfg)
    if not _head_views(cfg, b) or ec != e:
        return (2 if without_v else 3) * N * h * ec
    grouped = cfg.block == "llama" and cfg.kv_heads != cfg.n_head
    v = N * h * e if grouped else N * (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim * e  # a copy, or the qkv output
    if cfg.attn_impl == "manual":
        qk = _qkv_storages(cfg, N) - v
        return qk if without_v else qk + v
    return 2 * N * h * e + (0 if without_v else v)


def block_terms(cfg: ModelConfig, b: int) -> dict[str, int]:
    """What one block saves for backward without checkpointing, by the module that saves it first (bytes).

    The keys are the block's submodules (``attn`` is the attention core, the block's own ops); each value counts
    every storage once, for the first module that saves it, as :func:`anatomy_helpers.prediction.saved.saved_rows` does:

    * a norm keeps its input and mean and rstd (LayerNorm: N each, in the model's dtype on CPU) or its input,
      the normalised input and the rms (RMSNorm); each Linear keeps its input; GELU its input; SwiGLU gate, silu,
      up;
    * the manual core keeps copies of q, k^T and v for the two matmuls (3Nh; at batch 1 views, :func:`_matmul_qkv`),
      the softmax output and the inverted causal mask ``~mask`` (s x s bool); sdpa keeps q, k, v
      (:func:`_qkv_storages`), its output and the fp32 log-sum-exp. With dropout CPU sdpa runs the math kernel,
      which keeps what the manual core does but no mask.
    * dropout on CPU keeps its noise in the model's dtype; the attention dropout's output is saved by att @ v.
    """
    e, s, h, a, F = _elt(cfg), cfg.seq_len, cfg.d_model, cfg.n_head, cfg.mlp_ratio * cfg.d_model
    N, scores, ec, dropout = b * s, b * a * s * s, _core_elt(cfg), cfg.dropout > 0
    llama, fused = cfg.block == "llama", not _materialised(cfg)
    norm = 2 * N * h * e + N * e if llama else N * h * e + 2 * N * e
    if fused:  # the flash kernel: q, k, v, its output (often the out-proj's input too) and the log-sum-exp
        core = _qkv_storages(cfg, N) + N * h * e + 4 * b * a * s
    else:  # q, k^T, v for the two matmuls, the softmax output, (the dropout's output), (the causal mask)
        core = _matmul_qkv(cfg, b) + scores * ec * (2 if dropout else 1) + (s * s if cfg.attn_impl == "manual" else 0)
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
    e, s, h, a, D = _elt(cfg), cfg.seq_len, cfg.d_model, cfg.n_head, cfg.head_dim
    N, F, ec = b * s, cfg.mlp_ratio * cfg.d_model, _core_elt(cfg)
    llama, materialised = cfg.block == "llama", _materialised(cfg)
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
        terms.update({"attn": _qkv_storages(cfg, N), "attn.attn_drop": 0, "attn.proj": N * h * e})
    return sum(terms.values())


def embedding_activation_bytes(cfg: ModelConfig, b: int) -> int:
    """The embeddings' saved tensors: GPT-2's position ids (int64, s) and the embedding dropout's noise (Nh)."""
    pos = 8 * cfg.seq_len if cfg.block != "llama" else 0
    return pos + (b * cfg.seq_len * cfg.d_model * _elt(cfg) if cfg.dropout > 0 else 0)


def head_activation_bytes(cfg: ModelConfig, b: int) -> int:
    """The final norm's, the LM head's input and the loss's saved tensors: fp32 log-probabilities (N x V) and the
    loss's 4-byte total weight. Freed at the head's backward."""
    e, N, h, V = _elt(cfg), b * cfg.seq_len, cfg.d_model, cfg.vocab_size
    norm = 2 * N * h * e + N * e if cfg.block == "llama" else N * h * e + 2 * N * e
    return norm + N * h * e + N * V * 4 + 4


def _segments(cfg: ModelConfig) -> list[int]:
    """Blocks per checkpointed segment under "full" or "every_k", in forward order."""
    k = cfg.checkpoint_every if cfg.checkpoint == "every_k" else 1
    return [min(k, cfg.n_layer - i) for i in range(0, cfg.n_layer, k)]


def activation_bytes(cfg: ModelConfig, b: int) -> int:
    """What the forward keeps for backward, at its end, under the config's checkpointing policy."""
    L, N, h = cfg.n_layer, b * cfg.seq_len, cfg.d_model
    edge = embedding_activation_bytes(cfg, b) + head_activation_bytes(cfg, b)
    if cfg.checkpoint in ("full", "every_k"):
        return len(_segments(cfg)) * N * h * _elt(cfg) + edge  # one input per segment
    return L * layer_activation_bytes(cfg, b) + edge


def block_parameter_bytes(cfg: ModelConfig) -> int:
    """Bytes of one block's parameters."""
    h, F, e = cfg.d_model, cfg.mlp_ratio * cfg.d_model, _elt(cfg)
    if cfg.block == "llama":
        return (2 * h * h + 2 * h * cfg.kv_heads * cfg.head_dim + 3 * h * F + 2 * h) * e
    return (4 * h * h + 2 * h * F + 9 * h + F) * e


def optimizer_temporaries(cfg: ModelConfig, optimizer: str, impl: str) -> int:
    """The optimizer step's transient memory. Adam's ``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` makes two
    tensors: foreach one list for every parameter at once; the for-loop one tensor at a time, while the previous
    tensor's ``denom`` is still bound (until the assignment), so the largest of ``previous + 2 x this`` (torch's
    ``_single_tensor_adam``); fused kernels none, and SGD's updates are in place."""
    if impl == "fused" or optimizer in ("sgd", "momentum"):
        return 0
    sizes = param_sizes(cfg)
    if optimizer == "adamw_bf16":
        return max(_bf16_state_moments(sizes))
    if impl == "foreach":
        return sum(sizes) * _elt(cfg)
    return max(prev + 2 * n for prev, n in zip([0] + sizes, sizes)) * _elt(cfg)


def _bf16_state_moments(sizes: list[int]) -> list[int]:
    """AdamWBF16State's temporaries at each parameter of a float32 model (train.py): float32 copies ``m`` and ``v``
    of this tensor's moments (4 bytes an element each) are made while the previous tensor's are still bound (``v``
    also as ``denom``, until ``denom`` is rebound): the larger of ``2 x previous + this`` (making ``m``) and
    ``previous + 2 x this`` (making ``v``), times 4."""
    return [4 * max(2 * prev + n, prev + 2 * n) for prev, n in zip([0] + sizes, sizes)]


def _first_step_bf16_state(sizes: list[int]) -> int:
    """Step 1 of AdamWBF16State creates each tensor's bf16 moments (4 bytes an element) as it reaches it: the peak
    of the state made so far plus that tensor's temporaries."""
    made, peak = 0, 0
    for n, temps in zip(sizes, _bf16_state_moments(sizes)):
        made += 4 * n
        peak = max(peak, made + temps)
    return peak


def _reshape_copies(cfg: ModelConfig, b: int) -> tuple[int, int, int]:
    """Bytes of the copies of q, k^T and v that the manual core's matmuls make to reshape them to (B*a, s, D).

    None where the reshape is a view (:func:`_head_views`). GPT-2's q, k, v are transposed views of the qkv output:
    each copied. Llama's rotary q and k are contiguous (viewed), but at head width 2, where ``torch.cat`` lays them
    out heads-innermost (:func:`_math_sdpa`); its v is a view of the qkv output (copied) or, with grouped-query
    attention, a contiguous ``repeat_interleave`` output, as k then is."""
    one = b * cfg.seq_len * cfg.d_model * _elt(cfg)
    if _head_views(cfg, b):
        return 0, 0, 0
    if cfg.block != "llama":
        return one, one, one
    narrow, grouped = cfg.head_dim == 2 and cfg.seq_len > 1, cfg.kv_heads != cfg.n_head
    return (one if narrow else 0), (one if narrow and not grouped else 0), (0 if grouped else one)


def _saving_core(cfg: ModelConfig, b: int) -> int:
    """The peak of the manual core run with autograd saving (no checkpointing), beyond q, k, v's storages.

    The copies of q and k^T stay (saved); the scores, scaled, and masked beside the inverted mask (two s^2 at a
    time); then what the core saves (the softmax output, with dropout its noise and output) beside v's copy, the
    output y and its contiguous copy (none with one head)."""
    s, N, h, e = cfg.seq_len, b * cfg.seq_len, cfg.d_model, _elt(cfg)
    S, dropout = b * cfg.n_head * s * s * e, cfg.dropout > 0
    q, k, v = _reshape_copies(cfg, b)
    y = N * h * e * (1 if cfg.n_head == 1 else 2)
    return q + k + s * s + max(2 * S, (3 if dropout else 1) * S + v + y)


def _core_transients(cfg: ModelConfig, b: int, scores_kept: bool = False) -> int:
    """The peak of a materialised attention core run without saving (a checkpointed forward), beyond q, k, v.

    Manual: the scores, scaled, masked (the inverted mask), softmax: two at a time, or the copies of q and k^T
    beside the scores (:func:`_reshape_copies`); with dropout three s^2 tensors (its noise); at its end the
    weights beside v's copy and the output, then the output beside its contiguous copy. CPU sdpa's
    math kernel: an output buffer and a float s x s causal mask beside two s^2 tensors (the scores plus the mask,
    softmax), three with dropout, or beside the scores and its scaled q, k^T and v (v a view at batch 1); a 16-bit
    model's q, k, v cast to fp32 first. ``scores_kept`` ("selective" keeps the product q k^T): the scores stay
    beside the later s^2 tensors."""
    e, s, h, ec, N = _elt(cfg), cfg.seq_len, cfg.d_model, _core_elt(cfg), b * cfg.seq_len
    S, dropout = b * cfg.n_head * s * s * ec, cfg.dropout > 0
    kept = S if scores_kept else 0
    if cfg.attn_impl == "sdpa":
        casts = 3 * N * h * ec if ec != e else 0
        copies = 3 * N * h * ec if not _head_views(cfg, b) or ec != e else 2 * N * h * e
        end = 0  # the weights beside the output: never above the scores beside the copies
        if ec != e and _head_views(cfg, b):  # the fp32 casts reshaped as views: only the scaled k^T is new
            copies = N * h * ec
            end = S + S * e // ec + N * h * ec + N * h * e  # the weights and the output, each also cast back
        return casts + N * h * ec + 4 * s * s + max(copies + S, kept + (3 if dropout else 2) * S, kept + end)
    q, k, v = _reshape_copies(cfg, b)
    y = N * h * e  # the output of att @ v, then its contiguous copy beside it (none with one head)
    end = max(S + v + y, (2 if cfg.n_head > 1 else 1) * y)
    return max(q + k + S, kept + (3 * S if dropout else 2 * S + s * s), kept + end)


def math_core_cap(cfg: ModelConfig, b: int) -> int | None:
    """An upper bound on forward's memory inside CPU sdpa's math kernel run with autograd saving (no block
    recomputed: "none", "offload"), above parameters, optimizer state and the batch (bytes); None elsewhere.

    That moment is not modelled (the kernel's casts to fp32, its scaled q and k^T and their reshaped copies, its
    returned weights cast back to a 16-bit dtype, its output before and after the cast); the bound counts more than
    it can hold at once: the last block's q, k, v storages, the casts of q, k, v (16-bit), the bool and float causal
    masks (6 s^2), and the larger of two stretches. While the scores are made: five (N, h) tensors in the core's
    dtype (scaled q and k^T, copies) and two (b, a, s, s) ones (the product and the masked scores, or those and the
    softmax), three with dropout (its noise and output beside the softmax). At its end: four (N, h) tensors in the
    core's dtype (scaled q and k^T, v's copy, the output) and two in the model's (the output cast back, y's copy),
    beside the weights (with dropout its noise and output too; and their cast back to a 16-bit dtype). Where the bound
    stays under the modelled moments the kernel cannot decide forward's peak and :func:`estimate_step` is exact;
    elsewhere it refuses."""
    if not _math_sdpa(cfg) or cfg.checkpoint not in ("none", "offload"):
        return None
    s, N, h, e, ec = cfg.seq_len, b * cfg.seq_len, cfg.d_model, _elt(cfg), _core_elt(cfg)
    S, dropout, cast = b * cfg.n_head * s * s * ec, cfg.dropout > 0, ec != e
    terms = block_terms(cfg, b)
    before = activation_bytes(cfg, b) - head_activation_bytes(cfg, b)
    core_on = sum(v for k, v in terms.items() if k not in ("ln1", "attn.qkv"))  # not made yet, or made now
    scores = 5 * N * h * ec + (2 + dropout) * S
    end = 4 * N * h * ec + 2 * N * h * e + (1 + 2 * dropout) * S + (S * e // ec if cast else 0)
    casts = 3 * N * h * ec if cast else 0
    return before - core_on + _qkv_storages(cfg, N) + casts + 6 * s * s + max(scores, end)


def forward_moments(cfg: ModelConfig, b: int) -> dict[str, int]:
    """Memory above parameters, optimizer state and the batch where forward can peak (bytes).

    * ``"loss"``: every activation, the logits (a 16-bit model's fp32 copy too) and the loss;
    * ``"last MLP"`` (full, every_k, selective): inside the last block, which saves nothing (or only its matrix
      products) there: the residual after attention, the second norm's output (the MLP's argument) and the MLP's
      hidden (GELU's input and output; SwiGLU's silu, up and their product); the block's input too where the
      segment does not keep it (the segment's loop still holds it). Under "selective" at the MLP's out-projection
      (GPT-2: GELU's output beside the kept fc output; Llama: silu's and the product beside the kept gate and up);
    * ``"last core"`` (materialised attention): the first norm's output (the attention's argument), q, k, v and
      the core's transients (:func:`_core_transients`); under "attention" the block has saved its first half;
      under "selective" it has kept its input, the qkv output (beside q, k, v where they are new tensors: rotary,
      repeated) and the scores.
    """
    e, s, h, V = _elt(cfg), cfg.seq_len, cfg.d_model, cfg.vocab_size
    N, F, llama = b * s, cfg.mlp_ratio * h, cfg.block == "llama"
    A = activation_bytes(cfg, b)
    moments = {"loss": A + N * V * e + (N * V * 4 if e != 4 else 0) + 4}
    before = A - head_activation_bytes(cfg, b)  # embeddings and blocks
    if cfg.checkpoint in ("full", "every_k"):
        held = N * h * e if _segments(cfg)[-1] > 1 else 0  # the last block's input, not a segment's
        moments["last MLP"] = before + held + 2 * N * h * e + (3 if llama else 2) * N * F * e
        if _materialised(cfg):
            moments["last core"] = before + held + N * h * e + _qkv_storages(cfg, N) + _core_transients(cfg, b)
    elif cfg.checkpoint in ("none", "offload") and cfg.attn_impl == "manual":
        terms = block_terms(cfg, b)
        core_on = sum(v for k, v in terms.items() if k not in ("ln1", "attn.qkv"))  # not made yet, or made now
        moments["last core"] = before - core_on + _qkv_storages(cfg, N) + _saving_core(cfg, b)
    elif cfg.checkpoint == "attention" and _materialised(cfg):
        later = sum(v for k, v in block_terms(cfg, b).items() if k.startswith(("mlp", "ln2", "attn.proj", "attn.r")))
        moments["last core"] = before - later + _core_transients(cfg, b)  # q, k, v kept, the rest not made yet
    elif cfg.checkpoint == "selective":
        moments["last MLP"] = before + (N * h * e + 2 * N * F * e if llama else 2 * N * h * e + N * F * e)
        if _materialised(cfg):
            grouped = llama and cfg.kv_heads != cfg.n_head  # q, k, v all new tensors, none a view of the qkv output
            qkv = _qkv_storages(cfg, N) + (N * (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim * e if grouped else 0)
            last = before - layer_activation_bytes(cfg, b) + 2 * N * h * e + qkv  # its input, the first norm's output
            moments["last core"] = last + _core_transients(cfg, b, scores_kept=True)
    return moments


def backward_moments(cfg: ModelConfig, b: int) -> dict[str, int]:
    """Memory above parameters, optimizer state and the batch at the moments where backward can peak (bytes).

    * ``"head"``: the loss's backward, the gradients of the log-probabilities and of the logits (N x V, fp32);
    * ``"last MLP"``: the last block's MLP out-projection (GPT-2; Llama: SwiGLU's product), the head's activations
      freed, its weight gradient alive (tied: held by autograd until the embedding's gradient is added to it),
      the residual stream's gradient (Nh), the gradient of the MLP's hidden (SwiGLU: two) and the weight's;
      under "selective" the last block recomputed (all it saves without checkpointing, its input kept twice);
    * ``"last core"``: the last block's attention core (materialised), its MLP freed: the gradients of the
      scores and of the softmax (``b*a*s^2`` each), v's copy freed; recomputed first under "attention";
    * ``"segment"`` (full, every_k): a segment's blocks recomputed, the first segment with every later gradient;
    * ``"embedding"``: every gradient but the embedding's, then its own. A tied embedding's gradient is summed
      with the LM head's (autograd's ``InputBuffer::add``: both V x h and their sum alive at once); untied, the
      gradient of the embedding output (Nh) is alive beside it.
    """
    e, s, h, V = _elt(cfg), cfg.seq_len, cfg.d_model, cfg.vocab_size
    N, F, llama, tied = b * s, cfg.mlp_ratio * h, cfg.block == "llama", cfg.tie_embeddings
    G = param_count(cfg) * e
    acts = activation_bytes(cfg, b) - head_activation_bytes(cfg, b)  # embeddings and blocks
    head_grads = V * h * e + (1 if llama else 2) * h * e  # the LM head's weight and the final norm's
    # the last MLP's backward: the residual stream's gradient, the hidden's gradient(s) and the out-proj weight's
    mlp_bwd = N * h * e + (2 * N * F * e + F * h * e if llama else N * F * e + F * h * e + h * e)
    if cfg.dropout > 0:
        # Llama peaks at SwiGLU's product, after the dropout's noise and gradient are gone; under "selective"
        # the kept out-projection output goes once the recomputed dropout has used it
        mlp_bwd -= N * h * e * (llama + (cfg.checkpoint == "selective"))
        if not llama and cfg.checkpoint in ("selective", "full", "every_k"):
            mlp_bwd -= h * e  # a recomputed block peaks at the out-projection before its bias gradient
    moments = {"head": activation_bytes(cfg, b) - 4 + 2 * N * V * 4}  # the loss's 4-byte total weight freed
    if llama:  # RMSNorm's backward is its ops' (no fused kernel): the final norm's input beside five (N, h) tensors
        moments["final norm"] = acts + head_grads + 6 * N * h * e
    none = layer_activation_bytes(cfg, b, "none")
    materialised = _materialised(cfg)
    if cfg.checkpoint in ("full", "every_k"):
        segs = _segments(cfg)
        first = embedding_activation_bytes(cfg, b) + G - _emb_params(cfg) + (V * h * e if tied else 0)
        first -= segs[0] * block_parameter_bytes(cfg)
        # a segment recomputed (its input kept by the checkpoint), at its last block's MLP or attention core
        for name, inside in (("segment", mlp_bwd), ("segment core", _core_backward(cfg, b) if materialised else None)):
            if inside is not None:
                last = acts + head_grads + segs[-1] * none + inside - N * h * e
                moments[name] = max(last, first + segs[0] * none + inside)
    else:
        recomputed = none - layer_activation_bytes(cfg, b) + N * h * e if cfg.checkpoint == "selective" else 0
        inside = {"MLP": recomputed + mlp_bwd}
        if materialised:
            if cfg.checkpoint == "attention":  # the core recomputed, its copies of q, k, v too (at batch 1 or with
                # one head views of the kept q, k, v: the manual core's three, the math kernel's v)
                v_saved = _matmul_qkv(cfg, b) - _matmul_qkv(cfg, b, without_v=True)
                manual = cfg.attn_impl == "manual"
                views = _head_views(cfg, b) and _core_elt(cfg) == e
                kept = 0 if not views else _qkv_storages(cfg, N) if manual else v_saved
                terms = block_terms(cfg, b)
                recomputed = terms["attn"] + terms["attn.attn_drop"] - kept
            inside["core"] = recomputed + _core_backward(cfg, b)
        # the first block's backward: every later block's activations freed, their gradients made (the peak where
        # a block's parameters outweigh what it keeps)
        first = (cfg.n_layer - 1) * (block_parameter_bytes(cfg) - layer_activation_bytes(cfg, b))
        for part, bytes_ in inside.items():
            moments[f"last {part}"] = acts + head_grads + bytes_
            if first > 0:
                moments[f"first {part}"] = acts + head_grads + bytes_ + first
    # the first block's qkv projection, its input's gradient and its weight's made: every gradient but the
    # embeddings' and the first norm's, the tied head's held by autograd; what the embeddings, the first norm and
    # qkv saved (or recomputed); the gradients of the qkv output, of the residual stream and of the first norm's
    # output. GPT-2's qkv bias gradient is summed last: beside the rest, but where the block was recomputed, whose
    # norm output is freed first. "selective" without dropout still holds the MLP's kept out-projection output (no
    # recomputed op consumes it)
    terms, qkv_out = block_terms(cfg, b), N * (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim * e
    recomputed_block = cfg.checkpoint in ("full", "every_k", "selective")
    not_yet = (h if llama else 2 * h + (3 * h if recomputed_block else 0)) * e  # the norm's weight (and bias)
    first_qkv = G - _emb_params(cfg) - not_yet + (V * h * e if tied else 0) + embedding_activation_bytes(cfg, b)
    first_qkv += N * h * e if cfg.checkpoint == "selective" and cfg.dropout == 0 else 0
    moments["first qkv"] = first_qkv + terms["ln1"] + terms["attn.qkv"] + qkv_out + 2 * N * h * e
    grad_out = N * h * e
    moments["embedding"] = G + (V * h * e + max(grad_out, V * h * e) if tied else grad_out)
    return moments


def _core_backward(cfg: ModelConfig, b: int) -> int:
    """A materialised attention core's backward, relative to its block with everything it saves alive (bytes).

    The block's MLP side is done (its saved tensors freed, its gradients and the out-projection's made; qkv's and
    the first norm's still to come); then the residual's gradient and y's (copied to (B, a, s, D)), with dropout the
    out-proj input's too ("selective": the kept out-proj output gone, as in the MLP's moment); then the gradient of
    the scores and, without dropout, the softmax's too, v's storage freed (with dropout the noise and its output go
    first).
    """
    e, s, h, a, N = _elt(cfg), cfg.seq_len, cfg.d_model, cfg.n_head, b * cfg.seq_len
    ec, dropout, llama = _core_elt(cfg), cfg.dropout > 0, cfg.block == "llama"
    terms = block_terms(cfg, b)
    mlp_done = sum(v for k, v in terms.items() if k.startswith(("mlp", "ln2", "attn.proj", "attn.resid")))
    grads = block_parameter_bytes(cfg) - _qkv_ln1_params(cfg)  # all but qkv's and ln1's
    scores = b * a * s * s * ec
    v_saved = _matmul_qkv(cfg, b) - _matmul_qkv(cfg, b, without_v=True)
    grad_paths = 2 + (dropout and cfg.checkpoint != "selective")
    shared = _head_views(cfg, b) and cfg.attn_impl == "manual" and not llama  # q's and k's views hold v's storage
    # beside the residual's gradient, the others in the core's dtype: a 16-bit model's math kernel casts y's to fp32
    paths = N * h * e + (grad_paths - 1) * N * h * ec
    core_bwd = paths + scores + (0 if dropout else scores - (0 if shared else v_saved))
    return grads - mlp_done + core_bwd


def _qkv_ln1_params(cfg: ModelConfig) -> int:
    """Bytes of the qkv projection's and the first norm's parameters (their gradients come last in a block)."""
    h, qkv = cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    return (h * qkv + h if cfg.block == "llama" else h * qkv + qkv + 2 * h) * _elt(cfg)


def _emb_params(cfg: ModelConfig) -> int:
    """Bytes of the embedding tables (token, and GPT-2's positions)."""
    return (cfg.vocab_size + (cfg.seq_len if cfg.block != "llama" else 0)) * cfg.d_model * _elt(cfg)


def estimate_step(
    cfg: ModelConfig,
    batch_size: int,
    optimizer: str = "adamw",
    impl: str = "single",
    *,
    autocast: str | None = None,
    micro_batches: int = 1,
) -> StepEstimate:
    """Predicted peak of each phase of step 1 and of later steps (``phase_peaks[(1 or 2, phase)]``), in bytes.

    Autocast and gradient accumulation are not modelled (autocast's casts and saved dtypes follow per-op rules; a
    second micro-batch adds a gradient sum per parameter): they are refused with a ValueError, and the dry run
    (``dryrun.dry_run_config``) measures them instead. So is a shape where forward inside CPU sdpa's math kernel,
    without checkpointing, may decide the peak (:func:`math_core_cap`).
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if autocast is not None:
        raise ValueError(
            f"estimate_step does not model autocast (got {autocast!r}): which ops run in 16 bits and what they "
            "save follows torch's per-op lists; dry-run the step instead (dryrun.dry_run_config(..., autocast=...))"
        )
    if micro_batches != 1:
        raise ValueError(
            f"estimate_step models one micro-batch per step, got micro_batches={micro_batches!r}: accumulation "
            "adds each later micro-batch's gradient to .grad; dry-run it instead (train.track_steps under a dry run)"
        )
    if cfg.loss_chunk is not None:
        raise ValueError(
            f"estimate_step does not model the chunked loss (loss_chunk={cfg.loss_chunk}): its per-chunk logits and "
            "recomputed head change the loss's moments; dry-run it instead (dryrun.dry_run_config)"
        )
    check_optimizer(cfg, optimizer)
    cap, modelled = math_core_cap(cfg, batch_size), max(forward_moments(cfg, batch_size).values())
    if cap is not None and cap > modelled:
        raise ValueError(
            f"estimate_step does not model forward inside CPU sdpa's math kernel without checkpointing (it runs it "
            f"{'with dropout' if cfg.dropout > 0 else 'at head width 2'}, checkpoint={cfg.checkpoint!r}): at batch "
            f"{batch_size} its (b, a, s, s) scores ({batch_size * cfg.n_head * cfg.seq_len**2:,} elements) may "
            "decide forward's peak; dry-run it instead (dryrun.dry_run_config)"
        )
    if optimizer == "adamw_bf16" and impl != "single":
        raise ValueError(f"adamw_bf16 has one implementation, the for-loop (impl 'single'), got impl {impl!r}")
    e, b, N = _elt(cfg), batch_size, batch_size * cfg.seq_len
    P, G = parameter_bytes(cfg), param_count(cfg) * e
    O = optimizer_state_bytes(cfg, optimizer)  # noqa: E741
    batch = 2 * N * 8  # the inputs and the targets, int64
    A = activation_bytes(cfg, b)
    backward = 8 + max(backward_moments(cfg, b).values())  # + the loss and the gradient backward starts from
    temps = optimizer_temporaries(cfg, optimizer, impl)
    peaks = {}
    for step, state in ((1, 0), (2, O)):
        peaks[(step, "forward")] = P + state + batch + max(forward_moments(cfg, b).values())
        peaks[(step, "backward")] = P + state + batch + backward
        peaks[(step, "optimizer")] = P + G + O + batch + 4 + temps  # the loss is let go after zero_grad
    if optimizer == "adamw_bf16":  # step 1 makes the state tensor by tensor, inside the loop
        peaks[(1, "optimizer")] = P + G + batch + 4 + _first_step_bf16_state(param_sizes(cfg))
    return StepEstimate(P, G, O, A, peaks)


@dataclass(frozen=True)
class TextbookEstimates:
    """What the usual rules of thumb say for a config (bytes)."""

    weights_only: int  # the parameters
    model_states: int  # parameters + gradients + optimizer state, no activations
    sixteen_per_param: int  # "16 bytes per parameter" (mixed-precision Adam, ZeRO paper) + Korthikanti activations
    korthikanti: int  # Korthikanti et al.'s activations alone (16-bit, L layers)


def textbook_estimates(cfg: ModelConfig, batch_size: int, optimizer: str = "adamw") -> TextbookEstimates:
    """Weights only, model states only, and 16 bytes/parameter + Korthikanti et al.'s ``sbh(34 + 5as/h)`` per layer."""
    n, e = param_count(cfg), _elt(cfg)
    act = cfg.n_layer * korthikanti_layer_bytes(cfg.seq_len, batch_size, cfg.d_model, cfg.n_head)
    states = n * e * 2 + optimizer_state_bytes(cfg, optimizer)
    return TextbookEstimates(n * e, states, 16 * n + act, act)


def impl_of(foreach: bool | None, fused: bool | None) -> str:
    """The implementation torch runs on CPU for these optimizer flags (foreach=None is the for-loop there)."""
    return "fused" if fused else "foreach" if foreach else "single"
