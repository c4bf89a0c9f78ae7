import numpy as np
import pytest
import torch

from anatomy_helpers import make_model, make_optimizer

# Small enough that a tracked step takes milliseconds; big enough to have every part.
SMALL = dict(n_layer=2, d_model=64, n_head=2, seq_len=32)


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)  # what CI has; also keeps runs comparable


@pytest.fixture
def small():
    model = make_model(device="cpu", **SMALL)
    return model, make_optimizer(model, "adamw")


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: the number the tracker must reproduce."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def make_record(rows):
    """An allocation record like Trace.allocation_record() from (step, alloc_id, bytes) rows."""
    step, alloc_id, nbytes = (np.array(c, dtype=np.int64) for c in zip(*rows))
    n = len(rows)
    return {
        "sample": np.arange(n),
        "time_s": np.zeros(n),
        "alloc_id": alloc_id,
        "bytes": nbytes,
        "category": np.zeros(n, dtype=np.int64),
        "step": step,
        "phase": np.ones(n, dtype=np.int64),
    }
