"""Lesson 06's prediction helpers: will it fit, which phase runs out first, the cheapest fix."""

import dataclasses
import math

import pytest
import torch
from matplotlib.figure import Figure
from torch._subclasses.fake_tensor import FakeTensorMode

from anatomy_helpers import make_model, make_optimizer, track_steps
from anatomy_helpers.core.model import GPT, ModelConfig
from anatomy_helpers.lessons.lesson06_prediction import fit_panel
from anatomy_helpers.prediction.allocator import LimitReplay, min_limit_to_pass, replay
from anatomy_helpers.prediction.cuda_rules import CudaRuleError
from anatomy_helpers.prediction.devices import (
    CUDA_CONTEXT_BYTES,
    DEVICES,
    Capacity,
    Device,
    capacity_table,
    device_names,
    get_device,
    gib_device,
)
from anatomy_helpers.prediction.dryrun import build_fake_model, course_batch, dry_run_config
from anatomy_helpers.prediction.fit import SIZE_ONLY_RULES, FitRequest, allocator_answer, will_it_fit
from anatomy_helpers.prediction.fixes import cheapest_fix, fixes_table
from anatomy_helpers.prediction.flops import config_step_flops
from anatomy_helpers.prediction.levers import EFFECTS, Fix, levers, rank_key
from anatomy_helpers.tracking.tracker import StepTracker
from anatomy_helpers.training.step import flop_counter, gpt_loss
from anatomy_helpers.ui.plots import DEVICE_LINE_RANGE, plot_fit

from .conftest import SMALL
from .figure_data import horizontal_lines


def test_devices_carry_both_totals_and_a_fit_uses_what_a_process_sees():
    smi = {name: dev.driver_total / 2**20 for name, dev in DEVICES.items()}
    # nvidia-smi's totals (docs/references.md); marketed GB are neither 10**9 nor 2**30 bytes
    assert smi == {"t4": 15_360, "l4": 23_034, "a100-40": 40_960, "a100-80": 81_920, "h100": 81_559, "h200": 143_771}
    # what a process sees (total_memory, deviceQuery's totalGlobalMem) in public logs: the lowest where they differ
    seen = {"t4": 14_930, "l4": 22_518, "a100-40": 40_339, "a100-80": 81_221, "h100": 81_082, "h200": 143_156}
    assert {name: dev.total / 2**20 for name, dev in DEVICES.items()} == seen
    assert all(0.2 * 2**30 < dev.driver_total - dev.total < 0.7 * 2**30 for dev in DEVICES.values())
    assert all(dev.usable == dev.total - CUDA_CONTEXT_BYTES for dev in DEVICES.values())
    assert DEVICES["t4"].total_note().startswith("(as a process sees it: the lowest of 14,930 to 15,109 MiB")
    assert "as a process sees it: 143,156 MiB" in DEVICES["h200"].total_note()
    assert get_device("T4") is DEVICES["t4"] and get_device(2**30).usable == 2**29
    assert get_device(2**30).driver_total is None and get_device(2**30).total_note() == ""
    assert gib_device(24).total == 24 * 2**30
    assert ("this GPU" in device_names()) == torch.cuda.is_available()
    report = will_it_fit(ModelConfig(**SMALL), 2, device="h100")
    assert report.capacity == 81_082 * 2**20 and report.usable == 81_082 * 2**20 - CUDA_CONTEXT_BYTES
    assert "81,082 to 81,090 MiB in public logs; nvidia-smi says 81,559 MiB" in report.table()


def test_a_capacity_is_refused_unless_its_process_figures_are_sorted_and_under_the_driver():
    with pytest.raises(ValueError, match="lowest first"):
        Capacity(100, "x", (90, 80), "y")
    with pytest.raises(ValueError, match="one or more"):
        Capacity(100, "x", (), "y")
    with pytest.raises(ValueError, match="cannot see more"):
        Capacity(100, "x", (90, 101), "y")
    lines = capacity_table().splitlines()[2:]  # under the header and the rule: one line per GPU
    assert [line.split()[0] for line in lines] == list(DEVICES)
    assert all(line.split()[-2] == f"{dev.total // 2**20:,}" for line, dev in zip(lines, DEVICES.values()))


def test_bf16_is_native_from_compute_capability_8():
    assert [name for name, dev in DEVICES.items() if not dev.bf16_native] == ["t4"]  # 7.5; the rest 8.0 to 9.0
    assert DEVICES["t4"].mixed_precision == "float16" and DEVICES["a100-40"].mixed_precision == "bfloat16"
    assert get_device(2**34).bf16_native is None  # a size alone: capability unknown


@pytest.mark.parametrize("device", [-1, 0, True, math.nan, 1.5, "x", "T4 16 GB", None, [16]])
def test_bad_devices_are_refused_naming_the_argument(device):
    with pytest.raises(ValueError, match="device must be"):
        get_device(device)
    with pytest.raises(ValueError, match="device must be"):
        will_it_fit(ModelConfig(**SMALL), 2, device=device)  # before any dry run


