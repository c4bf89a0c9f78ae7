"""Closed-form memory arithmetic for the course GPT: numbers you can get without building a model.

Each function takes a ``ModelConfig`` (or anything with the same fields) and only
reads its fields, so it is cheap even for configurations far too big to allocate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported for the type hint only: model.py imports this module
    from .model import ModelConfig


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

    For r = 4: ``h*v + L*(12h^2 + 13h) + 2h + s*h``.
    """
    h, v, L, s, r = cfg.d_model, cfg.vocab_size, cfg.n_layer, cfg.seq_len, cfg.mlp_ratio
    per_block = (4 + 2 * r) * h * h + (9 + r) * h
    return h * v + L * per_block + 2 * h + s * h
