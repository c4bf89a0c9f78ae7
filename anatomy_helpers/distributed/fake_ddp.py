"""DDP on torch's fake process group (distributed/fake_world.py): what a fake rank's DDP needs that a real one's
does not, each leaving the bytes as they are (fake_world.FAKE_RULES, "DDP buckets")."""

from __future__ import annotations

import torch
import torch.distributed as dist


def fake_ddp(wrapped) -> None:
    """Make ``wrapped`` (a DistributedDataParallel of fake tensors) run on the fake process group: its gradient
    all-reduce as a comm hook whose future holds the bucket, and its reducer keeping its first buckets."""
    wrapped.register_comm_hook(None, _fake_allreduce_hook)
    wrapped.reducer = _KeepBuckets(wrapped.reducer)


def _fake_allreduce_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default gradient all-reduce (divide the bucket by N, all-reduce it in place) as a comm hook whose
    future holds the bucket: a fake process group's own future holds nothing, which DDP's C++ side rejects."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    dist.all_reduce(buffer)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


# DDP checks the annotation itself, which `from __future__ import annotations` turned into a string
_fake_allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


class _KeepBuckets:
    """A DDP reducer that keeps its first bucket assignment: a real one rebuilds its buckets once, in the order the
    first backward made the gradients, and agrees on it by broadcasting the indices from rank 0, which reads values
    a fake tensor lacks. Same bytes in its buckets either way (every gradient once), made before the first step."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)