@pytest.mark.parametrize("gib", [0, -2, math.nan, math.inf, True, "16"])
def test_bad_device_sizes_are_refused(gib):
    with pytest.raises(ValueError, match="finite number of GiB"):
        gib_device(gib)


def test_this_gpu_reads_mem_get_info(monkeypatch):
    """The CUDA branch, run on CPU with torch.cuda's answers stood in: total and free from mem_get_info, the
    memory outside the allocator (total - free - reserved) as the context when it exceeds the allowance."""
    total, free, reserved = 80 * 2**30, 78 * 2**30, 2**30  # 1 GiB outside the allocator
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: reserved)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    dev = get_device("this GPU")
    assert dev.total == total and dev.context == total - free - reserved and dev.context_measured
    assert dev.bf16_native and "A100" in dev.name and "this GPU" in device_names()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (total - reserved - 2**20, total))
    assert get_device("this GPU").context == CUDA_CONTEXT_BYTES  # 1 MiB measured: the allowance is larger


def test_fit_report_phases_are_the_dry_runs_phase_peaks():
    cfg = ModelConfig(**SMALL)
    # a T4's size without its capability: the CPU kernels' rules, so the phases are the dry run's own peaks (the
    # named T4 adds CUDA's rules, tests/test_cuda_rules.py)
    report = will_it_fit(cfg, 4, implementation="single", device=DEVICES["t4"].total)
    assert report.rules == SIZE_ONLY_RULES and "device rules: CPU kernels, not CUDA's" in report.table()
    trace = dry_run_config(cfg, batch_size=4, foreach=False)
    assert [(p.step, p.phase) for p in report.phases] == [
        (s, ph) for s in (1, 2) for ph in ("forward", "backward", "optimizer")
    ]
    for p in report.phases:
        assert p.tensors == trace.peak(step=p.step, phase=p.phase).bytes
        assert p.reserved >= p.tensors  # the simulated allocator rounds up and caches
    assert report.fits and report.first_failure is None and "FITS" in report.verdict()
    assert "CUDA context (assumed)" in report.table()
    assert "(MiB;" in report.table() and " 0.00 " not in report.table()  # a small step in MiB, not GiB on a T4


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


def _just_short(cfg, batch_size, **options) -> int:
    """A device size (bytes) one byte short of ``cfg``'s peak of tensors: it does not fit, barely."""
    return will_it_fit(cfg, batch_size, device=10**12, **options).peak.tensors - 1 + CUDA_CONTEXT_BYTES


def test_micro_batches_are_dry_run_as_real_gradient_accumulation_byte_for_byte():
    small = {**SMALL, "seq_len": 128}  # long enough that the allocator's segments tell 1 micro-batch from 2
    cfg = ModelConfig(**small)
    # a device (its size alone: the CPU kernels' rules) just large enough for 2 micro-batches of 2, not for 1 of 4
    two = min_limit_to_pass(dry_run_config(cfg, batch_size=4, foreach=False, micro_batches=2).allocation_record())
    assert min_limit_to_pass(dry_run_config(cfg, batch_size=4, foreach=False).allocation_record()) > two
    device = two + CUDA_CONTEXT_BYTES
    fixes = {f.name: f for f in cheapest_fix(cfg, 4, implementation="single", device=device)}
    fix = fixes["micro-batch 2 x 2 (accumulate)"]
    direct = will_it_fit(cfg, 4, implementation="single", device=device, micro_batches=2)
    assert direct.phases == fix.report.phases and "x 2 micro-batches" in direct.label and fix.fits
    model = make_model(device="cpu", **small)
    opt = make_optimizer(model, "adamw", foreach=False)
    tracker = StepTracker(model, opt, kernel_scratch=False, accumulate=True)
    real = track_steps(model, opt, steps=2, batch_size=4, micro_batches=2, tracker=tracker)
    # every phase's peak (the highest of its micro-batches' passes) and its breakdown, as the real run measured them
    for p in fix.report.phases:
        measured = real.peak(step=p.step, phase=p.phase)
        assert (p.tensors, p.breakdown) == (measured.bytes, measured.breakdown)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    plain = dry_run_config(cfg, batch_size=2, foreach=False).peak().bytes  # one micro-batch alone, no accumulation
    assert plain < real.peak().bytes == fix.report.peak.tensors
    assert fix.report.peak.breakdown["gradients"] == grads  # the second micro-batch's backward: every gradient alive
    assert fix.micro_batches == 2 and fix.extra_flops == pytest.approx(0, abs=1e-9)


