"""Lesson helpers that notebooks 06 and 08 print, checked on hand-made inputs (expected lines worked out here) and
on small real runs: compare_methods, methods_table, sweep_table, textbook_comparison, precision_table, formula_gaps.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from anatomy_helpers.core.model import GPT, ModelConfig
from anatomy_helpers.lessons.lesson06_prediction import (
    MethodComparison,
    compare_methods,
    methods_table,
    sweep_table,
    textbook_comparison,
    textbook_table,
)
from anatomy_helpers.lessons.lesson08_scaling import FormulaGap, formula_gaps, precision_table
from anatomy_helpers.prediction.estimate import n_param_tensors

from .conftest import SMALL
from .test_trace_oracles import hand_trace

MiB = 2**20
PHASES3 = ("forward", "backward", "optimizer")


def comparison(label: str, measured: list[float], dry: list[float], closed: list[float]) -> MethodComparison:
    """A MethodComparison from six values (MiB) per method, step 1's three phases then step 2's."""
    keys = [(s, p) for s in (1, 2) for p in PHASES3]
    as_bytes = lambda xs: {k: int(x * MiB) for k, x in zip(keys, xs)}  # noqa: E731
    return MethodComparison(label, as_bytes(measured), as_bytes(dry), as_bytes(closed), 0.5)


HAND = comparison("toy", [4, 8, 6, 5, 10, 7], [4, 8, 6, 5, 10, 7], [4, 8, 6.25, 5, 10.5, 7])


def test_methods_table_by_hand():
    rows = [line.split() for line in methods_table(HAND).splitlines()[2:]]
    assert rows == [
        ["1", "forward", "4.000", "4.000", "4.000", "+0.00%"],
        ["1", "backward", "8.000", "8.000", "8.000", "+0.00%"],
        ["1", "optimizer", "6.000", "6.000", "6.250", "+4.17%"],  # 0.25 / 6
        ["2", "forward", "5.000", "5.000", "5.000", "+0.00%"],
        ["2", "backward", "10.000", "10.000", "10.500", "+5.00%"],  # 0.5 / 10
        ["2", "optimizer", "7.000", "7.000", "7.000", "+0.00%"],
    ]


def test_sweep_table_by_hand():
    low = comparison("low", [2, 3, 1, 2, 3, 1], [2, 3, 1, 2, 3, 1], [2, 2.5, 1, 2, 2.7, 1])
    lines = sweep_table([HAND, low]).splitlines()
    assert lines[0].split()[:5] == ["config", "measured", "dry", "run", "closed"]
    # the step peak of each method (both steps): 10 measured, 10.5 closed (+5 %); 3 and 2.7 (-10 %)
    assert lines[2].split() == ["toy", "10.00", "10.00", "10.50", "+5.00%"]
    assert lines[3].split() == ["low", "3.00", "3.00", "2.70", "-10.00%"]
    assert HAND.peaks == (10 * MiB, 10 * MiB, int(10.5 * MiB)) and low.closed_form_error == pytest.approx(-0.1)


def test_compare_methods_on_a_small_model():
    cfg = ModelConfig(**SMALL)
    got = compare_methods(cfg, batch_size=2, optimizer="sgd", label="small")
    assert got.label == "small" and list(got.measured) == [(s, p) for s in (1, 2) for p in PHASES3]
    assert got.dry_run == got.measured  # a dry run is the measurement byte for byte (kernel scratch off)
    assert got.closed_form == got.measured  # SGD: no Adam step counters, so every phase to the byte
    # the measured step peak is at least the model states and the batch: parameters + gradients + the int64 batch
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())
    assert got.peaks[0] > 2 * 4 * n + 2 * 2 * SMALL["seq_len"] * 8


def test_textbook_comparison_on_the_hand_made_trace():
    """The measured side is read from the trace: the parameters at the start (10 MiB), the model states at step 2's
    optimizer peak (10 + 4 MiB: its gradients were let go in this design), the activations at the end of step 1's
    forward (4 MiB) and the trace's peak (20 MiB)."""
    cfg = ModelConfig(**SMALL)
    rows = textbook_comparison(cfg, 4, hand_trace())
    assert [(r.rule, r.measured) for r in rows] == [
        ("weights only", 10 * MiB),
        ("model states (P + G + O)", 14 * MiB),
        ("activations (Korthikanti)", 4 * MiB),
        ("16 B/param + Korthikanti", 20 * MiB),
    ]
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())
    s, b, h, a = SMALL["seq_len"], 4, SMALL["d_model"], SMALL["n_head"]
    korthikanti = SMALL["n_layer"] * (34 * s * b * h + 5 * a * s * s * b)
    assert [r.textbook for r in rows] == [4 * n, 16 * n + 4 * n_param_tensors(cfg), korthikanti, 16 * n + korthikanti]
    assert "ours are fp32" in rows[2].why and "no dropout here" in rows[2].why
    table = textbook_table(rows).splitlines()
    assert table[2].split()[:3] == ["weights", "only", f"{4 * n / MiB:.2f}"]


