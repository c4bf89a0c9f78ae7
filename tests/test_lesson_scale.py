"""Notebook 11's helpers (lessons/lesson11_scale.py): the per-rank rows, what shrinks with N, the TP totals against the
paper's closed forms, and the synchronization model's straggler tail added without dry-running again."""

import dataclasses

import pytest

from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.distributed.fake_world import WorldRow, model_states_rule
from anatomy_helpers.distributed.sync_model import ASSUMPTIONS, LINKS
from anatomy_helpers.distributed.tensor_parallel import korthikanti_tp_terms, layer_parts, tp_dry_run
from anatomy_helpers.lessons.lesson11_scale import (
    CATEGORIES,
    format_assumptions,
    format_gathers,
    format_priced,
    format_shrink,
    format_step_times,
    format_tp_totals,
    fsdp_gathers,
    per_rank_rows,
    shrink_factors,
    sync_curves,
    tp_layers,
    tp_totals,
    with_stragglers,
)

from .conftest import SMALL

TP_SMALL = ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, dropout=0.1, dtype="bfloat16")


def row(strategy: str, n: int, **sizes) -> WorldRow:
    values = dict(parameters=0, gradients=0, optimizer_state=0, activations=0, communication_peak=1) | sizes
    return WorldRow(strategy, n, 0, **values, peak=0, formula_model_states=1.0, rule_model_states=0,
                    seconds=0.0)  # fmt: skip


def test_per_rank_rows_dry_run_each_strategy_at_its_world_sizes_to_the_rules():
    rows = per_rank_rows(SMALL, (2, 8), (4,))
    assert [(r.strategy, r.world_size) for r in rows] == [("ddp", 2), ("ddp", 8), ("zero1", 2), ("zero1", 8),
                                                          ("fsdp2_zero3", 4)]  # fmt: skip
    for r in rows:
        rule = model_states_rule(SMALL, r.strategy, r.world_size, 0)
        assert (r.parameters, r.gradients, r.optimizer_state) == tuple(rule.values())


def test_shrink_factors_divide_the_smallest_ns_bytes_by_the_largest_ns():
    rows = [
        row("a", 64, parameters=10, gradients=4, optimizer_state=8, activations=6, communication_peak=8),
        row("a", 2, parameters=640, gradients=8, optimizer_state=8, activations=6, communication_peak=2),
        row("b", 8, parameters=3, gradients=3, optimizer_state=3, activations=3),
        row("b", 4, parameters=6, gradients=3, optimizer_state=9, activations=3),
    ]
    factors = shrink_factors(rows)
    assert factors == {
        "a": {
            "parameters": 64.0,
            "gradients": 2.0,
            "optimizer_state": 1.0,
            "activations": 1.0,
            "communication_peak": 0.25,
        },
        "b": {
            "parameters": 2.0,
            "gradients": 1.0,
            "optimizer_state": 3.0,
            "activations": 1.0,
            "communication_peak": 1.0,
        },
    }
    table = format_shrink(rows)
    assert "2->64" in table and "4->8" in table and "64.0" in table and "comm peak" in table and "0.2" in table
    with pytest.raises(ValueError, match="two world sizes"):
        shrink_factors(rows[:1])
    assert set(CATEGORIES) == set(next(iter(factors.values())))


def test_tp_totals_are_the_papers_closed_forms_plus_the_named_gaps():
    layers = tp_layers(TP_SMALL, ((1, False), (2, True)), batch_size=2)
    totals = tp_totals(layers, TP_SMALL, batch_size=2)
    s, b, h, a = 16, 2, 32, 2
    for r in totals:
        t, sp = r["t"], r["sequence_parallel"]
        assert r["formula"] == pytest.approx(sum(korthikanti_tp_terms(s, b, h, a, t, sp).values()), rel=1e-12)
        assert r["unexplained"] == 0 and r["known_gap"] > 0  # masks in 2 bytes, the causal mask, LN statistics
    one = sum(layer_parts(tp_dry_run(TP_SMALL, 1, batch_size=2).trace).values())
    assert totals[0]["measured"] == one
    assert totals[1]["measured"] < one  # two ranks with sequence parallelism keep less than one
    assert "Korthikanti" in format_tp_totals(totals)


