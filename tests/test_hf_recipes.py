"""Named precision recipes of a Hugging Face fine-tune (prediction/recipes.py): each recipe a dry run claims is
exact against a real CPU run of a tiny twin; the ones it cannot follow are refused by name; the bytes per
parameter a recipe prints are the trace's own categories."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.prediction.devices import DEVICES  # noqa: E402
from anatomy_helpers.prediction.dryrun import DryRunError  # noqa: E402
from anatomy_helpers.prediction.hf import tiny_config  # noqa: E402
from anatomy_helpers.prediction.hf_step import FineTune, dry_run_hf, make_hf_model, track_hf  # noqa: E402
from anatomy_helpers.prediction.recipes import RECIPES, device_recipe, recipe_of, state_bytes  # noqa: E402

from .test_dryrun import assert_same_trace  # noqa: E402

LORA = dict(method="lora", lora_rank=4, lora_alpha=8, lora_targets=("q_proj", "v_proj"))
# Each recipe a prediction may run: pure bf16, bf16 / fp16 autocast over fp32 master weights, an fp16 frozen base
# under fp16 autocast for LoRA (a T4's LoRA recipe), a bf16 base for LoRA.
CLAIMED = {
    "pure-bf16": dict(dtype="bfloat16"),
    "bf16-mixed": dict(autocast="bfloat16"),
    "fp16-mixed": dict(autocast="float16"),
    "fp16-base-lora": dict(dtype="float16", autocast="float16", **LORA),
    "bf16-base-lora": dict(dtype="bfloat16", **LORA),
}


@pytest.mark.parametrize("fields", CLAIMED.values(), ids=CLAIMED)
def test_each_recipe_a_dry_run_claims_equals_a_real_run_byte_for_byte(fields):
    cfg, ft = tiny_config("llama-3.2-1b"), FineTune(**fields)
    real = track_hf(cfg, ft, steps=2, kernel_scratch=False)
    dry = dry_run_hf(cfg, ft, steps=2)
    assert_same_trace(dry, real)


def _expected(cfg, ft):
    """numel x the recipe's bytes per parameter; AdamW8bit keeps fp32 moments for tensors under 4,096 elements
    (bitsandbytes' min_8bit_size): 8 more bytes per parameter than its weight and gradient there."""
    torch.manual_seed(0)
    model = make_hf_model(cfg, ft)
    per_trained, per_frozen = state_bytes(ft)
    out, tensors = 0, 0
    for p in model.parameters():
        small_8bit = ft.optimizer == "adamw8bit" and p.numel() < 4096
        per = (2 * p.element_size() + 8 if small_8bit else per_trained) if p.requires_grad else per_frozen
        out += p.numel() * per
        tensors += p.requires_grad
    out += sum(b.numel() * b.element_size() for b in model.buffers())  # the rotary tables, held with the weights
    return out, tensors


@pytest.mark.parametrize("fields", [*CLAIMED.values(), dict(optimizer="adamw8bit", dtype="float32")])
def test_a_recipes_bytes_per_parameter_are_the_traces_model_states(fields):
    """Weights + gradients + optimizer state before step 2's optimizer step, from numel alone x the recipe's bytes
    per parameter (and the model's buffers), and torch's one 4-byte step per trained tensor; AdamW8bit's from a
    real run (its dry run is refused), its per-tensor code books and scales bounded."""
    cfg, ft = tiny_config("llama-3.2-1b", layers=2), FineTune(**fields)
    real = track_hf(cfg, ft, steps=2, kernel_scratch=False)
    last = real.phase(real.training_steps()[-1], "optimizer")
    before = real.at(last.start - 1)
    held = before["parameters"] + before["gradients"] + before["optimizer_state"]
    expected, tensors = _expected(cfg, ft)
    if ft.optimizer == "adamw8bit":  # and bitsandbytes' per-tensor code books and scales: a few KiB here
        assert expected <= held < expected + 16 * 1024, (held, float(expected))
    else:  # and torch's one float32 step per trained tensor
        assert held == expected + 4 * tensors, (held, float(expected), tensors)


def test_the_8bit_adamw_recipe_runs_for_real_and_its_dry_run_is_refused_by_name():
    cfg, ft = tiny_config("llama-3.2-1b"), FineTune(optimizer="adamw8bit")
    assert track_hf(cfg, ft, steps=1, kernel_scratch=False).peak().bytes > 0
    with pytest.raises(DryRunError, match="8-bit AdamW recipe is refused: bitsandbytes' AdamW8bit"):
        dry_run_hf(cfg, ft)
    with pytest.raises(ValueError, match="adamw8bit has one implementation"):
        FineTune(optimizer="adamw8bit", foreach=True)


def test_the_recipe_is_named_with_its_bytes_per_parameter():
    assert recipe_of(FineTune(dtype="bfloat16")).text().startswith("recipe: pure bf16 (8 B per trained parameter")
    mixed = recipe_of(FineTune(autocast="float16")).text()
    assert mixed.startswith("recipe: fp16 autocast over fp32 master weights + GradScaler (16 B per trained")
    lora = recipe_of(FineTune(dtype="float16", autocast="float16", **LORA)).text()
    assert "fp16 frozen base, fp32 LoRA adapters" in lora and "16 B per trained parameter, 2 B per frozen" in lora
    assert set(RECIPES) == {"pure-bf16", "bf16-mixed", "fp16-mixed", "fp32"}


def test_a_device_without_native_bf16_gets_fp16_autocast_and_says_why():
    assert device_recipe("full", DEVICES["a100-80"]) == ("bfloat16", None, "")
    dtype, autocast, why = device_recipe("full", DEVICES["t4"])
    assert (dtype, autocast) == ("float32", "float16") and "T4 (compute capability 7.5) has no native bfloat16" in why
    assert device_recipe("lora", DEVICES["t4"])[:2] == ("float16", "float16")
