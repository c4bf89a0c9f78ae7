"""``predict --hf``: a Hugging Face fine-tune's will-it-fit from the command line (cli_hf.py)."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.cli.main import main  # noqa: E402
from anatomy_helpers.distributed.hf_fit import will_it_fit_hf  # noqa: E402
from anatomy_helpers.prediction.hf import tiny_config  # noqa: E402
from anatomy_helpers.prediction.hf_step import FineTune  # noqa: E402


@pytest.fixture(scope="module")
def tiny_json(tmp_path_factory):
    """A tiny Llama's config.json: the CLI reads it as it reads a downloaded one."""
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    tiny_config("llama-3.2-1b").to_json_file(path)
    return path


def test_predict_hf_answers_with_the_will_it_fit_reports_numbers(tiny_json, capsys):
    args = ["predict", "--hf", str(tiny_json), "--seq-len", "16", "--batch-size", "2", "--lora-rank", "4"]
    more = ["--lora-targets", "q_proj", "v_proj", "--gradient-checkpointing", "--gpu", "h100"]
    assert main([*args, *more, "--world-size", "4", "--zero", "3", "--json", "--fix"]) == 0
    answer = json.loads(capsys.readouterr().out)
    ft = FineTune(
        batch_size=2, seq_len=16, dtype="bfloat16", method="lora", lora_rank=4, lora_alpha=8,
        lora_targets=("q_proj", "v_proj"), gradient_checkpointing=True, foreach=True,
    )  # fmt: skip
    report = will_it_fit_hf(str(tiny_json), ft, "h100", world_size=4, zero=3)
    assert answer["phases"] == [
        dict(step=p.step, phase=p.phase, tensor_bytes=p.tensors, reserved_bytes=p.reserved) for p in report.phases
    ]
    assert answer["peak_breakdown_bytes"] == report.peak.breakdown and answer["fits"] and answer["zero"] == 3
    assert (
        "LoRA r=4" in answer["config"]
        and "under fsdp2_zero3" in answer["note"]
        and "fake process group" in answer["note"]
    )
    assert answer["rules"].startswith("CPU kernels") and answer["device"] == "H100 80GB HBM3"
    assumptions = "\n".join(answer["assumptions"])
    assert "every row 16 tokens, full length: no padding, no attention_mask" in assumptions
    assert "use_cache=False" in assumptions and "gradient checkpointing: on" in assumptions
    assert answer["verdict"] == report.verdict() and answer["too_close_to_call"] is False
    # it fits on an H100: no change is ranked (the catalogue's rule, prediction/levers.py)
    assert answer["fixes"] == []


def test_predict_hf_on_a_full_size_shipped_model(capsys):
    """GPT-2 (124M parameters) at its full size: a dry run of about 4 s of one core."""
    assert main(["predict", "--hf", "gpt2", "--seq-len", "64", "--optimizer", "sgd", "--impl", "single"]) == 0
    out = capsys.readouterr().out
    assert "gpt2, full, b=1 s=64, float32, autocast float16" in out and "FITS" in out and "on T4" in out  # the default
    assert "T4 (compute capability 7.5) has no native bfloat16" in out  # so its recipe: fp16 autocast, GradScaler


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hf", "llama-4"], "--hf llama-4: "),
        # a Hub name that is not shipped: how to get its config.json, for that very model
        (["--hf", "meta-llama/Llama-3.1-70B"], "`hf download meta-llama/Llama-3.1-70B config.json --local-dir"),
        # a shipped model's Hub name is taken (the refusal is the option's, after the configuration was read)
        (["--hf", "Qwen/Qwen2.5-3B", "--freeze", "decoder."], "no parameter name starts with 'decoder.'"),
        (["--hf", "gpt2", "--lora-rank", "8", "--freeze", "transformer.h.0."], "--freeze and --lora-rank"),
        (["--hf", "gpt2", "--lora-alpha", "16"], "--lora-alpha needs --lora-rank"),
        (["--hf", "gpt2", "--lora-targets", "c_attn"], "--lora-targets needs --lora-rank"),
        (["--hf", "gpt2", "--batch-size", "3", "--micro-batches", "2"], "--batch-size (3) must be a multiple of"),
        (["--hf", "gpt2", "--zero", "3"], "--zero 3 shards across ranks: it needs --world-size > 1"),
        (["--hf", "gpt2", "--world-size", "8", "--zero", "4"], "--zero: invalid choice"),
        (["--hf", "gpt2", "--world-size", "0"], "--world-size: must be a positive integer"),
        (["--hf", "gpt2", "--gpu", "a100-90"], "--gpu: invalid choice"),
        (["--hf", "gpt2", "--gpu-gib", "0.5"], "no memory left once the CUDA context"),
        (["--hf", "gpt2", "--lora-rank", "0"], "--lora-rank: must be a positive integer"),
        (["--hf", "gpt2", "--attn", "flash"], "--attn: invalid choice"),
        (["--hf", "gpt2", "--experts", "eager"], "experts_implementation is for mixture-of-experts models"),
        (["--hf", "gpt2", "--freeze", "decoder."], "no parameter name starts with 'decoder.'"),
        (["--hf", "gpt2", "--lora-rank", "4", "--lora-targets", "q_proj"], "LoRA target modules"),
    ],
)
def test_predict_hf_bad_options_exit_2_naming_them(args, message, capsys, monkeypatch):
    import anatomy_helpers.prediction.fit as fit  # trace_fit_report replays every dry run of a fine-tune

    monkeypatch.setattr(fit, "replay", lambda *a, **k: pytest.fail("replayed a refused request"))
    with pytest.raises(SystemExit) as e:
        main(["predict", "--seq-len", "16", *args])
    printed = capsys.readouterr()
    assert e.value.code == 2 and message in printed.err and printed.out == ""


