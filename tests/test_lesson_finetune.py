"""Lesson 09's helpers (anatomy_helpers/lessons/lesson09_finetune.py): expected values from tensor sizes and the
config."""

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from matplotlib.figure import Figure

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.lessons.lesson09_finetune import (  # noqa: E402
    KINDS,
    PANEL_MODELS,
    dry_run,
    fit_panel_hf,
    logits_at_peak,
    method_row,
    methods_table,
    module_kind,
    module_layer,
    panel_fine_tune,
    rules_of_thumb,
    rules_table,
    saved_by,
    saved_table,
    tiny_fine_tunes,
    tiny_llama,
    trainable,
)
from anatomy_helpers.prediction.hf import SHIPPED, meta_parameters, tiny_config  # noqa: E402
from anatomy_helpers.prediction.hf_step import FineTune, dry_run_hf, make_hf_model, track_hf  # noqa: E402

from .conftest import THREADS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    """The lesson's tiny Llama, its four fine-tunes, and two real tracked steps of each."""
    torch.set_num_threads(THREADS)
    cfg, fts = tiny_llama(), tiny_fine_tunes(lora_rank=4)
    return cfg, fts, {name: track_hf(cfg, ft, steps=2, kernel_scratch=False) for name, ft in fts.items()}


def real_model(cfg, ft):
    torch.manual_seed(0)
    return make_hf_model(cfg, ft)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_tiny_llama_keeps_llamas_shape_at_a_small_size():
    cfg = tiny_llama()
    assert type(cfg).__name__ == "LlamaConfig" and cfg.num_hidden_layers == 2 and cfg.tie_word_embeddings
    assert cfg.hidden_size == cfg.num_attention_heads * 16 and cfg.num_attention_heads == 4 * cfg.num_key_value_heads


def test_the_four_fine_tunes():
    fts = tiny_fine_tunes(lora_rank=8)
    assert [ft.method for ft in fts.values()] == ["full", "frozen", "lora", "lora"]
    assert fts["frozen"].freeze == ("model.embed_tokens.", "model.layers.0.")
    assert (fts["LoRA"].lora_rank, fts["LoRA"].lora_alpha, fts["LoRA"].dtype) == (8, 16, "float32")
    assert fts["LoRA, bf16 base"].dtype == "bfloat16"


@pytest.mark.parametrize("method", ["full", "frozen", "LoRA", "LoRA, bf16 base"])
def test_trainable_counts_the_parameters_that_require_grad(method):
    cfg = tiny_llama()
    ft = tiny_fine_tunes(lora_rank=4)[method]
    model = real_model(cfg, ft)
    params = list({id(p): p for p in model.parameters()}.values())
    train = [p for p in params if p.requires_grad]
    got = trainable(cfg, ft)
    assert (got.count, got.bytes, got.tensors) == (sum(p.numel() for p in train), nbytes(train), len(train))
    assert got.total == sum(p.numel() for p in params)
    h, F, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * 16
    if method.startswith("LoRA"):  # r x (in + out) for q, k, v, o, gate, up, down in each layer, A and B
        per_layer = 4 * ((h + h) + (h + kv) + (h + kv) + (h + h) + 2 * (h + F) + (F + h))
        assert got.count == cfg.num_hidden_layers * per_layer and got.tensors == cfg.num_hidden_layers * 7 * 2
        assert got.bytes == 4 * got.count  # peft keeps the adapters in fp32, on a bf16 base too
    if method == "frozen":  # layer 1, the final norm; the tied head is the frozen embedding
        layer = 2 * h + h * h + 2 * h * kv + h * h + 3 * h * F
        assert got.count == layer + h


def test_method_row_reads_the_model_states_off_the_trace(tiny):
    cfg, fts, traces = tiny
    for name, ft in fts.items():
        model = real_model(cfg, ft)
        row = method_row(name, traces[name])
        train = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
        assert row.parameters == nbytes({id(p): p for p in model.parameters()}.values()) + nbytes(model.buffers())
        assert row.gradients == nbytes(train)
        assert row.optimizer_state == 2 * nbytes(train) + 4 * len(train)
        assert row.peak == traces[name].peak().bytes and row.peak_where.startswith("step ")
    text = methods_table([method_row(n, t) for n, t in traces.items()])
    assert text.splitlines()[0].rstrip().endswith("at its end)") and "LoRA, bf16 base" in text


