import pytest

from anatomy_helpers.cli import main

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "2", "--device", "cpu"]


def test_cli_prints_table_and_writes_png(tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main([*TINY, "--steps", "2", "--optimizer", "sgd", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "parameters" in printed.out and "activations" in printed.out
    assert "peak:" in printed.out and "step 2" in printed.out
    assert "step 2/2" in printed.err  # progress
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "must be positive"),
        (["--heads", "3"], "divisible by n_head"),
        (["--optimizer", "lion"], "invalid choice"),
        (["--attn", "flash"], "invalid choice"),
        (["--layers", "two"], "expected a whole number"),
        (["--dropout", "2"], "dropout"),
        (["--dropout", "nan"], "ModelConfig.dropout"),
        (["--seed", "-1"], "--seed: must be in [0, 2**32)"),
        (["--seed", str(2**32)], "--seed: must be in [0, 2**32)"),
        (["--seed", "1.5"], "--seed: expected a whole number"),
        (["--seq-len", "30000"], "ModelConfig.seq_len must be at most"),
        (["--d-model", "1000000"], "GiB in float32; this machine has"),
    ],
)
def test_bad_options_get_argparse_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main([*TINY, *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "out, message",
    [
        ("", "--out needs a file name"),
        (".", "--out needs a file name"),
        ("{tmp}", "is a directory"),
        ("{tmp}/missing/t.png", "does not exist"),
        ("{tmp}/t.xyz", "matplotlib cannot write '.xyz' files; use one of"),
        ("{tmp}/timeline", "no suffix"),
    ],
)
def test_bad_out_is_refused_before_training(out, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*TINY, "--out", out.format(tmp=tmp_path)])
    assert e.value.code == 2
    printed = capsys.readouterr()
    assert message in printed.err
    assert printed.out == "" and "step 1" not in printed.err  # nothing was trained


def test_help_describes_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag in [
        "--steps",
        "--device",
        "--layers",
        "--d-model",
        "--heads",
        "--seq-len",
        "--batch-size",
        "--optimizer",
        "--attn",
        "--out",
    ]:
        assert flag in out


def test_predict_says_which_phase_runs_out(capsys):
    import json

    assert main(["predict", "--layers", "2", "--d-model", "64", "--heads", "2", "--seq-len", "32"]) == 0
    assert "FITS" in capsys.readouterr().out
    big = ["predict", "--layers", "12", "--d-model", "768", "--heads", "12", "--seq-len", "1024", "--vocab", "50304"]
    assert main([*big, "--attn", "sdpa", "--batch-size", "12", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert not answer["fits"] and answer["runs_out_first"] == {"step": 2, "phase": "backward"}
    assert len(answer["phases"]) == 6 and answer["usable_bytes"] < answer["capacity_bytes"]


def test_predict_bad_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["predict", "--heads", "3"])
    assert e.value.code == 2 and "divisible by n_head" in capsys.readouterr().err
