"""Lesson 10's levers, each through the one training step (step.run_step): the optimizer step fused into backward,
the chunked cross-entropy, bf16 optimizer state, zero_grad to zeros. Expected bytes come from tensor sizes."""

import math
from dataclasses import replace

import pytest
import torch

from anatomy_helpers import get_batch, make_model, make_optimizer, track_steps
from anatomy_helpers.core.model import GPT, ModelConfig, chunked_cross_entropy
from anatomy_helpers.core.tensors import state_bytes_by_key
from anatomy_helpers.prediction.dryrun import DryRunError, dry_run_config
from anatomy_helpers.prediction.levers import EFFECTS, levers, verify_levers
from anatomy_helpers.tracking.tracker import StepTracker
from anatomy_helpers.training.step import OptimizerInBackward, StepPlan, run_step, step_flops

from .conftest import SMALL, storage_bytes


def grad_bytes(model) -> int:
    """Bytes of every gradient the model's parameters get: one per parameter tensor, its size and dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def trained(steps: int = 2, optimizer: str = "adamw", model_kw=None, **step):
    model = make_model(device="cpu", **{**SMALL, **(model_kw or {})})
    opt = make_optimizer(model, optimizer, in_backward=step.pop("in_backward", False))
    trace = track_steps(model, opt, steps, 4, **step)
    return model, opt, trace


# ---- the optimizer step fused into backward -------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "momentum"])
def test_in_backward_trains_the_same_parameters_as_the_plain_step(optimizer):
    plain, _, _ = trained(3, optimizer)
    fused, _, _ = trained(3, optimizer, in_backward=True)
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_update_gap_is_zero_for_the_same_update_and_not_for_another():
    from anatomy_helpers.lessons.lesson10_optimizations import update_gap

    assert update_gap(SMALL, {"in_backward": True}, steps=2) == 0.0  # the same single-tensor update, bit for bit
    assert update_gap(SMALL, {"fused": True}, steps=2) < 1e-3  # the same update up to rounding
    assert update_gap(SMALL, {"lr": 2e-3}, steps=2) > 1e-4  # another update shows


def test_in_backward_never_holds_every_gradient_at_once():
    plain_model, _, plain = trained(2)
    model, opt, fused = trained(2, in_backward=True)
    every = grad_bytes(model)
    # the plain step: every gradient alive when the optimizer starts
    assert plain.at(plain.phase(2, "optimizer").start - 1)["gradients"] == every
    most = int(fused.timeline.category("gradients").max())
    largest = max(p.numel() * p.element_size() for p in model.parameters())  # the tied embedding's
    assert largest <= most < every
    assert fused.at(len(fused.timeline) - 1)["gradients"] == 0  # each freed once stepped
    assert all(p.grad is None for p in model.parameters())
    # the state is the same as the plain optimizer's, counted as optimizer state
    assert fused.at(len(fused.timeline) - 1)["optimizer_state"] == plain.at(len(plain.timeline) - 1)["optimizer_state"]
    assert fused.peak(phase="optimizer").bytes > 0  # the tracker sees optimizer phases, inside backward
    assert fused.peak().bytes < plain.peak().bytes


def test_in_backward_leaves_no_hook_behind_even_when_backward_fails():
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "sgd", in_backward=True)

    def failing_loss(model, batch):
        loss = model(*batch)[1]
        return loss.register_hook(lambda g: 1 / 0) and loss  # a hook on the loss fails inside backward

    with pytest.raises(ZeroDivisionError):
        run_step(model, opt, StepPlan(batch_size=2, loss=failing_loss), 0)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.parametrize(
    "plan, what",
    [
        (dict(clip_grad_norm=1.0), "clip_grad_norm: clipping by the norm over all parameters"),
        (dict(micro_batches=2), "micro_batches: accumulating"),
        (dict(world_size=2), "world_size: data parallelism"),
        (dict(optimizer_step=False), "optimizer_step"),
    ],
)
def test_in_backward_refuses_what_it_cannot_do_before_running(plan, what):
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "adamw", in_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=what):
        run_step(model, opt, StepPlan(batch_size=4, **plan), 0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing ran


def test_in_backward_cannot_be_stepped_by_hand():
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "adamw", in_backward=True)
    with pytest.raises(ValueError, match="inside loss.backward"):
        opt.step()
    with pytest.raises(ValueError, match="at least one parameter"):
        OptimizerInBackward([torch.zeros(2)], lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_clip_grad_norm_clips_over_all_parameters_like_torch():
    model = make_model(device="cpu", **SMALL)
    ref = make_model(device="cpu", **SMALL)
    opt, ref_opt = make_optimizer(model, "sgd"), make_optimizer(ref, "sgd")
    run_step(model, opt, StepPlan(batch_size=4, clip_grad_norm=0.01), 0)
    x, y = get_batch(4, SMALL["seq_len"], step=0)
    ref(x, y)[1].backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert norm > 0.01  # the clip bites
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        StepPlan(clip_grad_norm=0)


# ---- the chunked cross-entropy ------------------------------------------------------------------------------


def test_chunked_cross_entropy_gives_the_plain_loss_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(3, 10, 16, requires_grad=True)
    w = torch.randn(70, 16, requires_grad=True)
    t = torch.randint(0, 70, (3, 10))
    plain = torch.nn.functional.cross_entropy((x @ w.T).view(30, 70), t.view(30))
    gx, gw = torch.autograd.grad(plain, (x, w))
    for chunk in (1, 7, 30, 64):  # one token, uneven chunks, exactly all, more than all
        loss = chunked_cross_entropy(x, w, t, chunk)
        torch.testing.assert_close(loss, plain)
        cx, cw = torch.autograd.grad(loss, (x, w))
        torch.testing.assert_close(cx, gx)
        torch.testing.assert_close(cw, gw)


def test_loss_chunk_trains_the_same_parameters_and_never_holds_the_logits():
    big = dict(vocab_size=2048, seq_len=64)
    plain_model, _, plain = trained(2, "sgd", big)
    model, _, chunked = trained(2, "sgd", {**big, "loss_chunk": 32})
    for a, b in zip(plain_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)
    tokens, vocab = 4 * big["seq_len"], big["vocab_size"]
    # plain: the (B*T, V) fp32 logits are one allocation; chunked: none larger than one chunk's logits (32, V) or
    # the head weight's gradient (V, C), which each chunk's backward makes before it is summed
    assert plain.largest_allocation("temporaries") == tokens * vocab * 4
    biggest = max(chunked.largest_allocation(c) for c in ("temporaries", "recomputed", "activations"))
    assert biggest == max(32 * vocab * 4, vocab * SMALL["d_model"] * 4)
    assert chunked.largest_allocation("recomputed") == 32 * vocab * 4  # backward remakes one chunk's logits
    assert chunked.peak().bytes < plain.peak().bytes - (tokens - 32) * vocab * 4


def test_loss_chunk_costs_one_more_head_matmul_in_flops():
    cfg = dict(SMALL, vocab_size=512)
    x, y = get_batch(2, SMALL["seq_len"], step=0)
    plain = step_flops(make_model(device="cpu", **cfg), x, y)
    chunked = step_flops(make_model(device="cpu", **cfg, loss_chunk=16), x, y)
    tokens = 2 * SMALL["seq_len"]
    assert chunked - plain == 2 * tokens * SMALL["d_model"] * cfg["vocab_size"]  # the head's forward, recomputed


def test_loss_chunk_is_checked_and_keeps_logits_without_targets():
    with pytest.raises(ValueError, match="loss_chunk"):
        ModelConfig(loss_chunk=0)
    model = GPT(ModelConfig(**SMALL, loss_chunk=8))
    x, y = get_batch(2, SMALL["seq_len"], step=0)
    assert model(x, y)[0] is None  # trained: no logits are made
    assert model(x)[0].shape == (2, SMALL["seq_len"], model.cfg.vocab_size)  # generation still gets them


# ---- optimizer state: bf16, momentum vs Adam, zero_grad -----------------------------------------------------


def test_optimizer_state_bytes_per_parameter_from_tensor_sizes():
    per_param = {}
    for name in ("momentum", "adamw", "adamw_bf16"):
        model, opt, _ = trained(1, name)
        n = sum(p.numel() for p in model.parameters())
        state = state_bytes_by_key(opt)
        per_param[name] = sum(v for k, v in state.items() if k != "step") / n
    assert per_param == {"momentum": 4.0, "adamw": 8.0, "adamw_bf16": 4.0}


def test_bf16_state_trains_like_fp32_adamw_within_a_band():
    def losses(name):
        model = make_model(device="cpu", **SMALL)
        opt = make_optimizer(model, name)  # lr 1e-3
        return [run_step(model, opt, StepPlan(batch_size=8), i) for i in range(30)]

    fp32, bf16 = losses("adamw"), losses("adamw_bf16")
    assert bf16[-1] < 0.85 * bf16[0]  # it trains
    assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) < 0.01  # within 1% of fp32 AdamW at every step
    assert fp32 != bf16  # and it is not the same optimizer


def test_bf16_state_refuses_other_implementations():
    model = make_model(device="cpu", **SMALL)
    with pytest.raises(ValueError, match="foreach"):
        make_optimizer(model, "adamw_bf16", foreach=True)


def test_zero_grad_to_zeros_keeps_every_gradient_between_steps():
    model, _, kept = trained(2, "sgd", set_to_none=False)
    _, _, freed = trained(2, "sgd")
    end = len(kept.timeline) - 1
    assert kept.at(end)["gradients"] == grad_bytes(model)
    assert freed.at(len(freed.timeline) - 1)["gradients"] == 0


# ---- the decision: dominant phase and category, the levers on it, verified and ranked ------------------------

OPTIMIZER_BOUND = dict(n_layer=2, d_model=128, n_head=2, seq_len=8)  # many parameters, one short sequence
LOGITS_BOUND = dict(n_layer=1, d_model=32, n_head=2, seq_len=64, vocab_size=4096)  # a large vocabulary


def real_peak(cfg: dict, batch: int, optimizer: str = "adamw", **step) -> int:
    model = make_model(device="cpu", **cfg)
    opt_kw = {k: step.pop(k) for k in ("fused", "in_backward") if k in step}
    opt = make_optimizer(model, step.pop("optimizer", optimizer), **opt_kw)
    plan = StepPlan(batch_size=step.pop("batch_size", batch), **step)  # a smaller global batch's lever sets it
    with StepTracker(model, opt, kernel_scratch=False, accumulate=plan.micro_batches > 1) as tracker:
        for i in range(2):
            run_step(model, opt, plan, i)
    return tracker.trace.peak().bytes


@pytest.mark.parametrize("cfg, batch, phase, category", [
    (OPTIMIZER_BOUND, 1, "optimizer", "optimizer_state"),
    (LOGITS_BOUND, 4, "backward", "temporaries"),
])  # fmt: skip
def test_verify_levers_names_the_dominant_category_and_real_runs_confirm_each_lever(cfg, batch, phase, category):
    trace, dominant_category, verified = verify_levers(ModelConfig(**cfg), batch)
    assert (trace.peak().phase, dominant_category) == (phase, category)
    # the filter narrows only what changes training; what keeps the maths is tried wherever it lowers the peak
    assert verified and all(category in v.lever.acts_on for v in verified if v.lever.effect != "time only")
    assert trace.peak().bytes == real_peak(cfg, batch)
    for v in verified:  # each lever's dry run is what a real run of it measures (accumulation's micro-batches too)
        assert v.after.tensors == real_peak({**cfg, **v.lever.config}, batch, **v.lever.step), v.lever.name
    assert all(v.saved > 0 for v in verified)  # what saves nothing is dropped
    keys = [(EFFECTS.index(v.lever.effect), math.inf if v.extra_flops is None else round(v.extra_flops, 3))
            for v in verified]  # fmt: skip
    assert keys == sorted(keys)  # what changes least first, then the fewest extra FLOPs


def test_verify_levers_on_an_optimizer_bound_step_keeps_the_levers_that_keep_the_maths():
    # issue #40: the dominant-category filter (optimizer_state) hid the step in backward and the fused optimizer,
    # which keep the maths and lower this peak (their own dry runs, against the step's)
    cfg = ModelConfig(**OPTIMIZER_BOUND)
    trace, category, verified = verify_levers(cfg, 1)
    assert category == "optimizer_state"
    base = trace.peak().bytes
    names = [v.lever.name for v in verified]
    for name, step in (("optimizer step in backward", {"in_backward": True}), ("fused optimizer", {"fused": True})):
        assert real_peak(OPTIMIZER_BOUND, 1, **step) < base  # it lowers the peak, measured by a real run
        assert name in names
    assert names.index("optimizer step in backward") < names.index("bf16 optimizer state")  # maths kept first


def test_verify_levers_offers_micro_batches_and_a_smaller_batch():
    # issue #40: verify_levers offered neither; on the logits-bound step both lower the peak
    _, _, verified = verify_levers(ModelConfig(**LOGITS_BOUND), 4)
    by = {v.lever.name: v for v in verified}
    assert by["micro-batch 2 x 2 (accumulate)"].lever.effect == "time only"
    assert by["batch 2 (smaller global batch)"].lever.effect == "global batch"
    assert real_peak(LOGITS_BOUND, 2) == by["batch 2 (smaller global batch)"].after.tensors


def test_every_lever_that_lowers_the_peak_is_listed_without_the_dominant_filter():
    cfg = ModelConfig(**OPTIMIZER_BOUND)
    _, _, some = verify_levers(cfg, 1)
    trace, _, every = verify_levers(cfg, 1, only_dominant=False)
    assert {v.lever.name for v in some} <= {v.lever.name for v in every}
    catalogue = {lv.name for lv in levers(cfg, batch_size=1)}
    assert {v.lever.name for v in every} <= catalogue
    for lever in levers(cfg, batch_size=1):  # each left out saves nothing: its own dry run says so
        if lever.name not in {v.lever.name for v in every} and lever.applies(cfg, "adamw", {}):
            after = dry_run_config(replace(cfg, **lever.config), batch_size=1, **lever.step).peak().bytes
            assert after >= trace.peak().bytes, lever.name


def test_verify_levers_on_a_device_ranks_what_fits_there_first_and_nothing_when_the_step_fits():
    # issue #40: with no device cap, levers that save a few bytes ranked by cost alone. On a device one byte short of
    # the step's reserved memory, what fits comes first; on a device where the step already fits, nothing is ranked
    from anatomy_helpers.prediction.devices import CUDA_CONTEXT_BYTES
    from anatomy_helpers.prediction.fit import will_it_fit

    cfg = ModelConfig(**LOGITS_BOUND)
    uncapped = verify_levers(cfg, 4)[2]
    need = will_it_fit(cfg, 4, device=10**12).peak.reserved
    short = need - 1 + CUDA_CONTEXT_BYTES
    _, _, capped = verify_levers(cfg, 4, device=short)
    fits = [v.fix.fits for v in capped]
    assert True in fits and False in fits and fits == sorted(fits, reverse=True)
    # the same levers (of a family, such as the micro-batches, the first that fits: 1 x 4 on the device), reordered
    assert {v.lever.family or v.lever.name for v in capped} == {v.lever.family or v.lever.name for v in uncapped}
    assert [v.lever.name for v in capped] != [v.lever.name for v in uncapped]
    for v in capped:  # each verdict is that lever's own fit on the device
        assert v.fix.fits == (v.fix.report.peak.reserved <= short - CUDA_CONTEXT_BYTES)
    assert verify_levers(cfg, 4, device=need + CUDA_CONTEXT_BYTES)[2] == []


# ---- bitsandbytes' 8-bit AdamW (optional: the [levers] extra) --------------------------------------------------


def eight_bit_state_bytes(model) -> int:
    """bitsandbytes' AdamW8bit state from its documented layout: a tensor of 4,096 elements or more keeps each moment
    as one uint8 per element plus a float32 absolute maximum per block of 256; a smaller one keeps float32 moments;
    the two 256-entry float32 code books (qmap1, qmap2) are shared by all."""
    total = 2 * 256 * 4
    for p in model.parameters():
        n = p.numel()
        total += 2 * (n + -(-n // 256) * 4) if n >= 4096 else 2 * n * 4
    return total


def test_adamw8bit_state_is_what_its_layout_says_and_trains_like_fp32():
    pytest.importorskip("bitsandbytes")
    model, opt, trace = trained(2, "adamw8bit")
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert storage_bytes(state) == eight_bit_state_bytes(model)
    assert trace.at(len(trace.timeline) - 1)["optimizer_state"] == eight_bit_state_bytes(model)

    def losses(name):
        model = make_model(device="cpu", **SMALL)
        opt = make_optimizer(model, name)
        return [run_step(model, opt, StepPlan(batch_size=8), i) for i in range(30)]

    fp32, q8 = losses("adamw"), losses("adamw8bit")
    assert q8[-1] < 0.85 * q8[0] and max(abs(a - b) / a for a, b in zip(fp32, q8)) < 0.01 and fp32 != q8


def test_a_dry_run_of_adamw8bit_is_refused_it_reads_values():
    pytest.importorskip("bitsandbytes")
    with pytest.raises(DryRunError, match="GPT or its optimizer.* reads tensor values"):
        dry_run_config(ModelConfig(**SMALL), optimizer="adamw8bit", batch_size=2, steps=1)


# ---- lesson 10's own helpers ----------------------------------------------------------------------------------


def test_the_lesson_measures_each_lever_against_its_baseline():
    from anatomy_helpers.lessons.lesson10_optimizations import format_levers, lever_named, measure_levers

    cfg = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, vocab_size=512)
    rows, traces = measure_levers(cfg, 2, ["baseline", "bf16 optimizer state", "chunked loss", "zero_grad"])
    base, bf16, chunked, kept = rows
    assert list(traces) == [r.name for r in rows] and base.name == "baseline (AdamW)"
    assert bf16.state_per_param == 4.0 and not base.changes_training and bf16.changes_training
    tokens = 2 * cfg["seq_len"]
    flops = step_flops(make_model(device="cpu", **cfg), *get_batch(2, cfg["seq_len"], step=0))
    assert chunked.extra_flops == pytest.approx(2 * tokens * cfg["d_model"] * cfg["vocab_size"] / flops)
    # (its peak is not lower here: this step is not logits-bound, the lever acts on a category that is not at the peak)
    assert traces[chunked.name].largest_allocation("temporaries") < traces[base.name].largest_allocation("temporaries")
    end = traces[kept.name].at(len(traces[kept.name].timeline) - 1)
    assert end["gradients"] == grad_bytes(make_model(device="cpu", **cfg))  # zeroed, not freed
    assert "bf16 optimizer state" in format_levers(rows) and "+0%" in format_levers(rows)
    with pytest.raises(ValueError, match="no lever named"):
        lever_named("lion", cfg)


def test_the_stored_compile_record_is_of_the_notebooks_step(tmp_path):
    """Notebook 10 prints the recorded torch.compile peaks when it does not compile: they must be of its own step."""
    import json

    from anatomy_helpers.lessons.lesson10_optimizations import COMPILE_REFERENCE, LOGITS_BATCH, LOGITS_BOUND
    from anatomy_helpers.lessons.lesson10_optimizations import stored_compile_memory as stored

    record = stored()
    assert record is not None and record["config"] == LOGITS_BOUND and record["batch_size"] == LOGITS_BATCH
    assert set(record["peaks"]) == {"eager", "compiled"} and all(v > 0 for v in record["peaks"].values())
    assert stored(tmp_path / "missing.json") is None
    other = dict(json.loads(COMPILE_REFERENCE.read_text()), batch_size=LOGITS_BATCH + 1)
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="record_compile_reference"):
        stored(tmp_path / "other.json")


# ---- lesson 10's one-liners and its panel (runs cached per configuration and lever) ----------------------------

TINY_STEPS = {  # the lesson's two kinds of step, smaller: the optimizer's state, then the logits, dominate
    "optimizer-bound": (dict(n_layer=1, d_model=64, n_head=2, seq_len=8), 1),
    "logits-bound": (dict(n_layer=1, d_model=16, n_head=2, seq_len=16, vocab_size=1024), 4),
}


def plain_peak(cfg: dict, batch: int, optimizer_kw=None, **step) -> int:
    """The peak of two tracked steps, built here without the lesson's levers or its cache."""
    model = make_model(device="cpu", **cfg)
    return track_steps(model, make_optimizer(model, "adamw", **(optimizer_kw or {})), 2, batch, **step).peak().bytes


