"""Activation checkpointing: the policies (bad values, memory, gradients), the tracker's "recomputed" label, and
lesson 05's helpers. Expected figures come from tensor shapes and from the "none" run, not from the code under test."""

import contextlib
import io

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from anatomy_helpers import ModelConfig, make_model, make_optimizer, track_steps
from anatomy_helpers.lessons.lesson05_checkpointing import (
    Policy,
    block_gradients,
    cheapest_fitting,
    check_policy_choice,
    forward_flops,
    lineup,
    measure_policies,
    pareto_front,
    plot_pareto,
    plot_peak_moment,
    policy_by_label,
    policy_gradients,
    policy_table,
    recompute_bumps,
    same_gradients,
    same_memory,
    time_policies,
    with_time_ratios,
)
from anatomy_helpers.lessons.lesson05_kept import (
    KORTHIKANTI_SETUP,
    compare_kept,
    every_k_model,
    every_k_panel,
    every_k_sweep,
    kept_formula,
    kept_table,
    plot_every_k,
    segment_sizes,
    track_kept,
)
from anatomy_helpers.prediction.formulas import korthikanti_layer_bytes, korthikanti_terms
from anatomy_helpers.tracking.events import CATEGORIES
from anatomy_helpers.training.step import step_flops
from tests.conftest import SMALL, THREADS

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
B = 4  # batch
FOUR = {**SMALL, "n_layer": 4}  # four blocks, so that every 2 blocks is not the whole model
CHECKPOINTING = [p for p in lineup() if p.checkpoint not in ("none", "offload")]


def test_selective_announces_each_saved_matmul_output_and_each_block_input():
    """The tracker counts what "selective" keeps from these announcements (checkpointing.keep_for_backward)."""
    from anatomy_helpers.core.checkpointing import add_listener
    from anatomy_helpers.core.data import get_batch

    model = make_model(**SMALL, checkpoint="selective")  # manual attention
    announced: list[torch.Tensor] = []
    undo = add_listener(announced.append)
    try:
        model(*get_batch(B, SMALL["seq_len"]))
    finally:
        undo()
    b, s, h, a = B, SMALL["seq_len"], SMALL["d_model"], SMALL["n_head"]
    # per block: its input (b, s, h); the Linear layers' outputs, flattened to (b*s, out) by addmm: qkv 3h, the
    # attention's out-projection h, the MLP's fc 4h and proj h; the two batched matmuls Q K^T and att @ v
    per_block = [(b, s, h), (b * s, 3 * h), (b * a, s, s), (b * a, s, h // a), (b * s, h), (b * s, 4 * h), (b * s, h)]
    assert sorted(tuple(t.shape) for t in announced) == sorted(per_block * SMALL["n_layer"])


# ---- the policies: bad values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"checkpoint": "sometimes"}, r"ModelConfig\.checkpoint must be one of \('none', 'full', 'every_k'"),
        ({"checkpoint": "every_k", "checkpoint_every": 0}, r"checkpoint_every must be a whole number from 1"),
        ({"checkpoint": "every_k", "checkpoint_every": 5}, r"from 1 to n_layer \(4\).*got 5"),
        ({"checkpoint": "every_k", "checkpoint_every": -2}, r"ModelConfig\.checkpoint_every .*got -2"),
        ({"checkpoint": "every_k", "checkpoint_every": 1.5}, r"ModelConfig\.checkpoint_every .*got 1\.5"),
        ({"checkpoint": "every_k", "checkpoint_every": True}, r"ModelConfig\.checkpoint_every .*got True"),
        ({"checkpoint": "full", "checkpoint_every": 9}, r"ModelConfig\.checkpoint_every .*how many blocks"),
    ],
)
def test_bad_values_name_the_field_and_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(n_layer=4, **kwargs)
    with pytest.raises(ValueError, match=message):  # before anything is built
        make_model(device="cpu", n_layer=4, **kwargs)


def test_every_k_accepts_the_whole_range():
    for k in (1, 2, 3, 4):
        ModelConfig(n_layer=4, checkpoint="every_k", checkpoint_every=k)


# ---- the policies: memory, measured ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    """Two tracked AdamW steps of the FOUR model under each policy of the line-up (rows and traces)."""
    torch.set_num_threads(THREADS)  # module fixtures run before the autouse one: the same threads as the tests
    return measure_policies(lineup(), steps=2, batch_size=B, device="cpu", **FOUR)


