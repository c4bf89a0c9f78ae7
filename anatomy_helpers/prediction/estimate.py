"""The closed form: a step's memory predicted from the model's structure, tensor by tensor, without running it.

Every term below is one tensor (or one kind of tensor) that the course GPT keeps, written from the model's own
code (model.py) and torch's kernels: what autograd saves per layer, what a checkpointing policy keeps, what an
optimizer allocates. Notation as in ``formulas``: ``N = b*s`` tokens, ``h`` hidden size, ``F = r*h`` the MLP width,
``a`` heads, ``V`` vocabulary, ``e`` bytes per element of the model's dtype. Bytes everywhere.

A phase's peak is the largest of a few named moments (:func:`forward_moments`, :func:`backward_moments`): the
loss, the last block's MLP and attention core (forward inside the core, checkpointed or not, and at a checkpointed
attention's end; backward as the gradients arrive, at the MLP's out-projection and at its input projections), the
first block's (where a block's parameters outweigh what it keeps) and its qkv projection, a recomputed segment (at
its MLP or its attention core, or inside CPU sdpa's math kernel rerun), the LM head's backward, Llama's final
RMSNorm, and the embedding, where a tied embedding's gradient meets the LM head's.
The per-block terms are what each module saves on CPU (:func:`block_terms`). Checked against what a real forward
saved (saved.py) and against the dry run (which equals the measurement byte for byte) by tests/test_estimate.py;
benchmarks/prediction_errors.py prints the error table of its sweep (step peaks equal to the byte), and against the
dry run on seeded random configurations by tests/test_closed_form_property.py. Autocast and gradient accumulation
are not modelled (:func:`estimate_step` refuses them), nor forward inside CPU sdpa's math kernel without
checkpointing (refused where a bound says it may decide the peak: :func:`math_core_cap`), nor that kernel recomputed
under "selective" (for a Llama block or a 16-bit model; refused by name). Beside it, :func:`textbook_estimates` gives
what the usual rules of thumb say.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.model import ModelConfig, param_count
from .formulas import korthikanti_layer_bytes
from .kept import (
    activation_bytes,
    block_parameter_bytes,
    block_terms,
    core_elt,
    core_transients,
    elt,
    embedding_activation_bytes,
    head_activation_bytes,
    head_views,
    layer_activation_bytes,
    math_saving_core,
    math_sdpa,
    matmul_qkv,
    parameter_bytes,
    qkv_storages,
    reshape_copies,
    saving_core,
    scores_materialised,
    segments,
)

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
        return 2 * n * elt(cfg) + 4 * n_param_tensors(cfg)
    if optimizer == "adamw_bf16":
        return 2 * n * 2
    return n * elt(cfg) if optimizer == "momentum" else 0


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
        return sum(sizes) * elt(cfg)
    return max(prev + 2 * n for prev, n in zip([0] + sizes, sizes)) * elt(cfg)


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
    if not math_sdpa(cfg) or cfg.checkpoint not in ("none", "offload"):
        return None
    s, N, h, e, ec = cfg.seq_len, b * cfg.seq_len, cfg.d_model, elt(cfg), core_elt(cfg)
    S, dropout, cast = b * cfg.n_head * s * s * ec, cfg.dropout > 0, ec != e
    terms = block_terms(cfg, b)
    before = activation_bytes(cfg, b) - head_activation_bytes(cfg, b)
    core_on = sum(v for k, v in terms.items() if k not in ("ln1", "attn.qkv"))  # not made yet, or made now
    scores = 5 * N * h * ec + (2 + dropout) * S
    end = 4 * N * h * ec + 2 * N * h * e + (1 + 2 * dropout) * S + (S * e // ec if cast else 0)
    casts = 3 * N * h * ec if cast else 0
    return before - core_on + qkv_storages(cfg, N) + casts + 6 * s * s + max(scores, end)


def forward_moments(cfg: ModelConfig, b: int) -> dict[str, int]:
    """Memory above parameters, optimizer state and the batch where forward can peak (bytes).

    * ``"loss"``: every activation, the logits (a 16-bit model's fp32 copy too) and the loss;
    * ``"last MLP"`` (full, every_k, selective): inside the last block, which saves nothing (or only its matrix
      products) there: the residual after attention, the second norm's output (the MLP's argument) and the MLP's
      hidden (GELU's input and output; SwiGLU's silu, up and their product); the block's input too where the
      segment does not keep it (the segment's loop still holds it). Under "selective" at the MLP's out-projection
      (GPT-2: GELU's output beside the kept fc output; Llama: silu's and the product beside the kept gate and up);
    * ``"last core"`` (materialised attention): the first norm's output (the attention's argument), q, k, v and
      the core's transients (:func:`core_transients`); under "attention" the block has saved its first half;
      under "selective" it has kept its input, the qkv output (beside q, k, v where they are new tensors: rotary,
      repeated) and the scores.
    """
    e, s, h, V = elt(cfg), cfg.seq_len, cfg.d_model, cfg.vocab_size
    N, F, llama = b * s, cfg.mlp_ratio * h, cfg.block == "llama"
    A = activation_bytes(cfg, b)
    moments = {"loss": A + N * V * e + (N * V * 4 if e != 4 else 0) + 4}
    before = A - head_activation_bytes(cfg, b)  # embeddings and blocks
    if cfg.checkpoint in ("full", "every_k"):
        held = N * h * e if segments(cfg)[-1] > 1 else 0  # the last block's input, not a segment's
        moments["last MLP"] = before + held + 2 * N * h * e + (3 if llama else 2) * N * F * e
        if scores_materialised(cfg):
            moments["last core"] = before + held + N * h * e + qkv_storages(cfg, N) + core_transients(cfg, b)
        # the attention's end: its argument, q, k, v, its output, the out-projection's (with dropout its noise and
        # output too) all still bound
        moments["last attention"] = before + held + (3 + 2 * (cfg.dropout > 0)) * N * h * e + qkv_storages(cfg, N)
    elif cfg.checkpoint in ("none", "offload") and cfg.attn_impl == "manual":
        terms = block_terms(cfg, b)
        core_on = sum(v for k, v in terms.items() if k not in ("ln1", "attn.qkv"))  # not made yet, or made now
        moments["last core"] = before - core_on + qkv_storages(cfg, N) + saving_core(cfg, b)
    elif cfg.checkpoint == "attention" and scores_materialised(cfg):
        later = sum(v for k, v in block_terms(cfg, b).items() if k.startswith(("mlp", "ln2", "attn.proj", "attn.r")))
        moments["last core"] = before - later + core_transients(cfg, b)  # q, k, v kept, the rest not made yet
    elif cfg.checkpoint == "selective":
        moments["last MLP"] = before + (N * h * e + 2 * N * F * e if llama else 2 * N * h * e + N * F * e)
        if scores_materialised(cfg):
            grouped = llama and cfg.kv_heads != cfg.n_head  # q, k, v all new tensors, none a view of the qkv output
            qkv = qkv_storages(cfg, N) + (N * (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim * e if grouped else 0)
            last = before - layer_activation_bytes(cfg, b) + 2 * N * h * e + qkv  # its input, the first norm's output
            moments["last core"] = last + core_transients(cfg, b, scores_kept=True)
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
      ``"segment attention"``: inside CPU sdpa's math kernel, rerun with autograd saving (:func:`_math_rerun`);
    * ``"embedding"``: every gradient but the embedding's, then its own. A tied embedding's gradient is summed
      with the LM head's (autograd's ``InputBuffer::add``: both V x h and their sum alive at once); untied, the
      gradient of the embedding output (Nh) is alive beside it.
    """
    e, s, h, V = elt(cfg), cfg.seq_len, cfg.d_model, cfg.vocab_size
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
    # the LM head's backward: the log-probabilities and their gradient freed, the logits' gradient (in the model's
    # dtype), the head weight's gradient and its input's (the peak where h outweighs the tokens and V)
    moments["LM head"] = activation_bytes(cfg, b) - 4 - N * V * 4 + N * V * e + V * h * e + N * h * e
    if llama:  # RMSNorm's backward is its ops' (no fused kernel): the final norm's input beside five (N, h) tensors
        moments["final norm"] = acts + head_grads + 6 * N * h * e
    none = layer_activation_bytes(cfg, b, "none")
    materialised = scores_materialised(cfg)
    if cfg.checkpoint in ("full", "every_k"):
        segs = segments(cfg)
        first = embedding_activation_bytes(cfg, b) + G - _emb_params(cfg) + (V * h * e if tied else 0)
        first -= segs[0] * block_parameter_bytes(cfg)
        # a segment recomputed (its input kept by the checkpoint), at its last block's MLP or attention core
        core = _core_backward(cfg, b) if materialised else None
        rerun = _math_rerun(cfg, b) if math_sdpa(cfg) else None
        for name, inside in (
            ("segment", mlp_bwd),
            ("segment fc", _mlp_input_backward(cfg, b)),
            ("segment core", core),
            ("segment attention", rerun),
        ):
            if inside is not None:
                last = acts + head_grads + segs[-1] * none + inside - N * h * e
                moments[name] = max(last, first + segs[0] * none + inside)
    else:
        selective, terms = cfg.checkpoint == "selective", block_terms(cfg, b)
        recomputed = none - layer_activation_bytes(cfg, b) + N * h * e if selective else 0
        inside = {"MLP": recomputed + mlp_bwd}
        # "selective" with dropout: the kept MLP out-projection output gone (as at the MLP's moment). GPT-2's fc there:
        # GELU's output and gradient and the kept fc output freed, fc's gradients and GELU's input's made (dropout:
        # its output freed, the out-proj's bias gradient made)
        inside["fc"] = recomputed + _mlp_input_backward(cfg, b) - (N * h * e if selective and cfg.dropout else 0)
        if selective and not llama:
            inside["fc"] = inside["MLP"] - 2 * N * F * e + F * h * e + (h * e if cfg.dropout else N * h * e)
        if selective and materialised:  # the recomputed attention's end: the block's first half recomputed (its
            # input kept) to the residual dropout's output, the core's kept products gone once replayed; its matmuls'
            # views of the kept qkv output counted once
            first_half = sum(v for k, v in terms.items() if k.startswith(("ln1", "attn")))
            views = head_views(cfg, b) and core_elt(cfg) == e and not (llama and cfg.kv_heads != cfg.n_head)
            kept = matmul_qkv(cfg, b) - matmul_qkv(cfg, b, without_v=True) if views else 0
            kept += (b * cfg.n_head * s * s + N * h) * core_elt(cfg)
            inside["attention"] = first_half + (N * h * e if cfg.dropout else 0) - kept
        if materialised:
            if cfg.checkpoint == "attention":  # the core recomputed, its copies of q, k, v too, but where its
                # matmuls save views of the kept q, k, v: the manual core's uncopied ones (reshape_copies), the math
                # kernel's v (at batch 1, with one head, or a grouped-query repeat: contiguous) where not cast
                v_saved = matmul_qkv(cfg, b) - matmul_qkv(cfg, b, without_v=True)
                grouped = cfg.block == "llama" and cfg.kv_heads != cfg.n_head
                if cfg.attn_impl == "manual":
                    kept = matmul_qkv(cfg, b) - sum(reshape_copies(cfg, b))
                else:
                    kept = v_saved if (head_views(cfg, b) or grouped) and core_elt(cfg) == e else 0
                terms = block_terms(cfg, b)
                recomputed = terms["attn"] + terms["attn.attn_drop"] - kept
                if math_sdpa(cfg):
                    inside["attention"] = _math_rerun(cfg, b)
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


