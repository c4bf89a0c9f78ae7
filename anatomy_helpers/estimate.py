"""The closed form: a step's memory predicted from the model's structure, tensor by tensor, without running it.

Every term below is one tensor (or one kind of tensor) that the course GPT keeps, written from the model's own
code (model.py) and torch's kernels: what autograd saves per layer, what a checkpointing policy keeps, what an
optimizer allocates. Notation as in ``formulas``: ``N = b*s`` tokens, ``h`` hidden size, ``F = r*h`` the MLP width,
``a`` heads, ``V`` vocabulary, ``e`` bytes per element of the model's dtype. Bytes everywhere.

It is checked against the dry run (which equals the measurement byte for byte) by tests/test_estimate.py and
benchmarks/prediction_errors.py; beside it, :func:`textbook_estimates` gives what the usual rules of thumb say.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formulas import korthikanti_layer_bytes, param_count
from .model import ModelConfig

IMPLEMENTATIONS = ("single", "foreach", "fused")  # torch's optimizer implementations (single = the for-loop)


@dataclass(frozen=True)
class StepEstimate:
    """Predicted peaks (bytes) of each phase of step 1 and of a later step, and the model states behind them."""

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


def n_param_tensors(cfg: ModelConfig) -> int:
    """How many parameter tensors the model has (Adam keeps one 4-byte ``step`` per tensor)."""
    if cfg.block == "llama":
        per_block, rest = 2 + 2 + 3, 2 + (0 if cfg.tie_embeddings else 1)  # norms, qkv+proj, gate/up/down
    else:
        per_block, rest = 4 + 4 + 4, 4 + (0 if cfg.tie_embeddings else 1)  # LN w+b x2, qkv/proj w+b, fc/proj w+b
    return cfg.n_layer * per_block + rest


def optimizer_state_bytes(cfg: ModelConfig, optimizer: str) -> int:
    """Adam(W): two moments in the parameters' dtype + a 4-byte step per tensor; momentum: one buffer; SGD: none."""
    p = param_count(cfg) * _elt(cfg)
    if optimizer in ("adam", "adamw"):
        return 2 * p + 4 * n_param_tensors(cfg)
    return p if optimizer == "momentum" else 0


def layer_activation_bytes(cfg: ModelConfig, b: int, policy: str | None = None) -> int:
    """What one block saves for backward with no checkpointing (``policy`` "none") or under ``policy``.

    GPT-2 block: the LayerNorm inputs and the inputs of qkv and fc (4Nh), LayerNorm mean and rstd (fp32, 2N
    each, two norms), copies of q, k, v for the matmuls (3Nh), the out-proj input (Nh), GELU's input and output
    (2NF), and the attention core: the softmax output ``b*a*s^2`` (manual) or only the fp32 log-sum-exp
    ``4*b*a*s`` (sdpa: its output *is* the out-proj input). Llama block: RMSNorm keeps its input and the
    normalised input (6Nh with the qkv and gate/up inputs) and SwiGLU keeps gate, silu, up and their product
    (4NF). Dropout on CPU keeps its noise tensor in the model's dtype: the residual and MLP dropouts 2Nh, the
    attention dropout its noise and its output (2 ``b*a*s^2``); with dropout CPU sdpa runs the math kernel,
    which keeps what the manual one does.

    ``"selective"`` keeps the block's input and the outputs of its matrix multiplications: qkv, q k^T (manual)
    or the attention output and log-sum-exp (sdpa), att v, out-proj, fc (gate and up), MLP out-proj.
    ``"attention"`` drops the ``s^2`` part (recomputed in backward).
    """
    e, s, h, a, D = _elt(cfg), cfg.seq_len, cfg.d_model, cfg.n_head, cfg.head_dim
    N, F = b * s, cfg.mlp_ratio * cfg.d_model
    scores = b * a * s * s
    lse = 4 * b * a * s
    llama, dropout = cfg.block == "llama", cfg.dropout > 0
    materialised = cfg.attn_impl == "manual" or dropout
    policy = cfg.checkpoint if policy is None else policy
    if policy == "selective":
        qkv_out = N * (cfg.n_head + 2 * cfg.kv_heads) * D * e
        core = (scores * e + N * h * e) if materialised else (N * h * e + lse)
        mlp = N * F * e * (2 if llama else 1) + N * h * e
        return N * h * e + qkv_out + core + N * h * e + mlp
    stats = 2 * 2 * N * 4  # mean/rstd (LayerNorm) or rms (RMSNorm), two norms, fp32
    norms_and_inputs = (6 if llama else 4) * N * h * e
    mlp = (4 if llama else 2) * N * F * e
    qkv_copies, proj_in = 3 * N * h * e, N * h * e
    core = scores * e if materialised else lse
    if dropout:
        core += 2 * scores * e
    if policy == "attention" and materialised:
        core = 0  # recomputed in backward
    masks = 2 * N * h * e if dropout else 0
    return norms_and_inputs + stats + qkv_copies + proj_in + mlp + core + masks


