import os

# Before torch is imported (libgomp reads it once, at load): OpenMP threads sleep instead of spinning while they wait,
# so the two xdist workers and the nbval kernels they start (which inherit it) do not take cores from each other.
# scripts/course.py sets it for `test.sh`; this covers a plain `pytest`. A value already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from anatomy_helpers import make_model, make_optimizer, track_steps  # noqa: E402
from anatomy_helpers.prediction import fake_check, fake_check_cache  # noqa: E402
from anatomy_helpers.tracking.events import AllocationRecord  # noqa: E402

# One torch thread per xdist worker when scripts/test.sh runs two workers on two cores: two threads each would
# oversubscribe the cores, and OpenMP's waiting threads made the unit tests a third slower. Alone: two, as CI has.
THREADS = 1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 2

# Small enough that a tracked step takes milliseconds; big enough to have every part.
SMALL = dict(n_layer=2, d_model=64, n_head=2, seq_len=32)


@pytest.fixture(autouse=True)
def _test_threads():
    torch.set_num_threads(THREADS)  # the same in every test, so runs are comparable


@pytest.fixture
def fresh_op_checks(monkeypatch, tmp_path):
    """No op signature checked yet (prediction/fake_check.py), in this process or in the cache on disk (an empty
    directory of the test's own, returned), so that a test sees the real kernels run; the suite's shared cache (the
    root conftest.py) and this process's checks are back after it."""
    directory = tmp_path / "op-check-cache"
    monkeypatch.setenv(fake_check_cache.CACHE_DIR_ENV, str(directory))
    monkeypatch.setattr(fake_check, "_PASSED", set(fake_check._ENTRY_OPS))
    monkeypatch.setattr(fake_check, "_FAILED", {})
    monkeypatch.setattr(fake_check, "_ASKED", set())
    monkeypatch.setattr(fake_check_cache, "_current", None)
    return directory


@pytest.fixture
def small():
    """A fresh SMALL model and its AdamW."""
    model = make_model(device="cpu", **SMALL)
    return model, make_optimizer(model, "adamw")


@pytest.fixture(scope="session")
def small_run():
    """(model, optimizer, trace) of three tracked AdamW steps of the SMALL model, batch 4. Shared: do not mutate."""
    torch.set_num_threads(THREADS)  # session fixtures run before the autouse one
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "adamw")
    return model, opt, track_steps(model, opt, steps=3, batch_size=4)


@pytest.fixture(scope="session")
def small_trace(small_run):
    """The trace of :func:`small_run`."""
    return small_run[2]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``, computed here independently of the package."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def numel(model) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def phase_end(trace, step, phase) -> dict[str, int]:
    """Bytes per category at the end of ``phase`` in ``step``, read from the phase list."""
    return next(ph for ph in trace.phases() if ph.step == step and ph.phase == phase).at_end


def make_record(rows) -> AllocationRecord:
    """An allocation record like Trace.allocation_record() from hand-written (step, alloc_id, bytes) rows."""
    step, alloc_id, nbytes = (np.array(c, dtype=np.int64) for c in zip(*rows))
    n = len(rows)
    return AllocationRecord(
        sample=np.arange(n),
        time_s=np.zeros(n),
        alloc_id=alloc_id,
        bytes=nbytes,
        category=np.zeros(n, dtype=np.int64),
        step=step,
        phase=np.ones(n, dtype=np.int64),
    )


# The slow tests first, the longest first (a file's tests stay together): with pytest-xdist they then run beside the
# unit tests and notebooks from the start instead of as a tail at the end of the suite. scripts/test.sh passes
# --no-loadscope-reorder, or xdist would put the files with the most tests (the notebooks' cells) first instead.
# Then the longest unit-test files (each 13-50 CPU-seconds; measured with --quick, December 2026), so that neither
# worker is left with one of them at the end while the other has finished.
_SLOW_FIRST = ["test_colab_path.py", "test_wheelhouse.py", "test_binder_path.py", "test_browser.py", "test_hf.py",
               "test_fake_world.py", "test_prediction.py", "test_world_runner.py", "test_distributed.py",
               "test_tensor_parallel.py"]  # fmt: skip


# Under `--dist loadfile` a file's tests stay on one worker (a notebook's cells, a module fixture's users), except in
# these files, whose tests are independent of each other and long (the browser test, one per notebook): each is a
# scope of its own, so the two workers share them. (xdist's `loadgroup` would do this with marks, but with pytest 9 its
# workers cannot rename the tests it groups by, so every unmarked test became a group of one.)
_ONE_SCOPE_PER_TEST = {"tests/test_browser.py"}


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return nodeid if file in _ONE_SCOPE_PER_TEST else file

    return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    def key(item):
        name = item.path.name
        if name in _SLOW_FIRST:
            return _SLOW_FIRST.index(name)
        return len(_SLOW_FIRST) - 0.5 if item.get_closest_marker("delivery") else len(_SLOW_FIRST)

    items.sort(key=key)  # stable: everything else keeps its order