@pytest.fixture(scope="module")
def one_liner_rows():
    from anatomy_helpers.lessons.lesson10_optimizations import one_liners

    return {r.name: r for r in one_liners(device="cpu", configs=TINY_STEPS)}


def test_one_liners_match_plain_runs_and_tensor_sizes(one_liner_rows):
    from anatomy_helpers.lessons.lesson10_optimizations import FOREACH, MICRO_BATCHES, OFFLOAD, SINGLE_TENSOR

    opt_cfg, opt_batch = TINY_STEPS["optimizer-bound"]
    logits_cfg, logits_batch = TINY_STEPS["logits-bound"]
    offload, accumulated = one_liner_rows[OFFLOAD.name], one_liner_rows[MICRO_BATCHES.name]
    single, foreach = one_liner_rows[SINGLE_TENSOR.name], one_liner_rows[FOREACH.name]
    fused = one_liner_rows["fused optimizer"]
    assert offload.baseline == accumulated.baseline == plain_peak(logits_cfg, logits_batch)
    assert offload.peak == offload.baseline  # save_on_cpu on a CPU: the saved tensors are in host memory already
    assert accumulated.peak == plain_peak(logits_cfg, logits_batch, micro_batches=4) < accumulated.baseline
    assert single.peak == single.baseline == plain_peak(opt_cfg, opt_batch)  # the CPU default is the loop
    assert foreach.peak == plain_peak(opt_cfg, opt_batch, dict(foreach=True))
    assert foreach.optimizer_temporaries == grad_bytes(make_model(device="cpu", **opt_cfg))  # one per gradient
    assert fused.optimizer_temporaries == 0 < single.optimizer_temporaries < foreach.optimizer_temporaries
    assert {r.max_allocated for r in one_liner_rows.values()} == {None}  # a CPU has no caching allocator


