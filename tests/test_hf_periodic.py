"""periodic_dry_run_hf: a Hugging Face fine-tune's dry run at full depth, built from dry runs at 3, 4 and 5 layers,
equals the full-depth dry run byte for byte; where the layers differ it makes the full one and says why."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.prediction.fit import FULL_DRY_RUN_ENV, dry_run_text  # noqa: E402
from anatomy_helpers.prediction.hf import tiny_config  # noqa: E402
from anatomy_helpers.prediction.hf_periodic import block_list, periodic_dry_run_hf, refused_before_hf  # noqa: E402
from anatomy_helpers.prediction.hf_step import FineTune, dry_run_hf  # noqa: E402
from anatomy_helpers.prediction.periodic import trace_differences  # noqa: E402

# LoRA as a T4 runs it (fp16 base, fp32 adapters, fp16 autocast, foreach AdamW): the optimizer's first step makes
# every adapter's state, then every adapter's temporaries, two runs of rows per layer
LORA_T4 = dict(
    dtype="float16", autocast="float16", method="lora", lora_rank=4, lora_alpha=8, foreach=True, batch_size=1
)

# Tiny twins (hf.tiny_config: head width 8, 256 tokens) at depth 6 to 8: each dry run takes a second or two.
CASES = [
    ("llama-3.2-1b", 6, {}),  # dense, float32, AdamW
    ("qwen2.5-0.5b", 7, dict(dtype="bfloat16", autocast="bfloat16", optimizer="sgd")),  # grouped-query, layer_types
    ("mixtral-8x7b", 6, dict(dtype="bfloat16")),  # mixture of experts (grouped_mm)
    ("llama-3.2-1b", 8, LORA_T4),
    # full fine-tune under foreach AdamW: its first step's frees of temporaries (many rows of equal bytes) are aligned
    # as cut at two nearby places, in other proportions at depths 4 and 5: the two places read as one span
    ("llama-3.2-1b", 6, dict(foreach=True)),
    # GPT-2 (its layers are transformer.h), embeddings frozen, HF's gradient checkpointing
    ("gpt2", 6, dict(method="frozen", freeze=("transformer.wte.", "transformer.wpe."), gradient_checkpointing=True)),
]


@pytest.mark.parametrize("name, depth, fields", CASES, ids=[f"{n}-{d}-{','.join(f)}" for n, d, f in CASES])
def test_periodic_equals_the_full_dry_run(name, depth, fields):
    cfg, ft = tiny_config(name, layers=depth), FineTune(**fields)
    fast, why = periodic_dry_run_hf(cfg, ft)
    assert why is None  # the period was used
    assert trace_differences(fast, dry_run_hf(cfg, ft)) == []


def test_layers_that_differ_fall_back_to_the_full_dry_run():
    """Gemma 2 alternates sliding-window and full attention (its layer_types): refused by name before any run,
    the full-depth dry run returned."""
    cfg, ft = tiny_config("gemma-2-2b", layers=6), FineTune(attn_implementation="eager")
    trace, why = periodic_dry_run_hf(cfg, ft)
    assert why == "its layers differ: layer_types gives them sliding_attention, full_attention"
    assert "model.layers.5" in trace.timeline.module_names  # the full depth's trace
    assert dry_run_text(cfg.num_hidden_layers, why) == f"full depth ({why})"


def test_what_is_refused_by_name_before_any_run():
    llama = tiny_config("llama-3.2-1b", layers=8)
    path = block_list(llama, FineTune())
    assert path == "model.layers" and block_list(tiny_config("gpt2", layers=6), FineTune()) == "transformer.h"
    assert refused_before_hf(llama, FineTune(), path) is None
    assert refused_before_hf(tiny_config("llama-3.2-1b", layers=5), FineTune(), path).startswith(
        "num_hidden_layers 5 is at most 5"
    )
    frozen = FineTune(method="frozen", freeze=("model.layers.0.",))  # one layer frozen, the others trained
    assert refused_before_hf(llama, frozen, path) == "freeze prefix 'model.layers.0.' picks particular layers of " \
        "model.layers"  # fmt: skip
    all_layers = FineTune(method="frozen", freeze=("model.layers.", "model.embed_tokens."))
    assert refused_before_hf(llama, all_layers, path) is None
    one_layer = FineTune(method="lora", lora_targets=("layers.3.self_attn.q_proj", "v_proj"))
    assert "LoRA target 'layers.3.self_attn.q_proj'" in refused_before_hf(llama, one_layer, path)
    regex = FineTune(method="lora", lora_targets=r".*\.[0-3]\.mlp\..*")
    assert "a regular expression" in refused_before_hf(llama, regex, path)
    assert refused_before_hf(llama, FineTune(method="lora", lora_targets=("q_proj", "v_proj")), path) is None
    # fields that make some layers differ (DeepSeek's first dense layers, Qwen-MoE's dense layers by index)
    for field, value in (("first_k_dense_replace", 1), ("mlp_only_layers", [2]), ("decoder_sparse_step", 2)):
        setattr(changed := tiny_config("llama-3.2-1b", layers=8), field, value)
        assert refused_before_hf(changed, FineTune(), path).startswith(f"its layers differ: {field}={value!r}")


def test_a_model_of_five_layers_or_fewer_is_dry_run_in_full():
    cfg = tiny_config("llama-3.2-1b", layers=2)
    trace, why = periodic_dry_run_hf(cfg, FineTune())
    assert why == "num_hidden_layers 2 is at most 5, the deepest run the period is read from"
    assert trace_differences(trace, dry_run_hf(cfg, FineTune())) == []


def test_the_environment_asks_for_the_full_dry_run(monkeypatch):
    monkeypatch.setenv(FULL_DRY_RUN_ENV, "1")
    cfg = tiny_config("llama-3.2-1b", layers=6)
    trace, why = periodic_dry_run_hf(cfg, FineTune())
    assert why == f"{FULL_DRY_RUN_ENV}=1 asks for it" and "model.layers.5" in trace.timeline.module_names


def test_predict_hf_says_how_its_dry_run_was_made(tmp_path, capsys):
    """will_it_fit_hf on one device builds its dry run from 3, 4 and 5 layers: the same numbers as from the full
    dry run, and one line of the report (so of ``predict --hf``) says which was made."""
    from anatomy_helpers.cli.main import main
    from anatomy_helpers.distributed.hf_fit import will_it_fit_hf

    tiny_config("llama-3.2-1b", layers=6).to_json_file(tmp_path / "config.json")
    # what the options below make: LoRA on a T4 (the default GPU) runs fp16 autocast over an fp16 base
    ft = FineTune(**{**LORA_T4, "batch_size": 2})
    report = will_it_fit_hf(str(tmp_path), ft, "t4")
    assert report.dry_run == "depths 3, 4, 5, extended to 6 blocks (exact: the same bytes as a full dry run)"
    full = will_it_fit_hf(str(tmp_path), ft, "t4", trace=dry_run_hf(tmp_path / "config.json", ft))
    assert report.phases == full.phases and report.peak == full.peak and report.fits == full.fits
    assert full.dry_run == ""  # a trace given: its maker says how it was made
    args = ["predict", "--hf", str(tmp_path), "--seq-len", "16", "--batch-size", "2", "--lora-rank", "4"]
    assert main(args) == 0
    assert f"dry run: {report.dry_run}" in capsys.readouterr().out.splitlines()
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dry_run"] == report.dry_run
