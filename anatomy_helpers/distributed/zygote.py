"""Ranks forked from a zygote: a process that imported torch and the rank code once (Linux).

Started as ``python -m anatomy_helpers.distributed``, every rank of every world spends about 1.5 s of CPU before its
first step, nearly all of it importing torch. Instead, :func:`start_rank` asks a zygote to fork the rank: a child of
this process that imported torch and the rank code once, and then only waits. A forked rank runs the same command
line (through :mod:`runpy`, as ``python -m`` does) with all that imported, and is otherwise what a started one is: a
session of its own, its environment, its working folder, its standard output and error, the watch pipe of
:func:`~anatomy_helpers.distributed.world.run_world`. Its :class:`ForkedRank` answers ``pid``, ``poll()`` and
``wait()`` as a :class:`subprocess.Popen` does.

Why forking is safe here: the zygote is a fresh process (not a fork of a notebook's kernel), runs no torch op (so no
OpenMP thread pool, no CUDA context exists when it forks) and has a single thread. It ends when the process that
started it ends (its socket closes). ``ANATOMY_WORLD_ZYGOTE=0`` starts every rank as its own process instead, as
macOS and Windows always do (there, forking a process that loaded system frameworks is not safe).
"""

from __future__ import annotations

import importlib
import os
import pickle
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback

#: Imported by the zygote before it forks: torch and what a rank imports (DDP, FSDP2, device meshes, the course's
#: model and rank code), so that no rank imports them again.
PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.device_mesh",
    "torch.nn.parallel",
    "anatomy_helpers.training.train",
    "anatomy_helpers.distributed.__main__",
)
_MAX_MESSAGE = 1 << 20  # bytes: a request is this process's environment and two paths


def enabled() -> bool:
    """Whether :func:`start_rank` forks ranks from a zygote: on Linux, unless ``ANATOMY_WORLD_ZYGOTE=0``."""
    return sys.platform.startswith("linux") and os.environ.get("ANATOMY_WORLD_ZYGOTE", "1") != "0"


class ForkedRank:
    """A rank forked by the zygote, seen from the runner: ``pid``, and ``poll()``/``wait()`` give its exit status as
    :class:`subprocess.Popen` does (negative: the signal that killed it)."""

    def __init__(self, zygote: _Zygote, pid: int):
        self._zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self._zygote.returncode(self.pid, block=False)

    def wait(self) -> int:
        return self._zygote.returncode(self.pid, block=True)


