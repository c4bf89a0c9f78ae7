"""A small GPT-style decoder whose memory we can take apart.

It reads like nanoGPT's model.py on purpose: one config dataclass, one module per
idea, shape comments in (B, T, C) notation. Submodule names are stable
(``blocks.0.attn``, ``blocks.0.mlp.fc`` ...) so the step tracker can say which
module was running when memory was allocated.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .checkpointing import attention_core, check_policy, offload_context, recomputes_blocks, run_checkpointed
from .checks import positive_int
from .data import get_tokenizer

ATTENTION_IMPLS = ("manual", "sdpa")
BLOCKS = ("gpt2", "llama")  # GPT-2's block, or Llama's: RMSNorm, SwiGLU, rotary positions, grouped-query attention
ROPE_THETA = 500_000.0  # the rotary base of Llama 3 (Llama 2 used 10,000); it changes values, never memory
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: a target the loss skips (padding, a prompt token)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    n_layer: int = 4  # transformer blocks (L)
    d_model: int = 256  # hidden size (h)
    n_head: int = 4  # attention heads (a); d_model must divide evenly
    seq_len: int = 128  # context length (s); also the number of position embeddings (a real run on course
    # batches: at most data.max_seq_len(); a dry run: any)
    vocab_size: int = 59  # distinct characters in the course text (data.get_tokenizer())
    mlp_ratio: int = 4  # MLP hidden size = mlp_ratio * d_model
    dropout: float = 0.0  # attention and residual dropout; off by default
    dtype: str = "float32"  # "float32" or "bfloat16" (bf16 works on CPU too)
    attn_impl: str = "manual"  # "manual" keeps the (B, a, s, s) scores; "sdpa" fuses them away
    checkpoint: str = "none"  # activation checkpointing: none, full, every_k, selective, attention, offload
    checkpoint_every: int = 1  # with "every_k": blocks per checkpointed segment (1..n_layer)
    block: str = "gpt2"  # "gpt2" (LayerNorm, GELU MLP, learned positions) or "llama" (see LlamaBlock)
    n_kv_head: int | None = None  # "llama": key/value heads (grouped-query attention); None means n_head
    tie_embeddings: bool = True  # the LM head shares the token embedding's weight
    loss_chunk: int | None = None  # tokens per chunk of a chunked head + loss (chunked_cross_entropy); None: plain

    def __post_init__(self):
        for name in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size", "mlp_ratio"):
            positive_int(f"ModelConfig.{name}", getattr(self, name))
        if self.d_model % self.n_head:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                "so every head gets the same width"
            )
        course_vocab = get_tokenizer().vocab_size  # what course batches need (their length: data.get_batch's check)
        if self.vocab_size < course_vocab:
            raise ValueError(
                f"ModelConfig.vocab_size must be at least {course_vocab}: the course text needs at least "
                f"{course_vocab} token ids, got {self.vocab_size}"
            )
        dropout_is_number = isinstance(self.dropout, numbers.Real) and not isinstance(self.dropout, bool)
        if not dropout_is_number or not 0.0 <= self.dropout < 1.0:  # NaN fails the comparison too
            raise ValueError(f"ModelConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.attn_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attn_impl must be one of {ATTENTION_IMPLS}, got {self.attn_impl!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        check_policy(self.checkpoint, self.checkpoint_every, self.n_layer)  # see checkpointing.py
        if self.block not in BLOCKS:
            raise ValueError(f"ModelConfig.block must be one of {BLOCKS}, got {self.block!r}")
        if self.loss_chunk is not None:
            positive_int("ModelConfig.loss_chunk", self.loss_chunk)
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be True or False, got {self.tie_embeddings!r}")
        kv = self.n_kv_head
        if kv is not None:
            if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0 or self.n_head % kv:
                raise ValueError(
                    f"ModelConfig.n_kv_head must be a positive integer that divides n_head ({self.n_head}), got {kv!r}"
                )
            if self.block != "llama" and kv != self.n_head:
                raise ValueError(
                    f"ModelConfig.n_kv_head={kv} needs block='llama': the GPT-2 block has one key/value head per "
                    "query head"
                )
        if self.block == "llama" and self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.d_model / n_head must be even for block='llama' (rotary embeddings turn pairs of "
                f"dimensions), got head width {self.head_dim}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_head``, or one per query head."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head


def host_ram_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def check_params_fit_in_ram(cfg: ModelConfig) -> None:
    """Raise ValueError if the parameters alone would not fit in host RAM (they are built in float32 on CPU)."""
    if torch.get_default_device().type == "meta":  # built without memory (a dry run): nothing to fit
        return
    ram, n = host_ram_bytes(), param_count(cfg)
    if ram is not None and ram > 0 and n * 4 > ram:
        raise ValueError(
            f"{cfg} has {n:,} parameters = {n * 4 / 2**30:,.1f} GiB in float32; "
            f"this machine has {ram / 2**30:,.1f} GiB of RAM"
        )


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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # q, k, v for all heads at once
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)  # output projection
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        if cfg.attn_impl == "manual":
            # True where a position may attend (itself and the past). Not a parameter.
            mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, cfg.seq_len, cfg.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x)  # (B, T, 3C)
        # C and H from qkv's own width: under tensor parallelism this rank computes only its share of the heads
        C = qkv.shape[-1] // 3
        D = self.cfg.head_dim
        H = C // D
        q, k, v = qkv.split(C, dim=2)  # each (B, T, C)
        del qkv  # the views keep its storage; nothing else may (its lifetime is what the course measures)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        y = attention_core(self.attend, q, k, v, policy=self.cfg.checkpoint)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_drop(self.proj(y))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) v, causal: the part whose memory grows with seq_len squared."""
        T, D = q.shape[2], q.shape[3]
        if self.cfg.attn_impl == "manual":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))  # (B, H, T, T): the quadratic term
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)  # (B, H, T, T), saved for backward
            att = self.attn_drop(att)
            return att @ v  # (B, H, T, D)
        p = self.cfg.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, D)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, C) -> (B, T, 4C) -> (B, T, C)
        return self.drop(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        x = x + self.mlp(self.ln2(x))  # (B, T, C)
        return x


# ---- the Llama block: RMSNorm, SwiGLU, rotary positions, grouped-query attention ---------------------------------


class RMSNorm(nn.Module):
    """LayerNorm without the mean and the bias: x / rms(x) * weight (Zhang & Sennrich 2019)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))  # (C,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, 1)
        return x * rms * self.weight  # (B, T, C)


def rotary_tables(seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, (s, D/2) each: position t turns dimension pair i by t * theta_i."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (D/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (s, D/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (first half, second half) pair of x (B, H, T, D) by its position's angle; cos, sin (T, D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # (B, H, T, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (B, H, T, D)


class LlamaAttention(CausalSelfAttention):
    """Causal attention with rotary positions and grouped-query attention: n_kv_head key/value heads, each
    shared by n_head / n_kv_head query heads. No biases. The attention core is GPT-2's (``attend``)."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        D, H, K = cfg.head_dim, cfg.n_head, cfg.kv_heads
        self.qkv = nn.Linear(cfg.d_model, (H + 2 * K) * D, bias=False)  # q for H heads, k and v for K heads
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)  # output projection
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        cos, sin = rotary_tables(cfg.seq_len, D)
        self.register_buffer("cos", cos, persistent=False)  # (s, D/2); not parameters
        self.register_buffer("sin", sin, persistent=False)  # (s, D/2)
        if cfg.attn_impl == "manual":
            mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, cfg.seq_len, cfg.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        D, group = self.cfg.head_dim, self.cfg.n_head // self.cfg.kv_heads  # group: query heads per k/v head
        qkv = self.qkv(x)  # (B, T, (H + 2K) * D)
        # K and H from qkv's own width, (group + 2) * K * D: under tensor parallelism this rank computes only its
        # share of the heads (K/t key/value heads and the H/t query heads they serve)
        K = qkv.shape[-1] // ((group + 2) * D)
        H = group * K
        q, k, v = qkv.split([H * D, K * D, K * D], dim=2)  # (B, T, H*D), (B, T, K*D), (B, T, K*D)
        del qkv  # the views keep its storage; nothing else may (as in CausalSelfAttention)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        v = v.view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        cos, sin = self.cos[:T], self.sin[:T]  # (T, D/2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # positions enter here, not at the input
        if K != H:  # each key/value head serves H / K query heads
            k = k.repeat_interleave(H // K, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(H // K, dim=1)  # (B, H, T, D)
        y = attention_core(self.attend, q, k, v, policy=self.cfg.checkpoint)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, H * D)  # (B, T, H*D): this rank's heads side by side
        return self.resid_drop(self.proj(y))


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), three matrices of C x F, no biases (Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        F_ = cfg.mlp_ratio * cfg.d_model  # the MLP width F
        self.gate = nn.Linear(cfg.d_model, F_, bias=False)
        self.up = nn.Linear(cfg.d_model, F_, bias=False)
        self.proj = nn.Linear(F_, cfg.d_model, bias=False)  # "down"
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, C) -> (B, T, F) twice -> (B, T, C)
        return self.drop(self.proj(F.silu(self.gate(x)) * self.up(x)))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model)
        self.attn = LlamaAttention(cfg)
        self.ln2 = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        x = x + self.mlp(self.ln2(x))  # (B, T, C)
        return x