def head_activation_bytes(cfg: ModelConfig, b: int) -> int:
    """The final norm, the LM head's input and the loss: fp32 log-probabilities (N x V), targets (8N)."""
    e, N, h, V = _elt(cfg), b * cfg.seq_len, cfg.d_model, cfg.vocab_size
    norm = (2 if cfg.block == "llama" else 1) * N * h * e + 2 * N * 4
    loss = N * V * 4 + 8 * N + 4
    return norm + N * h * e + loss + (N * h * e if cfg.dropout > 0 else 0)  # + the embedding dropout's noise


def activation_bytes(cfg: ModelConfig, b: int) -> int:
    """What the forward keeps for backward, at its end, under the config's checkpointing policy."""
    L, e, N, h = cfg.n_layer, _elt(cfg), b * cfg.seq_len, cfg.d_model
    if cfg.checkpoint in ("full", "every_k"):
        k = 1 if cfg.checkpoint == "full" else cfg.checkpoint_every
        return -(-L // k) * N * h * e + head_activation_bytes(cfg, b)  # one input per segment
    return L * layer_activation_bytes(cfg, b) + head_activation_bytes(cfg, b)


def block_parameter_bytes(cfg: ModelConfig) -> int:
    """Bytes of one block's parameters."""
    h, F, e = cfg.d_model, cfg.mlp_ratio * cfg.d_model, _elt(cfg)
    if cfg.block == "llama":
        return (2 * h * h + 2 * h * cfg.kv_heads * cfg.head_dim + 3 * h * F + 2 * h) * e
    return (4 * h * h + 2 * h * F + 9 * h + F) * e


def optimizer_temporaries(cfg: ModelConfig, optimizer: str, impl: str) -> int:
    """The optimizer step's transient memory. Adam's ``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` makes two
    tensors: the for-loop one tensor at a time (the largest: the token embedding or an MLP matrix), foreach
    one list for every parameter at once; fused kernels none."""
    e, h, F, V = _elt(cfg), cfg.d_model, cfg.mlp_ratio * cfg.d_model, cfg.vocab_size
    largest = max(V * h, F * h) * e
    if impl == "fused" or optimizer in ("sgd", "momentum"):  # SGD's updates are in place
        return 0
    return param_count(cfg) * e if impl == "foreach" else 2 * largest


def estimate_step(cfg: ModelConfig, batch_size: int, optimizer: str = "adamw", impl: str = "single") -> StepEstimate:
    """Predicted peak of each phase of step 1 and of later steps (``phase_peaks[(1 or 2, phase)]``), in bytes."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    e, b, N, h, V = _elt(cfg), batch_size, batch_size * cfg.seq_len, cfg.d_model, cfg.vocab_size
    F = cfg.mlp_ratio * h
    P, G = parameter_bytes(cfg), param_count(cfg) * e
    O = optimizer_state_bytes(cfg, optimizer)  # noqa: E741
    A, A_head = activation_bytes(cfg, b), head_activation_bytes(cfg, b)
    logits = N * V * e + (N * V * 4 if e != 4 else 0)  # the logits (and their fp32 copy for the loss)
    # backward, at the head: the gradients of the log-probabilities and of the logits
    head_bwd = A + 2 * N * V * 4
    # backward, at the last block's MLP: gradients of its hidden (NF; SwiGLU: two more, one input freed), of its
    # output (Nh), and its out-projection's weight gradient (Fh)
    mlp_grads = (2 if cfg.block == "llama" else 1) * N * F * e
    block_bwd = A - A_head + mlp_grads + N * h * e + F * h * e
    none = layer_activation_bytes(cfg, b, "none")
    if cfg.checkpoint in ("full", "every_k"):
        k = cfg.checkpoint_every if cfg.checkpoint == "every_k" else 1
        segment = k * none + mlp_grads + N * h * e
        first = G - k * block_parameter_bytes(cfg) + F * h * e + segment  # last segment recomputed, grads in
        last = (A - A_head) + segment + F * h * e  # first segment recomputed, every input still kept
        block_bwd = max(first, last)
    elif cfg.checkpoint in ("selective", "attention"):
        block_bwd += none - layer_activation_bytes(cfg, b)  # the last block's recomputed part
    temps = optimizer_temporaries(cfg, optimizer, impl)
    peaks = {}
    for step, state in ((1, 0), (2, O)):
        peaks[(step, "forward")] = P + state + A + logits
        peaks[(step, "backward")] = P + state + max(head_bwd, block_bwd)
        peaks[(step, "optimizer")] = P + G + O + temps
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
