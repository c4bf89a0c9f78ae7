import json

import pytest

from anatomy_helpers.core.units import MiB
from anatomy_helpers.ui.exercises import (
    AUTORUN_ENV,
    STOP_TEXT,
    PredictionNeeded,
    check_prediction,
    require_prediction,
)


def test_close_prediction_is_accepted(capsys):
    v = check_prediction("activations", 10.5, 10 * 2**20, unit="MiB")
    assert v.ok and v.relative_error == pytest.approx(0.05)
    out = capsys.readouterr().out
    assert "off by 5.0%" in out and "measured 10 MiB" in out and "Well reasoned" in out


def test_far_prediction_is_rejected_with_distance(capsys):
    v = check_prediction("gradients", 2.0, 1 * 2**20, unit="MiB", tolerance=0.2)
    assert not v.ok and v.relative_error == pytest.approx(1.0)
    assert "outside the 20% tolerance" in capsys.readouterr().out


def test_missing_prediction_does_not_reveal_the_answer(capsys):
    v = check_prediction("peak", None, 123_456_789, unit="MiB")
    out = capsys.readouterr().out
    assert not v.ok and "no prediction yet" in out and "117.7" not in out
    assert "the measured value is revealed" in out  # the wording lessons 06-11 store: unchanged


def test_ratio_units_and_bad_units():
    assert check_prediction("ratio", 2, 2.1, unit="x").ok
    with pytest.raises(ValueError, match="unit must be one of"):
        check_prediction("peak", 1, 1, unit="MB")


def test_a_count_is_asked_in_words(capsys):
    check_prediction("segments", None, 3, unit="count", tolerance=0)
    assert "(in a plain count)" in capsys.readouterr().out
    assert not check_prediction("segments", 2, 3, unit="count", tolerance=0).ok
    assert check_prediction("segments", 3, 3, unit="count", tolerance=0).ok
    assert "exact answer" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("source", "said"),
    [("measured", "measured 6 MiB"), ("dry run", "the dry run gives 6 MiB"), ("formula", "the formula gives 6 MiB")],
)
def test_the_verdict_names_the_kind_of_number(capsys, source, said):
    v = check_prediction("peak", 6, 6 * MiB, source=source)
    out = capsys.readouterr().out
    assert said in out and v.source == source
    if source != "measured":
        assert "measured" not in out  # a dry run's or a formula's value is not called measured
    check_prediction("peak", None, 6 * MiB, source=source)
    assert "revealed" in capsys.readouterr().out


def test_an_unknown_source_is_refused():
    with pytest.raises(ValueError, match="source must be one of"):
        check_prediction("peak", 1, MiB, source="simulated")


# 01's exercise 3: the plain formula gives 5.50 MiB where the measurement is 6.02 MiB (8.6 % off): the lesson is
# the difference, so a 3 % tolerance and the formula named as the common wrong answer.
PLAIN = {"that is the plain formula: it misses the 2-byte dropout masks": 5.5 * MiB}


def test_a_tight_tolerance_refuses_the_small_difference_the_lesson_is_about():
    assert check_prediction("bf16 layer", 5.5, 6.02 * MiB).ok  # the default 10 % would grade the formula right
    assert not check_prediction("bf16 layer", 5.5, 6.02 * MiB, tolerance=0.03).ok
    assert check_prediction("bf16 layer", 6.0, 6.02 * MiB, tolerance=0.03).ok


def test_a_common_wrong_answer_gets_its_own_message(capsys):
    v = check_prediction("bf16 layer", 5.45, 6.02 * MiB, tolerance=0.03, mistakes=PLAIN)
    out = capsys.readouterr().out
    assert not v.ok and v.mistake == next(iter(PLAIN))
    assert "common wrong answer: that is the plain formula" in out and "Look again" not in out


def test_a_wrong_answer_far_from_every_mistake_gets_the_distance(capsys):
    v = check_prediction("bf16 layer", 3.0, 6.02 * MiB, tolerance=0.03, mistakes=PLAIN)
    out = capsys.readouterr().out
    assert not v.ok and v.mistake is None and "off by 50.2%" in out and "Look again at what the measurement" in out


def test_the_nearest_mistake_wins_and_a_right_answer_is_right():
    mistakes = {"missed A": 10 * MiB, "missed B": 10.5 * MiB}
    # 10.4 is within 10 % of both wrong answers (and 14.8 % off the right 12.2): the nearer one names it
    assert check_prediction("x", 10.4, 12.2 * MiB, tolerance=0.1, mistakes=mistakes).mistake == "missed B"
    # 11.4 is 6.6 % off the right answer: right, though it is also within 10 % of "missed B"
    v = check_prediction("x", 11.4, 12.2 * MiB, tolerance=0.1, mistakes=mistakes)
    assert v.ok and v.mistake is None


