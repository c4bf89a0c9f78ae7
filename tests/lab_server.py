"""JupyterLab started the way a learner starts it (scripts/lab.sh or scripts/course.py), on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Lab:
    proc: subprocess.Popen  # what was started (lab.sh execs course.py, which execs JupyterLab: one process)
    port: int
    log: Path  # its stdout and stderr

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> str:
        return urllib.request.urlopen(f"{self.base}{path}", timeout=20).read().decode()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def serving(cmd: list[str], log: Path, timeout_s: float = 90, **popen) -> Iterator[Lab]:
    """Run ``cmd`` (a launcher that ends in `jupyter lab`) with the arguments that make it serve without a browser or
    token on a free loopback port; yield once it answers; stop it (SIGTERM) afterwards if still running."""
    port = free_port()
    server = ["--no-browser", f"--port={port}", "--ip=127.0.0.1", "--IdentityProvider.token="]
    group = {"start_new_session": True} if os.name == "posix" else {}  # to clean up whatever it leaves, below
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, *server], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **group, **popen
        )
    lab = Lab(proc, port, log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{lab.base}/api/status", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    what = f"exited with {proc.returncode}" if proc.poll() is not None else f"not up in {timeout_s} s"
                    pytest.fail(f"JupyterLab {what}: {' '.join(cmd)}\n{lab.output()[-3000:]}")
                time.sleep(0.25)
        yield lab
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if group:  # a server a test left behind (a launcher that died alone): nothing stays on the machine
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