def test_both_predict_commands_default_to_the_one_default_gpu():
    """The course GPT's ``predict`` and ``predict --hf`` answer for the same GPU when none is named: a free Colab
    runtime's T4, defined once (prediction/devices.py)."""
    from anatomy_helpers.cli.hf import build_hf_predict_parser
    from anatomy_helpers.cli.main import build_predict_parser
    from anatomy_helpers.prediction.devices import DEFAULT_GPU

    assert build_predict_parser().get_default("gpu") == build_hf_predict_parser().get_default("gpu") == DEFAULT_GPU
    assert DEFAULT_GPU == "t4"


def test_predicts_help_names_a_shipped_model_whose_help_runs(capsys):
    """``predict --help`` shows ``predict --hf MODEL --help`` with a real model, not a placeholder to guess."""
    import re

    from anatomy_helpers.prediction.hf import SHIPPED

    with pytest.raises(SystemExit) as e:
        main(["predict", "--help"])
    assert e.value.code == 0
    named = re.findall(r"predict --hf (\S+) --help", " ".join(capsys.readouterr().out.split()))
    assert named and all(name in SHIPPED for name in named), named
    with pytest.raises(SystemExit) as e:
        main(["predict", "--hf", named[0], "--help"])
    assert e.value.code == 0 and "--lora-rank" in capsys.readouterr().out


def test_predict_hf_help_lists_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["predict", "--hf", "gpt2", "--help"])
    out = capsys.readouterr().out
    for flag in ("--lora-rank", "--freeze", "--gradient-checkpointing", "--world-size", "--zero", "--json", "--fix"):
        assert flag in out


def test_predict_hf_on_a_config_that_is_not_a_causal_lm_exits_2_naming_it(tmp_path, capsys):
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).to_json_file(
        tmp_path / "config.json"
    )
    with pytest.raises(SystemExit) as e:
        main(["predict", "--hf", str(tmp_path), "--seq-len", "16"])
    printed = capsys.readouterr()
    assert e.value.code == 2 and "ViTConfig (vit) is not a causal language model" in printed.err and not printed.out


def _config_json(tmp_path, kind: str) -> str:
    import transformers

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=300)
    if kind == "llama":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif kind == "bert":
        transformers.BertConfig(**sizes).to_json_file(tmp_path / "config.json")
    else:
        transformers.MambaConfig(hidden_size=64, num_hidden_layers=2).to_json_file(tmp_path / "config.json")
    return str(tmp_path)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("llama", "leaves out hidden_size, num_hidden_layers"),  # not transformers' defaults, silently (62.76 GiB)
        ("bert", "BertConfig (bert) is not a causal language model"),
        ("mamba", "MambaConfig (mamba) has no num_attention_heads"),
    ],
)
def test_predict_hf_on_configs_it_cannot_follow_exits_2_naming_why(kind, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["predict", "--hf", _config_json(tmp_path, kind), "--seq-len", "16", "--gpu", "t4"])
    printed = capsys.readouterr()
    assert e.value.code == 2 and message in printed.err and "Traceback" not in printed.err and not printed.out


def test_predict_hf_refused_by_the_dry_run_exits_1_saying_why(tmp_path, capsys):
    """A real refusal (a tiny Mixtral's eager experts make a shape from the router's choice: aten.nonzero) is not
    an answer: exit status 1, the dry run's reason on stderr, nothing on stdout."""
    tiny_config("mixtral-8x7b").to_json_file(tmp_path / "config.json")
    with pytest.raises(SystemExit) as e:
        main(["predict", "--hf", str(tmp_path), "--seq-len", "16", "--experts", "eager"])
    printed = capsys.readouterr()
    assert e.value.code == 1 and printed.out == ""
    assert printed.err.startswith("dry run refused: ") and "aten.nonzero" in printed.err
