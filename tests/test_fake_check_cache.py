"""The op checks' cache on disk (prediction/fake_check_cache.py): a later process on the same machine and torch
version checks no kernel again; another torch version or another source of the checks checks again; a broken file is
ignored; concurrent writers leave a whole file; ANATOMY_CACHE_DIR names the directory."""

import json
import multiprocessing
import os
import re
import subprocess
import sys

import pytest
import torch

from anatomy_helpers.prediction import fake_check, fake_check_cache
from anatomy_helpers.prediction.dryrun import DryRunError, dry_run

# A dry run of the smallest model with a foreach optimizer (a signature that holds a set of tensor kinds: parameters
# of 1 and 2 dimensions), as a line of code run here and in a child process alike.
TINY = (
    "dry_run(lambda: torch.nn.Linear(8, 4), lambda s: (torch.empty(3, 8),), lambda m, b: m(*b).sum(), "
    "lambda m: torch.optim.AdamW(m.parameters(), foreach=True))"
)


def tiny_trace():
    return eval(TINY, {"dry_run": dry_run, "torch": torch})


@pytest.fixture
def real_calls(fresh_op_checks, monkeypatch):
    """The real kernel calls the checks make, in order (an empty cache and nothing checked in this process)."""
    calls = []
    real_call = fake_check._real_call
    monkeypatch.setattr(fake_check, "_real_call", lambda call: calls.append(call) or real_call(call))
    return calls


def new_process(monkeypatch):
    """Forget what this process checked and read from the disk, as a new process starts (the disk is kept)."""
    monkeypatch.setattr(fake_check, "_PASSED", set(fake_check._ENTRY_OPS))
    monkeypatch.setattr(fake_check, "_FAILED", {})
    monkeypatch.setattr(fake_check, "_ASKED", set())
    monkeypatch.setattr(fake_check_cache, "_current", None)


def stored(directory) -> dict:
    """{file name: its contents} of the cache's files in ``directory``."""
    files = sorted((directory / "op-checks").glob("*.json"))
    return {f.name: json.loads(f.read_text(encoding="utf-8")) for f in files}


