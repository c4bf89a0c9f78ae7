"""The closed form against the dry run (== the measurement), and the textbook rules beside it."""

import pytest

from anatomy_helpers.dryrun import dry_run_config
from anatomy_helpers.estimate import (
    IMPLEMENTATIONS,
    estimate_step,
    impl_of,
    optimizer_state_bytes,
    parameter_bytes,
    textbook_estimates,
)
from anatomy_helpers.formulas import korthikanti_layer_bytes, param_count
from anatomy_helpers.model import ModelConfig

from .conftest import SMALL

# A few of benchmarks/prediction_errors.py's 34 configs (that script prints the whole error table).
CASES = [
    (dict(), "adamw", None, None, 4),
    (dict(attn_impl="sdpa", dropout=0.1), "adam", True, None, 4),
    (dict(checkpoint="full", n_layer=4), "adamw", None, None, 4),
    (dict(checkpoint="selective"), "momentum", None, None, 4),
    (dict(block="llama", n_head=4, n_kv_head=2), "adamw", None, True, 4),
    (dict(dtype="bfloat16", vocab_size=2000), "sgd", None, None, 4),
]


@pytest.mark.parametrize("changes, optimizer, foreach, fused, batch", CASES)
def test_closed_form_step_peak_within_5_percent_of_measured(changes, optimizer, foreach, fused, batch):
    cfg = ModelConfig(**{**SMALL, **changes})
    trace = dry_run_config(cfg, optimizer=optimizer, foreach=foreach, fused=fused, batch_size=batch, steps=2)
    est = estimate_step(cfg, batch, optimizer, impl_of(foreach, fused))
    assert est.peak == pytest.approx(trace.peak().bytes, rel=0.05)
    assert est.parameters == trace.baseline["parameters"]  # parameters and buffers: exact
    state = trace.phase(1, "optimizer").at_end["optimizer_state"]
    assert est.optimizer_state == state  # exact too


def test_model_states_by_hand():
    cfg = ModelConfig(**SMALL)
    n = param_count(cfg)
    tensors = 2 * 12 + 4  # per block: 2 LayerNorms (w, b), qkv, proj, fc, proj (w, b); embeddings 2, ln_f 2
    assert optimizer_state_bytes(cfg, "adamw") == 2 * 4 * n + 4 * tensors
    assert optimizer_state_bytes(cfg, "momentum") == 4 * n
    assert optimizer_state_bytes(cfg, "sgd") == 0
    assert parameter_bytes(cfg) == 4 * n + cfg.n_layer * cfg.seq_len**2  # + one bool causal mask per layer


def test_textbook_estimates_by_hand():
    cfg = ModelConfig(**SMALL)
    n, b = param_count(cfg), 4
    book = textbook_estimates(cfg, b, "adamw")
    assert book.weights_only == 4 * n
    assert book.model_states == book.weights_only * 4 + 4 * (2 * 12 + 4)  # weights, grads, two moments, steps
    assert book.korthikanti == 2 * korthikanti_layer_bytes(32, 4, 64, 2)
    assert book.sixteen_per_param == 16 * n + book.korthikanti


def test_step_one_has_no_optimizer_state_before_its_optimizer_phase():
    est = estimate_step(ModelConfig(**SMALL), 4)
    assert est.phase_peaks[(2, "forward")] - est.phase_peaks[(1, "forward")] == est.optimizer_state


def test_bad_implementation_is_refused():
    with pytest.raises(ValueError, match="impl must be one of"):
        estimate_step(ModelConfig(**SMALL), 4, "adamw", "triton")
    assert IMPLEMENTATIONS == ("single", "foreach", "fused")
