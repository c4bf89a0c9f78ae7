"""Issue #45, "Will my fine-tune fit on Colab's T4?": four fine-tunes at batch 4, sequence 2048, each predicted with
the T4's own precision recipe, and each given a combination that fits (or the smallest multi-GPU setup) by the
fix search, its peak from a full dry run. The configurations are written from the published numbers (the models'
config.json on the Hugging Face Hub) into a temporary folder.

Slow: each search makes tens of small dry runs and one or two full ones of a 1.5-3B model (fake tensors)."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.distributed.hf_fit import search_fix_hf, will_it_fit_hf  # noqa: E402
from anatomy_helpers.prediction.devices import DEVICES  # noqa: E402
from anatomy_helpers.prediction.hf_step import FineTune  # noqa: E402
from anatomy_helpers.prediction.recipes import device_recipe  # noqa: E402

LLAMA_3B = {
    "model_type": "llama", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "vocab_size": 128256,
    "tie_word_embeddings": True, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
}  # fmt: skip
QWEN = {"model_type": "qwen2", "tie_word_embeddings": True, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "use_sliding_window": False, "hidden_act": "silu"}  # fmt: skip
QWEN_3B = QWEN | {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
                  "intermediate_size": 11008}  # fmt: skip
QWEN_1_5B = QWEN | {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                    "intermediate_size": 8960}  # fmt: skip

LORA = dict(method="lora", lora_rank=16, lora_alpha=32)
CASES = {
    "llama-3.2-3b-lora-qv": (LLAMA_3B, LORA | {"lora_targets": ("q_proj", "v_proj")}),
    "llama-3.2-3b-lora-all": (LLAMA_3B, LORA),
    "qwen2.5-3b-lora-all": (QWEN_3B, LORA),
    "qwen2.5-1.5b-full": (QWEN_1_5B, {}),
}
T4 = DEVICES["t4"]


@pytest.mark.parametrize("config, fields", CASES.values(), ids=CASES)
def test_each_t4_fine_tune_gets_a_combination_that_fits(config, fields, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    method = fields.get("method", "full")
    dtype, autocast, why = device_recipe(method, T4)
    ft = FineTune(batch_size=4, seq_len=2048, dtype=dtype, autocast=autocast, foreach=True, **fields)
    assert autocast == "float16" and "no native bfloat16" in why  # the T4's recipe, not bf16
    assert not will_it_fit_hf(str(path), ft, T4).fits
    search = search_fix_hf(str(path), ft, T4)
    if method == "lora":  # trains the same adapters on one T4 with time-only or numerics changes
        assert search.one_device and search.fixes[0].effect in ("time only", "numerics")
        fix = search.fixes[0]
    else:  # 16 B per parameter of model states (24.7 GiB for 1.54 B parameters): no single T4
        # On T4s as a process sees them (14.08 GiB usable), 4 x ZeRO-3 + checkpointing holds 11.50 GiB of tensors
        # but the simulated allocator's segments reach 14.49 GiB: no data-parallel setup at this batch fits either
        assert not search.one_device and search.more_gpus is None and search.world_sizes == (2, 4)
        assert "nor do 2 or 4 GPUs under ZeRO-1/2/3" in search.text("T4")
        fix = search.fixes[0]  # what fits on one T4 trains something else: LoRA's adapters
        assert fix.effect == "trained parameters" and "LoRA" in fix.name
    # the fix's verdict and peak are its full dry run's (will_it_fit_hf of the setup it names)
    assert fix.fits and fix.report.peak.tensors <= T4.usable and fix.setup.fine_tune != ft
    print(f"\n{fix.report.label}: {fix.name}: {fix.report.peak.tensors} B at the peak ({search.dry_runs} dry runs)")
