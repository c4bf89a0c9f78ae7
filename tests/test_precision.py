"""Notebook 08's precision table: the bf16 weight copies autograd saves, found by provenance (a cast of a parameter)."""

import pytest
import torch

from anatomy_helpers import make_model
from anatomy_helpers.core.data import get_batch
from anatomy_helpers.lessons.lesson08_scaling import CONFIG, GLOBAL_BATCH, precision_table


def saved_parameter_copies(model, batch_size: int) -> int:
    """Bytes of the distinct storages autograd saves in one autocast forward that hold a bf16 copy of a parameter,
    found by value: a saved bf16 tensor equal to some parameter cast to bf16 (or to its transpose)."""
    casts = [p.detach().to(torch.bfloat16) for p in model.parameters() if p.dim() == 2]
    found: dict[int, int] = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and t.dim() == 2:
            for c in casts:
                for view in (c, c.t()):
                    if view.shape == t.shape and torch.equal(view, t):
                        found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x, y = get_batch(batch_size, model.cfg.seq_len, step=1, seed=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, y)
    return sum(found.values())


@pytest.fixture(scope="module")
def rows():
    return {r.setup: r for r in precision_table(device="cpu")}


def test_autocast_weight_copies_are_the_saved_casts_of_parameters(rows):
    model = make_model(device="cpu", **CONFIG)
    expected = saved_parameter_copies(model, GLOBAL_BATCH)
    # every linear layer's weight (the head's is the tied embedding's), cast once; transposed views are saved
    assert expected == 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert rows["fp32 + autocast bf16"].weight_copies == expected


def test_nothing_is_cast_without_autocast(rows):
    assert rows["fp32"].weight_copies == 0
    assert rows["pure bf16"].weight_copies == 0  # the model is bf16 already: no cast, even where shapes match