def test_a_mistake_nearer_the_right_answer_than_the_prediction_does_not_match():
    # 8.9 is 11.25 % off the right 8 and 9.6 % off the wrong 9.85, but nearer the right one: no specific message
    v = check_prediction("x", 8.9, 8.0 * MiB, tolerance=0.1, mistakes={"missed A": 9.85 * MiB})
    assert not v.ok and v.mistake is None


@pytest.mark.parametrize(
    ("mistakes", "match"),
    [
        ([5.5 * MiB], "mapping"),
        ({"": 5.5 * MiB}, "non-empty string"),
        ({"plain": "5.5"}, "finite number"),
        ({"plain": float("nan")}, "finite number"),
        ({"too near": 6.0 * MiB}, "within the 3% tolerance of the right one"),
    ],
)
def test_bad_mistakes_are_refused(mistakes, match):
    with pytest.raises(ValueError, match=match):
        check_prediction("bf16 layer", 5.5, 6.02 * MiB, tolerance=0.03, mistakes=mistakes)


@pytest.mark.parametrize("predicted", ["5.5", "5.5 MiB", float("inf"), True])
def test_a_prediction_that_is_not_a_number_is_refused(predicted):
    with pytest.raises(ValueError, match="must be a plain number"):
        check_prediction("peak", predicted, MiB)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), True, [5]])
def test_require_prediction_refuses_what_is_neither_a_number_nor_a_name(value):
    with pytest.raises(ValueError, match="must be a plain number"):
        require_prediction(value, "peak")


def test_require_prediction_passes_a_choice_by_name(monkeypatch):
    monkeypatch.delenv(AUTORUN_ENV, raising=False)
    assert require_prediction("selective", "the cheapest policy") == "selective"  # lesson 05's choice
    with pytest.raises(ValueError, match="non-empty name"):
        require_prediction("  ", "the cheapest policy")


@pytest.mark.parametrize("tolerance", [-0.1, 1.0, "0.1"])
def test_a_bad_tolerance_is_refused(tolerance):
    with pytest.raises(ValueError, match="tolerance must be"):
        check_prediction("peak", 1, MiB, tolerance=tolerance)


def test_the_suite_runs_unattended():
    import os

    assert os.environ.get(AUTORUN_ENV) == "1"  # the root conftest.py: nbval's kernels inherit it


def test_require_prediction_stops_a_run_without_a_number(monkeypatch):
    monkeypatch.delenv(AUTORUN_ENV, raising=False)
    with pytest.raises(PredictionNeeded, match=STOP_TEXT) as caught:
        require_prediction(None, "peak")
    assert caught.value._render_traceback_() == [f"Stopped here: peak: {STOP_TEXT}."]  # no stack: nothing broke
    assert require_prediction(5, "peak") == 5.0
    monkeypatch.setenv(AUTORUN_ENV, "0")  # "0" is not set
    with pytest.raises(PredictionNeeded):
        require_prediction(None, "peak")
    monkeypatch.setenv(AUTORUN_ENV, "1")
    assert require_prediction(None, "peak") is None
    with pytest.raises(ValueError, match="name must be"):
        require_prediction(1, "")


def test_run_all_in_a_kernel_stops_at_the_prediction_and_shows_only_the_message(tmp_path, monkeypatch):
    """A real kernel, as JupyterLab's Run All drives it: the cell raising stops the run before the answer."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.delenv(AUTORUN_ENV, raising=False)  # the kernel inherits the environment: a learner's
    cells = [
        "from anatomy_helpers.ui.exercises import require_prediction",
        "my_prediction_mib = None\nrequire_prediction(my_prediction_mib, 'peak')\nprint('the answer is 42')",
        "print('the next answer')",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": "."}})
    with pytest.raises(nbclient.exceptions.CellExecutionError):
        client.execute()
    stopped, after = nb.cells[1], nb.cells[2]
    [error] = stopped.outputs
    assert error.output_type == "error" and error.ename == "PredictionNeeded"
    assert error.traceback == [f"Stopped here: peak: {STOP_TEXT}."]
    assert "42" not in json.dumps(stopped.outputs) and after.outputs == [] and after.execution_count is None
