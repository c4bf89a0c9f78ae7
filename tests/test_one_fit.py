"""The one will-it-fit (distributed/one_fit.py): the course GPT or a Hugging Face model, one device or per rank, each
through the engine that runs it, with the same report; what one path cannot take refused by name."""

import dataclasses

import pytest

from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.distributed.fake_world import dry_run_rank
from anatomy_helpers.distributed.one_fit import RANK_RULES, will_it_fit
from anatomy_helpers.distributed.ranks import RankJob
from anatomy_helpers.prediction import fit
from anatomy_helpers.prediction.fit import STEP_PHASES

from .conftest import SMALL

CFG = ModelConfig(**SMALL)


def test_the_course_gpt_on_one_device_is_fit_will_it_fit():
    one = will_it_fit(CFG, 4, device="t4", optimizer="sgd")
    assert one == fit.will_it_fit(CFG, 4, device="t4", optimizer="sgd")


@pytest.mark.parametrize("zero, strategy", [(None, "ddp"), (1, "zero1"), (3, "fsdp2_zero3")])
def test_the_course_gpt_per_rank_is_the_dry_run_of_its_sharded_rank(zero, strategy):
    report = will_it_fit(CFG, 2, device="t4", world_size=2, zero=zero)
    job = RankJob(strategy, batch_size=4, warmup=1, model=dataclasses.asdict(CFG))
    trace = dry_run_rank(job, 2).result.trace
    for need, (step, phase) in zip(report.phases, STEP_PHASES):
        assert need.tensors == trace.peak(step=step, phase=phase).bytes, (step, phase)
    assert report.rules == RANK_RULES and f"per rank of 2 under {strategy}" in report.note
    assert report.fits  # a small model on 15 GiB


def test_a_sharded_rank_holds_less_than_a_ddp_rank():
    ddp = will_it_fit(CFG, 2, world_size=2, zero=0).peak.tensors
    zero3 = will_it_fit(CFG, 2, world_size=2, zero=3).peak.tensors
    assert zero3 < ddp


def test_a_hugging_face_model_goes_to_will_it_fit_hf(monkeypatch):
    pytest.importorskip("transformers")
    from anatomy_helpers.distributed import one_fit
    from anatomy_helpers.prediction.hf_step import FineTune

    seen = {}
    monkeypatch.setattr(one_fit, "will_it_fit_hf", lambda model, ft, device, **kw: seen.update(ft=ft, kw=kw) or "r")
    assert will_it_fit("llama-3.2-1b", 2, device="h100", world_size=4, zero=3, fine_tune=FineTune(seq_len=64)) == "r"
    assert seen["ft"] == FineTune(seq_len=64, batch_size=2) and seen["kw"] == dict(world_size=4, zero=3)


@pytest.mark.parametrize(
    "args, kwargs, why",
    [
        ((CFG, 2), dict(world_size=2, optimizer="sgd"), "optimizer is not modelled per rank"),
        ((CFG, 2), dict(world_size=2, zero=5), r"zero must be None or one of \(0, 1, 2, 3\)"),
        ((CFG, 2), dict(zero=1), "needs world_size > 1"),
        ((CFG, 2), dict(fine_tune=object()), "fine_tune is a Hugging Face fine-tune's"),
        (("llama-3.2-1b", 2), dict(optimizer="sgd"), "takes its options as fine_tune=FineTune"),
    ],
)
def test_what_one_path_cannot_take_is_refused_by_name(args, kwargs, why):
    with pytest.raises(ValueError, match=why):
        will_it_fit(*args, **kwargs)
