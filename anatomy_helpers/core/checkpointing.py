"""Activation checkpointing policies: what a block keeps for backward, and what it recomputes instead.

Every policy is ``torch.utils.checkpoint`` with ``use_reentrant=False`` (always passed explicitly):

* ``"none"``: keep every activation (no checkpointing);
* ``"full"``: every block keeps only its input and recomputes its insides during backward;
* ``"every_k"``: the blocks run in segments of ``checkpoint_every`` blocks; each segment keeps only its input
  and recomputes all of its blocks during backward (``"full"`` is ``checkpoint_every=1``). Memory goes like
  ``(L / k) x block input + k x one block's activations``: smallest near ``k = sqrt(L)`` (Chen et al. 2016);
* ``"selective"``: each block saves what is expensive to recompute and cheap to store, the outputs of the
  ops in :data:`SAVED_OPS` (matrix multiplications and attention kernels), and recomputes the rest (softmax,
  dropout, GELU, LayerNorm, additions), with ``create_selective_checkpoint_contexts``;
* ``"attention"``: Korthikanti et al. (2022)'s selective recomputation: only the attention core
  (``softmax(Q K^T) V``, the ``s^2`` part) is recomputed, everything else is kept;
* ``"offload"``: keep everything, but in host memory (``torch.autograd.graph.save_on_cpu``). That only means
  something when the model is on a GPU: on a CPU the activations already are in host memory, so it does
  nothing there.

With dropout, recomputation must draw the same random numbers as the forward did: the checkpoint then saves
the RNG state before each checkpointed piece (``preserve_rng_state=True``, a few KB of CPU memory each) and
restores it for the recomputation. Without dropout nothing random happens, so no state is saved.

Tensors that a policy keeps outside autograd's own saved-tensor mechanism (a checkpointed segment's input, the
outputs :data:`SAVED_OPS` produce under ``"selective"``) are announced with :func:`keep_for_backward`, so the
step tracker can count them as activations.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

CHECKPOINT_POLICIES = ("none", "full", "every_k", "selective", "attention", "offload")

aten = torch.ops.aten
#: What the "selective" policy saves: outputs of matrix multiplications and fused attention kernels. They are
#: the expensive ops to run again; everything else in a block (softmax, dropout, GELU, LayerNorm, adds, views)
#: is cheap to recompute from them.
SAVED_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    }
)

_listeners: list[Callable[[torch.Tensor], None]] = []


def keep_for_backward(*tensors: torch.Tensor) -> None:
    """Announce tensors a checkpointing policy keeps for the backward pass (the step tracker listens)."""
    for listener in _listeners:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                listener(t)


def add_listener(fn: Callable[[torch.Tensor], None]) -> Callable[[], None]:
    """Call ``fn(tensor)`` for every tensor announced by :func:`keep_for_backward`; returns the undo."""
    _listeners.append(fn)
    return lambda: _listeners.remove(fn)


def _save_matmuls(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _AnnounceSavedOutputs(TorchDispatchMode):
    """Announces the outputs of :data:`SAVED_OPS` with :func:`keep_for_backward` as the forward makes them.

    Entered above the selective checkpoint's own dispatch mode, so it sees each op's output on every torch version.
    The policy function cannot: torch 2.11 and older call it before the op runs, without ``ctx.op_output``.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            keep_for_backward(*(out if isinstance(out, (tuple, list)) else (out,)))
        return out


@contextmanager
def _saving_and_announcing(saving):
    with saving, _AnnounceSavedOutputs():  # the announcer second: it sees each op before, its output after, SAC's
        yield


def _selective_contexts():
    """``create_selective_checkpoint_contexts(_save_matmuls)`` whose forward context also announces what it saves."""
    forward, recompute = create_selective_checkpoint_contexts(_save_matmuls)
    return _saving_and_announcing(forward), recompute


def check_policy(policy: str, every: int, n_layer: int) -> None:
    """Raise ValueError unless ``policy`` is known and ``every`` (the segment length) is in 1..n_layer."""
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"ModelConfig.checkpoint must be one of {CHECKPOINT_POLICIES}, got {policy!r}")
    if not isinstance(every, int) or isinstance(every, bool) or not 1 <= every <= n_layer:
        raise ValueError(
            f"ModelConfig.checkpoint_every must be a whole number from 1 to n_layer ({n_layer}): it is how many "
            f"blocks one checkpointed segment holds, got {every!r}"
        )


def _random(modules) -> bool:
    """Whether any module among ``modules`` (and their children) draws random numbers: dropout with p > 0."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for module in modules for m in module.modules())


def _run_segment(blocks, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def recomputes_blocks(policy: str) -> bool:
    """Whether ``policy`` checkpoints whole blocks (run them with :func:`run_checkpointed`)."""
    return policy in ("full", "every_k", "selective")


def offload_context(policy: str, device: torch.device):
    """``save_on_cpu`` for the "offload" policy on a GPU; a context that does nothing otherwise."""
    if policy == "offload" and device.type != "cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return nullcontext()  # on a CPU the activations already live in host memory


def run_checkpointed(blocks, x: torch.Tensor, policy: str, every: int = 1) -> torch.Tensor:
    """Run ``blocks`` in order on ``x`` (B, T, C) under a block-checkpointing ``policy``; returns the output."""
    if policy == "selective":
        for block in blocks:
            keep_for_backward(x)  # the block's input, kept by the checkpoint itself
            x = checkpoint(
                block,
                x,
                use_reentrant=False,
                preserve_rng_state=_random([block]),
                context_fn=_selective_contexts,
            )
        return x
    size = 1 if policy == "full" else every
    for start in range(0, len(blocks), size):
        keep_for_backward(x)  # the segment's input: all it keeps, kept by the checkpoint itself
        segment = blocks[start : start + size]
        x = checkpoint(_run_segment, segment, x, use_reentrant=False, preserve_rng_state=_random(segment))
    return x


def attention_core(fn: Callable, *args: torch.Tensor, policy: str) -> torch.Tensor:
    """``fn(*args)``; under the "attention" policy, checkpointed so its (B, a, s, s) tensors are recomputed."""
    if policy == "attention" and torch.is_grad_enabled():
        keep_for_backward(*args)
        owner = getattr(fn, "__self__", None)  # the attention module, whose dropout may draw random numbers
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=owner is None or _random([owner]))
    return fn(*args)