def test_a_named_gpu_takes_the_highest_micro_batch_of_a_phase():
    """CUDA's rules correct each phase's peak on the corrected timeline: with 2 micro-batches the step's backward
    runs twice, and the second (every gradient of the first alive under it) is the higher, as on the CPU trace."""
    cfg = ModelConfig(**SMALL)
    report = will_it_fit(cfg, 4, micro_batches=2, device="h100")  # compute capability 9.0: CUDA's rules
    cpu = dry_run_config(cfg, batch_size=4, micro_batches=2, foreach=True).peak(step=2, phase="backward")
    backward = next(p for p in report.phases if (p.step, p.phase) == (2, "backward"))
    grads = sum(p.numel() * p.element_size() for p in make_model(device="cpu", **SMALL).parameters())
    assert backward.breakdown["gradients"] == cpu.breakdown["gradients"] == grads
    assert cpu.breakdown["kernel_scratch"] == 0 < backward.breakdown["kernel_scratch"]  # the cuBLAS workspaces
    assert backward.tensors == cpu.bytes + backward.breakdown["kernel_scratch"]  # and nothing else


def _flops_under_autocast(cfg, batch_size, dtype):
    mode = FakeTensorMode()
    model = build_fake_model(lambda: GPT(cfg), mode)
    with mode, flop_counter() as counter:
        with torch.autocast("cpu", dtype=dtype):
            loss = gpt_loss(model, course_batch(batch_size, cfg.seq_len))
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("changes", [{}, {"attn_impl": "sdpa", "block": "llama"}])
def test_flops_need_no_recount_for_autocast_or_smaller_batches(changes):
    cfg = ModelConfig(**SMALL, **changes)
    base = config_step_flops(cfg, 4)
    assert _flops_under_autocast(cfg, 4, torch.bfloat16) == _flops_under_autocast(cfg, 4, torch.float16) == base
    assert 2 * config_step_flops(cfg, 2) == 4 * config_step_flops(cfg, 1) == base  # linear in the batch


@pytest.mark.parametrize("changes", [{}, {"block": "llama", "n_kv_head": 2}, {"checkpoint": "full"}, {"dropout": 0.1}])
def test_cpu_sdpa_flops_are_torchs_sdpa_formula(changes):
    # issue #40: FlopCounterMode has no formula for the CPU flash kernel, so sdpa's attention counted 0 FLOPs (the
    # default model at batch 8: 19,420,151,808 against 21,030,764,544 for the manual attention's same matmuls).
    # With torch's SDPA formulas registered, sdpa counts the manual attention's s x s matmuls plus the one that
    # flash attention's backward recomputes (the scores), 2 B s^2 d FLOPs a layer
    cfg = ModelConfig(**{**SMALL, **changes})
    manual, flash = config_step_flops(cfg, 4), config_step_flops(dataclasses.replace(cfg, attn_impl="sdpa"), 4)
    recomputed = 2 * 4 * cfg.seq_len**2 * cfg.d_model * cfg.n_layer
    if cfg.dropout:  # the CPU flash kernel takes no dropout: torch runs the math kernel, the manual one's matmuls
        recomputed = 0
    assert flash - manual == recomputed


@pytest.mark.parametrize("policy", ["none", "full", "selective", "attention", "offload"])
def test_flops_from_one_and_two_blocks_equal_the_full_count(policy):
    from anatomy_helpers.prediction.flops import _flops_of

    for changes in ({}, {"block": "llama", "n_kv_head": 1, "attn_impl": "sdpa", "dropout": 0.1}):
        cfg = ModelConfig(**{**SMALL, "n_layer": 5, **changes}, checkpoint=policy)
        assert config_step_flops(cfg, 2) == _flops_of(dataclasses.astuple(cfg), 2)