@pytest.mark.parametrize(
    "name, kind, layer",
    [
        ("model.embed_tokens", "embedding", "embedding"),
        ("model.layers.0.input_layernorm", "norms", "layer 0"),
        ("model.layers.11.self_attn.q_proj", "linear layers", "layer 11"),
        ("base_model.model.model.layers.1.self_attn.q_proj.base_layer", "linear layers", "layer 1"),
        ("model.layers.1.self_attn", "attention core", "layer 1"),
        ("model.layers.1.mlp.act_fn", "MLP activation", "layer 1"),
        ("model.layers.1.mlp", "MLP activation", "layer 1"),
        ("base_model.model.model.layers.0.mlp.down_proj.lora_A.default", "LoRA A (its input)", "layer 0"),
        ("base_model.model.model.layers.0.mlp.down_proj.lora_B.default", "LoRA B (A's output)", "layer 0"),
        ("model.norm", "norms", "head and loss"),
        ("lm_head", "head and loss", "head and loss"),
        ("base_model.model", "head and loss", "head and loss"),
        ("model", "head and loss", "head and loss"),
    ],
)
def test_module_kinds_and_layers(name, kind, layer):
    assert module_kind(name) == kind and kind in KINDS
    assert module_layer(name) == layer


def test_an_unknown_module_has_no_kind():
    with pytest.raises(ValueError, match="no kind for module 'model.layers.0.rotary'"):
        module_kind("model.layers.0.rotary")


def test_saved_by_kind_matches_the_sizes_autograd_saves(tiny):
    cfg, fts, traces = tiny
    N, h, F, L = 4 * 32, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    saved = {name: saved_by(t) for name, t in traces.items()}
    linear_inputs = L * (2 * N * h + N * F) * 4  # x into q/k/v, x into gate/up, the product into down; fp32
    assert saved["full"]["linear layers"] == linear_inputs
    assert "linear layers" not in saved["LoRA"] and saved["LoRA"]["LoRA A (its input)"] == linear_inputs
    assert saved["LoRA"]["LoRA B (A's output)"] == L * 7 * N * 4 * 4  # rank 4, fp32
    assert saved["LoRA, bf16 base"]["LoRA A (its input)"] == L * (6 * N * h + N * F) * 4  # an fp32 copy each
    assert "embedding" not in saved["full"]  # the embedding saves its token ids (an input), no activation
    by_layer = saved_by(traces["frozen"], module_layer)
    assert "layer 0" not in by_layer and by_layer["layer 1"] > 0
    # every storage once: the kinds add up to the layers, and to the distinct storages saved in step 1
    assert sum(saved["LoRA"].values()) == sum(saved_by(traces["LoRA"], module_layer).values())
    text = saved_table(saved)
    assert text.splitlines()[-1].startswith("total") and "LoRA A (its input)" in text


def test_logits_at_peak_finds_the_loss_three_fp32_copies():
    cfg = tiny_config("llama-3.2-1b", vocab=4000, positions=128)  # logits far larger than anything else
    ft = FineTune(batch_size=2, seq_len=64)
    trace = dry_run_hf(cfg, ft)
    got = logits_at_peak(trace, cfg, ft)
    n = 2 * 64 * 4000
    assert (got.elements, got.fp32_bytes, got.peak) == (n, 4 * n, trace.peak().bytes)
    assert got.alive == [(4 * n, "activations"), (4 * n, "temporaries"), (4 * n, "temporaries")]
    assert got.total == 12 * n


def test_logits_at_peak_leaves_out_model_states_of_the_same_size():
    cfg = tiny_config("llama-3.2-1b", vocab=4000, positions=128)  # embedding 4000 x 64 fp32 = 1 x 64 x 4000 x 4
    ft = FineTune(batch_size=1, seq_len=cfg.hidden_size)
    got = logits_at_peak(dry_run_hf(cfg, ft), cfg, ft)
    assert all(category not in ("parameters", "gradients", "optimizer_state") for _, category in got.alive)


