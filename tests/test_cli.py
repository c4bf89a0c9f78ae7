import pytest

from anatomy_helpers.cli.main import main

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
        (["--steps", "0"], "must be a positive integer"),
        (["--heads", "3"], "divisible by n_head"),
        (["--optimizer", "lion"], "invalid choice"),
        (["--attn", "flash"], "invalid choice"),
        (["--layers", "two"], "expected a whole number"),
        (["--dropout", "2"], "dropout"),
        (["--dropout", "nan"], "ModelConfig.dropout"),
        (["--seed", "-1"], "--seed: must be an integer in [0, 2**32)"),
        (["--seed", str(2**32)], "--seed: must be an integer in [0, 2**32)"),
        (["--seed", "1.5"], "--seed: expected a whole number"),
        (["--seq-len", "30000"], "--seq-len=30000 is longer than the course text allows"),
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
    assert main([*big, "--attn", "sdpa", "--batch-size", "11", "--json"]) == 0  # a T4: step 1 fits, step 2 not
    answer = json.loads(capsys.readouterr().out)
    assert not answer["fits"] and answer["runs_out_first"] == {"step": 2, "phase": "backward"}
    assert len(answer["phases"]) == 6 and answer["usable_bytes"] < answer["capacity_bytes"]


PREDICT_TINY = ["predict", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--heads", "3"], "divisible by n_head"),
        (["--gpu", "T4 16 GB"], "invalid choice"),
        (["--gpu", "t5"], "invalid choice"),
        (["--gpu-gib", "0"], "--gpu-gib: must be a finite positive number"),
        (["--gpu-gib", "nan"], "--gpu-gib: must be a finite positive number"),
        (["--gpu-gib", "inf"], "--gpu-gib: must be a finite positive number"),
        (["--gpu-gib", "lots"], "--gpu-gib: expected a number of GiB"),
        (["--gpu-gib", "0.5"], "no memory left once the CUDA context (assumed) takes 512.00 MiB"),
        (["--gpu", "h100", "--gpu-gib", "80"], "not allowed with argument"),
        (["--micro-batches", "3"], "batch_size (4) must be a multiple of micro_batches (3)"),
        (["--micro-batches", "0"], "--micro-batches: must be a positive integer"),
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint every_k"),
        (["--checkpoint", "every_k", "--checkpoint-every", "5"], "checkpoint_every must be a whole number from 1"),
        (["--dropout", "1"], "ModelConfig.dropout"),
        (["--dropout", "nan"], "ModelConfig.dropout"),
        (["--mlp-ratio", "0"], "--mlp-ratio: must be a positive integer"),
        (["--batch-size", str(10**12)], "no dry run is needed to say so"),
        (["--vocab", str(10**15)], "no dry run is needed to say so"),
        (["--layers", str(10**6)], "n_layer must be at most 1024"),
        # per rank (issue #40): what a rank's dry run does not model is refused by name
        (["--zero", "2"], "--zero 2 shards across ranks: it needs --world-size > 1"),
        (["--world-size", "2", "--fix"], "--fix is not modelled per rank"),
        (["--world-size", "2", "--impl", "fused"], "--impl is not modelled per rank"),
        (["--world-size", "2", "--optimizer", "sgd"], "--optimizer is not modelled per rank"),
        (["--world-size", "0"], "--world-size: must be a positive integer"),
    ],
)
def test_predict_bad_options_exit_2_before_any_work(args, message, capsys, monkeypatch):
    import anatomy_helpers.distributed.one_fit as one_fit
    import anatomy_helpers.prediction.fit as fit

    for name in ("dry_run_config", "periodic_dry_run"):  # fit's two dry runs (full depth, and depths 3, 4, 5)
        monkeypatch.setattr(fit, name, lambda *a, **k: pytest.fail("dry-ran a refused request"))
    monkeypatch.setattr(one_fit, "dry_run_rank", lambda *a, **k: pytest.fail("dry-ran a refused request"))
    with pytest.raises(SystemExit) as e:
        main([*PREDICT_TINY, *args])
    printed = capsys.readouterr()
    assert e.value.code == 2 and message in printed.err and printed.out == ""


