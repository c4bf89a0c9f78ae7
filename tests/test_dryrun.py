"""A dry run (fake tensors) records the same trace as a real run, byte for byte, but for kernel scratch."""

import functools

import numpy as np
import pytest
import torch
import torch.nn as nn

from anatomy_helpers import ModelConfig, make_model, make_optimizer, track_steps
from anatomy_helpers.core.checkpointing import CHECKPOINT_POLICIES
from anatomy_helpers.prediction import dryrun
from anatomy_helpers.prediction.dryrun import (
    KERNEL_SCRATCH_RULE,
    DryRunError,
    dry_run,
    dry_run_config,
    run_steps,
)
from anatomy_helpers.tracking.events import CATEGORIES
from anatomy_helpers.tracking.trace import Trace
from anatomy_helpers.training import train as train_module

from .conftest import SMALL

# Each differs from SMALL in one or two ways; together they cover every field a dry run must follow.
SWEEP = [
    dict(),
    dict(n_layer=3, d_model=48, n_head=3, seq_len=24, batch=3),
    dict(n_head=4, seq_len=16, batch=5),
    dict(optimizer="adam"),
    dict(optimizer="sgd"),
    dict(optimizer="momentum"),
    dict(optimizer="adamw", foreach=True),
    dict(optimizer="adamw", fused=True),
    dict(optimizer="adam", fused=True),
    dict(optimizer="sgd", fused=True),
    dict(optimizer="momentum", foreach=True),
    dict(attn_impl="sdpa"),
    dict(dropout=0.1),
    dict(dropout=0.1, attn_impl="sdpa"),
    dict(dtype="bfloat16"),
    dict(dtype="bfloat16", optimizer="sgd"),
    dict(autocast="bfloat16"),
    dict(checkpoint="full"),
    dict(n_layer=4, checkpoint="every_k", checkpoint_every=2),
    dict(checkpoint="selective"),
    dict(checkpoint="selective", attn_impl="sdpa"),
    dict(checkpoint="attention"),
    dict(checkpoint="offload"),
    dict(checkpoint="full", dropout=0.1),
    dict(block="llama", n_head=4, n_kv_head=2),
    dict(block="llama", n_head=4, tie_embeddings=False, attn_impl="sdpa"),
    dict(block="llama", n_head=4, n_kv_head=1, checkpoint="selective", optimizer="adam", foreach=True),
    # lesson 10's levers: the step fused into backward, the chunked loss, bf16 optimizer state, zero_grad to zeros
    dict(in_backward=True),
    dict(in_backward=True, optimizer="momentum", set_to_none=False),
    dict(loss_chunk=24),
    dict(loss_chunk=7, dtype="bfloat16", in_backward=True),
    dict(optimizer="adamw_bf16"),
    dict(set_to_none=False),
    # gradient accumulation: the global batch in k micro-batches, the tracker made with accumulate=True
    dict(micro_batches=2),
    dict(block="llama", n_head=4, n_kv_head=2, micro_batches=4, batch=8),
    dict(checkpoint="full", micro_batches=2, batch=6),
    dict(autocast="bfloat16", micro_batches=4, optimizer="sgd"),
]


#: the choices of the sweep and their defaults (SMALL's, the course's)
CHOICES = dict(
    optimizer="adamw",
    foreach=None,
    fused=None,
    attn_impl="manual",
    dropout=0.0,
    dtype="float32",
    autocast=None,
    checkpoint="none",
    block="gpt2",
    tie_embeddings=True,
    in_backward=False,
    loss_chunk=None,
    set_to_none=True,
    micro_batches=1,
)