def test_every_checkpointing_policy_keeps_less_than_none(runs):
    rows, _ = runs
    none = rows[0]
    for r in rows[1:]:
        if r.policy.checkpoint == "offload":
            continue
        assert r.peak < none.peak, r.label
        assert r.activations < none.activations, r.label
        assert r.recomputed > 0, r.label


def test_full_keeps_one_block_input_per_block():
    x_bytes = B * SMALL["seq_len"] * SMALL["d_model"] * 4  # (b, s, h) fp32
    acts = {}
    for n_layer in (1, 2):
        model = make_model(device="cpu", checkpoint="full", **{**SMALL, "n_layer": n_layer})
        trace = track_steps(model, make_optimizer(model, "sgd"), 1, B, optimizer_step=False)
        acts[n_layer] = trace.phase(1, "forward").at_end["activations"]
    assert acts[2] - acts[1] == x_bytes


def test_offload_is_a_no_op_on_cpu(runs):
    _, traces = runs
    assert same_memory(traces["none"], traces["offload"])


@needs_cuda
@pytest.mark.cuda
def test_offload_moves_activations_off_the_gpu():
    peaks = {}
    for policy in ("none", "offload"):
        model = make_model(device="cuda", checkpoint=policy, **SMALL)
        trace = track_steps(model, make_optimizer(model), 2, B)
        peaks[policy] = trace.phase(2, "forward").at_end["activations"]
    assert peaks["offload"] < peaks["none"]


# ---- the policies: gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradients_are_bit_identical_under_every_policy(dropout):
    reference = policy_gradients(Policy("none"), dropout=dropout, device="cpu", **SMALL)
    assert all(g is not None for g in reference)
    for p in lineup(every=2):
        assert same_gradients(reference, policy_gradients(p, dropout=dropout, device="cpu", **SMALL)), p.label


def test_same_gradients_to_rounding():
    a = [torch.ones(3), torch.zeros(2)]
    assert same_gradients(a, [t.clone() for t in a]) and not same_gradients(a, a[:1])
    nudged = [a[0] + 1e-7, a[1]]
    assert not same_gradients(a, nudged) and same_gradients(a, nudged, exact=False)
    assert not same_gradients(a, [a[0] * 2, a[1]], exact=False)


def test_dropout_changes_the_gradients():
    # so the equality above is not empty: with dropout on, the gradients are not those without dropout
    on = policy_gradients(Policy("none"), dropout=0.1, device="cpu", **SMALL)
    off = policy_gradients(Policy("none"), dropout=0.0, device="cpu", **SMALL)
    assert not same_gradients(on, off)


def test_without_rng_state_preservation_the_recomputation_draws_other_masks():
    kept = block_gradients(True, device="cpu", **SMALL)
    lost = block_gradients(False, device="cpu", **SMALL)
    assert kept.identical and kept.differing == 0
    assert not lost.identical and 0 < lost.differing <= lost.total
    assert block_gradients(False, dropout=0.0, device="cpu", **SMALL).identical  # nothing random: nothing lost


# ---- the tracker: recomputation is labelled "recomputed" ---------------------------------------------------


def allocated(trace, step, phase):
    """Bytes allocated per category during one phase (allocations only), from the allocation record."""
    rec = trace.allocation_record()
    mask = rec.where(step=step, phase=phase, allocations=True)
    return {c: int(rec.bytes[mask & (rec.category == i)].sum()) for i, c in enumerate(CATEGORIES)}


@pytest.mark.parametrize("label", [p.label for p in CHECKPOINTING])
def test_recomputed_only_in_backward_and_nothing_else_mislabelled(runs, label):
    _, traces = runs
    none, trace = traces["none"], traces[label]
    for step in (1, 2):  # step 2 too: a label must not leak into the next step
        fwd, bwd, opt = (allocated(trace, step, ph) for ph in ("forward", "backward", "optimizer"))
        ref_fwd, ref_bwd, ref_opt = (allocated(none, step, ph) for ph in ("forward", "backward", "optimizer"))
        assert fwd["recomputed"] == opt["recomputed"] == 0
        assert bwd["recomputed"] > 0
        # the forward allocates what it did without checkpointing (it only keeps less of it)
        assert fwd["activations"] + fwd["temporaries"] == ref_fwd["activations"] + ref_fwd["temporaries"]
        # backward's own work (gradients and their temporaries) is the same as without checkpointing
        assert bwd["gradients"] == ref_bwd["gradients"] and bwd["temporaries"] == ref_bwd["temporaries"]
        assert opt == ref_opt
        recomputed = trace.timeline.category("recomputed")
        assert recomputed[trace.window(step, "forward")].max() == 0
        assert recomputed[trace.window(step, "optimizer")].max() == 0