class _Zygote:
    """The runner's side: one zygote per process, started on first use; requests and exit statuses cross a
    socket pair (a pickled message each, with the rank's file descriptors as ancillary data)."""

    def __init__(self):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "anatomy_helpers.distributed.zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl+C in a terminal reaches the runner, not the zygote
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
        self.owner = os.getpid()  # a process forked from this one (multiprocessing) starts a zygote of its own
        self.lock = threading.Lock()
        self.codes: dict[int, int | None] = {}  # the pid of each rank forked -> its exit status (None: running)
        self.asked = 0  # requests sent; a reply names its request's number
        self.waiting: int | None = None  # the request whose reply fork() waits for

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def fork(self, env: dict[str, str], cwd: str, args: list[str], fds: tuple[int, int, int]) -> ForkedRank:
        """Fork a rank that runs ``python -m *args`` with ``env``, in ``cwd``, with ``fds`` as its standard
        output, its standard error and the watch pipe."""
        with self.lock:
            self.asked += 1
            self.waiting = number = self.asked
            try:
                socket.send_fds(self.sock, [pickle.dumps((number, env, cwd, args))], list(fds))
                while True:  # exit statuses of other ranks may come first
                    kind, *rest = self._receive(block=True)
                    if kind == "forked" and rest[0] == number:
                        self.codes[rest[1]] = None
                        return ForkedRank(self, rest[1])
                    if kind in ("failed", "gone") and rest[0] == number:
                        raise RuntimeError(f"the zygote could not fork a rank: {rest[1]}")
            finally:
                self.waiting = None

    def returncode(self, pid: int, block: bool) -> int | None:
        with self.lock:
            while self.codes.get(pid) is None:
                if self._receive(block=block) is None:
                    return None
            return self.codes[pid]

    def _receive(self, block: bool):
        """Read one message from the zygote and file it (an exit status into ``codes``); None if none is waiting.
        The rank of a request nobody waits for any more (an interrupted :meth:`fork`) is killed."""
        if not block and not select.select([self.sock], [], [], 0)[0]:
            return None
        data = self.sock.recv(_MAX_MESSAGE)
        if not data:  # the zygote died, and with it the ranks' exit statuses: stop each, count it as killed
            for pid, code in self.codes.items():
                if code is None:
                    _kill_group(pid)
                    self.codes[pid] = -signal.SIGKILL
            return ("gone", self.waiting, "it ended unexpectedly")
        message = pickle.loads(data)
        if message[0] == "exited":
            self.codes[message[1]] = message[2]
        elif message[0] == "forked" and message[1] != self.waiting:
            _kill_group(message[2])
        return message


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def start_rank(cmd: list[str], env: dict[str, str], stderr, pass_fds: tuple[int]):
    """Start one rank of :func:`~anatomy_helpers.distributed.world.run_world`: ``cmd`` (``python -m
    anatomy_helpers.distributed --worker TMP --backend=B``) forked from the zygote where :func:`enabled`, else
    started as a process of its own (``subprocess.Popen``). Standard output goes nowhere, standard error to the
    open file ``stderr``; ``pass_fds``: the watch pipe's read end. Returns the Popen or the :class:`ForkedRank`."""
    global _zygote
    if not enabled():
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                                pass_fds=pass_fds)  # fmt: skip
    if cmd[:2] != [sys.executable, "-m"]:
        raise ValueError(f"the zygote forks `python -m MODULE ...` commands of this interpreter, not {cmd}")
    with _zygote_lock:
        if _zygote is None or not _zygote.alive():
            _zygote = _Zygote()
        zygote = _zygote
    with open(os.devnull, "w") as devnull:
        return zygote.fork(env, os.getcwd(), cmd[2:], (devnull.fileno(), stderr.fileno(), *pass_fds))


# ---- inside the zygote ---------------------------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    """Fork a rank for each request until the runner's end of the socket closes; report each rank's exit. It sleeps
    until a request comes or a rank ends (SIGCHLD, through a wake-up pipe), never polling."""
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the signal writes to the wake-up pipe
    while True:
        ready = select.select([sock, woken], [], [])[0]
        if woken in ready:
            os.read(woken, 4096)
        while True:  # reap: report every rank that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except OSError:
            return
        if not data:
            return  # the runner is gone; its ranks end themselves (their watch pipe closed)
        number, env, cwd, args = pickle.loads(data)
        started, has_session = os.pipe()
        try:
            pid = os.fork()
        except OSError as err:
            pid = None
            _send(sock, ("failed", number, str(err)))
        if pid == 0:
            os.close(started)
            for fd in (woken, wake):
                os.close(fd)
            _become_rank(sock, env, cwd, args, fds, has_session)  # never returns
        os.close(has_session)
        if pid is not None:
            os.read(started, 1)  # EOF once the rank has its session: the runner kills ranks by their group
            _send(sock, ("forked", number, pid))
        for fd in (*fds, started):
            os.close(fd)


def _send(sock: socket.socket, message: tuple) -> None:
    try:
        sock.send(pickle.dumps(message))
    except OSError:  # the runner is gone
        pass


def _become_rank(sock: socket.socket, env: dict, cwd: str, args: list[str], fds: list[int], has_session: int):
    """In the forked child: take the rank's session (then close ``has_session``, which the zygote waits on),
    environment, folder and files, run ``python -m *args``, exit with its code."""
    code = 1
    try:
        sock.close()
        os.setsid()
        os.close(has_session)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a started Python has it (the zygote ignores it)
        stdout, stderr, watch = fds
        for fd, target in ((os.open(os.devnull, os.O_RDONLY), 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(env, ANATOMY_WORLD_WATCH=f"{watch} {os.getppid()}")  # the zygote is this rank's parent
        os.chdir(cwd)
        sys.argv = list(args)  # as `python -m MODULE ARGS` has them (runpy puts the module's file first)
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)  # its imports are the zygote's, done
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def main(fd: int) -> None:

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner decides when ranks stop
    for name in PRELOAD:
        importlib.import_module(name)
    _serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    main(int(sys.argv[1]))