def test_lever_runs_are_cached_per_configuration_and_lever():
    from anatomy_helpers.lessons.lesson10_optimizations import BASELINE, FOREACH, lever_run

    cfg, batch = TINY_STEPS["optimizer-bound"]
    first = lever_run(cfg, batch, BASELINE, device="cpu")
    assert lever_run(cfg, batch, BASELINE, device="cpu") is first  # measured once
    assert lever_run(dict(cfg, d_model=32), batch, BASELINE, device="cpu") is not first
    other = lever_run(cfg, batch, FOREACH, device="cpu")
    assert other is not first and other.trace.peak().bytes > first.trace.peak().bytes
    assert first.num_params == sum(p.numel() for p in make_model(device="cpu", **cfg).parameters())
    assert first.max_allocated is None


def test_the_tables_show_the_allocators_peak_only_when_a_gpu_measured_one(one_liner_rows):
    from dataclasses import replace

    from anatomy_helpers.lessons.lesson10_optimizations import LeverRow, format_levers, format_one_liners

    rows = list(one_liner_rows.values())
    assert "max_memory_allocated" not in format_one_liners(rows)
    on_gpu = [replace(r, max_allocated=r.peak + 512, baseline_max_allocated=r.baseline + 512) for r in rows]
    text = format_one_liners(on_gpu)
    assert "max_memory_allocated" in text and f"{rows[0].peak + 512:,}" in text
    row = LeverRow("x", 2 * 2**20, "backward", "temporaries", 8.0, 0, 0.0, False)
    assert "max_memory_allocated" not in format_levers([row])
    assert "3.00" in format_levers([replace(row, max_allocated=3 * 2**20)]).splitlines()[-1]


