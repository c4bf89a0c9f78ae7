"""Lesson 06's prediction helpers: will it fit, which phase runs out first, the cheapest fix."""

import pytest
import torch
from matplotlib.figure import Figure

from anatomy_helpers import make_model, make_optimizer, track_steps
from anatomy_helpers.allocator import min_limit_to_pass
from anatomy_helpers.dryrun import dry_run_config
from anatomy_helpers.fit import (
    CUDA_CONTEXT_BYTES,
    DEVICES,
    cheapest_fix,
    devices,
    fixes_table,
    step_flops,
    usable_bytes,
    will_it_fit,
)
from anatomy_helpers.lessons.prediction import fit_panel, plot_fit
from anatomy_helpers.model import ModelConfig
from anatomy_helpers.tracker import StepTracker

from .conftest import SMALL


def test_devices_and_usable_memory():
    assert DEVICES["T4 16 GB"] == 16 * 10**9 and DEVICES["H200 141 GB"] == 141 * 10**9
    assert usable_bytes("T4 16 GB") == 16 * 10**9 - CUDA_CONTEXT_BYTES == 16 * 10**9 - 2**29
    assert usable_bytes(2**30) == 2**29
    assert ("this GPU" in devices()) == torch.cuda.is_available()
    with pytest.raises(ValueError, match="device must be one of"):
        usable_bytes("T5")


def test_fit_report_phases_are_the_dry_runs_phase_peaks():
    cfg = ModelConfig(**SMALL)
    report = will_it_fit(cfg, 4, implementation="single")
    trace = dry_run_config(cfg, batch_size=4, foreach=False)
    assert [(p.step, p.phase) for p in report.phases] == [
        (s, ph) for s in (1, 2) for ph in ("forward", "backward", "optimizer")
    ]
    for p in report.phases:
        assert p.tensors == trace.peak(step=p.step, phase=p.phase).bytes
        assert p.reserved >= p.tensors  # the simulated allocator rounds up and caches
    assert report.fits and report.first_failure is None and "FITS" in report.verdict()
    assert "CUDA context (assumed)" in report.table()


def test_verdict_names_the_first_phase_that_runs_out():
    cfg = ModelConfig()  # big enough for 2 MiB steps of the cap to tell step 1 from step 2
    record = dry_run_config(cfg, batch_size=4, foreach=True).allocation_record()
    step1, both = min_limit_to_pass(record, through_step=1), min_limit_to_pass(record)
    assert step1 < both
    # a device whose usable memory is just what step 1 needs: step 1 passes, step 2 runs out
    report = will_it_fit(cfg, 4, device=step1 + CUDA_CONTEXT_BYTES)
    assert not report.fits and report.failure[0] == 2
    assert "runs out first in step 2" in report.verdict()
    assert will_it_fit(cfg, 4, device=both + CUDA_CONTEXT_BYTES).fits
    # smaller than the parameters: the model itself does not fit
    tiny = will_it_fit(cfg, 4, device=CUDA_CONTEXT_BYTES + 1024)
    assert tiny.failure[0] == 0 and "the model itself" in tiny.verdict()


def test_micro_batch_bound_covers_real_gradient_accumulation():
    cfg = ModelConfig(**SMALL)
    fixes = {f.name: f for f in cheapest_fix(cfg, 4, implementation="single", device=10**9)}
    fix = fixes["micro-batch 2 x 2 (accumulate)"]
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "adamw", foreach=False)
    tracker = StepTracker(model, opt, kernel_scratch=False, accumulate=True)
    real = track_steps(model, opt, steps=2, batch_size=4, micro_batches=2, tracker=tracker)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    plain = dry_run_config(cfg, batch_size=2, foreach=False).peak().bytes
    inputs = 2 * 8 * cfg.seq_len * 2  # x and y (int64) of the two rows not in the micro-batch
    assert plain < real.peak().bytes <= fix.report.peak.tensors == plain + grads + inputs
    assert fix.micro_batches == 2 and fix.extra_flops == pytest.approx(0, abs=1e-9)


def test_checkpointing_costs_flops_and_fixes_are_ranked():
    cfg = ModelConfig(**SMALL)
    none, full = step_flops(cfg, 4), step_flops(ModelConfig(**SMALL, checkpoint="full"), 4)
    assert 1 < full / none < 4 / 3  # recomputing the blocks' forwards: at most one more forward (1/3 of the step)
    fixes = cheapest_fix(cfg, 4, device=2 * 2**30)
    assert all(f.fits for f in fixes[:-1] if fixes[-1].fits)  # fitting candidates come first
    fitting = [f for f in fixes if f.fits]
    assert fitting == sorted(fitting, key=lambda f: (f.changes_training, round(f.extra_flops, 3), f.micro_batches))
    ck = next(f for f in fixes if f.name == "checkpoint=full")
    assert ck.extra_flops == pytest.approx(full / none - 1)
    assert "CHANGES TRAINING" in fixes_table(fixes)


def test_plot_and_panel(capsys):
    report = will_it_fit(ModelConfig(**SMALL), 2, device=CUDA_CONTEXT_BYTES + 2**20)
    fig = plot_fit(report)
    ax = fig.axes[0]
    assert isinstance(fig, Figure) and "MiB" in ax.get_ylabel() and ax.get_title()
    assert isinstance(fit_panel(batch_size=1), Figure)
    assert "usable on T4 16 GB" in capsys.readouterr().out