def test_without_early_stop_full_recomputes_exactly_the_forward_of_every_block(runs):
    _, traces = runs
    none = traces["none"]
    rec = none.allocation_record()
    names = np.array(none.timeline.module_names)[none.timeline.module]
    in_block = np.zeros(len(rec), dtype=bool)
    in_block[rec.sample >= 0] = np.char.startswith(names[rec.sample[rec.sample >= 0]], "blocks.")
    expected = int(rec.bytes[rec.where(step=1, phase="forward", allocations=True) & in_block].sum())
    model = make_model(device="cpu", checkpoint="full", **FOUR)
    with set_checkpoint_early_stop(False):
        trace = track_steps(model, make_optimizer(model), 1, B)
    assert allocated(trace, 1, "backward")["recomputed"] == expected


def test_recomputed_per_module_and_in_the_table(runs):
    _, traces = runs
    for label, where in (("full", 2), ("attention", 3)):
        trace = traces[label]
        i = int(np.argmax(trace.timeline.category("recomputed")))
        by_module = trace.live_by_module(i, depth=where)
        holders = [m for m, cats in by_module.items() if cats["recomputed"]]
        last = FOUR["n_layer"] - 1
        assert holders == ([f"blocks.{last}"] if label == "full" else [f"blocks.{last}.attn"]), holders
        assert sum(c["recomputed"] for c in by_module.values()) == trace.timeline.category("recomputed")[i]
        for ph in trace.phases():  # the table's rows: recomputed bytes only ever in backward
            assert ph.peak.breakdown["recomputed"] == 0 or ph.phase == "backward"
            assert ph.at_end["recomputed"] == 0
    table = traces["full"].table()  # full: the backward peak is during a recomputation
    header, *lines = table.splitlines()
    column = header.index("recomputed")
    assert [line[column : column + 10].strip() for line in lines if " backward " in line][0] != "0.00"


def test_one_recomputation_per_segment(runs):
    _, traces = runs
    for step in (1, 2):
        full, every, attention = (recompute_bumps(traces[k], step) for k in ("full", "every 2", "attention"))
        assert len(full) == len(attention) == FOUR["n_layer"] and len(every) == FOUR["n_layer"] // 2
        assert min(every) > max(full) > max(attention)  # two blocks at once > one block > its attention core
    assert recompute_bumps(traces["none"], 2) == []


# ---- FLOPs -------------------------------------------------------------------------------------------


def flops_by_hand(n_layer, b, s, h, v, r=4):
    """Forward FLOPs from the shapes: 2 * m * n * k per matmul."""
    n = b * s
    block = 2 * n * h * 3 * h + 2 * n * h * h + 2 * n * h * r * h + 2 * n * r * h * h + 2 * (2 * b * s * s * h)
    return n_layer * block + 2 * n * h * v, block, 2 * n * r * h * h, 2 * b * s * s * h


def test_flops_counted_per_policy():
    from anatomy_helpers import get_batch

    L, s, h = SMALL["n_layer"], SMALL["seq_len"], SMALL["d_model"]
    total, block, fc2, bmm = flops_by_hand(L, B, s, h, 59)
    x, y = get_batch(B, s)
    flops = {}
    for p in lineup(every=2):
        model = make_model(device="cpu", **SMALL, **p.config)
        flops[p.label] = (step_flops(model, x, y), step_flops(model, x, y, early_stop=False))
        assert all(q.grad is None for q in model.parameters())
    assert forward_flops(make_model(device="cpu", **SMALL), x, y)["total"]["all"] == total
    assert flops["none"] == (3 * total, 3 * total)  # backward: two matmuls per forward matmul
    extra = {k: (a - 3 * total, b - 3 * total) for k, (a, b) in flops.items()}
    assert extra["offload"] == extra["selective"] == (0, 0)  # selective keeps every matmul's output
    assert extra["full"] == (L * (block - fc2), L * block)  # early stop skips each segment's last matmul
    assert extra["every 2"] == (L * block - fc2, L * block)  # one segment of two blocks
    assert extra["attention"] == (L * bmm, 2 * L * bmm)  # q @ k^T again (and att @ v without early stop)