def test_the_panel_shows_before_and_after_on_one_scale(capsys):
    from anatomy_helpers.lessons.lesson10_optimizations import (
        OPTIMIZER_BATCH,
        OPTIMIZER_BOUND,
        lever_panel,
        panel_levers,
    )

    fig = lever_panel("optimizer-bound", "optimizer step in backward", device="cpu")
    out = capsys.readouterr().out
    before = plain_peak(OPTIMIZER_BOUND, OPTIMIZER_BATCH)
    model = make_model(device="cpu", **OPTIMIZER_BOUND)
    after = track_steps(model, make_optimizer(model, in_backward=True), 2, OPTIMIZER_BATCH).peak().bytes
    assert f"{before:,} B" in out and f"{after:,} B" in out and f"by {after - before:+,} B" in out
    assert len(fig.axes) == 2 and fig.axes[0].get_ylim() == fig.axes[1].get_ylim()
    alone = lever_panel("optimizer-bound", "micro-batches", device="cpu")  # a one-row batch cannot be split
    assert "does not apply" in capsys.readouterr().out and len(alone.axes) == 1
    assert set(panel_levers()) >= {"optimizer step in backward", "chunked loss", "save_on_cpu offload"}
    with pytest.raises(ValueError, match="config must be one of"):
        lever_panel("huge")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_lever_runs_report_the_allocators_peak_and_offload_lowers_it():
    from anatomy_helpers.lessons.lesson10_optimizations import BASELINE, LOGITS_BATCH, LOGITS_BOUND, OFFLOAD, lever_run

    base = lever_run(LOGITS_BOUND, LOGITS_BATCH, BASELINE, device="cuda")
    offload = lever_run(LOGITS_BOUND, LOGITS_BATCH, OFFLOAD, device="cuda")
    assert base.max_allocated >= base.trace.peak().bytes  # every tracked byte, rounded up by the allocator
    assert offload.max_allocated < base.max_allocated  # the blocks' saved tensors wait in host memory


