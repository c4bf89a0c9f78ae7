"""The fix search for a Hugging Face fine-tune (distributed/hf_fit.search_fix_hf): combinations of the one lever
catalogue's levers (prediction/levers.fine_tune_levers), each claimed fit confirmed by a full dry run; nothing in
a combination that saves nothing; the smallest multi-GPU setup where one device does not fit."""

import dataclasses

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.core.model import ModelConfig  # noqa: E402
from anatomy_helpers.distributed.hf_fit import search_fix_hf, will_it_fit_hf  # noqa: E402
from anatomy_helpers.prediction.devices import DEVICES, get_device  # noqa: E402
from anatomy_helpers.prediction.hf import tiny_config  # noqa: E402
from anatomy_helpers.prediction.hf_step import FineTune  # noqa: E402
from anatomy_helpers.prediction.levers import (  # noqa: E402
    CHECKPOINT_FULL,
    EFFECTS,
    FUSED,
    Setup,
    fine_tune_levers,
    levers,
)

TINY = tiny_config("llama-3.2-1b", layers=3, head_dim=32, vocab=4096)  # tens of MiB: the allocator's 2 MiB segments
FT = FineTune(batch_size=8, seq_len=64, dtype="bfloat16", foreach=True)


def _setup_of(fix, start: Setup) -> Setup:
    """The setup a fix names, rebuilt from its levers' own fields (not from the fix's setup)."""
    setup = start
    for lever in fix_levers(fix, start):
        setup = setup.but(lever)
    return setup


def fix_levers(fix, start: Setup):
    names = fix.name.split(" + ")
    by_name = {lv.name: lv for lv in fine_tune_levers(start.fine_tune, get_device("h100"))}
    return [by_name[n] for n in names]


@pytest.fixture(scope="module")
def tight():
    """A device between the simulated allocator's most reserved bytes of 4 micro-batches with checkpointing and of
    4 micro-batches alone: the step does not fit, nor does either lever alone (checked), a combination may."""
    h100 = get_device("h100").total  # by its size: the CPU kernels' rules, as the tight device's (no CUDA workspaces)
    base = will_it_fit_hf(TINY, FT, h100)
    reserved = lambda **f: max(p.reserved for p in will_it_fit_hf(TINY, dataclasses.replace(FT, **f), h100).phases)  # noqa: E731
    both, micro = reserved(micro_batches=4, gradient_checkpointing=True), reserved(micro_batches=4)
    assert both < micro
    size = get_device("h100").context + (both + micro) // 2
    return base, size, search_fix_hf(TINY, FT, size)


def test_the_search_ends_in_a_combination_its_full_dry_run_confirms(tight):
    base, size, search = tight
    assert not will_it_fit_hf(TINY, FT, size).fits
    assert search.fixes and search.one_device
    fix = search.fixes[0]
    setup = _setup_of(fix, Setup(FT))
    again = will_it_fit_hf(TINY, setup.fine_tune, size)  # the fine-tune the fix names, dry-run afresh
    assert again.fits and fix.fits and again.phases == fix.report.phases
    assert fix.report.peak.tensors < base.peak.tensors


def test_no_lever_of_the_combination_saves_nothing(tight):
    """Each lever left out in turn, the rest does not fit (full dry runs): nothing is in it that is not needed."""
    _, size, search = tight
    chosen = fix_levers(search.fixes[0], Setup(FT))
    for dropped in chosen:
        setup = Setup(FT)
        for lever in chosen:
            setup = setup.but(lever) if lever is not dropped else setup
        assert not will_it_fit_hf(TINY, setup.fine_tune, size).fits, dropped.name


def test_the_search_names_what_a_dry_run_cannot_take(tight):
    _, _, search = tight
    refused = {lv.name: lv.not_for_fine_tune for lv in search.refused}
    assert "8-bit AdamW" in refused and "QLoRA (4-bit base)" in refused
    assert any(name.startswith("chunked loss") for name in refused)
    text = search.text("this device")
    assert "refused by name: 8-bit AdamW: bitsandbytes' AdamW8bit" in text


def test_a_step_that_fits_needs_no_search():
    search = search_fix_hf(TINY, FT, "h100")
    assert search.fixes == [] and search.more_gpus is None


def test_shared_levers_are_the_course_gpts_own_objects():
    """One catalogue: the levers a fine-tune shares with the course GPT are the same objects, not copies."""
    gpt = levers(ModelConfig(), batch_size=4, device=DEVICES["t4"])
    ft = fine_tune_levers(FineTune(batch_size=4), DEVICES["t4"])
    assert CHECKPOINT_FULL in gpt and CHECKPOINT_FULL in ft and FUSED in gpt and FUSED in ft
    shared = {lv.name for lv in gpt} & {lv.name for lv in ft}
    assert {"micro-batch 2 x 2 (accumulate)", "fp16 autocast + GradScaler", "SGD with momentum"} <= shared
    effects = [EFFECTS.index(lv.effect) for lv in ft]
    assert effects == sorted(effects)


def test_levers_apply_to_a_fine_tune_by_their_fields_or_not_at_all():
    start = Setup(FineTune(batch_size=4, optimizer="sgd"))
    assert start.but(FUSED) is None  # torch fuses Adam(W) only (no fused SGD offered)
    assert start.but(CHECKPOINT_FULL).fine_tune.gradient_checkpointing
    micro8 = dataclasses.replace(fine_tune_levers(FineTune(batch_size=8), DEVICES["t4"])[2])  # 1 x 8
    assert micro8.fine_tune == {"micro_batches": 8} and start.but(micro8) is None  # 8 does not divide 4
