"""run_world's failure handling: bad arguments refused in the parent, failing and hung ranks named, and ranks that end
with the process that started them (a kernel restart), leaving no temporary folder behind."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from anatomy_helpers.distributed.ranks import RankJob
from anatomy_helpers.distributed.world import RankFailed, run_world

from .conftest import SMALL

WORLD = 2


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (nobody left to reap it in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


@pytest.mark.parametrize(
    "fault, match, forked",
    [
        ("raise", "(?s)raised an exception;.*injected fault", True),
        ("kill", "was killed by SIGKILL", True),
        ("exit", "exited with code 3", True),
        ("exit", "exited with code 3", False),  # ranks started as processes of their own (macOS; zygote.py)
    ],
)
def test_a_failing_rank_is_named_with_how_it_failed_and_no_process_is_left(fault, match, forked, monkeypatch):
    monkeypatch.setenv("ANATOMY_WORLD_ZYGOTE", "1" if forked else "0")
    with pytest.raises(RankFailed, match=match) as info:
        run_world(RankJob("ddp", model=SMALL, fault=fault, fault_rank=1), WORLD, timeout_s=60)
    assert info.value.rank == 1 and "rank 1 of 2" in str(info.value)
    assert "raised an exception" not in str(info.value) or fault == "raise"
    assert all(_gone(pid) for pid in info.value.pids)


def test_a_time_out_names_the_rank_that_hung_not_the_one_waiting_for_it():
    # long enough for both ranks to start (importing torch) and rank 0 to wait in its first barrier
    with pytest.raises(RankFailed, match=r"timed out.*rank\(s\) \[1\] hung") as info:
        run_world(RankJob("ddp", model=SMALL, fault="hang", fault_rank=1), WORLD, timeout_s=12)
    assert info.value.rank == 1
    assert "in _fail" in str(info.value)  # its stack: where it hung
    assert all(_gone(pid) for pid in info.value.pids)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(world_size=True), "world_size"),
        (dict(world_size="2"), "world_size"),
        (dict(world_size=2.0), "world_size"),
        (dict(world_size=8), "world_size"),
        (dict(port=-1), "port"),
        (dict(port=2.0), "port"),
        (dict(jobs=["x"]), "jobs"),
        (dict(jobs=[]), "jobs"),
        (dict(timeout_s=-1), "timeout_s"),
        (dict(timeout_s=float("nan")), "timeout_s"),
        (dict(backend="tcp"), "backend"),
        (dict(world_size=3), "multiple of world_size"),  # a global batch of 8 does not split over 3 ranks
    ],
)
def test_bad_arguments_are_refused_in_the_parent_naming_the_argument(kwargs, name, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # nothing may be made, let alone started
    args = dict(jobs=RankJob("ddp", batch_size=8, model=SMALL), world_size=2) | kwargs
    with pytest.raises(ValueError, match=name):
        run_world(**args)
    assert list(tmp_path.iterdir()) == []


def test_bad_jobs_are_refused_when_made():
    with pytest.raises(ValueError, match="strategy"):
        RankJob("zero4")
    with pytest.raises(ValueError, match="batch_size"):
        RankJob("ddp", batch_size=0)


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RuntimeError, match=f"port {s.getsockname()[1]} on 127.0.0.1 is taken"):
            run_world(RankJob("ddp", model=SMALL), WORLD, port=s.getsockname()[1])


def test_the_cli_refuses_a_batch_the_ranks_cannot_split_with_a_message():
    cmd = [sys.executable, "-m", "anatomy_helpers.distributed", "--world-size", "3", "--batch-size", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 2
    assert "multiple of world_size" in done.stderr and "Traceback" not in done.stderr


# The parent of a world, killed as a kernel restart kills it: its ranks (one hung, one waiting) must end too.
_PARENT = textwrap.dedent(
    """
    from anatomy_helpers.distributed.ranks import RankJob
    from anatomy_helpers.distributed.world import run_world
    run_world(RankJob("ddp", model={model!r}, fault="hang", fault_rank=1), 2, timeout_s=600)
    """
)


def _descendants(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    return children + [d for c in children for d in _descendants(c)]


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"), reason="Linux /proc")
@pytest.mark.parametrize("sig, forked", [(signal.SIGTERM, True), (signal.SIGKILL, True), (signal.SIGKILL, False)])
def test_ranks_end_with_their_parent_and_remove_the_world_folder(sig, forked, tmp_path):
    # forked: the ranks are the zygote's children (zygote.py), and it must end too; else the parent's own
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", ANATOMY_WORLD_ZYGOTE="1" if forked else "0")
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(model=SMALL)], env=env)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.endswith(".stack") for d in tmp_path.glob("anatomy_world_*") for p in d.iterdir()):
            assert parent.poll() is None and time.monotonic() < deadline, "the world never started"
            time.sleep(0.1)
        ranks = _descendants(parent.pid)  # the ranks, and the zygote that forked them
        assert len(ranks) == WORLD + forked
        parent.send_signal(sig)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while not (all(_gone(r) for r in ranks) and not list(tmp_path.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(r) for r in ranks), "a rank outlived its parent"
        assert list(tmp_path.iterdir()) == [], "the world's folder was left behind"
    finally:  # whatever failed, leave no process behind
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for r in ranks:
            if not _gone(r):
                os.kill(r, signal.SIGKILL)