def test_a_later_process_checks_no_kernel_and_gets_the_same_trace(real_calls, fresh_op_checks):
    first = tiny_trace()
    assert len(real_calls) > 5  # checked here, for real
    [(name, data)] = stored(fresh_op_checks).items()
    assert data["namespace"] == fake_check_cache.namespace() and len(data["results"]) == len(real_calls)
    assert any(re.search(r"\{\('cpu'[^{}]*\), \('cpu'", text) for text in data["results"])  # a set: sorted
    code = (
        "import torch\n"
        "from anatomy_helpers.prediction import fake_check\n"
        "from anatomy_helpers.prediction.dryrun import dry_run\n"
        "ran = []\n"
        "real_call = fake_check._real_call\n"
        "fake_check._real_call = lambda call: ran.append(call) or real_call(call)\n"
        f"trace = {TINY}\n"
        "print(len(ran))\n"
        "print(trace.table())\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="12345", ANATOMY_CACHE_DIR=str(fresh_op_checks))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == f"0\n{first.table()}\n"  # no real call (another hash seed), the same answer
    assert stored(fresh_op_checks) == {name: data}  # nothing new to write


@pytest.mark.parametrize("change", ["torch version", "fake_check.py"])
def test_another_torch_version_or_source_checks_again(change, real_calls, fresh_op_checks, monkeypatch, tmp_path):
    tiny_trace()
    first = len(real_calls)
    new_process(monkeypatch)
    tiny_trace()
    assert len(real_calls) == first  # the same namespace: read from the disk
    new_process(monkeypatch)
    if change == "torch version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    else:  # a copy of fake_check.py with one more line: a rule changed
        source = tmp_path / "fake_check.py"
        source.write_bytes(open(fake_check.__file__, "rb").read() + b"# changed\n")
        monkeypatch.setattr(fake_check_cache, "_SOURCES", (source, *fake_check_cache._SOURCES[1:]))
    tiny_trace()
    assert len(real_calls) == 2 * first  # checked again, for real
    assert len(stored(fresh_op_checks)) == 2  # in a file of its own; the first is left alone


@pytest.mark.parametrize(
    "content",
    [b"", b'{"namespace": ', b"\xff\xfe not text", b"[1, 2]", b'{"namespace": {}, "results": {}}', b"other namespace",
     b"results of a wrong shape"],
)  # fmt: skip
def test_a_broken_or_foreign_file_is_ignored_and_replaced(content, real_calls, fresh_op_checks, monkeypatch):
    tiny_trace()
    first = len(real_calls)
    [(name, data)] = stored(fresh_op_checks).items()
    if content == b"other namespace":
        content = json.dumps({**data, "namespace": {**data["namespace"], "torch": "0.0"}}).encode()
    elif content == b"results of a wrong shape":
        content = json.dumps({**data, "results": {text: True for text in data["results"]}}).encode()
    (fresh_op_checks / "op-checks" / name).write_bytes(content)
    new_process(monkeypatch)
    tiny_trace()  # no error
    assert len(real_calls) == 2 * first  # nothing taken from the file: checked again
    assert stored(fresh_op_checks) == {name: data}  # and the file replaced by a whole one


def test_a_cache_dir_that_cannot_be_written_leaves_the_checks_in_the_process(real_calls, fresh_op_checks, monkeypatch):
    fresh_op_checks.write_text("a file where the directory should be")
    tiny_trace()  # no error
    first = len(real_calls)
    assert first and fresh_op_checks.is_file()
    tiny_trace()
    assert len(real_calls) == first  # remembered in this process all the same


def test_a_refusal_is_stored_and_refuses_again(real_calls, fresh_op_checks, monkeypatch):
    """oneDNN's LSTM: its fake kernel returns an empty workspace (tests/test_dryrun_modules.py). The later process runs
    no kernel and refuses it, naming the op."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    from .test_dryrun_modules import RecurrentLM, real_and_dry, token_batch, token_loss

    with pytest.raises(DryRunError, match=r"mkldnn_rnn_layer.*\(0,\) uint8") as first:
        real_and_dry(RecurrentLM, token_batch, token_loss)
    [data] = stored(fresh_op_checks).values()
    assert [text for text, result in data["results"].items() if result != "passed"] == [
        text for text in data["results"] if text.startswith("(aten.mkldnn_rnn_layer.default")
    ]
    new_process(monkeypatch)
    monkeypatch.setattr(fake_check, "_real_call", lambda call: pytest.fail(f"{call.func} checked again"))
    with pytest.raises(DryRunError, match=r"mkldnn_rnn_layer.*\(0,\) uint8") as again:
        dry_run(RecurrentLM, token_batch, token_loss)
    assert str(again.value) == str(first.value)


def test_what_is_not_stored_custom_ops_gpus_and_out_of_memory(real_calls, fresh_op_checks, monkeypatch, tmp_path):
    from .test_dryrun_modules import UsesAFakeKernelWrongInBf16

    dry_run(UsesAFakeKernelWrongInBf16, lambda s: (torch.empty(3, 8),), lambda m, b: m(*b).sum())
    assert any("anatomy_test" in str(key[0]) for key in fake_check._PASSED if isinstance(key, tuple))  # passed ...
    [data] = stored(fresh_op_checks).values()
    assert data["results"] and not any("anatomy_test" in text for text in data["results"])  # ... but not stored
    # a call on a GPU: not stored; the same on the CPU: stored
    call = next(c for c in real_calls if "addmm" in str(c.func))
    key = (call.func, True, "a signature of no other call")
    for device, stored_now in (("cuda", False), ("cpu", True)):
        meta = fake_check.TensorMeta((1,), (1,), 0, torch.float32, torch.device(device), 0, 4, False)
        fake_check._store(key, fake_check.OpCall(call.func, (meta,), {}, (), 4, "", True), "passed")
        assert bool(fake_check_cache._current.new) == stored_now
    fake_check_cache._current.new.clear()
    # a real kernel out of memory: refused in this process only
    new_process(monkeypatch)
    monkeypatch.setenv(fake_check_cache.CACHE_DIR_ENV, str(tmp_path / "empty"))
    monkeypatch.setattr(fake_check, "_real_call", lambda call: (None, "OutOfMemoryError: try again later"))
    with pytest.raises(DryRunError, match="OutOfMemoryError"):
        tiny_trace()
    assert not (tmp_path / "empty").exists()  # nothing stored


def _write_many(directory: str, writer: int, rounds: int) -> None:
    os.environ[fake_check_cache.CACHE_DIR_ENV] = directory
    disk = fake_check_cache.DiskChecks(fake_check_cache.cache_dir())
    for i in range(rounds):
        disk.add(f"writer {writer} signature {i}", "passed")
        disk.write()


def _read_many(path: str, rounds: int, bad) -> None:
    for _ in range(rounds):
        try:
            with open(path, "rb") as f:
                json.loads(f.read())
        except FileNotFoundError:
            continue
        except ValueError:
            bad.value += 1


def test_concurrent_writers_leave_a_whole_file(fresh_op_checks):
    """Four processes write 50 times each while a fifth reads: every read is whole JSON, and so is the file."""
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    path = fake_check_cache.DiskChecks(fresh_op_checks).path
    bad = context.Value("i", 0)
    procs = [context.Process(target=_write_many, args=(str(fresh_op_checks), w, 50)) for w in range(4)]
    procs.append(context.Process(target=_read_many, args=(str(path), 2000, bad)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 5 and bad.value == 0
    [data] = stored(fresh_op_checks).values()
    assert data["namespace"] == fake_check_cache.namespace()
    # the last writer's entries are all there (another's may be lost: checked again, see fake_check.py)
    assert any({f"writer {w} signature {i}" for i in range(50)} <= set(data["results"]) for w in range(4))
    assert not list(path.parent.glob(".op-checks-*"))  # no temporary file left


def test_the_cache_dir_is_anatomy_cache_dir_else_the_users_cache(fresh_op_checks, monkeypatch, tmp_path):
    assert fake_check_cache.cache_dir() == fresh_op_checks
    monkeypatch.delenv(fake_check_cache.CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    expected = {"win32": tmp_path / "local", "darwin": fake_check_cache.Path.home() / "Library" / "Caches"}
    assert fake_check_cache.cache_dir() == expected.get(sys.platform, tmp_path / "xdg") / "training-step-anatomy"


def test_the_namespace_holds_torchs_version_and_the_checks_source():
    ns = fake_check_cache.namespace()
    assert ns["torch"] == torch.__version__ and ns["torch_git"] == torch.version.git_version
    sources = b""
    for module in (fake_check, fake_check_cache):
        with open(module.__file__, "rb") as f:
            sources += f.read()
    assert ns["sources"] == fake_check_cache._digest(sources)
    assert ns["cpu"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()


def test_a_signature_is_stored_as_text_the_same_in_every_process():
    """Sets (a list argument's kinds) are written sorted, not in the process's hash order; parts with no such text
    (an object, an op of another namespace) leave the signature unstored."""
    kinds = frozenset({("cpu", torch.float32, 2, True, True), ("cpu", torch.float32, 1, True, True)})
    key = (torch.ops.aten._foreach_add.List, True, kinds, kinds, int)
    assert fake_check_cache.signature_text(key) == (
        "(aten._foreach_add.List, True, {('cpu', dtype(torch.float32), 1, True, True), ('cpu', dtype(torch.float32), "
        "2, True, True)}, {('cpu', dtype(torch.float32), 1, True, True), ('cpu', dtype(torch.float32), 2, True, "
        "True)}, <class builtins.int>)"
    )
    text = fake_check_cache.signature_text
    assert text((torch.ops.aten.add.Tensor, True, object())) is None
    assert text((torch.ops.profiler._record_function_enter_new.default, True, "name")) is None