def _chunk_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of one chunk of N tokens: x (N, C) through the head to logits (N, V), in fp32.
    Targets of -100 (``F.cross_entropy``'s ``ignore_index``) add nothing, as in the plain loss."""
    return F.cross_entropy(F.linear(x, weight).float(), targets, reduction="sum")


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """The mean cross-entropy of ``logits = x @ weight.T`` over all B*T tokens, without ever holding all the logits.

    x (B, T, C), weight (V, C), targets (B, T). The tokens go through the LM head and the loss ``chunk`` at a time,
    each chunk under ``torch.utils.checkpoint``: forward keeps only its inputs (views of x, the weight, the targets)
    and frees its (chunk, V) logits at once; backward runs the head again for that chunk (the same matmul a second
    time: 2 * chunk * C * V more FLOPs per chunk) and frees its logits and their gradient before the next chunk. So
    the (B*T, V) logits in fp32 and their gradient, which dominate the end of forward and the start of backward for
    a large vocabulary, shrink to one chunk's. The same loss as the plain one up to the order of the sums (float
    rounding), ignored targets (-100) included: the sum is divided by the tokens that count, as ``F.cross_entropy``'s
    mean is.
    """
    B, T, C = x.shape
    flat, tgt = x.reshape(B * T, C), targets.reshape(B * T)
    counted = tgt.ne(IGNORE_INDEX).sum()  # a scalar: the tokens whose target is not ignored
    total = None
    # split (not slicing): autograd joins the chunks' input gradients once, in one (B*T, C) tensor
    for xs, ts in zip(flat.split(chunk), tgt.split(chunk)):
        part = checkpoint(_chunk_loss, xs, weight, ts, use_reentrant=False)
        total = part if total is None else total + part
    return total / counted


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, LM head, cross-entropy.

    The LM head shares its weight with the token embedding (as in GPT-2 and nanoGPT),
    so the parameter count is the textbook ``h*v + L*(12h^2 + 13h) + 2h`` plus
    ``s*h`` for the learned position embeddings (``param_count``).

    With ``cfg.block == "llama"`` the blocks are :class:`LlamaBlock` s, positions are rotary (no position
    embedding) and the final norm is an RMSNorm; ``tie_embeddings=False`` gives the head its own weight.
    """

    def __init__(self, cfg: ModelConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or ModelConfig()
        check_params_fit_in_ram(cfg)  # fail before allocating, not after minutes of swapping
        llama = cfg.block == "llama"
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if not llama:
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList((LlamaBlock if llama else Block)(cfg) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.d_model) if llama else nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # weight tying: one storage, counted once
        self.apply(self._init_weights)
        self.to(cfg.torch_dtype)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Number of parameters, each shared tensor counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) token ids. Returns (logits (B, T, V), loss or None); with ``cfg.loss_chunk`` and
        targets, (None, loss): the loss is :func:`chunked_cross_entropy`, which never holds all the logits."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds ModelConfig.seq_len={self.cfg.seq_len}")
        if self.cfg.block == "llama":
            x = self.drop(self.tok_emb(idx))  # (B, T, C); positions are rotated into q and k in each block
        else:
            pos = torch.arange(T, device=idx.device)  # (T,)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        policy = self.cfg.checkpoint  # what the blocks keep for backward: see checkpointing.py
        if recomputes_blocks(policy) and torch.is_grad_enabled():
            x = run_checkpointed(self.blocks, x, policy, self.cfg.checkpoint_every)  # (B, T, C)
        else:
            with offload_context(policy, x.device):
                for block in self.blocks:
                    x = block(x)  # (B, T, C); nothing else holds the previous x, so it can be freed

        x = self.ln_f(x)  # (B, T, C)
        if targets is not None and self.cfg.loss_chunk is not None:
            return None, chunked_cross_entropy(x, self.lm_head.weight, targets, self.cfg.loss_chunk)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            # The loss is taken in fp32 whatever the model dtype, as mixed-precision training does.
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.view(B * T))
        return logits, loss
