"""The op checks' cache on disk: each fake kernel checked against the real one (fake_check.py) once per machine and
torch version, not once per process.

Each check's result, the signature passed or how its fake kernel differed (a refusal is stored too, and refuses
again), is kept in one JSON file per *namespace*: the torch version and build (its version, git commit and build
configuration), this machine (operating system, CPU architecture, the CPU's model and instruction set flags, the
instruction set torch's CPU kernels dispatch to, whether oneDNN is built in), the Python version, and a hash of the
source of fake_check.py and of this file, so that a change of any rule of the check or of this cache starts a new
file. The file is ``<cache dir>/op-checks/<hash of the namespace>.json``, the cache dir ``$ANATOMY_CACHE_DIR`` if set,
else the platform's user cache (``$XDG_CACHE_HOME`` or ``~/.cache``, ``~/Library/Caches`` on macOS,
``%LOCALAPPDATA%`` on Windows) ``/training-step-anatomy``. Why a result read from it is as good as a check made now:

* a check is a pure function of what is in the namespace: the same op overload, with arguments of the same
  signature, run on zeros by the same kernels of the same build on the same kind of CPU, gives the same outcome
  (fake_check's memo in a process already relies on this across sizes);
* only signatures whose real kernels ship with torch itself are stored: ops of the ``aten`` and ``prims``
  namespaces, every tensor and device on the CPU. A custom op (``torch.library``, another package's kernels) can
  change without torch's version changing, and a GPU's kernels depend on which GPU and driver: those are checked
  once per process, as before. A signature is stored under a text written from its parts (sorted where a
  signature holds a set), never Python's per-process hashes; one whose parts have no such text is not stored;
* a real kernel that ran out of memory is not stored (it may pass another time); any other refusal is;
* the file is written whole to a temporary file in the same directory and moved over the old one
  (``os.replace``, atomic on every platform torch runs on), after reading the file again and adding what other
  processes (xdist workers, ranks) wrote meanwhile: a reader sees an old file or a new one, never half of one. Two
  writers at the same moment can lose one's new entries (until it writes again): those signatures are then checked
  again, nothing worse;
* a file that cannot be read, is not JSON, has another namespace or a wrong shape is ignored (every signature is
  checked again and the next write replaces it); a directory that cannot be written leaves the checks in this
  process only. The cache never makes a dry run fail.

Files of other torch versions or sources are left where they are (a few hundred KiB at most): delete the directory
to clear it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

#: The environment variable naming the cache's directory.
CACHE_DIR_ENV = "ANATOMY_CACHE_DIR"
#: A stored signature's result when its fake kernel matched the real one; otherwise the sentence saying how it differed.
PASSED = "passed"
_STORED_NAMESPACES = ("aten", "prims")  # ops whose kernels ship with torch: the only ones stored
_SOURCES = (Path(__file__).with_name("fake_check.py"), Path(__file__))  # the checks' rules, and this cache's


def cache_dir() -> Path:
    """The directory of the op checks' cache on disk: ``$ANATOMY_CACHE_DIR``, else the platform's user cache."""
    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen:
        return Path(chosen)
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "training-step-anatomy"


def _digest(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def _cpu() -> dict:
    """The CPU as its kernels see it: the instruction set torch dispatches to and, on Linux, the first CPU's model and
    flags (oneDNN picks its own code paths from the flags)."""
    cpu = {"torch_capability": torch.backends.cpu.get_cpu_capability(), "processor": platform.processor()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first CPU's block
                name, _, value = (part.strip() for part in line.partition(":"))
                if name in ("model name", "flags", "Features", "CPU implementer", "CPU part", "CPU variant"):
                    cpu[name] = _digest(value) if name in ("flags", "Features") else value
    except OSError:
        pass  # not Linux: the processor's name and torch's capability stand for it
    return cpu


def namespace() -> dict:
    """What a stored check is valid for: torch's version and build, this machine, Python, the checks' source."""
    return {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "torch_build": _digest(torch.__config__.show()),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "system": platform.system(),
        "machine": platform.machine(),
        "cpu": _cpu(),
        "python": f"{sys.implementation.name} {platform.python_version()}",
        "sources": _digest(b"".join(path.read_bytes() for path in _SOURCES)),
    }


class DiskChecks:
    """The stored results of one namespace (``results``: signature text -> :data:`PASSED` or how its fake kernel
    differed): read once, written after each check that added some."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.namespace = namespace()
        self.path = directory / "op-checks" / f"{_digest(json.dumps(self.namespace, sort_keys=True))}.json"
        self.results = self._read()
        self.new: dict[str, str] = {}

    def _read(self) -> dict[str, str]:
        """The file's results, or none when it is missing, unreadable, of another namespace or of a wrong shape."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            results = data["results"]
            if data["namespace"] == self.namespace and all(
                type(k) is str and type(v) is str for k, v in results.items()
            ):
                return results
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass
        return {}

    def add(self, text: str, result: str) -> None:
        self.results[text] = self.new[text] = result

    def write(self) -> None:
        """What the file holds now and what this process knows, written whole to a temporary file moved over it."""
        if not self.new:
            return
        results = {**self._read(), **self.results}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".op-checks-", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"namespace": self.namespace, "results": results}, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
            tmp = None
        except OSError:
            return  # not writable: the results stay in this process (and are tried again next time)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self.results.update(results)  # what other processes stored meanwhile, too
        self.new.clear()


_current: DiskChecks | None = None  # of the current cache_dir(); made at the first lookup


def write_checks() -> None:
    """Write what this process checked since the last write, if anything (:meth:`DiskChecks.write`)."""
    if _current is not None:
        _current.write()


def checks_on_disk() -> DiskChecks | None:
    """The checks stored in :func:`cache_dir` (None when it cannot be known: no home directory, a source unreadable)."""
    global _current
    made = of_cache_dir(_current, DiskChecks)
    _current = made if made is not None else _current
    return made


def of_cache_dir(current, make):
    """``current`` if it was made for :func:`cache_dir` (its ``directory``), else ``make(cache_dir())``; None when that
    cannot be known (no home directory, a source unreadable). The op checks' cache and the fake kernels' answers
    (fake_memo_cache.py) each keep their own ``current``."""
    try:
        directory = cache_dir()
        return current if current is not None and current.directory == directory else make(directory)
    except (OSError, RuntimeError):
        return None


def signature_text(part) -> str | None:
    """A signature (fake_check.signature), or a part of it, as text that is the same in every process; None if it has
    none (not stored)."""
    cls = type(part)
    if cls is tuple or cls is frozenset:
        texts = [signature_text(p) for p in part]
        if None in texts:
            return None
        return f"({', '.join(texts)})" if cls is tuple else f"{{{', '.join(sorted(texts))}}}"
    if isinstance(part, torch._ops.OpOverload):
        return str(part) if part.namespace in _STORED_NAMESPACES else None
    if cls in (bool, int, str, type(None)):
        return repr(part)
    if cls in (torch.dtype, torch.device, torch.layout, torch.memory_format):
        return f"{cls.__name__}({part})"
    if isinstance(part, type):
        return f"<class {part.__module__}.{part.__qualname__}>"
    return None