def test_save_on_cpu_keeps_a_cpu_tensor_itself():
    """Why checkpointing.offload_context enters save_on_cpu only on a GPU: on a CPU its pack hook (``tensor.cpu()``)
    hands back the same storage, so nothing moves and nothing is copied."""
    x = torch.randn(256, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        y = x.sin()
    assert y.grad_fn._saved_self.data_ptr() == x.data_ptr()
    with torch.autograd.graph.save_on_cpu():
        t = x * 2
        z = t.sin()  # a tensor saved mid-graph: the very same storage too
    assert z.grad_fn._saved_self.data_ptr() == t.data_ptr()


def test_save_on_cpu_with_pinned_memory_copies_even_a_cpu_tensor():
    """The course's offload policy calls ``save_on_cpu(pin_memory=True)`` (on a GPU only): its pack hook allocates a
    new host tensor and copies into it, so on a CPU it would keep a second copy of every saved tensor."""
    x = torch.randn(256, requires_grad=True)
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        y = x.sin()
    saved = y.grad_fn._saved_self
    assert saved.data_ptr() != x.data_ptr() and torch.equal(saved, x)


def test_lesson10_lists_the_levers_that_save_a_share_of_the_peak_and_names_the_rest():
    """sdpa saves a few bytes on the optimizer-bound step (its attention scores are tiny): lesson 10 leaves it out of
    the table, where it would read "saves 0.00 MiB", and keeps every lever that saves 0.5 % of the peak or more."""
    from anatomy_helpers.lessons.lesson10_optimizations import worth_listing

    _, _, verified = verify_levers(ModelConfig(**OPTIMIZER_BOUND), 1)
    listed, left_out = worth_listing(verified)
    assert listed + left_out == sorted(verified, key=lambda v: v in left_out) and listed and left_out
    peak = verified[0].before.tensors
    assert all(v.saved >= 0.005 * peak for v in listed) and all(0 < v.saved < 0.005 * peak for v in left_out)
    assert [v.lever.name for v in left_out] == ["sdpa attention"]
    assert "optimizer step in backward" in [v.lever.name for v in listed]
    assert worth_listing(verified, 0.0) == (verified, [])
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="share of the peak"):
            worth_listing(verified, bad)