def test_forward_flops_by_module():
    from anatomy_helpers import get_batch

    x, y = get_batch(B, SMALL["seq_len"])
    by = forward_flops(make_model(device="cpu", **SMALL), x, y)
    _, block, fc2, bmm = flops_by_hand(SMALL["n_layer"], B, SMALL["seq_len"], SMALL["d_model"], 59)
    assert by["blocks.0"]["all"] == block and by["blocks.1.mlp.proj"] == {"addmm": fc2, "all": fc2}
    assert by["blocks.0.attn"]["bmm"] == 2 * bmm


# ---- the table, the front, the timing ------------------------------------------------------------------


def test_rows_match_their_traces(runs):
    rows, traces = runs
    assert [r.label for r in rows] == ["none", "offload", "attention", "selective", "every 2", "full"]
    for r in rows:
        tr = traces[r.label]
        assert r.peak == tr.peak(step=2).bytes and r.peak_phase == tr.peak(step=2).phase
        assert r.activations == tr.phase(2, "forward").at_end["activations"]
        assert r.flop_ratio == r.flops / rows[0].flops
    assert rows[0].flop_ratio == 1.0 and rows[-1].flop_ratio > 1.0
    with pytest.raises(ValueError, match="first policy must be 'none'"):
        measure_policies([Policy("full")], device="cpu", **FOUR)


def test_table_and_time_ratios(runs):
    rows, _ = runs
    text = policy_table(rows)
    assert all(r.label in text for r in rows) and "time ratio" not in text
    with pytest.raises(ValueError, match="no time ratios"):
        plot_pareto(rows)
    seconds = time_policies([r.policy for r in rows[:2]], batch_size=2, warm=0, timed=1, device="cpu", **SMALL)
    assert set(seconds) == {"none", "offload"} and all(t > 0 for t in seconds.values())
    timed = with_time_ratios(rows, {r.label: 1.0 + i for i, r in enumerate(rows)})
    assert [r.time_ratio for r in timed] == [1.0 + i for i in range(len(rows))]
    assert "time ratio" in policy_table(timed)
    assert plot_pareto(timed).axes[0].get_xlabel().startswith("step time")


def test_pareto_front_by_hand():
    assert pareto_front([(1.0, 10), (1.2, 8), (1.1, 12), (1.5, 8), (2.0, 5)]) == [0, 1, 4]
    assert pareto_front([(1.0, 10), (1.0, 10)]) == [0, 1]  # equal points do not beat each other
    assert pareto_front([(1.0, 1)]) == [0]


def test_policy_by_label():
    assert policy_by_label("every 3", lineup(every=3)) == Policy("every_k", 3)
    with pytest.raises(ValueError, match="policy must be one of"):
        policy_by_label("every 2", lineup(every=3))


# ---- what each policy keeps per layer, against Korthikanti et al. ----------------------------------------------


@pytest.fixture(scope="module")
def kept():
    """Per policy: (one layer's comparison, the forward's activations at its end), Korthikanti's setup at a small
    size (bf16, dropout, manual attention; s=32, b=2, h=64, a=4)."""
    out = {}
    for policy in ("none", "attention", "full"):
        model = make_model(device="cpu", checkpoint=policy, **KORTHIKANTI_SETUP, d_model=64, n_head=4, seq_len=32)
        trace, rows, announced = track_kept(model, 2)
        comparisons = [compare_kept(policy, rows, announced, i, 32, 2, 64, 4) for i in range(model.cfg.n_layer)]
        assert all(comp == comparisons[0] for comp in comparisons), policy  # every layer keeps the same
        out[policy] = (comparisons[0], trace.phase(1, "forward").at_end["activations"])
    return out


@pytest.mark.parametrize("policy", ["none", "attention"])
def test_kept_per_layer_term_by_term(kept, policy):
    s, b, h, a = 32, 2, 64, 4
    comparison, _ = kept[policy]
    by = {t.term: t for t in comparison}
    recomputed = ("softmax output", "softmax dropout mask", "dropout output")
    for term, nbytes in korthikanti_terms(s, b, h, a).items():
        expected = 0 if policy == "attention" and term in recomputed else nbytes
        factor = by[term].element_size if "mask" in term and expected else 1  # masks: the dtype's size on CPU
        assert by[term].measured == expected * factor, term
    assert by["Q and K"].measured == 4 * s * b * h and by["V"].measured == 2 * s * b * h  # bf16 views of qkv
    assert by["LayerNorm mean/rstd"].measured == 2 * 2 * s * b * by["LayerNorm mean/rstd"].element_size
    assert by.get("causal mask") is None or by["causal mask"].measured == (s * s if policy == "none" else 0)
    assert "other" not in by