def _mlp_input_backward(cfg: ModelConfig, b: int) -> int:
    """The last MLP's input projections' backward, relative to its block with everything it saves alive (bytes):
    the peak where the MLP's weights outweigh the tokens.

    GPT-2 at fc: GELU's input and output (and the dropout's noise) freed; the residual's gradient, the fc output's
    and input's, both weights' and biases'. Llama at gate: SwiGLU's silu input and output, up's output and their
    product (and the noise) freed; the residual's gradient, the gate output's, up's and gate's input gradients (not
    summed yet) and the three weights'."""
    e, h, N, F = elt(cfg), cfg.d_model, b * cfg.seq_len, cfg.mlp_ratio * cfg.d_model
    noise = N * h * e if cfg.dropout > 0 else 0
    if cfg.block == "llama":
        return 3 * N * h * e + N * F * e + 3 * F * h * e - 4 * N * F * e - noise
    return 2 * N * h * e + N * F * e + 2 * F * h * e + h * e + F * e - 2 * N * F * e - noise


def _core_backward(cfg: ModelConfig, b: int) -> int:
    """A materialised attention core's backward, relative to its block with everything it saves alive (bytes).

    The block's MLP side is done (its saved tensors freed, its gradients and the out-projection's made; qkv's and
    the first norm's still to come); then the residual's gradient and y's (copied to (B, a, s, D)), with dropout the
    out-proj input's too ("selective": the kept out-proj output gone, as in the MLP's moment); then the gradient of
    the scores and, without dropout, the softmax's too, v's storage freed (with dropout the noise and its output go
    first).
    """
    e, s, h, a, N = elt(cfg), cfg.seq_len, cfg.d_model, cfg.n_head, b * cfg.seq_len
    ec, dropout, llama = core_elt(cfg), cfg.dropout > 0, cfg.block == "llama"
    scores = b * a * s * s * ec
    v_saved = matmul_qkv(cfg, b) - matmul_qkv(cfg, b, without_v=True)
    grad_paths = 2 + (dropout and cfg.checkpoint != "selective")
    shared = head_views(cfg, b) and cfg.attn_impl == "manual" and not llama  # q's and k's views hold v's storage
    # beside the residual's gradient, the others in the core's dtype: a 16-bit model's math kernel casts y's to fp32
    paths = N * h * e + (grad_paths - 1) * N * h * ec
    if cfg.checkpoint == "attention":  # v's storage stays where the matmul saved a view of the kept v
        grouped = llama and cfg.kv_heads != cfg.n_head
        copied = reshape_copies(cfg, b)[2] if cfg.attn_impl == "manual" else not (head_views(cfg, b) or grouped)
        v_saved = v_saved if copied or ec != e else 0
    core_bwd = paths + scores + (0 if dropout else scores - (0 if shared else v_saved))
    return _mlp_done(cfg, b) + core_bwd