def test_rules_of_thumb_from_the_parameter_count_and_the_shape():
    cfg = tiny_llama()
    ft = FineTune(batch_size=4, seq_len=32, dtype="bfloat16", micro_batches=2)
    trace = dry_run_hf(cfg, ft)
    model = real_model(cfg, ft)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    s, b, h, a, L = 32, 2, cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers  # b: one micro-batch
    row = rules_of_thumb(cfg, ft, trace, "tiny")
    assert (row.parameters, row.dry_run, row.weights_only) == (n, trace.peak().bytes, 2 * n)
    assert (row.times_four, row.sixteen_per_param) == (8 * n, 16 * n)
    assert row.formula == 16 * n + L * (34 * s * b * h + 5 * a * s * s * b)
    assert row.off_by("x4") == (8 * n - row.dry_run) / row.dry_run
    text = rules_table([row])
    assert "tiny" in text and text.splitlines()[0].split().count("off") == 4  # a column after each rule


def test_panel_fine_tune_is_full_at_rank_0_else_lora():
    assert panel_fine_tune(0, 4, 1024) == FineTune(batch_size=4, seq_len=1024, dtype="bfloat16")
    lora = panel_fine_tune(16, 1, 512)
    assert (lora.method, lora.lora_rank, lora.lora_alpha, lora.dtype) == ("lora", 16, 32, "bfloat16")


def test_dry_run_is_made_once_per_fine_tune():
    cfg, ft = tiny_llama(), FineTune(batch_size=1, seq_len=8)
    first = dry_run(cfg, ft)
    assert dry_run(cfg, ft) is first and dry_run(cfg, dataclasses.replace(ft, seq_len=16)) is not first


def test_fit_panel_hf_reports_per_rank_and_refuses_a_sequence_past_the_positions(capsys):
    cfg = tiny_llama()
    fig = fit_panel_hf(cfg, device="t4", world_size=2, zero=3, lora_rank=4, batch_size=2, seq_len=16)
    out = capsys.readouterr().out
    assert isinstance(fig, Figure) and len(fig.panel_numbers) == 3 and fig.panel_numbers[2]  # it fits on a T4
    assert "per rank of 2 under fsdp2_zero3" in out and "FITS" in out
    alone = fit_panel_hf(cfg, device="t4", world_size=1, zero=3, lora_rank=4, batch_size=2, seq_len=16)
    assert "per rank" not in capsys.readouterr().out and isinstance(alone, Figure)  # zero needs ranks: ignored
    with pytest.raises(ValueError, match="has 64 positions"):
        fit_panel_hf(cfg, seq_len=128)


def test_the_panel_offers_the_colab_size_models_and_opens_on_its_default():
    """The panel's models are shipped ones, the Colab sizes among them, none over 4 B parameters (their dry runs
    stay short), and it opens on its function's default (the notebook's plain call)."""
    assert PANEL_MODELS[0] == inspect.signature(fit_panel_hf).parameters["model"].default
    assert set(PANEL_MODELS) <= set(SHIPPED) and len(set(PANEL_MODELS)) == len(PANEL_MODELS)
    assert {"llama-3.2-3b", "qwen2.5-1.5b", "qwen2.5-3b", "phi-3.5-mini", "smollm2-1.7b"} <= set(PANEL_MODELS)
    assert all(meta_parameters(name) < 4e9 for name in PANEL_MODELS)


def test_the_notebooks_colab_line_installs_the_hf_extra_as_pyproject_declares_it():
    declared = re.search(r"^hf = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)  # [project.optional-...]
    extra = re.findall(r'"([^"]+)"', declared.group(1))
    first = "".join(json.loads((ROOT / "notebooks" / "09_finetune.ipynb").read_text())["cells"][1]["source"])
    lines = [line for line in first.splitlines() if '"pip", "install"' in line]
    assert len(lines) == 2 and re.findall(r'"([^"]+)"', lines[1].split('"-q",')[1]) == extra


def test_fit_panel_hf_reports_the_settings_its_dry_run_used():
    """What the browser test compares with the controls: read from the fine-tune the panel built, so a panel that
    silently changed a setting (a sequence clamped to 1,024 tokens) reports the changed one. The tiny twin has room
    for 2,048 positions, past any such clamp."""
    cfg = tiny_config(PANEL_MODELS[0], head_dim=16, positions=4096)
    fig = fit_panel_hf(cfg, device="t4", world_size=1, lora_rank=8, batch_size=1, seq_len=2048)
    assert fig.panel_used == {"lora_rank": 8, "batch_size": 1, "seq_len": 2048, "world_size": 1}
    fig = fit_panel_hf(cfg, device="t4", world_size=2, zero=1, lora_rank=0, batch_size=2, seq_len=16)
    assert fig.panel_used == {"lora_rank": 0, "batch_size": 2, "seq_len": 16, "world_size": 2, "zero": 1}
