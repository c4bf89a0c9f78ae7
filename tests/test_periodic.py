"""periodic_dry_run: the course GPT's dry run at a depth not recorded, built from three shallow ones, equals the
full-depth dry run byte for byte; where the step does not repeat block by block it runs the full one and says why."""

import dataclasses

import numpy as np
import pytest

from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.prediction import periodic
from anatomy_helpers.prediction.dryrun import dry_run_config
from anatomy_helpers.prediction.periodic import periodic_dry_run

# small widths: every dry run here takes a fraction of a second
TINY = dict(d_model=16, n_head=2, seq_len=8, vocab_size=64)


def assert_same(fast, full):
    """Every sequence of the two traces equal (all but the wall times, which the periodic one does not measure):
    the whole timeline per category, every phase's peak and breakdown, the step peaks, allocations, marks."""
    assert periodic.trace_differences(fast, full) == []


# Both blocks x every policy; across them fp32 and bf16 weights, bf16 autocast, manual and sdpa attention,
# grouped-query attention, batch 1 and 2, AdamW and SGD (one case each keeps the file's run short).
CASES = [
    (dict(checkpoint="none"), {"in_backward": True}),
    (dict(checkpoint="full", attn_impl="sdpa"), {"autocast": "bfloat16", "batch_size": 2}),
    (dict(checkpoint="selective", dtype="bfloat16"), {}),
    (dict(checkpoint="attention"), {"autocast": "bfloat16"}),
    (dict(checkpoint="every_k", checkpoint_every=1, attn_impl="sdpa"), {"optimizer": "sgd"}),
    (dict(block="llama", checkpoint="none", attn_impl="sdpa"), {"autocast": "bfloat16"}),
    (dict(block="llama", checkpoint="full", dtype="bfloat16"), {}),
    (dict(block="llama", checkpoint="selective", n_kv_head=1), {"batch_size": 2}),
    (dict(block="llama", checkpoint="attention", attn_impl="sdpa", dtype="bfloat16"), {}),
    (dict(block="llama", checkpoint="every_k", checkpoint_every=1), {"autocast": "bfloat16"}),
]


@pytest.mark.parametrize("fields, run", CASES, ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) or "-")
def test_periodic_equals_full_dry_run(fields, run):
    run = {"batch_size": 1, **run}
    cfg = ModelConfig(n_layer=6, **TINY, **fields)
    fast, why = periodic_dry_run(cfg, **run)
    assert why is None  # the period was used, not the full dry run
    assert_same(fast, dry_run_config(cfg, **run))


def test_periodic_at_twelve_layers():
    cfg = ModelConfig(n_layer=12, block="llama", checkpoint="selective", **TINY)
    fast, why = periodic_dry_run(cfg, batch_size=2, autocast="bfloat16")
    assert why is None
    assert_same(fast, dry_run_config(cfg, batch_size=2, autocast="bfloat16"))


@pytest.mark.parametrize(
    "fields, run",
    [
        (dict(), {"micro_batches": 2, "batch_size": 2}),
        (dict(), {"micro_batches": 4, "batch_size": 8}),  # its saved tensors' passes were aligned into each other
        (dict(block="llama", checkpoint="full", attn_impl="sdpa"), {"micro_batches": 4, "batch_size": 8}),
    ],
    ids=["gpt2 k=2", "gpt2 k=4", "llama full k=4"],
)
def test_periodic_equals_full_dry_run_with_micro_batches(fields, run):
    """Gradient accumulation: every depth runs the k micro-batches, the gradients alive across them; the period
    read from depths 3, 4 and 5 still gives the full dry run at depth 7, byte for byte."""
    cfg = ModelConfig(n_layer=7, **TINY, **fields)
    fast, why = periodic_dry_run(cfg, **run)
    assert why is None
    full = dry_run_config(cfg, **run)
    assert_same(fast, full)
    forwards = [p for p in full.phases() if p.phase == "forward"]
    assert len(forwards) == 2 * run["micro_batches"]  # two steps of k micro-batches: the micro-batches were run


@pytest.mark.parametrize(
    "fields, reason",
    [
        (dict(n_layer=6, checkpoint="every_k", checkpoint_every=2), "checkpoint_every 2 > 1 groups blocks"),
        (dict(n_layer=5), "n_layer 5 is at most 5"),
    ],
)
def test_refused_before_any_run(fields, reason):
    cfg = ModelConfig(**TINY, **fields)
    trace, why = periodic_dry_run(cfg, batch_size=1)
    assert why is not None and why.startswith("full dry run: ") and reason in why
    assert f"blocks.{cfg.n_layer - 1}" in trace.timeline.module_names  # the full depth's trace


def test_falls_back_where_the_rows_do_not_repeat(monkeypatch):
    """every_k with k = 2, let through to the period's checks: segments of two blocks do not repeat every block,
    the checks say so, and the full dry run is returned."""
    monkeypatch.setattr(periodic, "_refused_before", lambda cfg: None)
    cfg = ModelConfig(n_layer=6, checkpoint="every_k", checkpoint_every=2, **TINY)
    trace, why = periodic_dry_run(cfg, batch_size=1)
    assert why is not None and why.startswith("full dry run: the ") and "block" in why
    assert_same(trace, dry_run_config(cfg, batch_size=1))


def test_rows_that_do_not_repeat_are_refused():
    """Rows whose numbers do not grow by one step per block (or that change, not just grow) are not extrapolated."""
    toks = [["a", "b"], ["a", "m", "b"], ["a", "m", "m", "b"]]
    grows = [np.array([[0], [1]]), np.array([[0], [1], [2]]), np.array([[0], [1], [2], [4]])]
    with pytest.raises(periodic.NotPeriodic, match="same step"):
        periodic._extrapolate(toks, grows, 3, "rows")
    changed = [["a", "b"], ["a", "m", "b"], ["a", "m", "n", "b"]]
    with pytest.raises(periodic.NotPeriodic):
        periodic._extrapolate(changed, [np.zeros((len(t), 1), dtype=np.int64) for t in changed], 3, "rows")
    steady = [np.array([[0], [1]]), np.array([[0], [1], [2]]), np.array([[0], [1], [2], [3]])]
    toks_ok, nums_ok = periodic._extrapolate(toks, steady, 3, "rows")  # depth 3 + 3: three blocks in between
    assert toks_ok == ["a", "m", "m", "m", "b"] and nums_ok[:, 0].tolist() == [0, 1, 2, 3, 4]


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="cfg must be a ModelConfig"):
        periodic_dry_run(dataclasses.asdict(ModelConfig(**TINY)))