def real_trace(cfg: dict, steps: int) -> Trace:
    """track_steps, the course's loop, with kernel scratch off (the one category a dry run cannot see)."""
    cfg = dict(cfg)
    opt_kw = {k: cfg.pop(k) for k in ("optimizer", "foreach", "fused", "in_backward") if k in cfg}
    step = {k: cfg.pop(k) for k in ("autocast", "set_to_none", "micro_batches") if k in cfg}
    batch = cfg.pop("batch", 4)
    model = make_model(device="cpu", **{**SMALL, **cfg})
    opt = make_optimizer(model, opt_kw.pop("optimizer", "adamw"), **opt_kw)
    original = train_module.StepTracker
    train_module.StepTracker = functools.partial(original, kernel_scratch=False)  # accumulate=: track_steps' own
    try:
        return track_steps(model, opt, steps, batch, **step)
    finally:
        train_module.StepTracker = original


def fake_trace(cfg: dict, steps: int) -> Trace:
    cfg = dict(cfg)
    batch = cfg.pop("batch", 4)
    opt_kw = {
        k: cfg.pop(k)
        for k in ("optimizer", "foreach", "fused", "autocast", "in_backward", "set_to_none", "micro_batches")
        if k in cfg
    }
    return dry_run_config(ModelConfig(**{**SMALL, **cfg}), batch_size=batch, steps=steps, **opt_kw)


def assert_same_trace(dry: Trace, real: Trace) -> None:
    """Every phase of every step (its peak, the peak's breakdown by category, what is left at its end), the
    baseline, and every allocation and free, in order."""
    assert dry.phases() == real.phases()
    assert dry.baseline == real.baseline
    np.testing.assert_array_equal(dry.alloc_deltas, real.alloc_deltas)
    np.testing.assert_array_equal(dry.alloc_category[dry.alloc_ids], real.alloc_category[real.alloc_ids])
    for c in CATEGORIES:
        np.testing.assert_array_equal(dry.timeline.category(c), real.timeline.category(c))


def test_the_sweep_covers_every_choice_a_dry_run_must_follow():
    """Each value of each choice appears in some configuration (a sweep that lost one would no longer test it)."""
    seen = {k: {c.get(k, default) for c in SWEEP} for k, default in CHOICES.items()}
    assert seen == {
        "optimizer": {"adamw", "adam", "sgd", "momentum", "adamw_bf16"},
        "foreach": {None, True},
        "fused": {None, True},
        "attn_impl": {"manual", "sdpa"},
        "dropout": {0.0, 0.1},
        "dtype": {"float32", "bfloat16"},
        "autocast": {None, "bfloat16"},
        "checkpoint": set(CHECKPOINT_POLICIES),
        "block": {"gpt2", "llama"},
        "tie_embeddings": {True, False},
        "in_backward": {False, True},
        "loss_chunk": {None, 24, 7},
        "set_to_none": {True, False},
        "micro_batches": {1, 2, 4},
    }
    assert {c["optimizer"] for c in SWEEP if c.get("fused")} == {"adamw", "adam", "sgd"}  # each fused CPU kernel


@pytest.mark.parametrize("cfg", SWEEP, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_dry_run_equals_measured_byte_for_byte(cfg):
    steps = 2  # step 1 (optimizer state is born) and a later step
    assert_same_trace(fake_trace(cfg, steps), real_trace(cfg, steps))


def test_dry_run_says_kernel_scratch_is_unknown():
    trace = dry_run_config(ModelConfig(**SMALL), batch_size=2, steps=1)
    assert trace.kernel_scratch_recorded is False
    assert np.all(trace.timeline.category("kernel_scratch") == 0)
    assert "kernel_scratch_recorded=False" in KERNEL_SCRATCH_RULE


def test_dry_run_allocates_no_data_for_a_model_bigger_than_ram():
    # 2 x 16384 is ~6.4 B parameters, 26 GB in fp32: built on meta and run on fake tensors.
    cfg = ModelConfig(n_layer=2, d_model=16384, n_head=128, seq_len=64, vocab_size=50304, attn_impl="sdpa")
    trace = dry_run_config(cfg, optimizer="sgd", batch_size=1, steps=1)
    from anatomy_helpers.core.model import param_count

    assert trace.baseline["parameters"] == param_count(cfg) * 4


# ---- any nn.Module -------------------------------------------------------------------------------------------


class EncoderClassifier(nn.Module):
    """torch.nn.TransformerEncoder with a linear head: not the course GPT."""

    def __init__(self, d=32, layers=2, classes=5):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))  # (B, classes)