def _mlp_done(cfg: ModelConfig, b: int) -> int:
    """A block's MLP side done in backward, relative to the block with everything it saves alive (bytes): what
    the MLP, the second norm and the out-projection saved freed, their gradients made (all but qkv's and ln1's)."""
    terms = block_terms(cfg, b)
    mlp_done = sum(v for k, v in terms.items() if k.startswith(("mlp", "ln2", "attn.proj", "attn.resid")))
    return block_parameter_bytes(cfg) - _qkv_ln1_params(cfg) - mlp_done


def _math_rerun(cfg: ModelConfig, b: int) -> int:
    """CPU sdpa's math kernel rerun with autograd saving in backward, at its peak, relative to its block with all
    it saves alive (bytes). In a segment: the residual's gradient, the first norm, qkv, q, k, v and the kernel's
    tensors (:func:`math_saving_core`) recomputed. Under "attention": the MLP side done, the residual's and y's
    gradients, the kernel's tensors up to the last it saves (v or its copy: the recomputation stops there)."""
    terms, N, h, e = block_terms(cfg, b), b * cfg.seq_len, cfg.d_model, elt(cfg)
    if cfg.checkpoint == "attention":
        return _mlp_done(cfg, b) + N * h * e + N * h * core_elt(cfg) + math_saving_core(cfg, b, stop_at_v=True)
    made = terms["ln1"] + terms["attn.qkv"] + qkv_storages(cfg, N) + math_saving_core(cfg, b)
    return N * h * e + made - layer_activation_bytes(cfg, b, "none")