def _rank(strategy, n_params, world_size, numel_bytes, padded_bytes, states, measured, comm):
    """A stand-in for a RankResult with only the fields formula_gaps reads."""
    timeline = SimpleNamespace(category=lambda name: np.array(comm if name == "communication" else [0]))
    return SimpleNamespace(
        strategy=strategy,
        rank=1,
        n_params=n_params,
        world_size=world_size,
        torch_param_numel_bytes=numel_bytes,
        torch_param_bytes=padded_bytes,
        torch_state_by_key=states,
        torch_state_bytes=sum(states.values()),
        model_states=measured,
        trace=SimpleNamespace(timeline=timeline),
    )


def test_formula_gaps_by_hand():
    # ZeRO-3 over 2 ranks of 1001 parameters: the formula's share is 2002 B of parameters and 4004 B of state.
    # This rank holds 500 rows (2000 B: 2 B under the share), padded to 501 (4 B of padding), 256 B of buffers;
    # Adam's three 4-byte step counters and 2 x 2000 B of moments (4 B under the share).
    zero3 = _rank(
        "fsdp2_zero3", 1001, 2, 2000, 2004, {"step": 12, "exp_avg": 2000, "exp_avg_sq": 2000},
        {"parameters": 2002 + 256 - 2 + 4, "optimizer_state": 4004 + 12 - 4}, [0, 300, 100],
    )  # fmt: skip
    # DDP: whole parameters (4004 B), nothing split or padded; the full state
    ddp = _rank(
        "ddp", 1001, 2, 4004, 4004, {"step": 12, "exp_avg": 4004, "exp_avg_sq": 4004},
        {"parameters": 4004 + 256, "optimizer_state": 8008 + 12}, [0, 50],
    )  # fmt: skip
    gaps = formula_gaps({"fsdp2_zero3": [zero3], "ddp": [ddp]}, buffers=256)
    assert gaps == [
        FormulaGap("fsdp2_zero3", 1, 258, 256, -2, 4, 0, 8, 4004, 12, -4, 300),
        FormulaGap("ddp", 1, 256, 256, 0, 0, 0, 12, 8008, 12, 0, 50),
    ]
    assert gaps[0].optimizer_relative == pytest.approx(8 / 4004)
    ddp.model_states = {"parameters": 4004 + 255, "optimizer_state": 8020}  # a byte nobody can explain
    with pytest.raises(AssertionError, match="do not add up"):
        formula_gaps({"ddp": [ddp]}, buffers=256)


def test_precision_table_bytes_per_parameter():
    """Just before step 2's optimizer: fp32 (also under autocast) keeps 4 B of parameter, 4 of gradient and two
    4-byte Adam moments per parameter; pure bf16 2, 2 and two 2-byte moments. Adam's 4-byte step counter per tensor
    comes on top of the state."""
    config = dict(n_layer=1, d_model=32, n_head=2, seq_len=16)
    rows = {r.setup: r for r in precision_table(batch_size=2, device="cpu", **config)}
    cfg = ModelConfig(**config)
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())
    counters = 4 * n_param_tensors(cfg) / n
    for setup, e in (("fp32", 4), ("fp32 + autocast bf16", 4), ("pure bf16", 2)):
        r = rows[setup]
        assert (r.parameters, r.gradients) == (e, e), setup
        assert r.optimizer_state == pytest.approx(2 * e + counters), setup
    assert rows["fp32"].saved_16bit == 0.0 and 0 < rows["fp32 + autocast bf16"].saved_16bit < 1
    assert rows["pure bf16"].activations < rows["fp32"].activations


def test_measure_world_runs_one_world_for_one_set_of_arguments_however_they_are_passed(monkeypatch):
    from anatomy_helpers.lessons import lesson08_scaling as scaling

    worlds = []

    def fake_run_world(jobs, world_size, backend, timeout_s):
        worlds.append((world_size, tuple(j.strategy for j in jobs), jobs[0].micro_batches, backend))
        return {"world": len(worlds)}

    monkeypatch.setattr(scaling, "run_world", fake_run_world)
    scaling._measured_world.cache_clear()
    try:
        first = scaling.measure_world(2)  # the lesson's call
        assert scaling.measure_world(2, 1) is first  # the panel's
        assert scaling.measure_world(world_size=2, strategies=list(scaling.STRATEGIES)) is first
        assert scaling.measure_world(2, 2) is not first  # other micro-batches: another world
        assert scaling.measure_world(4, strategies=("zero1",)) == {"world": 3}
    finally:
        scaling._measured_world.cache_clear()  # no fake world left for a later test
    assert worlds == [(2, tuple(scaling.STRATEGIES), 1, "gloo"), (2, tuple(scaling.STRATEGIES), 2, "gloo"),
                      (4, ("zero1",), 1, "gloo")]  # fmt: skip