def test_checkpointing_costs_flops_and_fixes_are_ranked():
    cfg = ModelConfig(**SMALL)
    none, full = config_step_flops(cfg, 4), config_step_flops(ModelConfig(**SMALL, checkpoint="full"), 4)
    assert 1 < full / none < 4 / 3  # recomputing the blocks' forwards: at most one more forward (1/3 of the step)
    device = _just_short(cfg, 4)
    base = will_it_fit(cfg, 4, device=device)
    fixes = cheapest_fix(cfg, 4, device=device)
    assert not base.fits and fixes
    assert all(f.report.peak.tensors < base.peak.tensors for f in fixes)  # each one lowers the peak
    # the ranking by hand: what fits first; then what changes only time, then numerics, the global batch, the
    # optimizer; then extra FLOPs, a cost the count cannot see (None) after every counted one
    fitting = [f.fits for f in fixes]
    assert fitting == sorted(fitting, reverse=True)
    for group in (fixes[: fitting.count(True)], fixes[fitting.count(True) :]):
        order = [EFFECTS.index(f.effect) for f in group]
        assert order == sorted(order)
        for effect in set(order):
            costs = [f.extra_flops for f in group if f.effect == effect]
            counted = [c for c in costs if c is not None]
            assert costs == counted + [None] * (len(costs) - len(counted))
            assert [round(c, 3) for c in counted] == sorted(round(c, 3) for c in counted)
    extra = {f.name: f.extra_flops for f in fixes}
    assert extra.get("checkpoint=selective", None) is None  # element-wise recompute: FlopCounterMode counts none
    tokens, h, v = 4 * SMALL["seq_len"], SMALL["d_model"], cfg.vocab_size
    chunked = config_step_flops(ModelConfig(**SMALL, loss_chunk=8), 4)
    assert chunked / none - 1 == pytest.approx(2 * tokens * h * v / none)  # the head's matmul, recomputed
    ck = next(f for f in fixes if f.name == "checkpoint=full")
    assert ck.extra_flops == pytest.approx(full / none - 1) and ck.effect == "time only"
    effects = {f.name: f.effect for f in fixes if f.lever is not None}  # one lever each (a combination: none)
    assert {e for n, e in effects.items() if n.startswith("micro-batch ")} == {"time only"}
    for both in (f for f in fixes if f.lever is None):  # a combination, where no one lever fits: its costliest effect
        assert " + " in both.name and both.fits and both is fixes[0]
    assert {e for n, e in effects.items() if n.endswith("(smaller global batch)")} == {"global batch"}
    assert effects.get("bf16 optimizer state", "numerics") == "numerics"
    assert effects.get("SGD with momentum", "optimizer") == "optimizer"
    assert "time only" in fixes_table(fixes)
    # every effect fits its column, the longest ("trained parameters", LoRA's) too: the notes stay aligned
    widest = dataclasses.replace(fixes[0], effect=max(EFFECTS, key=len))
    lines = fixes_table([widest, *fixes]).splitlines()
    starts = {line.index(f.note) for line, f in zip(lines[2:], [widest, *fixes]) if f.note}
    assert starts == {lines[0].index("note")}, lines


def test_a_cost_the_flop_counter_cannot_see_ranks_after_every_counted_one():
    # the ranking rule (prediction/levers.py): an uncounted recompute (selective's element-wise ops) is not free;
    # of one effect, it ranks after a counted lever however costly, and fitting still ranks first
    report = will_it_fit(ModelConfig(**SMALL), 4, device=10**12)
    unseen = Fix("uncounted", report, None, "time only", "")
    counted = Fix("counted", report, 0.9, "time only", "")
    free = Fix("free", report, 0.0, "time only", "")
    assert sorted([unseen, counted, free], key=rank_key) == [free, counted, unseen]


def test_a_step_that_already_fits_ranks_no_fix():
    # issue #40: on an H100 the step fit, yet predict --fix ranked 11 changes
    cfg = ModelConfig(**SMALL)
    assert will_it_fit(cfg, 4, device="h100").fits
    assert cheapest_fix(cfg, 4, device="h100") == []


def test_a_candidate_that_saves_nothing_is_dropped():
    # issue #40: the fused optimizer and the step in backward saved 0 bytes of a backward-bound peak yet were
    # ranked. On this logits-bound step (its peak in backward, the optimizer's temporaries long gone) the fused
    # optimizer leaves the peak where it is: it is not offered
    cfg = ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=64, vocab_size=4096)
    device = _just_short(cfg, 4, implementation="single")
    fused = will_it_fit(cfg, 4, implementation="fused", device=10**12).peak.tensors
    plain = will_it_fit(cfg, 4, implementation="single", device=10**12).peak.tensors
    assert fused == plain  # the lever saves nothing here, as measured by its own dry run
    fixes = cheapest_fix(cfg, 4, implementation="single", device=device)
    assert fixes and "fused optimizer" not in [f.name for f in fixes]
    base = will_it_fit(cfg, 4, implementation="single", device=device)
    assert all(f.report.peak.tensors < base.peak.tensors for f in fixes)


