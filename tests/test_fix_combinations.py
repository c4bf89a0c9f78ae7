"""``predict --fix`` for the course GPT where no one lever fits: a combination of the catalogue's levers
(prediction/levers.combined), each of its levers needed, first in the list."""

from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.prediction.devices import get_device
from anatomy_helpers.prediction.fit import FitRequest, fit_run
from anatomy_helpers.prediction.fixes import cheapest_fix
from anatomy_helpers.prediction.levers import UNBOUNDED, levers

# The default widths with two blocks at batch 8: every kind of lever of the default model at batch 64 is in the
# catalogue (checkpointing has blocks to recompute), with fewer batch and micro-batch sizes, the costly part (one
# dry run each, of up to 32 micro-batches at batch 64); the device is cut from what the levers reach.
CFG, BATCH = ModelConfig(n_layer=2), 8


def test_where_no_one_lever_fits_the_combination_that_does_comes_first():
    big = FitRequest(CFG, BATCH, device=UNBOUNDED)
    catalogue = levers(CFG, batch_size=BATCH, device=big.check())
    dev = big.check()
    opts = dict(in_backward=False, fused=None, foreach=True, autocast=None, micro_batches=1)  # the request's
    singles = [fit_run(lv.apply(big), dev) for lv in catalogue if lv.applies(CFG, big.optimizer, opts)]
    by_name = {lv.name: lv for lv in catalogue}
    lowest = min(r.peak.tensors for r in singles)  # the lowest peak of tensors any one lever reaches, alone
    device = get_device(512 * 2**20 + lowest - 1)  # no one lever's tensors fit under it
    fixes = cheapest_fix(CFG, BATCH, device=device)
    first = fixes[0]
    assert first.fits and " + " in first.name and not any(f.fits for f in fixes[1:])
    chosen = [by_name[n] for n in first.name.split(" + ")]
    request = FitRequest(CFG, BATCH, device=device)
    for lever in chosen:
        request = lever.apply(request)
    assert fit_run(request, request.check()).phases == first.report.phases  # the combination it names
    for dropped in chosen:  # each lever is needed: without it, the rest does not fit
        rest = FitRequest(CFG, BATCH, device=device)
        for lever in chosen:
            rest = rest if lever is dropped else lever.apply(rest)
        assert not fit_run(rest, rest.check()).fits, dropped.name
