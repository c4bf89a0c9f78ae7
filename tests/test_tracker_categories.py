"""What the tracker files under which category, worked out by hand from the model's sizes (numel x element size) on a
one-layer model: fast, and sharp enough that filing a buffer or a gradient under another category fails."""

import pytest

from anatomy_helpers import make_model, make_optimizer, track_steps
from anatomy_helpers.tracking.events import CATEGORIES

TINY = dict(n_layer=1, d_model=32, n_head=2, seq_len=16)


@pytest.fixture(scope="module")
def tiny_run():
    model = make_model(device="cpu", **TINY)
    opt = make_optimizer(model, "adamw")
    return model, track_steps(model, opt, steps=1, batch_size=2)


def test_parameters_and_buffers_are_parameters_at_rest(tiny_run):
    model, trace = tiny_run
    params = [p.numel() for p in model.parameters()]
    # fp32 weights, and the manual attention's causal mask: one (s, s) bool buffer per layer, 1 byte each
    expected = 4 * sum(params) + TINY["n_layer"] * TINY["seq_len"] ** 2
    assert trace.baseline == {**dict.fromkeys(CATEGORIES, 0), "parameters": expected}


def test_gradients_and_adam_state_by_hand(tiny_run):
    model, trace = tiny_run
    params = [p.numel() for p in model.parameters()]
    backward = trace.phase(1, "backward").at_end
    assert backward["gradients"] == 4 * sum(params)  # one fp32 gradient per parameter
    # AdamW: exp_avg and exp_avg_sq (fp32, like each parameter) and a 4-byte step counter per tensor
    assert trace.phase(1, "optimizer").at_end["optimizer_state"] == 8 * sum(params) + 4 * len(params)
