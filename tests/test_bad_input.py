"""The bad-input probes of issue 18, in one place: each is refused up front with a ValueError that names the argument,
and leaves nothing behind (no tracker running, no dispatch mode, no profiler session, the model still trains)."""

import math

import pytest
import torch
from torch._C._autograd import _profiler_enabled

from anatomy_helpers import StepTracker, make_model, make_optimizer, track_steps
from anatomy_helpers.distributed.ranks import RankJob
from anatomy_helpers.distributed.world import run_world
from anatomy_helpers.prediction.allocator import CachingAllocatorSim, LimitedAllocatorSim, allocator_at
from anatomy_helpers.prediction.fit import will_it_fit

from .conftest import SMALL

MODEL = make_model(device="cpu", **SMALL)
OPT = make_optimizer(MODEL, "sgd")
OTHER = make_model(device="cpu", **SMALL)


def _record():
    trace = track_steps(MODEL, OPT, steps=1, batch_size=2)
    return trace.allocation_record()


PROBES = {
    "lr nan": (lambda: make_optimizer(MODEL, "adamw", lr=math.nan), "lr"),
    "lr inf": (lambda: make_optimizer(MODEL, "adamw", lr=math.inf), "lr"),
    "lr 'fast'": (lambda: make_optimizer(MODEL, "adamw", lr="fast"), "lr"),
    "a string as the model": (lambda: make_optimizer("gpt2"), "model"),
    "after_step 'x'": (lambda: track_steps(MODEL, OPT, steps=1, batch_size=2, after_step="x"), "after_step"),
    "tracker object()": (lambda: track_steps(MODEL, OPT, steps=1, batch_size=2, tracker=object()), "tracker"),
    "tracker of another model": (
        lambda: track_steps(MODEL, OPT, tracker=StepTracker(OTHER, make_optimizer(OTHER, "sgd"))),
        "tracker",
    ),
    "world_size True": (lambda: track_steps(MODEL, OPT, steps=1, batch_size=2, world_size=True), "world_size"),
    "will_it_fit device -1": (lambda: will_it_fit(device=-1), "device"),
    "will_it_fit device True": (lambda: will_it_fit(device=True), "device"),
    "will_it_fit device nan": (lambda: will_it_fit(device=math.nan), "device"),
    "will_it_fit cfg 'gpt2'": (lambda: will_it_fit(cfg="gpt2"), "cfg"),
    "LimitedAllocatorSim nan": (lambda: LimitedAllocatorSim(math.nan), "limit"),
    "LimitedAllocatorSim '1GiB'": (lambda: LimitedAllocatorSim("1GiB"), "limit"),
    "malloc nan": (lambda: CachingAllocatorSim().malloc(1, math.nan), "nbytes"),
    "malloc inf": (lambda: CachingAllocatorSim().malloc(1, math.inf), "nbytes"),
    "malloc '100'": (lambda: CachingAllocatorSim().malloc(1, "100"), "nbytes"),
    "malloc 1.5": (lambda: CachingAllocatorSim().malloc(1, 1.5), "nbytes"),
    "allocator_at 1.5": (lambda: allocator_at(_record(), 1.5), "row"),
    "run_world world_size True": (lambda: run_world(RankJob("ddp"), world_size=True), "world_size"),
    "run_world world_size '2'": (lambda: run_world(RankJob("ddp"), world_size="2"), "world_size"),
    "run_world world_size 2.0": (lambda: run_world(RankJob("ddp"), world_size=2.0), "world_size"),
    "run_world port -1": (lambda: run_world(RankJob("ddp"), port=-1), "port"),
    "run_world jobs ['x']": (lambda: run_world(["x"]), "jobs"),
    "run_world timeout_s -1": (lambda: run_world(RankJob("ddp"), timeout_s=-1), "timeout_s"),
}


@pytest.mark.parametrize("probe", PROBES, ids=list(PROBES))
def test_a_bad_argument_is_a_value_error_that_names_it_and_leaves_nothing_behind(probe):
    call, argument = PROBES[probe]
    with pytest.raises(ValueError, match=argument):
        call()
    assert StepTracker._running is None and not hasattr(MODEL, "_anatomy_tracker")
    assert torch._C._len_torch_dispatch_stack() == 0 and not _profiler_enabled()
    assert track_steps(MODEL, OPT, steps=1, batch_size=2).training_steps() == [1]  # still trains