def test_with_stragglers_adds_the_tail_step_time_would_have_added():
    jitter = [0.8, 1.0, 1.0, 1.3, 2.0]
    sizes = {"ddp": (2, 16)}
    kwargs = dict(rows_per_rank=1, peak_flops=1e12, link=LINKS["ethernet100"])
    plain = sync_curves(SMALL, sizes, **kwargs)
    direct = sync_curves(SMALL, sizes, jitter=jitter, **kwargs)
    added = with_stragglers(plain, jitter)
    for a, d, p in zip(added["ddp"], direct["ddp"], plain["ddp"]):
        assert p.straggler == 0.0
        assert a.straggler == pytest.approx(d.straggler, rel=1e-12) and a.step == pytest.approx(d.step, rel=1e-12)
        assert dataclasses.replace(a, straggler=0.0, step=p.step) == p  # nothing else changed
    assert added["ddp"][1].straggler > added["ddp"][0].straggler > 0  # the slowest of 16 is slower than of 2
    table = format_step_times(added)
    assert table.count("\nddp") == 2 and "modelled" in table


def test_format_assumptions_prints_every_assumption_and_the_inputs():
    text = format_assumptions(peak_flops=100e12, utilisation=0.5, link=LINKS["ethernet100"])
    assert all(a in text for a in ASSUMPTIONS)
    assert "100 TFLOP/s peak at 50% utilisation" in text and "12.5 GB/s" in text and "10 us" in text


