import pytest

from anatomy_helpers.ui.exercises import check_prediction


def test_close_prediction_is_accepted(capsys):
    v = check_prediction("activations", 10.5, 10 * 2**20, unit="MiB")
    assert v.ok and v.relative_error == pytest.approx(0.05)
    assert "off by 5.0%" in capsys.readouterr().out


def test_far_prediction_is_rejected_with_distance(capsys):
    v = check_prediction("gradients", 2.0, 1 * 2**20, unit="MiB", tolerance=0.2)
    assert not v.ok and v.relative_error == pytest.approx(1.0)
    assert "outside the 20% tolerance" in capsys.readouterr().out


def test_missing_prediction_does_not_reveal_the_answer(capsys):
    v = check_prediction("peak", None, 123_456_789, unit="MiB")
    out = capsys.readouterr().out
    assert not v.ok and "no prediction yet" in out and "117.7" not in out


def test_ratio_units_and_bad_units():
    assert check_prediction("ratio", 2, 2.1, unit="x").ok
    with pytest.raises(ValueError, match="unit must be one of"):
        check_prediction("peak", 1, 1, unit="MB")