def test_sdpa_is_offered_where_the_manual_attentions_scores_do_not_fit():
    # issue #40: GPT-2 small at batch 8 on a T4 fits with --attn sdpa (10.56 GiB) but cheapest_fix never offered it.
    # The same at a fraction of the cost: manual attention at s = 512 (its s^2 scores dominate the peak), on a device
    # with a T4's compute capability between what sdpa and the manual attention reserve
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=4, seq_len=512, vocab_size=256)
    sdpa = dataclasses.replace(cfg, attn_impl="sdpa")
    need, need_sdpa = (max(p.reserved for p in will_it_fit(c, 4, device=10**12).phases) for c in (cfg, sdpa))
    t4 = get_device("t4")
    dev = Device("T4-sized", total=(need + need_sdpa) // 2 + t4.context, capability=t4.capability)
    assert not will_it_fit(cfg, 4, device=dev).fits and will_it_fit(sdpa, 4, device=dev).fits
    fixes = cheapest_fix(cfg, 4, device=dev)
    offered = next(f for f in fixes if f.name == "sdpa attention")
    assert (
        offered.fits
        and offered.effect == "time only"
        and offered.report.label == will_it_fit(sdpa, 4, device=dev).label
    )
    # its FLOPs are counted (torch's SDPA formula registered for the CPU flash kernel): backward recomputes the
    # scores, one s x s matmul per layer, 2 B s^2 d FLOPs each
    per_layer = 2 * 4 * cfg.seq_len**2 * cfg.d_model
    assert offered.extra_flops == pytest.approx(cfg.n_layer * per_layer / config_step_flops(cfg, 4))
    # ranked by that cost among the fitting changes that keep training
    at = fixes.index(offered)
    keep = [f for f in fixes if f.fits and not f.changes_training]
    assert all(fixes.index(f) < at for f in keep if f.extra_flops is not None and f.extra_flops < offered.extra_flops)
    assert all(fixes.index(f) > at for f in fixes if not f.fits or f.changes_training)


def test_training_preserving_fixes_rank_first_and_the_t4_gets_fp16():
    # Lesson 06's case (GPT-2 small, batch 12, on a T4) at a fraction of its cost: a quarter of GPT-2's blocks at half
    # its width and sequence, a sixth of its vocabulary (the head still costs fewer FLOPs than the blocks), on a device
    # with a T4's compute capability and 85 % of what the batch of 12 reserves (the notebook runs the real case).
    cfg = ModelConfig(n_layer=3, d_model=384, n_head=6, vocab_size=8192, seq_len=512, attn_impl="sdpa")
    needs = will_it_fit(cfg, 12, device=10**12).peak.reserved
    t4 = get_device("t4")
    t4_sized = Device("T4-sized", total=int(0.85 * needs) + t4.context, capability=t4.capability)
    t4 = cheapest_fix(cfg, 12, device=t4_sized)
    names = [f.name for f in t4]
    assert not will_it_fit(cfg, 12, device=t4_sized).fits
    # time only, ahead of autocast; the chunked loss (the head recomputed) costs fewer FLOPs than every block
    assert names[0] == "micro-batch 6 x 2 (accumulate)" and names[2] == "checkpoint=full"
    assert names[1].startswith("chunked loss (") and 0 < t4[1].extra_flops < t4[2].extra_flops
    assert "fp16 autocast + GradScaler" in names and "bf16 autocast" not in names  # sm_75: no native bf16
    amp = next(f for f in t4 if f.name.startswith("fp16"))
    assert amp.fits and amp.extra_flops == 0 and amp.effect == "numerics" and "GradScaler" in amp.name
    assert names.index("fp16 autocast + GradScaler") > names.index("checkpoint=full")  # numerics are not free
    smaller = next(f for f in t4 if f.effect == "global batch")
    assert smaller.name == "batch 6 (smaller global batch)" and smaller.fits
    # the micro-batch's size without accumulation: no gradients alive under the second micro-batch's activations
    micro = t4[0]
    assert smaller.report.peak.tensors < micro.report.peak.tensors
    # which autocast is offered depends on the device alone: a small model shows it at a fraction of the cost
    a100 = [lv.name for lv in levers(ModelConfig(**SMALL), device=get_device("a100-40"))]
    assert "bf16 autocast" in a100 and not any(n.startswith("fp16") for n in a100)
    assert "fp16 autocast + GradScaler" in [lv.name for lv in levers(ModelConfig(**SMALL), device=get_device("t4"))]


def test_bf16_on_a_t4_gets_a_note():
    report = will_it_fit(ModelConfig(**SMALL), 2, autocast="bfloat16", device="t4")
    assert "no native bfloat16" in report.table()
    assert not will_it_fit(ModelConfig(**SMALL), 2, autocast="bfloat16", device="a100-80").note


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"micro_batches": 3}, "multiple of micro_batches"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"autocast": "fp8"}, "autocast"),
        ({"batch_size": 10**12}, "cannot fit, and no dry run"),
        ({"cfg": ModelConfig(**{**SMALL, "n_layer": 2000})}, "n_layer must be at most"),
    ],
)
def test_bad_requests_are_refused_before_any_dry_run(kwargs, match):
    kwargs = {"cfg": ModelConfig(**SMALL), "batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        will_it_fit(**kwargs)
    with pytest.raises(ValueError, match=match):
        cheapest_fix(**kwargs)


def test_fit_report_by_hand():
    """The report's peak is the phase with the most tensor bytes; the first failure is the phase the capped
    allocator ran out in (step 0: the model itself)."""
    from anatomy_helpers.prediction.fit_report import FitReport, PhaseNeed

    phases = tuple(
        PhaseNeed(s, p, t * 2**20, (t + 2) * 2**20, {})
        for s, p, t in [(1, "forward", 5), (1, "backward", 9), (1, "optimizer", 7), (2, "forward", 8)]
    )
    fits = FitReport("toy", "T4", 16 * 2**30, 15 * 2**30, phases, None)
    assert (fits.peak.step, fits.peak.phase) == (1, "backward") and fits.fits and fits.first_failure is None
    # the allocator's reserved memory decides (11 MiB at most, step 1 backward); the tensors' peak is beside it
    assert "FITS: the simulated caching allocator reserves at most 11.00 MiB (step 1 backward)" in fits.verdict()
    assert "tensors peak at 9.00 MiB (step 1 backward)" in fits.verdict()
    fails = dataclasses.replace(fits, failure=(2, "forward"))
    assert fails.first_failure is phases[3] and not fails.fits
    assert "runs out first in step 2's forward pass" in fails.verdict()
    model = dataclasses.replace(fits, failure=(0, "idle")).first_failure
    assert (model.step, model.tensors) == (0, 0)


def test_the_verdict_names_the_allocators_reserved_memory_as_what_decides():
    """Tensors under the usable memory, the capped allocator out of it: the verdict says the allocator decides, with
    what it held and asked for; the table shows both per phase, where it ran out and what it never reached."""
    from anatomy_helpers.prediction.fit_report import RESERVED_DECIDES, FitReport, PhaseNeed

    mib = 2**20
    sizes = tuple(zip(("forward", "backward", "optimizer"), (5, 9, 7)))
    phases = tuple(PhaseNeed(s, p, t * mib, (t + 3) * mib, {}) for s in (1, 2) for p, t in sizes)
    oom = LimitReplay(10 * mib, False, 7, 1, "backward", 3 * mib, 7 * mib, 9 * mib, 1, 4 * mib)
    report = FitReport("toy", "T4", 11 * mib, 10 * mib, phases, (1, "backward"), oom=oom)
    verdict = report.verdict()
    assert verdict.startswith("toy on T4: DOES NOT FIT: the simulated caching allocator, capped at 10.00 MiB usable")
    assert "still holds 9.00 MiB, 7.00 MiB in tensors and 2.00 MiB in free blocks" in verdict
    assert "the next 3.00 MiB tensor, and a new 4.00 MiB segment" in verdict and "tensors peak at 9.00 MiB" in verdict
    table = report.table()
    rows = [line.split() for line in table.splitlines() if line.strip()[:1] in ("1", "2")]
    # no row answers for a phase after the one that ran out (it never runs); the deciding column is named
    assert [" ".join(r[4:]) for r in rows] == ["yes ok", "yes RUNS OUT", "- -", "- -", "- -", "- -"]
    assert "allocator (decides)" in table.splitlines()[0] and "allocator (decides)" in report.table(brief=True)
    assert "-: not reached" in report.table(brief=True)
    model = dataclasses.replace(report, failure=(0, "idle"))  # the model itself does not fit: no phase runs
    assert all(line.split()[4:] == ["-", "-"] for line in model.table().splitlines() if line.strip()[:1] in ("1", "2"))
    assert RESERVED_DECIDES + ": the tensors alone (9.00 MiB) would fit, the segments do not" in table
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in table and "torch.cuda.mem_get_info()" in table
    # the assumed CUDA context (capacity - usable) is the margin's allowance; it is printed with its size
    assert report.allowance == mib and "CUDA context: 1.00 MiB assumed, not measured" in table
    close = dataclasses.replace(report, close=True)
    assert "toy on T4: DOES NOT FIT, BUT TOO CLOSE TO CALL: " in close.verdict()
    assert "TOO CLOSE TO CALL: with 1.00 MiB more memory the simulated answer turns" in close.table()


def test_too_close_to_call_is_an_answer_that_turns_within_the_allowance():
    """The allocator's answer at the usable memory and at the usable memory give or take what is assumed; the
    least memory the replay needs comes from min_limit_to_pass (a scan, independent of allocator_answer)."""
    record = dry_run_config(ModelConfig(**SMALL), batch_size=2).allocation_record()
    rep, need = replay(record), min_limit_to_pass(record)  # passes at need, not at need - 2 MiB
    mib = 2**20
    assert allocator_answer(record, rep, need, 0) == (None, False)
    assert allocator_answer(record, rep, need, 2 * mib) == (None, True)  # 2 MiB less and it runs out
    oom, close = allocator_answer(record, rep, need - 2 * mib, 2 * mib)
    assert oom is not None and not oom.passed and close  # 2 MiB more and it passes
    far = int(rep.reserved.max()) + 4 * mib
    assert allocator_answer(record, rep, far + 2 * mib, 2 * mib) == (None, False)


def test_every_report_lists_its_assumptions():
    cfg = ModelConfig(**SMALL, checkpoint="full")
    table = will_it_fit(cfg, 2, device="t4", implementation="single").table()
    block = table[table.index("assumptions:") :]
    assert f"sequences: every row {cfg.seq_len} tokens, full length" in block
    assert (
        "activation checkpointing: full" in block and "precision: float32 weights and gradients, no autocast" in block
    )
    assert "device rules: CUDA rules from torch source" in block and "CUDA context: 512.00 MiB assumed" in block
    assert "not counted: kernel scratch (temporary buffers inside ops)\n" in block  # cuBLAS's workspaces applied
    sized = will_it_fit(cfg, 2, device=DEVICES["t4"].total, implementation="single").table()
    assert "cuBLAS and cuBLASLt workspaces (up to 66.00 MiB)" in sized  # no capability: 2 x (32 + 1) MiB


def test_plot_and_panel(capsys):
    report = will_it_fit(ModelConfig(**SMALL), 2, device=CUDA_CONTEXT_BYTES + 2**20)
    fig = plot_fit(report)
    ax = fig.axes[0]
    assert isinstance(fig, Figure) and "MiB" in ax.get_ylabel() and ax.get_title()
    assert isinstance(fit_panel(batch_size=1), Figure)
    assert "usable on T4" in capsys.readouterr().out


def test_the_panel_says_when_no_cuda_rule_states_a_combination_and_shows_the_cpu_rules(capsys):
    """A learner can reach combinations the CUDA rules refuse (a bf16 model under bf16 autocast; the browser test
    moved there): the panel says why instead of a traceback, and draws the dry run by the CPU kernels' rules."""
    with pytest.raises(CudaRuleError):
        will_it_fit(ModelConfig(dtype="bfloat16", seq_len=64), 1, autocast="bfloat16", device="t4")
    fig = fit_panel(batch_size=1, seq_len=64, dtype="bfloat16", autocast="bfloat16", device="t4")
    out = capsys.readouterr().out
    assert isinstance(fig, Figure) and out.startswith("No prediction for t4: autocast over a bfloat16 model")
    assert "the CPU kernels' rules" in out and "usable on 14.58 GiB device: 14.08 GiB" in out  # as a process sees it


def test_fit_plot_scales_to_the_bars_and_names_the_device_lines():
    """The y-axis holds the tallest bar and fills at least 1/DEVICE_LINE_RANGE of it; the usable line (and the
    capacity's) is drawn when within that range, named in the legend (outside the axes, clear of the bars), and
    named as off the scale when not."""
    report = will_it_fit(ModelConfig(**SMALL), 2, device="t4")
    tallest = max(max(p.reserved, p.tensors) for p in report.phases)
    for usable, in_range in ((tallest * 2, True), (tallest // 2, True), (tallest * 50, False)):
        r = dataclasses.replace(report, usable=usable, capacity=usable + 2**20)
        fig = plot_fit(r)
        ax = fig.axes[0]
        scale = 2**30 if "GiB" in ax.get_ylabel() else 2**20
        tops = [p.get_y() + p.get_height() for p in ax.patches]
        assert max(tops) == pytest.approx(tallest / scale)  # the bars stack to the tallest phase's reserved bytes
        for i, p in enumerate(r.phases):  # each phase's stack: its tensor bytes, topped by what is reserved besides
            stack = [b for b in ax.patches if b.get_x() < i < b.get_x() + b.get_width()]
            assert max(b.get_y() + b.get_height() for b in stack) == pytest.approx(max(p.reserved, p.tensors) / scale)
            assert sum(b.get_height() for b in stack if b.get_facecolor()[:3] != (1, 1, 1)) == pytest.approx(
                sum(p.breakdown.values()) / scale
            )
        bottom, top = ax.get_ylim()
        assert bottom == 0 and tallest / scale <= top <= DEVICE_LINE_RANGE * 1.1 * tallest / scale
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        usable_entry = [t for t in legend if t.startswith("usable on T4")]
        assert len(usable_entry) == 1, legend
        lines = horizontal_lines(ax)
        if in_range:
            assert any(y == pytest.approx(usable / scale) for y in lines) and usable / scale <= top
            assert "off the scale" not in usable_entry[0]
        else:
            assert not any(y == pytest.approx(usable / scale) for y in lines) and top < usable / scale
            assert "off the scale (50x the tallest bar)" in usable_entry[0]
        assert not [t for t in ax.texts if "usable" in t.get_text()]  # named in the legend, not on a bar
        fig.draw_without_rendering()
        assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1  # right of the bars
        assert fig.get_size_inches()[0] * 100 <= 820  # a 1280 px window's notebook output is 844 px wide


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_this_gpu_reads_the_real_device_and_a_known_one_matches_its_table_entry():
    """On a GPU (scripts/gpu_check.py): "this GPU" is what the driver says, and where the GPU is one of DEVICES,
    mem_get_info's total lies between the table's process figure (the lowest seen in public logs) and nvidia-smi's
    (a lower total here means the table needs this figure)."""
    from anatomy_helpers.prediction.devices import DEVICES, this_gpu

    dev = this_gpu()
    free, total = torch.cuda.mem_get_info()
    assert dev.total == total and 0 < dev.usable < total and dev.capability == torch.cuda.get_device_capability()
    print(f"this GPU: {dev.name}, {total / 2**20:,.0f} MiB, context {dev.context / 2**20:,.0f} MiB")
    same_kind = [e for e in DEVICES.values() if e.name.split()[0] in dev.name]  # "A100" has two sizes
    if same_kind:
        print(
            "table:",
            ", ".join(f"{e.name} {e.total / 2**20:,.0f} to {e.driver_total / 2**20:,.0f} MiB" for e in same_kind),
        )
        assert any(e.total <= total <= e.driver_total and e.capability == dev.capability for e in same_kind)


def test_a_fit_request_is_checked_once_for_both_questions():
    cfg = ModelConfig(**SMALL)
    request = FitRequest(cfg, 8, optimizer="sgd", micro_batches=2)
    label, whole = request.label(), request.but(micro_batches=1).label()
    assert "b=4 " in label and label.endswith("sgd (foreach) x 2 micro-batches")  # 8 rows in 2 passes
    assert "b=8 " in whole and whole.endswith("sgd (foreach)")
    for bad, named in ((dict(autocast="fp8"), "autocast"), (dict(implementation="loop"), "implementation")):
        with pytest.raises(ValueError, match=named):
            will_it_fit(cfg, 8, **bad)
        with pytest.raises(ValueError, match=named):
            cheapest_fix(cfg, 8, **bad)
    with pytest.raises(TypeError, match="gpu"):  # a misspelt option is not silently ignored
        will_it_fit(cfg, 8, gpu="t4")


# ---- the plotted data against what each figure claims (tests/figure_data.py reads a figure back) ----


def test_predicted_vs_measured_puts_each_configuration_at_its_peaks_and_states_each_miss():
    from anatomy_helpers.lessons.lesson06_prediction import MethodComparison, plot_predicted_vs_measured

    from .figure_data import numbers_in

    def comparison(label, measured, dry, closed):  # two phases each: the step peak is the larger
        phases = ((1, "forward"), (2, "backward"))
        return MethodComparison(
            label, dict(zip(phases, measured)), dict(zip(phases, dry)), dict(zip(phases, closed)), dry_run_s=0.1
        )

    MiB = 2**20
    rows = [
        comparison("a", (3 * MiB, 5 * MiB), (3 * MiB, 5 * MiB), (3 * MiB, 5 * MiB + 4096)),
        comparison("b", (8 * MiB, 2 * MiB), (8 * MiB - 512, MiB), (7 * MiB, 2 * MiB)),
    ]
    ax, misses = plot_predicted_vs_measured(rows).axes
    dry, closed = ax.collections  # the dry run's circles, then the closed form's dots: (measured, predicted) MiB
    assert dry.get_offsets().tolist() == [[5, 5], [8, 8 - 512 / MiB]]
    assert closed.get_offsets().tolist() == [[5, 5 + 4096 / MiB], [8, 7]]
    dry_miss, closed_miss = misses.collections  # predicted - measured step peak, bytes, a row per configuration
    assert dry_miss.get_offsets()[:, 0].tolist() == [0, -512] and closed_miss.get_offsets()[:, 0].tolist() == [
        4096,
        -MiB,
    ]
    stated = [numbers_in(t.get_text()) for t in misses.texts]
    assert stated == [[0], [-512], [4096], [-MiB]]


def test_the_fit_panel_draws_the_dry_run_of_its_settings():
    """fit_panel (notebook 06's panel): its bars are the report will_it_fit gives for the same settings."""
    import contextlib
    import io

    from anatomy_helpers.lessons.lesson06_prediction import SHAPES
    from anatomy_helpers.prediction.devices import DEFAULT_GPU

    from .figure_data import bars, unit_bytes

    with contextlib.redirect_stdout(io.StringIO()):
        fig = fit_panel(batch_size=2, seq_len=64, optimizer="sgd", checkpoint="full")
    cfg = ModelConfig(**SHAPES["toy (4 x 256)"], seq_len=64, checkpoint="full", attn_impl="manual")
    report = will_it_fit(cfg, 2, device=DEFAULT_GPU, optimizer="sgd", implementation="foreach")
    ax = fig.axes[0]
    scale = unit_bytes(ax.get_ylabel())
    for i, phase in enumerate(report.phases):
        stack = [b for b in bars(ax) if b[0] < i < b[0] + b[2]]
        assert max(y + h for _, y, _, h, _ in stack) * scale == pytest.approx(max(phase.reserved, phase.tensors))
        assert sum(h for _, _, _, h, c in stack if c != "#ffffff") * scale == pytest.approx(phase.tensors)
