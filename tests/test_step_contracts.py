"""The one step against torch's own recipes: the AMP order (unscale, then clip), DDP's no_sync on all but the last
micro-batch, the optimizer step in backward keeping torch's optimizer contract, and the chunked loss equal to
F.cross_entropy with ignored targets. Each test pins a result that was silently wrong before (issue "One engine")."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from anatomy_helpers import make_model, make_optimizer, track_steps
from anatomy_helpers.core.data import get_batch
from anatomy_helpers.core.model import chunked_cross_entropy
from anatomy_helpers.training.step import StepPlan, run_step
from anatomy_helpers.training.train import train_step

from .conftest import SMALL

# ---- AMP: torch's recipe is scaler.scale(loss).backward(); scaler.unscale_(opt); clip; scaler.step(opt) ------------


def test_clipping_under_a_grad_scaler_clips_the_unscaled_gradients_like_torchs_recipe():
    """Before: run_step clipped the *scaled* gradients, so with init_scale 2**16 and clip 1.0 the update was 65,536x
    too small. A power-of-two scale and no overflow make the scaled recipe equal the unscaled one."""
    model = make_model(device="cpu", seed=3, **SMALL)
    by_hand = copy.deepcopy(model)
    opt, opt_hand = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(by_hand.parameters(), lr=0.1)
    x, y = get_batch(4, SMALL["seq_len"], step=0, seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    run_step(model, opt, StepPlan(batch_size=4, clip_grad_norm=1.0), 0, scaler=scaler)

    by_hand(x, y)[1].backward()
    norm = torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 1.0)
    assert norm > 1.0  # the clip is active, so a missing unscale shows
    opt_hand.step()
    for a, b in zip(model.parameters(), by_hand.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert scaler.get_scale() == 2.0**16  # no overflow: the step ran and the scale is unchanged


# ---- DDP micro-batches: no_sync on all but the last ---------------------------------------------------------------


class CountAllReduces(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "allreduce" in func.__name__:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def one_rank_gloo():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(29_500 + os.getpid() % 20_000)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_ddp_all_reduces_once_per_step_whatever_the_micro_batches(one_rank_gloo, micro_batches):
    """Before: every micro-batch's backward all-reduced its gradients (k all-reduces of every bucket per step);
    nanoGPT and accelerate all-reduce only the last one's, under no_sync() before it. The gradients are the same."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    counts = []
    for k in (1, micro_batches):
        model = DDP(make_model(device="cpu", **SMALL), bucket_cap_mb=1000)  # one bucket: one all-reduce a backward
        opt = make_optimizer(model.module, "sgd", lr=0.1)
        with CountAllReduces() as seen:
            run_step(model, opt, StepPlan(batch_size=4, micro_batches=k), 0)
        counts.append((seen.calls, [p.detach().clone() for p in model.parameters()]))
    assert counts[1][0] == counts[0][0] == 1
    for a, b in zip(counts[0][1], counts[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- train_step is the one step -----------------------------------------------------------------------------------


def test_train_step_is_a_run_step_of_the_given_batch():
    a, b = make_model(device="cpu", seed=1, **SMALL), make_model(device="cpu", seed=1, **SMALL)
    x, y = get_batch(4, SMALL["seq_len"], step=0, seed=0)
    loss = train_step(a, make_optimizer(a, "adamw"), x, y)
    assert loss == run_step(b, make_optimizer(b, "adamw"), StepPlan(batch_size=4), 0)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert x.shape == (4, SMALL["seq_len"])  # the caller's batch is left alone


# ---- the optimizer step in backward keeps torch's optimizer contract -----------------------------------------------


def _steps(model, opt, n, first=0):
    for i in range(n):
        run_step(model, opt, StepPlan(batch_size=2, first_batch=first + i), 0)


def test_in_backward_state_dict_round_trip_continues_where_it_stopped():
    """Before: after load_state_dict the live per-parameter optimizers kept their own state (Adam at step 1 while
    the loaded state said 3): 1.8e-3 off the plain optimizer's parameters."""
    plain, fused = make_model(device="cpu", seed=2, **SMALL), make_model(device="cpu", seed=2, **SMALL)
    plain_opt, fused_opt = make_optimizer(plain, "adamw"), make_optimizer(fused, "adamw", in_backward=True)
    _steps(plain, plain_opt, 3)
    _steps(fused, fused_opt, 3)
    saved = copy.deepcopy(fused_opt.state_dict())
    fresh = make_optimizer(fused, "adamw", in_backward=True)
    fresh.load_state_dict(saved)
    assert all(int(s["step"]) == 3 for s in fresh.state.values())
    _steps(plain, plain_opt, 2, first=3)
    _steps(fused, fresh, 2, first=3)
    for a, b in zip(plain.parameters(), fused.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for group in fresh.param_groups:  # every per-parameter optimizer steps from the loaded state and groups
        opt = fresh.optimizers[group["params"][0]]
        assert opt.state is fresh.state and opt.param_groups[0] is group


def test_in_backward_learning_rate_and_schedulers_go_through_param_groups():
    """Before: an lr set in param_groups was ignored (lr 0 still trained) and StepLR failed with KeyError 'lr'."""
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "sgd", lr=0.1, in_backward=True)
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    _steps(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    opt = make_optimizer(model, "sgd", lr=0.1, in_backward=True)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _steps(model, opt, 1)
    schedule.step()
    assert {g["lr"] for g in opt.param_groups} == {0.05}
    assert {o.param_groups[0]["lr"] for o in opt.optimizers.values()} == {0.05}


def test_in_backward_trains_a_parameter_unfrozen_after_it_was_made_and_skips_a_frozen_one():
    """Before: a parameter unfrozen after construction was never stepped and kept its gradient."""
    model = make_model(device="cpu", **SMALL)
    frozen, unfrozen = model.lm_head.weight, model.ln_f.weight
    unfrozen.requires_grad_(False)
    opt = make_optimizer(model, "sgd", lr=0.1, in_backward=True)
    unfrozen.requires_grad_(True)
    before = unfrozen.detach().clone()
    _steps(model, opt, 1)
    assert not torch.equal(before, unfrozen) and unfrozen.grad is None  # stepped, and its gradient freed

    frozen.requires_grad_(False)
    kept = frozen.detach().clone()
    _steps(model, opt, 1, first=1)
    assert torch.equal(kept, frozen) and frozen.grad is None


def test_in_backward_refuses_a_second_backward_in_one_step_and_add_param_group():
    """Before: two backward passes inside one in_backward() stepped every parameter twice."""
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "sgd", in_backward=True)
    x, y = get_batch(2, SMALL["seq_len"], step=0, seed=0)
    with pytest.raises(ValueError, match="second backward inside one in_backward"):
        with opt.in_backward():
            model(x, y)[1].backward()
            model(x, y)[1].backward()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # the hooks are gone
    with pytest.raises(ValueError, match="make a new one with every parameter"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    track_steps(model, opt, 1, 2)  # and it still trains afterwards


# ---- the chunked loss equals F.cross_entropy, ignored targets included --------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 30])
def test_chunked_loss_skips_ignored_targets_like_cross_entropy(chunk):
    """Before: with -100 targets the chunked loss divided by every token (2.0405 against 4.0811 for half ignored)."""
    torch.manual_seed(0)
    x = torch.randn(3, 10, 16, requires_grad=True)
    w = torch.randn(70, 16, requires_grad=True)
    t = torch.randint(0, 70, (3, 10))
    t[:, ::2] = -100
    plain = F.cross_entropy((x @ w.T).view(30, 70), t.view(30))
    loss = chunked_cross_entropy(x, w, t, chunk)
    torch.testing.assert_close(loss, plain)
    for a, b in zip(torch.autograd.grad(loss, (x, w)), torch.autograd.grad(plain, (x, w))):
        torch.testing.assert_close(a, b)