def test_the_step_in_backward_peaks_in_an_optimizer_phase_inside_backward():
    """With the optimizer step in backward, the tracker marks each parameter's step as an optimizer phase between
    backward's pieces: the peak's phase reads "optimizer", and backward still runs after it in the same step."""
    from anatomy_helpers.lessons.lesson10_optimizations import in_backward_peak

    model = make_model(device="cpu", **OPTIMIZER_BOUND)
    fused = track_steps(model, make_optimizer(model, "adamw", in_backward=True), 2, 1)
    where = in_backward_peak(fused)
    step2 = [ph.phase for ph in fused.phases() if ph.step == where.step]
    assert where.optimizer_pieces == step2.count("optimizer") > 1
    assert where.phase == "optimizer" and where.backward_after  # an optimizer piece, with backward still to run
    _, _, plain = trained(2)
    assert not in_backward_peak(plain).backward_after and in_backward_peak(plain).optimizer_pieces == 1


def test_the_panel_draws_the_two_runs_it_compares(capsys):
    """lever_panel's two timelines are the plain step and the step with the lever, each tracked here again without
    the lesson's levers or its cache (the same bytes, event by event)."""
    from anatomy_helpers.lessons.lesson10_optimizations import OPTIMIZER_BATCH, OPTIMIZER_BOUND, lever_panel

    from .figure_data import assert_stack_is_the_trace

    fig = lever_panel("optimizer-bound", "optimizer step in backward", device="cpu")
    capsys.readouterr()
    plain = make_model(device="cpu", **OPTIMIZER_BOUND)
    fused = make_model(device="cpu", **OPTIMIZER_BOUND)
    runs = (
        track_steps(plain, make_optimizer(plain), 2, OPTIMIZER_BATCH),
        track_steps(fused, make_optimizer(fused, in_backward=True), 2, OPTIMIZER_BATCH),
    )
    for ax, trace in zip(fig.axes, runs, strict=True):
        assert_stack_is_the_trace(ax, trace)