def encoder_batch(step):
    return torch.empty(4, 10, 32), torch.zeros(4, dtype=torch.long)


def encoder_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("optimizer", ["adamw", "momentum"])
def test_any_module_dry_run_equals_its_real_run(optimizer):
    torch.manual_seed(0)
    model = EncoderClassifier()
    real = run_steps(
        model, make_optimizer(model, optimizer), encoder_batch, encoder_loss, steps=2, kernel_scratch=False
    )
    dry = dry_run(EncoderClassifier, encoder_batch, encoder_loss, lambda m: make_optimizer(m, optimizer), steps=2)
    assert_same_trace(dry, real)
    assert dry.peak().bytes > dry.baseline["parameters"] > 0


class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum().item() > 0:  # branches on data: a dry run has none
            return self.lin(x)
        return self.lin(x) * 2


class NoParameters(nn.Module):
    def forward(self, x):
        return x


def test_a_model_that_reads_values_gets_a_clear_error():
    with pytest.raises(DryRunError, match="reads tensor values"):
        dry_run(ReadsValues, lambda s: (torch.empty(2, 4),), lambda m, b: m(*b).sum())


def test_unsupported_factories_get_clear_errors():
    with pytest.raises(DryRunError, match="no parameters"):
        dry_run(NoParameters, lambda s: (torch.empty(2, 4),), lambda m, b: m(*b).sum())
    with pytest.raises(DryRunError, match="must return an nn.Module"):
        dry_run(lambda: "model", lambda s: (), lambda m, b: m(*b))
    with pytest.raises(DryRunError, match="meta device"):
        dry_run(lambda: nn.Linear(2, 2, device="cpu"), lambda s: (torch.empty(1, 2),), lambda m, b: m(*b).sum())
    real = torch.ones(2, 4)
    with pytest.raises(DryRunError, match="real tensor"):
        dry_run(lambda: nn.Linear(4, 4), lambda s: (real,), lambda m, b: m(*b).sum())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="steps"):
        dry_run_config(ModelConfig(**SMALL), steps=0)
    with pytest.raises(ValueError, match="autocast"):
        dry_run_config(ModelConfig(**SMALL), autocast="fp8")
    with pytest.raises(ValueError, match="batch_size"):
        dry_run_config(ModelConfig(**SMALL), batch_size=0)
    with pytest.raises(ValueError, match="optimizer"):
        dry_run_config(ModelConfig(**SMALL), optimizer="lion")
    with pytest.raises(ValueError, match="ModelConfig.n_kv_head"):
        dry_run_config(n_layer=1, n_head=4, n_kv_head=3, block="llama")


@pytest.mark.parametrize(
    "run, match",
    [
        (dict(micro_batches=0), "micro_batches must be a positive integer"),
        (dict(micro_batches=2.0), "micro_batches must be a positive integer"),
        (dict(micro_batches=True), "micro_batches must be a positive integer"),
        (dict(micro_batches=3), r"batch_size \(4\) must be a multiple of micro_batches \(3\): the global batch"),
        (dict(micro_batches=2, in_backward=True), r"in_backward cannot accumulate micro-batches \(micro_batches=2\)"),
        (dict(in_backward="yes"), "in_backward must be one of"),
    ],
)
def test_bad_micro_batches_are_refused_before_any_run(run, match, monkeypatch):
    monkeypatch.setattr(dryrun, "_run_fake", lambda *a: pytest.fail("a dry run started"))
    with pytest.raises(ValueError, match=match):
        dry_run_config(ModelConfig(**SMALL), batch_size=4, **run)