def test_format_priced_groups_each_steps_collectives_by_group_and_op():
    from anatomy_helpers.core.units import MiB
    from anatomy_helpers.distributed.ranks import Collective
    from anatomy_helpers.distributed.sync_model import price_step

    def coll(phase, op, nbytes):
        return Collective(0, 0.0, 1, phase, op, nbytes)

    colls = [coll("forward", "all_reduce", MiB)] * 2 + [coll("backward", "_reduce_scatter_base_", MiB // 8)] * 3
    step = price_step(colls, 64, forward=1.0, backward=1.0, tp=8)
    table = format_priced({"mesh": step})
    rows = [" ".join(line.split()) for line in table.splitlines()[2:]]
    tp, rs = step.priced[:2], step.priced[2:]  # the table sums each group: priced collective by collective

    def ms(ps, what):
        return f"{sum(getattr(p, what) for p in ps) * 1e3:,.3f}"

    # the two TP all-reduces: 2 MiB on 8 ranks; the 3 reduce-scatters: 8 x their 1/8 MiB shards each, on 8 nodes
    assert rows == [
        f"mesh 64 TP (one node) all-reduce 2 8 2.0 {ms(tp, 'seconds')} {ms(tp, 'latency')}",
        f"mesh 64 data-parallel reduce-scatter 3 8 3.0 {ms(rs, 'seconds')} {ms(rs, 'latency')}",
    ]


def test_fsdp_gathers_pad_each_parameter_to_n_chunks_of_ceil_rows_over_n():
    """By hand from the shapes: block 0 of a model with d_model 16 has parameters of 16 (the LayerNorms, attn.proj,
    mlp.proj and their biases), 48 (qkv) and 64 (fc) rows; an all-gather carries N x ceil(rows / N) rows of each."""
    model = dict(n_layer=1, d_model=16, n_head=2, seq_len=8)
    # (rows, bytes of one row) of block 0's parameters, fp32
    shapes = [(16, 4), (16, 4), (48, 64), (48, 4), (16, 64), (16, 4), (16, 4), (16, 4), (64, 64), (64, 4)]
    shapes += [(16, 256), (16, 4)]
    own = sum(r * b for r, b in shapes)
    rows = fsdp_gathers(model, (8, 16, 32, 128))
    for g in rows:
        n = g.world_size
        assert g.block_bytes == own and g.fewest_rows == 16
        assert g.gathered == sum(n * -(-r // n) * b for r, b in shapes)
    assert [g.padding for g in rows][:2] == [0, 0] and rows[2].padding > 0  # 32 does not divide 16 or 48
    assert rows[3].gathered == 128 * sum(b for _, b in shapes)  # past every row count: one row per rank
    assert "x block" in format_gathers(rows)


# ---- the panel -----------------------------------------------------------------------------------------------------

D128, D1024 = "lesson 08's GPT (d_model 128)", "section 3's GPT (d_model 1024)"


def drawn_bars(ax) -> dict[float, list[float]]:
    """{bar's y: the widths of its segments, left to right} of a horizontal bar chart."""
    bars: dict[float, list[tuple[float, float]]] = {}
    for p in ax.patches:
        bars.setdefault(round(p.get_y() + p.get_height() / 2, 6), []).append((p.get_x(), p.get_width()))
    return {y: [w for _, w in sorted(parts)] for y, parts in bars.items()}


@pytest.mark.parametrize("model, strategy, world_size", [(D128, "ddp", 16), (D1024, "zero1", 8), (D128, "tp_fsdp", 8)])
def test_scale_panel_draws_and_prints_what_the_engines_compute(capsys, model, strategy, world_size):
    from anatomy_helpers.core.units import pick_unit
    from anatomy_helpers.distributed.fit import FIGURES, dry_run_memory, format_fit_table
    from anatomy_helpers.distributed.sync_model import scaling_curve
    from anatomy_helpers.lessons.lesson11_panel import PANEL_MODELS, scale_panel, scale_setting
    from anatomy_helpers.lessons.lesson11_scale import LINK, PEAK_FLOPS, TP_LINK, UTILISATION
    from anatomy_helpers.tracking.events import CATEGORIES as CATEGORIES_TRACKED

    scale_setting.cache_clear()
    fig = scale_panel(model, strategy, world_size)
    printed = capsys.readouterr().out
    spec = PANEL_MODELS[model]
    tp = spec.tp if strategy == "tp_fsdp" else 1
    # the engines, called here: the same global batch (rows per GPU x N) for the dry run and the step model
    memory = dry_run_memory(spec.short, spec.config, strategy, world_size, tp, spec.rows_per_rank * tp)
    network = dict(tp=tp, tp_link=TP_LINK) if tp > 1 else {}
    (step,) = scaling_curve(spec.config, strategy, [world_size], rows_per_rank=spec.rows_per_rank,
                            peak_flops=PEAK_FLOPS, utilisation=UTILISATION, link=LINK, **network)  # fmt: skip
    setting = scale_setting(model, strategy, world_size)
    assert setting.memory == memory and setting.step == step
    assert format_fit_table([memory], device_bytes=None, unit="KiB" if memory.peak < 2**31 else "GiB") in printed
    assert format_step_times({memory.label: [step]}, note_below=True) in printed
    assert max(len(line) for line in printed.splitlines()) <= 104  # the panel's output is about 105 characters wide
    assert fig.panel_used == {"model": model, "strategy": strategy, "world_size": world_size}
    assert fig.panel_numbers == tuple(getattr(memory, f) for f in FIGURES) + (
        step.step, step.communication, step.exposed)  # fmt: skip
    left, right = fig.axes
    scale = pick_unit(memory.peak)[1]
    bars = drawn_bars(left)
    ys = sorted(bars, reverse=True)  # top to bottom: the five categories, then the peak by category
    fields = ("parameters", "gradients", "optimizer_state", "activations", "communication_peak")
    assert [bars[y] for y in ys[:5]] == [[pytest.approx(getattr(memory, f) / scale, rel=1e-12)] for f in fields]
    assert sum(bars[ys[5]]) == pytest.approx(memory.peak / scale, rel=1e-12)
    stacked = [setting.peak.breakdown[c] / scale for c in CATEGORIES_TRACKED if setting.peak.breakdown.get(c)]
    assert bars[ys[5]] == pytest.approx(stacked, rel=1e-12)  # left to right in the course's category order
    times = drawn_bars(right)
    assert sum(times[1.0]) == pytest.approx(step.step * 1e3, rel=1e-12)  # forward, backward, exposed: the step
    assert sum(times[0.0]) == pytest.approx(step.communication * 1e3, rel=1e-12)  # exposed + hidden: every collective
    assert times[1.0][:2] == [pytest.approx(step.forward * 1e3), pytest.approx(step.backward * 1e3)]
    assert fig._suptitle.get_text() and left.get_xlabel().endswith("iB)") and right.get_xlabel().endswith("(ms)")
    assert fig.legends  # the categories and the step's parts named


def test_scale_panel_reports_the_model_its_dry_run_built_not_the_one_asked_for(monkeypatch):
    from anatomy_helpers.lessons import lesson11_panel

    models = list(lesson11_panel.PANEL_MODELS.values())
    other = {m.config["d_model"]: o.config for m, o in zip(models, reversed(models))}
    real = lesson11_panel.rank_job

    def swapped(model, *args):  # a panel that silently builds the other model
        return real(other[model["d_model"]], *args)

    lesson11_panel.scale_setting.cache_clear()
    monkeypatch.setattr(lesson11_panel, "rank_job", swapped)
    try:
        fig = lesson11_panel.scale_panel(D128, "ddp", 8)
    finally:
        lesson11_panel.scale_setting.cache_clear()
    assert fig.panel_used == {"model": D1024, "strategy": "ddp", "world_size": 8}


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(model="70B"), "model"),
        (dict(strategy="fsdp2_zero2"), "strategy"),
        (dict(strategy="tp"), "strategy"),
        (dict(world_size=4096), "world_size"),
        (dict(world_size=2), "world_size"),
        (dict(world_size=8.0), "world_size"),
        (dict(world_size=True), "world_size"),
        (dict(world_size="8"), "world_size"),
    ],
)
def test_scale_panel_refuses_a_setting_it_does_not_offer_by_name(kwargs, named):
    from anatomy_helpers.lessons.lesson11_panel import scale_panel

    with pytest.raises(ValueError, match=f"^{named} must be one of"):
        scale_panel(**kwargs)
