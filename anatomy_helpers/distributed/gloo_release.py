"""A real gloo rank's blocking collectives, run so that gloo lets go of their tensors before the caller goes on.

Why: gloo runs each collective on a worker thread (``ProcessGroupGloo::runLoop`` in torch's
torch/csrc/distributed/c10d/ProcessGroupGloo.cpp). The work item, a ``ProcessGroupGloo::AsyncWork``, holds the
collective's tensors (its ``outputTensors_`` and its completed ``future_``, lines 114-115 of the installed
include/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp; its subclass the inputs and outputs). The worker marks it
complete (``AsyncWork::execute`` -> ``finishWorkGloo``), which wakes the caller's ``wait()``, and only after that
drops its own two references (the loop's local ``work`` and ``workInProgress_[workerIndex]``, line 492). A blocking
collective's caller (``dist.all_gather_single`` / ``reduce_scatter_single``, torch/distributed/distributed_c10d.py
lines 4387 and 4936: ``work.wait()``, then the work is dropped) goes on at once, and FSDP2 drops its own reference
to the buffers a few ops later (``self._all_gather_result = None``, fsdp/_fully_shard/_fsdp_param_group.py line 489;
the reduce-scatter input at the end of ``foreach_reduce``). When the worker thread was not scheduled in between
(a loaded machine), gloo's reference was the last one: the buffer died on the worker thread, after allocations the
program had made since it let go, and the rank's peak came out one buffer higher than in program order (measured:
5 runs in 15 of FSDP2 at N = 4 under load, one rank's peak +90,816 B; a dry run has no worker thread).

What :func:`run_blocking` does instead, for a collective whose caller waits at once (``async_op=False``): it hands
gloo detached aliases of the tensors (same storages, tensor objects of their own), waits for the collective, drops
the work, and returns only once the aliases and their storages have no more holders than before the collective:
gloo's work item is gone, and so is every view it made (``ProcessGroupGloo::_allgather_base`` hands its work
``at::chunk`` views of the output, which hold the storage, not the alias). The caller gets its own tensors back and
a work already completed. The collective is the same gloo collective on the same storages; the caller resumes a few
microseconds later, with gloo done. Collectives issued with ``async_op=True`` are left alone (blocking them would
move where a rank waits for a straggler, which lesson 08 shows): DDP's bucket all-reduces and ZeRO-1's broadcasts
move buffers that live across steps, and DDP's broadcast of the model's buffers at the start of a step (2,048 B on
the test model) is followed by no other communication buffer before backward, so a late free of theirs moves no
figure (checked: every strategy's ranks equal their dry runs in the repeated N = 2 and 4 runs).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves, tree_map_only

#: How long gloo may hold a finished collective's tensors before we call it a hang (s). It lets go within
#: microseconds once its worker thread runs.
RELEASE_TIMEOUT_S = 60.0


def blocking(func, args, kwargs) -> bool:
    """Whether the c10d op ``func`` was issued with ``async_op=False`` (its caller waits at once)."""
    names = [a.name for a in func._schema.arguments]
    if "async_op" not in names:
        return False
    i = names.index("async_op")
    return not (args[i] if i < len(args) else kwargs.get("async_op", True))


def run_blocking(func, args, kwargs):
    """Run the blocking c10d op ``func`` on aliases of its tensors; return its result (the caller's tensors and a
    completed work) once gloo's worker thread holds none of them."""
    originals: dict[int, torch.Tensor] = {}  # id(alias) -> the caller's tensor
    aliases: list[torch.Tensor] = []

    def alias(t: torch.Tensor) -> torch.Tensor:
        a = t.detach()
        originals[id(a)] = t
        aliases.append(a)
        return a

    args, kwargs = tree_map_only(torch.Tensor, alias, (tuple(args), dict(kwargs)))
    before = _references(aliases)
    out = func(*args, **kwargs)
    del args, kwargs
    as_tuple = isinstance(out, tuple)  # (tensors..., work), or a work alone (barrier)
    tensors, work = (out[:-1], out[-1]) if as_tuple else ((), out)
    dist.Work.unbox(work).wait()  # raises as the caller's wait() would
    tensors = tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), tensors)
    del out, work  # the work and its future: now held by gloo's worker thread alone, if at all
    _wait_released(aliases, before)
    done = torch.futures.Future()
    done.set_result([t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)])
    done_work = torch._C._distributed_c10d._create_work_from_future(done).boxed()
    return (*tensors, done_work) if as_tuple else done_work


def _references(aliases: list[torch.Tensor]) -> list[int]:
    """How many holders each alias has, and each alias's storage: gloo may hold an alias itself (a work's
    ``outputTensors_``) or views it made of it (``_allgather_base`` hands gloo ``at::chunk`` of the output)."""
    return [a._use_count() for a in aliases] + [
        torch._C._storage_Use_Count(a.untyped_storage()._cdata) for a in aliases
    ]


def _wait_released(aliases: list[torch.Tensor], before: list[int]) -> None:
    """Until the aliases and their storages have no more holders than ``before`` the collective (gloo's work item
    and every view it made are gone)."""
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    pause = 0.0
    while any(now > then for now, then in zip(_references(aliases), before)):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"gloo still holds a finished collective's tensors after {RELEASE_TIMEOUT_S:g} s "
                "(its worker thread is stuck?)"
            )
        time.sleep(pause)  # lets gloo's worker thread run
        pause = min(2 * pause + 1e-5, 1e-3)