def test_full_keeps_the_block_input_and_nothing_else(kept):
    comparison, _ = kept["full"]
    assert [(t.term, t.formula, t.measured, t.dtype) for t in comparison] == [
        ("block input", 2 * 32 * 2 * 64, 2 * 32 * 2 * 64, "bfloat16")
    ]


def test_kept_layers_account_for_the_forward_activations(kept):
    # what is outside the layers (embeddings, head) is the same under every policy, so the forward's activations
    # differ by exactly n_layer times what one layer keeps
    n_layer = KORTHIKANTI_SETUP["n_layer"]
    layer = {p: sum(t.measured for t in comp) for p, (comp, _) in kept.items()}
    total = {p: acts for p, (_, acts) in kept.items()}
    for policy in ("attention", "full"):
        assert total["none"] - total[policy] == n_layer * (layer["none"] - layer[policy]), policy
    assert "one layer" in kept_table({p: comp for p, (comp, _) in kept.items()})


def test_kept_formula():
    s, b, h, a = 128, 4, 256, 4
    assert sum(kept_formula("none", s, b, h, a).values()) == korthikanti_layer_bytes(s, b, h, a)
    assert sum(kept_formula("attention", s, b, h, a).values()) == 34 * s * b * h
    assert kept_formula("full", s, b, h, a) == {"block input": 2 * s * b * h}
    with pytest.raises(ValueError, match="covers 'none', 'attention' and 'full'"):
        kept_formula("selective", s, b, h, a)


# ---- every k: the sqrt(L) rule -------------------------------------------------------------------------


def test_segments_and_the_count_by_hand():
    assert segment_sizes(7, 3) == [3, 3, 1] and segment_sizes(4, 4) == [4] and segment_sizes(4, 1) == [1] * 4
    # x = 1, A = 10: k=1 -> max(j + 10) = 13; k=2 -> max(0 + 20, 1 + 20) = 21; k=3 on 4 -> max(30, 1 + 10) = 30
    assert [every_k_model(4, k, 1, 10) for k in (1, 2, 3, 4)] == [13, 21, 30, 40]


def test_every_k_sweep_measures_what_counting_predicts():
    sweep = every_k_sweep(6, [1, 2, 3, 4, 6], device="cpu")
    x = 2 * 32 * 32 * 4  # batch 2, seq 32, width 32, fp32
    assert sweep.block_input == x
    assert sweep.measured == [sweep.model(k) for k in sweep.ks]
    assert sweep.best_k == sweep.ks[int(np.argmin(sweep.measured))]
    assert sweep.weighted_rule == pytest.approx((6 * x / sweep.block_activations) ** 0.5)
    assert len(plot_every_k(sweep, k=2).axes) == 1
    with pytest.raises(ValueError, match="from 1 to n_layer"):
        every_k_sweep(4, [0, 2], device="cpu")


def test_every_k_panel(capsys):
    fig = every_k_panel(n_layer=4, k=6, device="cpu")
    out = capsys.readouterr().out
    assert "k = 6 is more than the 4 blocks" in out and "measured minimum at k =" in out and "sqrt(L) = 2.00" in out
    assert fig.axes[0].get_xlabel().startswith("k: blocks per checkpointed segment")


# ---- the peak, the exercise -----------------------------------------------------------------------------


def test_plot_peak_moment(runs):
    _, traces = runs
    fig = plot_peak_moment(traces["full"], step=2)
    assert any("forward ends" in t.get_text() for t in fig.axes[0].texts)


def test_budget_exercise(runs):
    rows, _ = runs
    by = {r.label: r for r in rows}
    budget = (by["selective"].peak + by["attention"].peak) // 2
    assert cheapest_fitting(rows, budget).label == "selective"
    assert cheapest_fitting(rows, 1) is None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert check_policy_choice(None, budget, rows, batch_size=B, device="cpu", **FOUR) is None
        assert check_policy_choice("selective", budget, rows, batch_size=B, device="cpu", **FOUR) is True
        assert check_policy_choice("full", budget, rows, batch_size=B, device="cpu", **FOUR) is False
        assert check_policy_choice("none", budget, rows, batch_size=B, device="cpu", **FOUR) is False
    text = out.getvalue()
    assert "no choice yet" in text and "Well chosen" in text and "does not fit" in text and "fewer extra FLOPs" in text
    with pytest.raises(ValueError, match="policy must be one of"):
        check_policy_choice("sometimes", budget, rows)


