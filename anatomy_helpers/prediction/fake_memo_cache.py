"""The fake kernels' remembered answers (fake_memo.py) on disk: a later process that meets the same op with the same
input layouts takes its outputs' layouts from there instead of asking FakeTensorMode again.

In a new process a dry run's first meeting with each (op, input layouts) goes to FakeTensorMode (a new process's
verdict on a 7B-shaped Llama: 1.13 CPU s after import that way, 0.91 with the answers read from here; GPT-2 small
1.32 and 0.92). What fake_memo.py keeps for the rest of the process is kept here for later
processes too, one line per answer, in ``<cache dir>/fake-answers/<hash of the namespace>.txt`` (the cache dir of
fake_check_cache.py). Why an answer read from it is as good as one remembered now:

* an answer is a pure function of the layout key (fake_memo.layout_key: the op and everything of its arguments and
  of torch's global state that its fake kernel reads) and of the fake kernels' code: the *namespace* is torch's
  version and build, the Python version, and a hash of the source of fake_memo.py, this file, fake_check.py,
  fake_check_cache.py and core/tensors.py (the rules of what is remembered and how it is keyed), so a change of any
  starts a new file. Fake kernels do not depend on the machine, so the namespace does not name it;
* a key is stored as a 128-bit hash of its ``repr`` (ops, dtypes, devices, sizes and Python scalars: the same text
  in every process, whatever the hash seed), under a 64-bit hash of its op signature's text (as
  fake_check_cache.signature_text writes it), beside the answer as JSON. An answer is
  taken only for a call whose op signature has passed its check against the real kernel in this process (read from
  the op checks' disk cache, which does name the machine, or checked now): a signature that differs on this
  machine gets no answer from here;
* lines are only ever appended, each with one ``os.write`` on a file opened for appending (whole, beside other
  processes' appends, on a local file system), and each carries a hash of its own text: a line cut short or mixed
  with another, or one of another format, is ignored (that call asks FakeTensorMode, as without this file);
* a file that would grow over :data:`MAX_FILE_BYTES` starts over: a new file of the new lines alone is moved over it
  (``os.replace``: a reader sees the old file or the new one); a directory that cannot be read or written leaves the
  answers in this process only. The file never makes a dry run fail.

Files of other namespaces are left where they are: delete the directory to clear it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import torch

from .fake_check_cache import of_cache_dir

#: A file of answers that would grow over this starts over (about 150 bytes per answer: about 100,000 answers).
#: The suite writes about 23 MB in a run (most of them answers no later process asks for); a process reads the file
#: once, about 0.08 s for 15 MiB.
MAX_FILE_BYTES = 16 * 2**20
_HERE = Path(__file__).parent
_SOURCES = (
    _HERE / "fake_memo.py",
    Path(__file__),
    _HERE / "fake_check.py",
    _HERE / "fake_check_cache.py",
    _HERE.parent / "core" / "tensors.py",
)


def _digest(text: str, size: int = 16) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:size]


def namespace() -> str:
    """What a stored answer is valid for, as text: torch's version and build, Python, the memo's rules' source."""
    sources = hashlib.sha256(b"".join(path.read_bytes() for path in _SOURCES)).hexdigest()[:16]
    return f"torch {torch.__version__} {torch.version.git_version}, {sys.implementation.name} {sys.version}, {sources}"


class StoredAnswers:
    """The answers of one namespace's file, read once; new ones appended. A key and an op signature are kept as
    hashes of their texts (128 and 64 bits)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.path = directory / "fake-answers" / f"{_digest(namespace())}.txt"
        self.answers = self._read()

    def _read(self) -> dict[str, tuple[str, str, str]]:
        """key hash -> (the line's hash, signature hash, answer text); a line's hash is checked when its key is
        looked up (get)."""
        try:
            text = self.path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            return {}
        answers = {}
        for line in text.split("\n"):
            parts = line.split("\t")
            if len(parts) == 4:
                answers[parts[1]] = (parts[0], parts[2], parts[3])
        return answers

    def get(self, key: str, signature: str) -> str | None:
        """The answer text stored for the key's text ``key`` under the op signature's text ``signature``, if its line
        is whole (its hash matches)."""
        key = _digest(key, 32)
        found = self.answers.get(key)
        if found is None or found[1] != _digest(signature):
            return None
        return found[2] if found[0] == _digest(f"{key}\t{found[1]}\t{found[2]}") else None

    def append(self, answers: list[tuple[str, str, str]]) -> None:
        """Append ``(key text, op signature text, answer text)`` lines not stored yet (an answer without tabs or
        newlines)."""
        entries = {}  # key hash -> (the line's hash, signature hash, answer), for the keys not stored yet
        for key, sig, answer in answers:
            key, sig = _digest(key, 32), _digest(sig)
            if key not in self.answers:
                entries[key] = (_digest(f"{key}\t{sig}\t{answer}"), sig, answer)
        if not entries:
            return
        data = "".join(f"{d}\t{k}\t{sig}\t{a}\n" for k, (d, sig, a) in entries.items()).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if (self.path.stat().st_size if self.path.exists() else 0) + len(data) > MAX_FILE_BYTES:
                self._start_over(data)
            else:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data)  # one write: a line another process appends goes before or after it
                finally:
                    os.close(fd)
        except OSError:
            return  # not writable: the answers stay in this process
        self.answers.update(entries)

    def _start_over(self, data: bytes) -> None:
        """A new file of ``data`` alone, moved over the full one (a reader sees one or the other; a line another
        process appends to the old one meanwhile is lost: that answer is asked of its fake kernel again)."""
        fd, tmp = tempfile.mkstemp(prefix=".fake-answers-", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError:
            os.unlink(tmp)
            raise


_current: StoredAnswers | None = None  # of the current cache_dir(); made at the first lookup


def stored_answers() -> StoredAnswers | None:
    """The answers stored in :func:`~anatomy_helpers.prediction.fake_check_cache.cache_dir` (None when it cannot be
    known: no home directory, a source unreadable)."""
    global _current
    made = of_cache_dir(_current, StoredAnswers)
    _current = made if made is not None else _current
    return made
