"""The fake kernels' answers on disk (prediction/fake_memo_cache.py): a later process takes every answer an earlier one
remembered, asks no fake kernel for them and gets the same trace, byte for byte, on configurations drawn at random;
an answer is taken only for an op signature checked in this process; a line cut short or changed, a file of another
namespace, a full file or a directory that cannot be written are each ignored."""

import itertools
import multiprocessing
import os
import re
import subprocess
import sys

import pytest

from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.prediction import fake_check, fake_memo, fake_memo_cache
from anatomy_helpers.prediction.dryrun import dry_run_config
from anatomy_helpers.prediction.periodic import trace_differences

from .test_fake_check_cache import new_process as forget_checks
from .test_fake_memo import _random_configs

SMALL = dict(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=64)


@pytest.fixture
def asks(fresh_op_checks, monkeypatch):
    """How many calls of remembered kinds went to their fake kernel (fake_memo.remember sees each), and how many
    were answered from the disk; in an empty cache directory of the test's own, nothing remembered yet."""
    new_process(monkeypatch)
    counts = {"asked": 0, "from disk": 0}
    remember, stored_outputs = fake_memo.remember, fake_memo.stored_outputs

    def counted_remember(*args):
        counts["asked"] += 1
        return remember(*args)

    def counted_stored(*args):
        out = stored_outputs(*args)
        counts["from disk"] += out is not fake_memo.MISS
        return out

    monkeypatch.setattr(fake_memo, "remember", counted_remember)
    monkeypatch.setattr(fake_memo, "stored_outputs", counted_stored)
    return counts


def new_process(monkeypatch):
    """Forget what this process checked, remembered and read from the disk, as a new process starts."""
    forget_checks(monkeypatch)
    monkeypatch.setattr(fake_memo, "_ANSWERS", {})
    monkeypatch.setattr(fake_memo, "_NEW", [])
    monkeypatch.setattr(fake_memo_cache, "_current", None)


def answers_file(directory):
    [path] = (directory / "fake-answers").glob("*.txt")
    return path


def three_runs(cfg, run, asks):
    """Dry runs 1 (checks the ops), 2 (remembers each answer) and 3 (asks only for what is never remembered);
    returns run 3's trace and how many of its calls asked their fake kernel."""
    dry_run_config(cfg, **run)
    dry_run_config(cfg, **run)
    before = asks["asked"]
    trace = dry_run_config(cfg, **run)
    return trace, asks["asked"] - before


@pytest.mark.parametrize("cfg, run", list(_random_configs(4, seed=11)), ids=lambda x: repr(x)[:60])
def test_a_later_process_takes_every_answer_from_disk_and_gets_the_same_trace(cfg, run, asks, monkeypatch):
    with fake_memo.off():
        without = dry_run_config(cfg, **run)
    remembered, never = three_runs(cfg, run, asks)
    new_process(monkeypatch)
    asks.update({"asked": 0, "from disk": 0})
    trace = dry_run_config(cfg, **run)
    assert asks["asked"] == never  # every answer remembered before came from the disk
    assert asks["from disk"] > 20
    assert trace_differences(trace, without) == [] and trace_differences(remembered, without) == []