@needs_cuda
@pytest.mark.cuda
def test_cuda_peaks_beside_the_tracker():
    from anatomy_helpers.lessons.lesson05_checkpointing import cuda_peaks, format_cuda_peaks

    # A batch whose saved activations outweigh what recomputation adds beside the tensors on a GPU: at batch 4, "full"
    # saved 0.36 MB of tensors, but the allocator held 1.02 MiB beside its tensors against 0.01 MiB under "none" (1.00
    # MiB more, a cuBLASLt workspace's size; H200, torch 2.11), so its peak came out above "none"'s.
    rows = cuda_peaks([Policy("none"), Policy("full"), Policy("offload")], batch_size=8 * B, **SMALL)
    print(format_cuda_peaks(rows))
    for r in rows:
        assert r.tracked <= r.allocated
    by = {r.label: r for r in rows}
    assert by["full"].allocated < by["none"].allocated and by["offload"].allocated < by["none"].allocated
    assert "max_memory_allocated" in format_cuda_peaks(rows)


# ---- the plotted data against what each figure claims (tests/figure_data.py reads a figure back) ----


def test_the_pareto_plot_puts_each_policy_at_its_time_and_peak_and_draws_the_front_through_the_unbeaten(runs):
    from .figure_data import line, unit_bytes

    rows, _ = runs
    timed = with_time_ratios(rows, {r.label: 1.0 + 0.1 * i for i, r in enumerate(rows)})  # made-up, distinct times
    ax = plot_pareto(timed).axes[0]
    scale = unit_bytes(ax.get_ylabel())
    dots = [(ln.get_xdata()[0], ln.get_ydata()[0] * scale) for ln in ax.get_lines() if ln.get_marker() == "o"]
    assert dots == [(r.time_ratio, pytest.approx(r.peak)) for r in timed]
    labels = {tuple(t.xy): t.get_text() for t in ax.texts}
    assert sorted(", ".join(sorted(v.split(", "))) for v in labels.values()) == sorted(r.label for r in timed)
    # the front: every policy no other is at least as fast and as small as (found here by comparing all pairs)
    unbeaten = [
        r for r in timed
        if not any(o.time_ratio <= r.time_ratio and o.peak <= r.peak and o is not r for o in timed)
    ]  # fmt: skip
    front = line(ax, "Pareto front")
    drawn = sorted(zip(front.get_xdata(), front.get_ydata() * scale))
    assert drawn == [(r.time_ratio, pytest.approx(r.peak)) for r in sorted(unbeaten, key=lambda r: r.time_ratio)]


def test_the_peak_moment_marks_where_the_forward_ends(runs):
    from .figure_data import vertical_lines

    _, traces = runs
    trace = traces["full"]
    fig = plot_peak_moment(trace, step=2)
    forward_end = trace.window(2, "forward")[-1]  # the last memory event of step 2's forward
    assert forward_end in vertical_lines(fig.axes[0])
    [note] = [t for t in fig.axes[0].texts if "forward ends" in t.get_text()]
    assert note.get_position()[0] == forward_end


def test_the_every_k_plot_draws_the_measured_bytes_the_count_and_the_two_rules():
    import math

    from .figure_data import line, unit_bytes, vertical_lines

    sweep = every_k_sweep(6, [1, 2, 3, 6], device="cpu")
    ax = plot_every_k(sweep, k=2).axes[0]
    scale = unit_bytes(ax.get_ylabel())
    measured = line(ax, "measured")
    assert list(measured.get_xdata()) == [1, 2, 3, 6]
    assert list(measured.get_ydata() * scale) == pytest.approx(sweep.measured)
    counted = line(ax, "counted")  # (L/k) x + k A + the position ids, at every k from 1 to L
    x, a = sweep.block_input, sweep.block_activations
    assert list(counted.get_ydata() * scale) == pytest.approx(
        [every_k_model(6, k, x, a) + sweep.constant for k in range(1, 7)]
    )
    best = min(range(4), key=lambda i: sweep.measured[i])
    [low] = [ln for ln in ax.get_lines() if ln.get_label().startswith("measured minimum")]
    assert (low.get_xdata()[0], low.get_ydata()[0] * scale) == ([1, 2, 3, 6][best], pytest.approx(sweep.measured[best]))
    assert sorted(vertical_lines(ax)) == pytest.approx(sorted([math.sqrt(6), math.sqrt(6 * x / a), 2]))
