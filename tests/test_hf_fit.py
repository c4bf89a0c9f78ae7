"""Will a Hugging Face fine-tune fit (prediction/hf_fit.py): the dry run's report, per rank the ZeRO formulas'."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.prediction.devices import get_device  # noqa: E402
from anatomy_helpers.prediction.fit import STEP_PHASES  # noqa: E402
from anatomy_helpers.prediction.hf import tiny_config  # noqa: E402
from anatomy_helpers.prediction.hf_fit import rank_states, will_it_fit_hf  # noqa: E402
from anatomy_helpers.prediction.hf_step import FineTune, dry_run_hf, make_hf_model  # noqa: E402
from anatomy_helpers.tracking.events import CATEGORIES  # noqa: E402

FULL = FineTune()
LORA = FineTune(method="lora", dtype="bfloat16", lora_rank=4)


@pytest.fixture(scope="module")
def runs():
    cfg = tiny_config("llama-3.2-1b")
    return cfg, {ft: dry_run_hf(cfg, ft) for ft in (FULL, LORA)}


def test_the_report_holds_the_dry_runs_peaks_and_its_verdict_follows_the_device(runs):
    cfg, traces = runs
    trace = traces[FULL]
    report = will_it_fit_hf(cfg, FULL, "h100", trace=trace)
    for need, (step, phase) in zip(report.phases, STEP_PHASES):
        pk = trace.peak(step=step, phase=phase)
        assert (need.step, need.phase, need.tensors, need.breakdown) == (step, phase, pk.bytes, dict(pk.breakdown))
    assert report.peak.tensors == trace.peak().bytes and report.fits
    assert report.rules.startswith("CPU kernels") and "course's GPT only" in report.rules
    context = get_device("h100").context
    reserved = max(p.reserved for p in report.phases)
    just_enough = will_it_fit_hf(cfg, FULL, context + reserved, trace=trace)
    assert just_enough.fits and just_enough.usable == reserved
    too_small = will_it_fit_hf(cfg, FULL, context + trace.peak().bytes - 1, trace=trace)
    assert not too_small.fits and "DOES NOT FIT" in too_small.verdict()


@pytest.mark.parametrize("ft", [FULL, LORA], ids=["full", "lora"])
def test_per_rank_model_states_are_the_zero_formulas_of_the_trainable_parameters(runs, ft):
    cfg, traces = runs
    trace, n = traces[ft], 4
    torch.manual_seed(0)
    model = make_hf_model(cfg, ft)  # the real model: what each rank holds, counted from its tensors
    # the tracker files buffers (the rotary frequencies) as parameters at rest
    params = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    state = 2 * grads + 4 * len(trainable)  # AdamW: exp_avg and exp_avg_sq like the parameter, a float32 step
    for zero in range(4):
        states = rank_states(trace, n, zero)
        assert states.whole == {"parameters": params, "gradients": grads, "optimizer_state": state}
        expected = {
            "parameters": params / (n if zero >= 3 else 1),
            "gradients": grads / (n if zero >= 2 else 1),
            "optimizer_state": state / (n if zero >= 1 else 1),
        }
        assert states.per_rank == expected, zero


def test_per_rank_reports_shrink_the_model_states_and_keep_the_activations(runs):
    cfg, traces = runs
    trace = traces[FULL]
    single = will_it_fit_hf(cfg, FULL, "t4", trace=trace)
    ddp = will_it_fit_hf(cfg, FULL, "t4", world_size=4, trace=trace)
    assert ddp.phases == single.phases and "under ddp" in ddp.note  # DDP keeps every model state whole
    reports = [will_it_fit_hf(cfg, FULL, "t4", world_size=4, zero=z, trace=trace) for z in (1, 2, 3)]
    for before, after in zip([ddp, *reports], reports):
        assert all(b.tensors >= a.tensors for b, a in zip(before.phases, after.phases))
    zero3 = reports[-1]
    end = trace.phases()[-1].at_end  # after step 2: parameters and optimizer state at rest, whole
    last = trace.timeline.bytes[-1]  # the same moment on the timeline
    rows = len(trace.allocation_record().bytes)  # each scaled allocation is rounded to a whole byte
    step2_optimizer = zero3.phases[-1].breakdown
    for category in ("parameters", "optimizer_state"):
        assert last[CATEGORIES.index(category)] == end[category]
        assert abs(step2_optimizer[category] - end[category] / 4) <= rows, category
    assert "not a dry run of the sharded step" in zero3.note and "zero_model_states" in zero3.note


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(world_size=0), "world_size must be a positive integer"),
        (dict(zero=2), "needs world_size > 1"),
        (dict(world_size=8, zero=4), "zero must be one of"),
        (dict(device="a100-90"), "device must be one of"),
        (dict(fine_tune="lora"), "fine_tune must be a FineTune"),
        (dict(model="llama-4"), "shipped configurations"),
    ],
)
def test_bad_requests_are_refused_before_any_dry_run(kw, message):
    args = {"model": "llama-3.1-8b", "fine_tune": FULL, "device": "a100-80"} | kw
    with pytest.raises(ValueError, match=message):
        will_it_fit_hf(args.pop("model"), **args)


def test_the_flop_count_from_one_and_two_layers_is_the_whole_models():
    from anatomy_helpers.prediction.hf_fixes import _flops_of, hf_step_flops

    cfg = tiny_config("llama-3.2-1b", layers=3)
    for ft in (FineTune(), FineTune(gradient_checkpointing=True, batch_size=2, micro_batches=2)):
        assert hf_step_flops(cfg, ft) == _flops_of(cfg, ft) > 0


def test_cheapest_fix_hf_ranks_dry_run_candidates(runs):
    from anatomy_helpers.prediction.fixes import EFFECTS
    from anatomy_helpers.prediction.hf_fixes import cheapest_fix_hf

    cfg, _ = runs
    ft = FineTune(dtype="bfloat16", fused=True)  # candidates: 2 micro-batches, checkpointing, ZeRO-1/2/3, LoRA
    trace = dry_run_hf(cfg, ft)
    device = get_device("h100").context + trace.peak().bytes - 1  # the request itself does not fit
    assert not will_it_fit_hf(cfg, ft, device, world_size=2, trace=trace).fits
    fixes = cheapest_fix_hf(cfg, ft, device, world_size=2)
    by_name = {f.name: f for f in fixes}
    assert set(by_name) == {"micro-batch 1 x 2", "gradient checkpointing", "ZeRO-1", "ZeRO-2", "ZeRO-3", "LoRA r=16"}
    zero3 = will_it_fit_hf(cfg, ft, device, world_size=2, zero=3, trace=trace)
    assert by_name["ZeRO-3"].report.phases == zero3.phases  # the request's own dry run, per rank
    assert by_name["micro-batch 1 x 2"].extra_flops == 0 and by_name["gradient checkpointing"].extra_flops > 0
    ranks = [(not f.fits, EFFECTS.index(f.effect)) for f in fixes]
    assert ranks == sorted(ranks)  # what fits first, then by what it changes (tiny: 2 MiB segments decide "fits")