def test_a_new_process_with_another_hash_seed_reads_the_same_keys(asks, fresh_op_checks):
    """A key is stored as its repr, the same text whatever the hash seed: a child process asks no fake kernel for
    what this one remembered, and prints the same trace."""
    cfg = ModelConfig(**SMALL)
    trace, never = three_runs(cfg, {"batch_size": 2}, asks)
    code = (
        "from anatomy_helpers.core.model import ModelConfig\n"
        "from anatomy_helpers.prediction import fake_memo\n"
        "from anatomy_helpers.prediction.dryrun import dry_run_config\n"
        "asked = []\n"
        "remember = fake_memo.remember\n"
        "fake_memo.remember = lambda *a: asked.append(a[2]) or remember(*a)\n"
        f"trace = dry_run_config(ModelConfig(**{SMALL!r}), batch_size=2)\n"
        "print(len(asked))\n"
        "print(trace.table())\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="4321", ANATOMY_CACHE_DIR=str(fresh_op_checks))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == f"{never}\n{trace.table()}\n"


def test_no_answer_for_an_op_signature_not_checked_here(asks, fresh_op_checks, monkeypatch):
    """With the op checks' file gone (another machine, say), the answers on disk wait for each signature's check:
    the first dry run takes none of them and runs the real kernels."""
    cfg = ModelConfig(**SMALL)
    three_runs(cfg, {"batch_size": 2}, asks)
    for path in (fresh_op_checks / "op-checks").glob("*.json"):
        path.unlink()
    new_process(monkeypatch)
    real = []
    run = fake_check._real_call
    monkeypatch.setattr(fake_check, "_real_call", lambda call: real.append(call) or run(call))
    asks["from disk"] = 0
    dry_run_config(cfg, batch_size=2)
    assert asks["from disk"] == 0 and any(str(call.func) == "aten.mm.default" for call in real)
    asks["from disk"] = 0
    dry_run_config(cfg, batch_size=2)  # checked now: the answers on disk are taken
    assert asks["from disk"] > 20


def test_an_answer_under_another_signature_is_not_taken(asks, monkeypatch):
    cfg = ModelConfig(**SMALL)
    three_runs(cfg, {"batch_size": 2}, asks)
    new_process(monkeypatch)
    text = fake_memo.signature_text
    monkeypatch.setattr(fake_memo, "signature_text", lambda sig: None if text(sig) is None else text(sig) + "'")
    asks["from disk"] = 0
    dry_run_config(cfg, batch_size=2)
    assert asks["from disk"] == 0


def test_a_line_cut_short_or_changed_is_ignored(asks, fresh_op_checks, monkeypatch):
    cfg = ModelConfig(**SMALL)
    with fake_memo.off():
        without = dry_run_config(cfg, batch_size=2)
    three_runs(cfg, {"batch_size": 2}, asks)
    path = answers_file(fresh_op_checks)
    lines = path.read_text().splitlines(keepends=True)

    def changed(i, line):  # a size one larger in the answer, still well formed; or the line cut short
        larger = re.sub(r"\[\[(\d+)", lambda m: f"[[{int(m.group(1)) + 1}", line, count=1)
        return larger if i % 2 and larger != line else line[: len(line) // 2] + "\n"

    path.write_text("".join(changed(i, line) for i, line in enumerate(lines)) + "not a line\n")
    new_process(monkeypatch)
    asks.update({"asked": 0, "from disk": 0})
    trace = dry_run_config(cfg, batch_size=2)
    assert asks["from disk"] == 0  # every line was changed: each call asked its fake kernel
    assert trace_differences(trace, without) == []


def test_another_namespace_starts_a_new_file(asks, fresh_op_checks, monkeypatch):
    cfg = ModelConfig(**SMALL)
    three_runs(cfg, {"batch_size": 2}, asks)
    new_process(monkeypatch)
    monkeypatch.setattr(fake_memo_cache, "namespace", lambda: "another torch")
    asks["from disk"] = 0
    dry_run_config(cfg, batch_size=2)
    dry_run_config(cfg, batch_size=2)
    assert asks["from disk"] == 0
    assert len(list((fresh_op_checks / "fake-answers").glob("*.txt"))) == 2


def test_a_full_file_starts_over(asks, fresh_op_checks, monkeypatch):
    three_runs(ModelConfig(**SMALL), {"batch_size": 2}, asks)
    path = answers_file(fresh_op_checks)
    first = set(path.read_text().splitlines())
    monkeypatch.setattr(fake_memo_cache, "MAX_FILE_BYTES", path.stat().st_size * 3 // 2)
    other = ModelConfig(**{**SMALL, "d_model": 24})  # about as many answers: the file would grow past the limit
    dry_run_config(other, batch_size=2)
    dry_run_config(other, batch_size=2)
    now = set(path.read_text().splitlines())
    assert now and not now & first and path.stat().st_size <= fake_memo_cache.MAX_FILE_BYTES
    assert not list(path.parent.glob(".fake-answers-*"))  # no temporary file left
    new_process(monkeypatch)
    asks.update({"asked": 0, "from disk": 0})
    dry_run_config(other, batch_size=2)  # the new file's answers are taken
    assert asks["from disk"] > 20


def test_a_cache_dir_that_cannot_be_written_leaves_the_answers_in_the_process(asks, fresh_op_checks):
    fresh_op_checks.write_text("a file where the directory should be")
    cfg = ModelConfig(**SMALL)
    with fake_memo.off():
        without = dry_run_config(cfg, batch_size=2)
    remembered, never = three_runs(cfg, {"batch_size": 2}, asks)
    assert trace_differences(remembered, without) == [] and fresh_op_checks.is_file()


def _append_many(directory: str, writer: int, rounds: int) -> None:
    stored = fake_memo_cache.StoredAnswers(fake_memo_cache.Path(directory))
    for i in range(rounds):  # 20 lines of about 2 KiB per append
        stored.append([(f"key {writer} {i} {j}", "sig", _answer(writer, i, j)) for j in range(20)])


def _answer(writer: int, i: int, j: int) -> str:
    filler = "x" * 2000
    return f'["tensor", "{writer}-{i}-{j}{filler}"]'


def test_concurrent_appenders_leave_every_line_whole(fresh_op_checks):
    """Four processes append 50 times each (40 KiB at a time): every line read back is whole, and every key is
    found with its own answer."""
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    procs = [context.Process(target=_append_many, args=(str(fresh_op_checks), w, 50)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 4
    stored = fake_memo_cache.StoredAnswers(fresh_op_checks)
    assert len(stored.answers) == 4 * 50 * 20
    for w, i, j in itertools.product(range(4), range(50), range(20)):
        assert stored.get(f"key {w} {i} {j}", "sig") == _answer(w, i, j)