def _qkv_ln1_params(cfg: ModelConfig) -> int:
    """Bytes of the qkv projection's and the first norm's parameters (their gradients come last in a block)."""
    h, qkv = cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    return (h * qkv + h if cfg.block == "llama" else h * qkv + qkv + 2 * h) * elt(cfg)


def _emb_params(cfg: ModelConfig) -> int:
    """Bytes of the embedding tables (token, and GPT-2's positions)."""
    return (cfg.vocab_size + (cfg.seq_len if cfg.block != "llama" else 0)) * cfg.d_model * elt(cfg)


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
    without checkpointing, may decide the peak (:func:`math_core_cap`), and that kernel recomputed under
    "selective" for a Llama block or a 16-bit model.
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
    if cfg.checkpoint == "selective" and math_sdpa(cfg) and (cfg.block == "llama" or core_elt(cfg) != elt(cfg)):
        raise ValueError(
            "estimate_step does not model CPU sdpa's math kernel recomputed under checkpoint='selective' "
            f"({'a Llama block' if cfg.block == 'llama' else 'a 16-bit model, its fp32 casts'}): the recomputation "
            "replays the kernel's saved matmul outputs but makes its casts, scaled q and k^T, mask, softmax and "
            "dropout again beside them; dry-run it instead (dryrun.dry_run_config)"
        )
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
    e, b, N = elt(cfg), batch_size, batch_size * cfg.seq_len
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
    n, e = param_count(cfg), elt(cfg)
    act = cfg.n_layer * korthikanti_layer_bytes(cfg.seq_len, batch_size, cfg.d_model, cfg.n_head)
    states = n * e * 2 + optimizer_state_bytes(cfg, optimizer)
    return TextbookEstimates(n * e, states, 16 * n + act, act)


def impl_of(foreach: bool | None, fused: bool | None) -> str:
    """The implementation torch runs on CPU for these optimizer flags (foreach=None is the for-loop there)."""
    return "fused" if fused else "foreach" if foreach else "single"
