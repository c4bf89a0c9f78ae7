"""distributed/gloo_release.py: a real gloo rank's blocking collectives hand back the caller's own tensors and a
completed work, and only once gloo holds none of their tensors. One gloo process group of one rank, in this process
(the real-vs-fake equality at N = 2 and 4, where the late frees showed, is tests/test_fake_world.py's)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from anatomy_helpers.distributed.gloo_release import blocking, run_blocking
from anatomy_helpers.distributed.world import free_port

# FSDP2's two collectives under their torch 2.13 names; torch 2.11 (and older) names them *_into_tensor / *_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def gloo_of_one():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Blocking(TorchDispatchMode):
    """What the rank tracker does for a real gloo rank: blocking c10d ops through run_blocking. Notes each op's name
    and its result as the caller gets it."""

    def __init__(self):
        super().__init__()
        self.results = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's default guard imports Dynamo on the first op: seconds, for nothing here

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "c10d" or not blocking(func, args, kwargs):
            return func(*args, **kwargs)
        out = run_blocking(func, args, kwargs)
        self.results.append((func._schema.name.split("::")[-1], out))
        return out


def holders(*tensors) -> list[int]:
    """Who holds each tensor, and its storage (gloo may hold views it made: _allgather_base chunks its output)."""
    return [t._use_count() for t in tensors] + [
        torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors
    ]


def test_blocking_reads_async_op_from_the_schema():
    ag = torch.ops.c10d._allgather_base_.default
    x = torch.ones(2)
    assert blocking(ag, (x, x, None, False, -1), {})
    assert not blocking(ag, (x, x, None, True, -1), {})
    assert not blocking(ag, (x, x, None), {})  # the schema's default: async
    assert not blocking(torch.ops.aten.add.Tensor, (x, x), {})  # no async_op at all


def test_the_caller_gets_its_own_tensors_and_a_completed_work_with_gloo_holding_none_of_them():
    x, y = torch.arange(4.0), torch.empty(4)
    mode = Blocking()
    with gloo_of_one():
        held = holders(x, y)
        after = []
        with mode:
            for _ in range(300):  # gloo's worker thread lets go a moment after completing: give the race chances
                all_gather_single(y, x)  # FSDP2's two collectives
                after.append(holders(x, y))
                reduce_scatter_single(x, y)
                after.append(holders(x, y))
            dist.all_reduce(x)
            dist.barrier()
            work = dist.all_reduce(x, async_op=True)  # left to gloo: its caller waits later
            work.wait()
    assert after == [held] * 600  # as soon as each collective returned, nothing but the caller held x, y
    assert torch.equal(y, torch.arange(4.0)) and torch.equal(x, torch.arange(4.0))
    assert [r[0] for r in mode.results] == ["_allgather_base_", "_reduce_scatter_base_"] * 300 + [
        "allreduce_",
        "barrier",
    ]
    for name, out in mode.results:
        work = out[-1] if isinstance(out, tuple) else out  # barrier: a work alone
        assert dist.Work.unbox(work).is_completed(), name
        returned = [t for t in out[:-1] for t in (t if isinstance(t, list) else [t])] if isinstance(out, tuple) else []
        assert all(t is x or t is y for t in returned), name  # the caller's tensors, not the aliases gloo had


def test_an_error_in_the_collective_reaches_the_caller():
    with gloo_of_one(), Blocking(), pytest.raises(RuntimeError):
        all_gather_single(torch.empty(3), torch.ones(2))  # sizes that do not match


def test_run_blocking_waits_for_a_worker_thread_that_lets_go_late():
    """gloo's race made deterministic: a stand-in collective whose worker thread completes the work at once and
    keeps its reference to the tensor (and a view of it, as _allgather_base's chunks) for 50 ms more. run_blocking
    must return only after the thread let go; a caller going on at once would find the storage still held."""
    import threading
    import time

    x = torch.arange(4.0)
    held = holders(x)
    released = threading.Event()

    def late_collective(t, async_op=False):
        done = torch.futures.Future()
        done.set_result([t])
        work = torch._C._distributed_c10d._create_work_from_future(done).boxed()
        box = [t, t[:2]]  # the worker's reference and a view it made

        def worker():
            time.sleep(0.05)
            box.clear()
            released.set()

        threading.Thread(target=worker).start()
        return t, work

    t, work = run_blocking(late_collective, (x,), {"async_op": False})
    assert released.is_set()  # returned only after the worker let go
    assert t is x and dist.Work.unbox(work).is_completed()
    assert holders(x) == held
