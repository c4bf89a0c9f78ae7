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

from .checkpointing import attention_core, check_policy, offload_context, recomputes_blocks, run_checkpointed
from .data import get_tokenizer, max_seq_len
from .formulas import param_count

ATTENTION_IMPLS = ("manual", "sdpa")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    n_layer: int = 4  # transformer blocks (L)
    d_model: int = 256  # hidden size (h)
    n_head: int = 4  # attention heads (a); d_model must divide evenly
    seq_len: int = 128  # context length (s); also the number of position embeddings
    vocab_size: int = 59  # distinct characters in the course text (data.get_tokenizer())
    mlp_ratio: int = 4  # MLP hidden size = mlp_ratio * d_model
    dropout: float = 0.0  # attention and residual dropout; off by default
    dtype: str = "float32"  # "float32" or "bfloat16" (bf16 works on CPU too)
    attn_impl: str = "manual"  # "manual" keeps the (B, a, s, s) scores; "sdpa" fuses them away
    checkpoint: str = "none"  # activation checkpointing: none, full, every_k, selective, attention, offload
    checkpoint_every: int = 1  # with "every_k": blocks per checkpointed segment (1..n_layer)

    def __post_init__(self):
        for name in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                "so every head gets the same width"
            )
        course_vocab, longest = get_tokenizer().vocab_size, max_seq_len()  # what course batches need
        if self.vocab_size < course_vocab:
            raise ValueError(
                f"ModelConfig.vocab_size must be at least {course_vocab}: the course text needs at least "
                f"{course_vocab} token ids, got {self.vocab_size}"
            )
        if self.seq_len > longest:
            raise ValueError(
                f"ModelConfig.seq_len must be at most {longest}: the course text is {longest + 1} characters "
                f"long and targets are shifted by one, got {self.seq_len}"
            )
        dropout_is_number = isinstance(self.dropout, numbers.Real) and not isinstance(self.dropout, bool)
        if not dropout_is_number or not 0.0 <= self.dropout < 1.0:  # NaN fails the comparison too
            raise ValueError(f"ModelConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.attn_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attn_impl must be one of {ATTENTION_IMPLS}, got {self.attn_impl!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        check_policy(self.checkpoint, self.checkpoint_every, self.n_layer)  # see checkpointing.py

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def host_ram_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def check_params_fit_in_ram(cfg: ModelConfig) -> None:
    """Raise ValueError if the parameters alone would not fit in host RAM (they are built in float32 on CPU)."""
    ram, n = host_ram_bytes(), param_count(cfg)
    if ram is not None and ram > 0 and n * 4 > ram:
        raise ValueError(
            f"{cfg} has {n:,} parameters = {n * 4 / 2**30:,.1f} GiB in float32; "
            f"this machine has {ram / 2**30:,.1f} GiB of RAM"
        )


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
        B, T, C = x.shape
        H, D = self.cfg.n_head, self.cfg.head_dim
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
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


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, LM head, cross-entropy.

    The LM head shares its weight with the token embedding (as in GPT-2 and nanoGPT),
    so the parameter count is the textbook ``h*v + L*(12h^2 + 13h) + 2h`` plus
    ``s*h`` for the learned position embeddings (``formulas.param_count``).
    """

    def __init__(self, cfg: ModelConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or ModelConfig()
        check_params_fit_in_ram(cfg)  # fail before allocating, not after minutes of swapping
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
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
        """idx, targets: (B, T) token ids. Returns (logits (B, T, V), loss or None)."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds ModelConfig.seq_len={self.cfg.seq_len}")
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
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            # The loss is taken in fp32 whatever the model dtype, as mixed-precision training does.
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.view(B * T))
        return logits, loss