def test_predict_per_rank_is_the_one_fits_rank_0(capsys):
    # issue #40: the course GPT's predict had no --world-size; per rank it now answers from the one per-rank engine,
    # with the Python API's numbers
    import json

    from anatomy_helpers.core.model import ModelConfig
    from anatomy_helpers.distributed.one_fit import will_it_fit as one_fit

    assert main([*PREDICT_TINY, "--world-size", "2", "--zero", "1", "--gpu", "h100", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    cfg = ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=16)
    report = one_fit(cfg, 4, device="h100", world_size=2, zero=1)
    assert answer["phases"] == [
        dict(step=p.step, phase=p.phase, tensor_bytes=p.tensors, reserved_bytes=p.reserved) for p in report.phases
    ]
    assert answer["world_size"] == 2 and answer["zero"] == 1 and "fake process group" in answer["note"]
    assert answer["peak_breakdown_bytes"] == report.peak.breakdown and answer["verdict"] == report.verdict()
    # ZeRO-1 shards the optimizer state: rank 0 holds about half of one device's
    single = one_fit(cfg, 4, device="h100", world_size=2)
    state = [r.peak.breakdown.get("optimizer_state", 0) for r in (report, single)]
    assert 0 < state[0] < state[1]


def test_predict_takes_a_sequence_longer_than_the_course_text(capsys):
    """A dry run needs no text: 32,768 positions (the course text has fewer tokens) are predicted, not refused;
    a real run of the same length is refused (test_bad_options_get_argparse_errors)."""
    import json

    from anatomy_helpers.core.data import max_seq_len

    seq_len = 32_768
    assert seq_len > max_seq_len()  # longer than any course batch
    assert main([*PREDICT_TINY, "--seq-len", str(seq_len), "--json"]) == 0
    printed = capsys.readouterr()
    answer = json.loads(printed.out)
    assert f"s={seq_len}" in answer["config"] and printed.err == ""


def test_predict_options_reach_the_configuration(capsys):
    import json

    args = ["--untied", "--mlp-ratio", "2", "--dropout", "0.1", "--checkpoint", "every_k", "--checkpoint-every", "1"]
    assert main([*PREDICT_TINY, *args, "--micro-batches", "2", "--gpu", "H100", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    for part in ("MLP 2h", "untied head", "dropout 0.1", "checkpoint every_k 1", "b=2", "x 2 micro-batches"):
        assert part in answer["config"]
    assert answer["device"] == "H100 80GB HBM3" and answer["driver_bytes"] == 81_559 * 2**20  # nvidia-smi's
    assert answer["capacity_bytes"] == 81_082 * 2**20  # the lowest total_memory a process was seen with
    assert answer["compute_capability"] == "9.0"
    assert main([*PREDICT_TINY, "--gpu-gib", "1.5", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["capacity_bytes"] == 3 * 2**29 and answer["compute_capability"] is None
    assert answer["driver_bytes"] is None  # a size given by hand: no driver figure


def test_predict_prints_a_tiny_model_in_mib_and_says_it_needs_no_fix(capsys):
    # issue #40: a step that fits ranks no change
    assert main([*PREDICT_TINY, "--gpu-gib", "0.6", "--fix"]) == 0
    out = capsys.readouterr().out
    assert "(MiB;" in out and " 0.00 " not in out and "FITS" in out
    assert "fits as it is: no change needed" in out and "rank" not in out


def test_predict_ranks_the_catalogues_levers_where_the_step_does_not_fit(capsys):
    # two blocks at batch 16 with manual attention on s = 512 and 8 heads (its scores dominate), on a 0.6 GiB device:
    # over 600 MiB of tensors, so the answer is not too close to call; two blocks, so the checkpointing levers are
    # tried too, and each lever's dry run (up to 16 micro-batches) costs half the default model's four
    args = ["predict", "--layers", "2", "--heads", "8", "--seq-len", "512", "--batch-size", "16", "--gpu-gib", "0.6"]
    assert main([*args, "--fix"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "TOO CLOSE TO CALL" not in out and "changes" in out and "time only" in out
    assert "sdpa attention" in out and "micro-batch " in out and "fits as it is" not in out
