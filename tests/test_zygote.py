"""Ranks forked from the zygote (anatomy_helpers/distributed/zygote.py): what a forked rank gets, one zygote for
successive worlds, and what happens to a rank nobody waits for or whose zygote died. The worlds of
test_world_runner, test_distributed and the other distributed tests run forked ranks too (on Linux)."""

import os
import pickle
import signal
import socket
import sys
import time
from dataclasses import dataclass

import pytest

from anatomy_helpers.distributed import zygote
from anatomy_helpers.distributed.world import free_port, run_world

from .test_world_runner import _gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote forks on Linux only")


@dataclass
class Where:
    strategy: str  # run_world files each result under its strategy
    pid: int
    ppid: int
    sid: int
    cwd: str
    mark: str | None
    stdin_is_null: bool


@dataclass
class WhereJob:
    """A job whose rank says where it runs (a job with its own run_rank, as timed_step.TimedJob)."""

    strategy: str = "where"
    batch_size: int = 4  # rows: run_world checks that its ranks can split them
    micro_batches: int = 1
    sleep_s: float = 0.0

    def run_rank(self, rank, world_size, device):
        time.sleep(self.sleep_s)
        null_stdin = os.path.samestat(os.fstat(0), os.stat(os.devnull))
        mark = os.environ.get("ANATOMY_TEST_MARK")
        return Where(self.strategy, os.getpid(), os.getppid(), os.getsid(0), os.getcwd(), mark, null_stdin)


def test_ranks_are_forked_by_one_zygote_in_sessions_of_their_own_with_the_runners_environment(monkeypatch):
    monkeypatch.setenv("ANATOMY_WORLD_ZYGOTE", "1")
    monkeypatch.setenv("ANATOMY_TEST_MARK", "first")
    first = run_world(WhereJob(), 2)["where"]
    monkeypatch.setenv("ANATOMY_TEST_MARK", "second")  # read at each world, not when the zygote started
    second = run_world(WhereJob(), 2)["where"]
    server = zygote._zygote.proc.pid
    for r in first + second:
        assert r.ppid == server != os.getpid()  # the zygote's children, not this process's
        assert r.sid == r.pid  # a session (and process group) of its own: run_world kills it by its group
        assert r.cwd == os.getcwd() and r.stdin_is_null
    assert [r.mark for r in first + second] == ["first"] * 2 + ["second"] * 2
    assert len({r.pid for r in first + second}) == 4  # a new process for each rank of each world


def _request(z: zygote._Zygote, tmp, job, number: int) -> None:
    """Send the zygote a request for a one-rank world running ``job``, as fork() does, numbered ``number``."""
    with open(os.path.join(tmp, "jobs.pkl"), "wb") as f:
        pickle.dump([job], f)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    watch, alive = os.pipe()
    with open(os.path.join(tmp, "rank0.err"), "w") as err, open(os.devnull, "w") as out:
        args = ["anatomy_helpers.distributed", "--worker", str(tmp)]
        socket.send_fds(z.sock, [pickle.dumps((number, env, os.getcwd(), args))], [out.fileno(), err.fileno(), watch])
    os.close(watch)
    return alive


def test_a_rank_forked_for_a_request_nobody_waits_for_is_killed(tmp_path):
    z = zygote._Zygote()
    try:
        alive = _request(z, tmp_path, WhereJob(sleep_s=60), number=7)  # as if fork() was interrupted before the reply
        kind, number, pid = z._receive(block=True)
        assert (kind, number) == ("forked", 7)
        assert z.returncode(pid, block=True) == -signal.SIGKILL  # killed, not left to sleep for a minute
        os.close(alive)
    finally:
        z.proc.kill()
        z.proc.wait()


def test_when_the_zygote_dies_its_ranks_are_stopped_and_counted_as_killed_and_the_next_world_gets_a_new_one(tmp_path):
    z = zygote._Zygote()
    try:
        alive = _request(z, tmp_path, WhereJob(sleep_s=60), number=1)
        z.waiting = 1
        kind, _, pid = z._receive(block=True)
        z.codes[pid] = None
        rank = zygote.ForkedRank(z, pid)
        assert kind == "forked" and rank.poll() is None
        z.proc.kill()
        z.proc.wait()
        assert rank.wait() == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid)
        os.close(alive)
    finally:
        if z.proc.poll() is None:
            z.proc.kill()
            z.proc.wait()
    zygote._zygote = z  # the process's zygote is this dead one: the next world must start another
    assert run_world(WhereJob(), 1)["where"][0].ppid == zygote._zygote.proc.pid != z.proc.pid


def test_ranks_are_started_as_processes_where_the_zygote_is_off(monkeypatch):
    monkeypatch.setenv("ANATOMY_WORLD_ZYGOTE", "0")
    assert not zygote.enabled()
    [rank] = run_world(WhereJob(), 1)["where"]
    assert rank.ppid == os.getpid() and rank.sid == rank.pid
    monkeypatch.setenv("ANATOMY_WORLD_ZYGOTE", "1")
    assert zygote.enabled() == sys.platform.startswith("linux")


def test_a_process_forked_from_the_runner_starts_a_zygote_of_its_own(monkeypatch):
    monkeypatch.setenv("ANATOMY_WORLD_ZYGOTE", "1")
    run_world(WhereJob(), 1)
    inherited = zygote._zygote
    monkeypatch.setattr(inherited, "owner", os.getpid() + 1)  # as a forked child sees its parent's zygote
    try:
        [rank] = run_world(WhereJob(), 1)["where"]
        assert zygote._zygote is not inherited and rank.ppid == zygote._zygote.proc.pid != inherited.proc.pid
    finally:
        inherited.proc.kill()
        inherited.proc.wait()


def test_only_python_dash_m_commands_of_this_interpreter_are_forked(monkeypatch, tmp_path):
    monkeypatch.setenv("ANATOMY_WORLD_ZYGOTE", "1")
    with open(tmp_path / "err", "w") as err, pytest.raises(ValueError, match="python -m MODULE"):
        zygote.start_rank(["/bin/true"], dict(os.environ), stderr=err, pass_fds=())
