"""Hugging Face causal LMs: shipped configurations, tiny twins, and dry runs exact or refused (prediction/hf*.py)."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.prediction.dryrun import DryRunError  # noqa: E402
from anatomy_helpers.prediction.hf import (  # noqa: E402
    SHIPPED,
    build_model,
    hf_config,
    meta_parameters,
    shipped_name,
    tiny_config,
)
from anatomy_helpers.prediction.hf_step import (  # noqa: E402
    FineTune,
    dry_run_hf,
    make_hf_model,
    track_hf,
    twin_config,
    twin_fine_tune,
)

from .test_dryrun import assert_same_trace  # noqa: E402

# Published sizes (model cards; safetensors index metadata total_size / bytes per parameter), not the code's.
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b-v0.3": 7_248_023_552,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "gemma-2-2b": 2_614_341_888,
    "phi-3-mini-4k": 3_821_079_552,
    "phi-3.5-mini": 3_821_079_552,  # Phi-3-mini's sizes; LongRoPE's scaling adds no parameter
    "smollm2-1.7b": 1_711_376_384,
    "mixtral-8x7b": 46_702_792_704,
}


def test_every_shipped_model_has_its_published_size():
    assert set(PUBLISHED) == set(SHIPPED)
    for name, count in PUBLISHED.items():
        assert meta_parameters(name) == count, name


def test_lora_r16_trains_the_published_number_of_parameters():
    """Llama 3.2 3B's LoRA r=16 adapters: r x (in + out) per adapted linear layer, 28 layers. On q and v:
    28 x 16 x ((3072 + 3072) + (3072 + 1024)) = 4,587,520; on every linear layer of a block (q, k, v, o, gate, up,
    down; peft's all-linear leaves the LM head out) 28 x 16 x (2 x 6144 + 2 x 4096 + 3 x 11264) = 24,313,856."""
    for targets, count in ((("q_proj", "v_proj"), 4_587_520), (None, 24_313_856)):
        ft = FineTune(method="lora", lora_rank=16, dtype="bfloat16", **({"lora_targets": targets} if targets else {}))
        with torch.device("meta"):
            model = make_hf_model("llama-3.2-3b", ft)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == count, targets


def test_configs_from_a_name_a_file_a_folder_or_an_object(tmp_path):
    cfg = hf_config("llama-3.2-1b")
    assert type(cfg).__name__ == "LlamaConfig" and cfg.num_key_value_heads == 8 and cfg.tie_word_embeddings
    assert hf_config(cfg) is cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    for where in (tmp_path / "config.json", tmp_path, str(tmp_path)):
        assert hf_config(where).to_dict() == cfg.to_dict()
    # a shipped model by the Hub name its config.json comes from, in any case
    assert hf_config("Qwen/Qwen2.5-3B").to_dict() == hf_config("qwen2.5-3b").to_dict()
    assert shipped_name("META-LLAMA/Llama-3.2-3B") == "llama-3.2-3b" and shipped_name("Qwen/Qwen2.5-14B") is None


def test_bad_models_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="shipped configurations.*llama-3.1-8b.*mixtral-8x7b.*never read") as e:
        hf_config("meta-llama/Llama-3.1-70B")
    # how to get it, for this very model: the Hub page's download, huggingface_hub's CLI, a gated model's licence
    for how in ("https://huggingface.co/meta-llama/Llama-3.1-70B", "hf download meta-llama/Llama-3.1-70B config.json"):
        assert how in str(e.value)
    assert "licence accepted" in str(e.value) and "hf auth login" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="no 'model_type'"):
        hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        hf_config(tmp_path)
    from transformers import ViTConfig

    with pytest.raises(ValueError, match="not a causal language model"):
        build_model(ViTConfig(), attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation"):
        build_model("gpt2", attn_implementation="flash")
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):  # transformers' own refusal
        build_model(tiny_config("gemma-2-2b"), attn_implementation="sdpa")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        build_model("gpt2", experts_implementation="eager")


def test_phi_35s_published_config_reads_without_a_note(caplog, monkeypatch):
    """transformers notes (once per process, to stderr) that it prefers a rope ``factor`` to Phi-3.5's published
    LongRoPE length; hf.py drops that note alone, so the CLI and the panels print nothing of it."""
    import logging

    import anatomy_helpers.prediction.hf as hf

    def notes():
        return [r for r in caplog.records if "original_max_position_embeddings" in r.getMessage()]

    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process cache: the note would come now
    hf_config("phi-3.5-mini"), tiny_config("phi-3.5-mini")
    assert notes() == []
    logging.Logger.warning_once.cache_clear()
    monkeypatch.setattr(hf, "_not_the_longrope_length_note", lambda record: True)  # without the filter: it comes
    hf_config("phi-3.5-mini")
    assert len(notes()) == 1


def test_tiny_twins_keep_each_architectures_features():
    for name in SHIPPED:
        big, tiny = hf_config(name), tiny_config(name)
        assert type(tiny) is type(big) and tiny.num_hidden_layers == 2 and tiny.vocab_size == 256, name
        assert tiny.tie_word_embeddings == big.tie_word_embeddings, name
        kv_big = getattr(big, "num_key_value_heads", None) or big.num_attention_heads
        kv_tiny = getattr(tiny, "num_key_value_heads", None) or tiny.num_attention_heads
        assert big.num_attention_heads // kv_big == tiny.num_attention_heads // kv_tiny, name  # the GQA ratio
        window = getattr(big, "sliding_window", None)
        assert getattr(tiny, "sliding_window", None) == (None if window is None else 8), name
    gemma = tiny_config("gemma-2-2b")
    assert gemma.attn_logit_softcapping == 50.0 and gemma.final_logit_softcapping == 30.0
    assert gemma.sliding_window == 8 and gemma.layer_types == ["sliding_attention", "full_attention"]
    assert gemma.hidden_size != gemma.num_attention_heads * gemma.head_dim  # as in the 2B model
    mixtral = tiny_config("mixtral-8x7b")
    assert mixtral.num_local_experts == 4 and mixtral.num_experts_per_tok == 2
    phi = tiny_config("phi-3.5-mini").rope_parameters  # LongRoPE: one factor per rotated pair of the tiny head
    assert phi["rope_type"] == "longrope" and len(phi["short_factor"]) == len(phi["long_factor"]) == 8 // 2
    assert phi["original_max_position_embeddings"] == 32 and phi["long_factor"][0] == 1.0800000429153442


def _case(name, **fields):
    return pytest.param(name, fields, id=name + ":" + ",".join(f"{k}={v}" for k, v in fields.items()))


FROZEN = {  # the embeddings and the first layer
    "gpt2": ("transformer.wte.", "transformer.wpe.", "transformer.h.0."),
}
LAYER0 = ("model.embed_tokens.", "model.layers.0.")
# Every shipped architecture at least once, each feature at least once, features combined so the sweep stays short:
# eager/sdpa (Gemma 2: eager only, transformers refuses SDPA with its logit softcapping), full/frozen/LoRA (GPT-2's
# Conv1D, Phi-3's fused projections, chosen targets), checkpointing, bf16 weights and fp32 with bf16 autocast,
# micro-batches, AdamW/Adam/SGD/momentum in single-tensor (CPU's default), foreach and fused implementations.
SWEEP = [
    _case("gpt2", attn_implementation="eager", method="lora", dtype="bfloat16", gradient_checkpointing=True),
    _case("gpt2", method="frozen", freeze=FROZEN["gpt2"], optimizer="sgd"),
    _case("llama-3.2-1b", method="lora", dtype="bfloat16", lora_rank=4, lora_targets=("q_proj", "v_proj")),
    _case(
        "llama-3.1-8b",
        attn_implementation="eager",
        method="frozen",
        freeze=LAYER0,
        autocast="bfloat16",
        optimizer="adam",
        foreach=True,
    ),
    _case("mistral-7b-v0.3", dtype="bfloat16", method="frozen", freeze=("model.layers.",), gradient_checkpointing=True),
    _case("qwen2.5-0.5b", gradient_checkpointing=True, fused=True),
    _case("qwen2.5-7b", attn_implementation="eager", batch_size=2, micro_batches=2),
    # Qwen2's biased q/k/v under bf16 autocast: the bias casts, held by autocast's cache alone, die when it is
    # cleared, in an order set by addresses (the tracker records them oldest first: Recorder.frees_in_allocation_order)
    _case("qwen2.5-0.5b", autocast="bfloat16"),
    _case("gemma-2-2b", attn_implementation="eager", gradient_checkpointing=True, optimizer="momentum", foreach=True),
    _case("phi-3-mini-4k", method="lora", dtype="bfloat16", batch_size=2, micro_batches=2),
    # Phi-3.5's LongRoPE past its original length (the tiny twin's 32 positions): the long factors, picked by a
    # torch.where on the positions (modeling_rope_utils.longrope_frequency_update), not by Python on their values
    _case("phi-3.5-mini", seq_len=48, batch_size=1),
    # a Llama with multi-head attention and no rope scaling
    _case("smollm2-1.7b", method="frozen", freeze=LAYER0, optimizer="adam"),
    # mixture of experts: transformers' default grouped_mm, whose shapes do not depend on the routing
    _case("mixtral-8x7b", dtype="bfloat16", attn_implementation="eager", gradient_checkpointing=True),
    _case("mixtral-8x7b", dtype="bfloat16", method="lora", lora_targets=("q_proj", "v_proj")),
    _case("mixtral-8x7b", experts_implementation="batched_mm", seq_len=8),
]


def _architecture(name: str) -> tuple:
    """What a shipped model's tiny twin runs that another's may not: its configuration class, its rope scaling, and
    whether its attention is grouped-query (the sizes aside, Llama 3.2 3B runs what Llama 3.2 1B runs)."""
    cfg = hf_config(name)
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type")
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return type(cfg).__name__, rope, kv < cfg.num_attention_heads


def test_the_sweep_covers_every_shipped_architecture_and_every_choice():
    """Each shipped architecture's tiny twin (:func:`_architecture`), and each value of each choice, is in the
    byte-for-byte sweep at least once (a sweep trimmed for time that lost one would no longer test it)."""
    cases = [(p.values[0], FineTune(**p.values[1])) for p in SWEEP]
    assert {_architecture(name) for name, _ in cases} == {_architecture(name) for name in SHIPPED}
    seen = lambda field: {getattr(ft, field) for _, ft in cases}  # noqa: E731
    assert seen("method") == {"full", "frozen", "lora"} and seen("attn_implementation") == {"eager", "sdpa"}
    assert seen("dtype") == {"float32", "bfloat16"} and seen("autocast") == {None, "bfloat16"}
    assert seen("gradient_checkpointing") == {False, True} and seen("micro_batches") == {1, 2}
    assert seen("optimizer") == {"adamw", "adam", "sgd", "momentum"}
    assert seen("foreach") == {None, True} and seen("fused") == {None, True}
    assert seen("experts_implementation") == {None, "batched_mm"}


@pytest.mark.parametrize("name, fields", SWEEP)
def test_dry_run_of_a_tiny_twin_equals_its_real_run_byte_for_byte(name, fields):
    cfg, ft = tiny_config(name), FineTune(**fields)
    real = track_hf(cfg, ft, steps=2, kernel_scratch=False)
    dry = dry_run_hf(cfg, ft, steps=2)
    assert_same_trace(dry, real)
    assert dry.peak().bytes == real.peak().bytes and dry.peak().breakdown == real.peak().breakdown


def test_lora_and_frozen_parameters_get_no_gradient_and_no_state():
    cfg = tiny_config("llama-3.2-1b")
    torch.manual_seed(0)
    full = make_hf_model(cfg, FineTune())
    lora = make_hf_model(cfg, FineTune(method="lora", dtype="bfloat16", lora_rank=4))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in full.parameters()) // 10
    assert {p.dtype for p in lora.parameters() if not p.requires_grad} == {torch.bfloat16}  # the frozen base
    full_trace = dry_run_hf(cfg, FineTune(), steps=2)
    lora_trace = dry_run_hf(cfg, FineTune(method="lora", dtype="bfloat16", lora_rank=4), steps=2)
    at_end = lora_trace.phases()[-1].at_end
    trainable_bytes = sum(p.numel() * p.element_size() for p in lora.parameters() if p.requires_grad)
    steps = 4 * len([p for p in lora.parameters() if p.requires_grad])  # AdamW's float32 step count per parameter
    assert at_end["optimizer_state"] == 2 * trainable_bytes + steps  # exp_avg and exp_avg_sq
    assert lora_trace.peak().bytes < full_trace.peak().bytes


def test_bad_fine_tunes_get_clear_errors():
    with pytest.raises(ValueError, match="multiple of micro_batches"):
        FineTune(batch_size=3, micro_batches=2)
    with pytest.raises(ValueError, match="method"):
        FineTune(method="qlora")
    with pytest.raises(ValueError, match="needs freeze"):
        FineTune(method="frozen")
    with pytest.raises(ValueError, match="tuple of parameter-name prefixes"):
        FineTune(method="frozen", freeze="model.layers.0.")
    with pytest.raises(ValueError, match="no parameter name starts with 'decoder.'.*model.layers"):
        dry_run_hf(tiny_config("llama-3.2-1b"), FineTune(method="frozen", freeze=("decoder.",)))
    with pytest.raises(ValueError, match="LoRA target modules.*nonexistent"):
        dry_run_hf(tiny_config("llama-3.2-1b"), FineTune(method="lora", lora_targets=("nonexistent_proj",)))
    # GPT-2's learned positions end at n_positions: past them the real step fails (index out of range), so a dry
    # run, which reads no token ids, is refused there rather than answering for a step that cannot run
    from anatomy_helpers.prediction.hf_step import hf_plan, make_hf_optimizer
    from anatomy_helpers.training.step import run_step

    tiny, long = tiny_config("gpt2"), FineTune(seq_len=65, batch_size=1)
    assert tiny.max_position_embeddings == 64
    model = make_hf_model(tiny, long)
    with pytest.raises(IndexError):
        run_step(model, make_hf_optimizer(model, long), hf_plan(tiny.vocab_size, long), 0)
    for run in (dry_run_hf, track_hf):
        with pytest.raises(ValueError, match=r"seq_len 65 .*GPT2Config.*64 positions"):
            run(tiny, long)


def test_micro_batches_of_a_hugging_face_step_average_their_gradients():
    """The Hugging Face step is the course's run_step, which divides each micro-batch's loss by k: two
    micro-batches of one row leave the gradients of one batch of two rows (the model's loss is the mean over a
    micro-batch's tokens, the same number in each), not twice them."""
    from anatomy_helpers.prediction.hf_step import hf_plan, make_hf_optimizer
    from anatomy_helpers.training.step import run_step

    cfg = tiny_config("llama-3.2-1b")
    grads = {}
    for k in (1, 2):
        ft = FineTune(batch_size=2, micro_batches=k)
        torch.manual_seed(0)
        model = make_hf_model(cfg, ft)
        run_step(model, make_hf_optimizer(model, ft), hf_plan(cfg.vocab_size, ft, optimizer_step=False), 0)
        grads[k] = {name: p.grad for name, p in model.named_parameters()}
    assert grads[1].keys() == grads[2].keys() and all(g is not None for g in grads[2].values())
    for name, whole in grads[1].items():
        torch.testing.assert_close(grads[2][name], whole, rtol=1e-4, atol=1e-6, msg=name)


def test_mixture_of_experts_routing_is_refused_where_it_makes_shapes():
    cfg = tiny_config("mixtral-8x7b")
    # transformers' eager experts loop over the experts the router picked: torch.nonzero's shape is the data's
    with pytest.raises(DryRunError, match=r"aten\.nonzero.*router.*grouped_mm"):
        dry_run_hf(cfg, FineTune(dtype="bfloat16", experts_implementation="eager"))
    # grouped_mm in float32: the CPU kernel runs it, torch's fake kernel accepts bfloat16 only
    with pytest.raises(DryRunError, match=r"aten\._grouped_mm.*bfloat16"):
        dry_run_hf(cfg, FineTune(dtype="float32"))
    real = track_hf(cfg, FineTune(dtype="float32"), steps=1)  # the real step runs
    assert real.peak().bytes > 0


PROFILED = [  # a dense model with LoRA and eager attention, and the mixture of experts
    _case("gemma-2-2b", attn_implementation="eager", method="lora", dtype="bfloat16"),
    _case("mixtral-8x7b", dtype="bfloat16", optimizer="adamw", foreach=True),
]


@pytest.mark.parametrize("name, fields", PROFILED)
def test_tracker_agrees_with_torch_profiler_on_hf_models(name, fields, tmp_path):
    """As tests/test_profiler_agreement.py: two warm-up steps, one tracked, the next profiled; peaks within 0.5 %."""
    from anatomy_helpers.prediction.hf_step import hf_batch, hf_plan, make_hf_optimizer
    from anatomy_helpers.tracking.tracker import StepTracker
    from anatomy_helpers.training.step import run_step

    from .test_profiler_agreement import BOUND, profiled_peaks

    cfg = tiny_config(name, head_dim=16, vocab=512)
    ft = FineTune(batch_size=4, seq_len=32, **fields)
    torch.manual_seed(0)
    model = make_hf_model(cfg, ft)
    opt = make_hf_optimizer(model, ft)
    plan = hf_plan(cfg.vocab_size, ft)  # step i trains on hf_batch(..., i)
    for i in range(2):
        run_step(model, opt, plan, i)
    with StepTracker(model, opt) as tracker:
        run_step(model, opt, plan, 2)
    trace = tracker.trace
    ours = {"step": trace.peak().bytes} | {p: trace.peak(phase=p).bytes for p in ("forward", "backward", "optimizer")}
    # profiled_peaks runs the course's step, model(x, y)[1] then backward and the optimizer: the HF loss in its place
    as_course_model = lambda x, y: (None, model(input_ids=x, labels=y).loss)
    theirs = profiled_peaks(as_course_model, opt, hf_batch(cfg.vocab_size, ft, 3), tmp_path)
    for key, value in theirs.items():
        assert abs(ours[key] - value) <= BOUND * value, (key, ours[key], value, f"{(ours[key] - value) / value:+.3%}")


def test_without_transformers_the_error_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "anatomy_helpers\[hf\]"'):
        hf_config("gpt2")


QUIET = """
import json, warnings
from anatomy_helpers.prediction.hf import tiny_config
from anatomy_helpers.prediction.hf_step import FineTune, dry_run_hf, track_hf
cases = [
    ("gpt2", FineTune()),
    ("gpt2", FineTune(method="frozen", freeze=("transformer.wte.", "transformer.h.0."))),
    ("gpt2", FineTune(method="lora", dtype="bfloat16", gradient_checkpointing=True)),
    ("mixtral-8x7b", FineTune(method="lora", dtype="bfloat16", lora_rank=4)),
]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for name, ft in cases:
        cfg = tiny_config(name)
        track_hf(cfg, ft, steps=1)
        dry_run_hf(cfg, ft, steps=1)
print(json.dumps([f"{w.category.__name__}: {w.message}" for w in caught]))
"""


def test_building_stepping_and_dry_running_print_nothing():
    """A notebook cell that builds a model, tracks a real step and dry-runs one shows no stderr and no warning:
    full, frozen and LoRA fine-tunes of GPT-2 (whose class names no loss: transformers would log its fallback)
    and LoRA on the mixture of experts (whose fused experts peft maps through rank patterns, then warns about).
    A fresh process, as a notebook's kernel: transformers logs each such message once per process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", QUIET], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [] and out.stderr == ""


def test_lora_on_fused_experts_gets_the_rank_peft_maps_it_to():
    """transformers 5.x fuses Mixtral's w1 and w3 into one gate_up_proj: peft gives it twice the rank (its
    rank_pattern, whose "matched no module" warning make_hf_model silences) and down_proj the rank asked for."""
    cfg = tiny_config("mixtral-8x7b")
    model = make_hf_model(cfg, FineTune(method="lora", dtype="bfloat16", lora_rank=4))
    experts = cfg.num_local_experts
    shapes = {n.split("layers.0.")[1]: tuple(p.shape) for n, p in model.named_parameters() if "layers.0.mlp.exp" in n}
    assert shapes["mlp.experts.base_layer.lora_A.default.weight"] == (experts * 2 * 4, cfg.hidden_size)  # gate_up
    assert shapes["mlp.experts.lora_A.default.weight"] == (experts * 4, cfg.intermediate_size)  # down_proj


@pytest.mark.parametrize(
    ("batch", "micro", "seq", "expected"),
    [(4, 1, 1024, (2, 16)), (1, 1, 1024, (1, 16)), (8, 4, 8, (8, 8)), (4, 4, 64, (4, 16)), (6, 2, 16, (4, 16))],
)
def test_the_twin_runs_two_rows_per_micro_batch_where_the_step_does(batch, micro, seq, expected):
    """GPT-2 at batch 4 x 1,024 was refused: its twin ran one row, whose size-1 batch dimension made a bmm input
    contiguous that is not at batch 4, so the big step's bmm signature was never checked."""
    twin = twin_fine_tune(FineTune(batch_size=batch, micro_batches=micro, seq_len=seq))
    assert (twin.batch_size, twin.seq_len, twin.micro_batches) == (*expected, micro)


def test_the_twin_keeps_a_sliding_window_the_step_stays_inside():
    """Phi-3 (window 2,047) at 1,024 tokens has no mask and runs SDPA's fused CPU kernel; a twin whose 16 tokens
    cross a shrunk window runs the math path instead, and the big step's fused kernel went unchecked."""
    cfg = hf_config("phi-3-mini-4k")
    inside = twin_config(cfg, FineTune(seq_len=cfg.sliding_window))
    crossing = twin_config(cfg, FineTune(seq_len=cfg.sliding_window + 1))
    assert inside.sliding_window >= twin_fine_tune(FineTune(seq_len=cfg.sliding_window)).seq_len
    assert crossing.sliding_window < twin_fine_tune(FineTune(seq_len=cfg.sliding_window + 1)).seq_len
    assert twin_config(hf_config("llama-3.2-1b"), FineTune()).to_dict() == tiny_config("llama-3.2-1b").to_dict()


def _written(tmp_path, config) -> str:
    """``config`` (made by transformers' own class) as a config.json in ``tmp_path``, as save_pretrained writes it."""
    folder = tmp_path / type(config).__name__
    folder.mkdir()
    config.to_json_file(folder / "config.json")
    return str(folder)


@pytest.mark.parametrize(
    "cls, sizes, own",
    [
        # BLOOM: n_layer, n_head (its attribute_map) and ALiBi, so no position limit at all
        ("BloomConfig", dict(hidden_size=48, n_layer=3, n_head=6, vocab_size=300), ("n_layer", "n_head")),
        # MPT: d_model, n_heads, n_layers (its attribute_map) and max_seq_len (not mapped)
        ("MptConfig", dict(d_model=48, n_heads=6, n_layers=3, vocab_size=300, max_seq_len=40), ("d_model", "n_heads")),
    ],
)
def test_configs_naming_their_sizes_their_own_way_dry_run_exactly(tmp_path, cls, sizes, own):
    import transformers

    path = _written(tmp_path, getattr(transformers, cls)(**sizes))
    twin = tiny_config(path)
    fields = twin.to_dict()
    assert all(name in fields for name in own) and "max_position_embeddings" not in fields
    assert twin.num_hidden_layers == 2 and twin.vocab_size == 256  # through the class's own names
    if cls == "MptConfig":
        assert fields["max_seq_len"] == 40  # kept: it is under the twin's 64 positions
        with pytest.raises(ValueError, match=r"seq_len 41 .*MptConfig.*40 positions"):
            dry_run_hf(path, FineTune(seq_len=41, attn_implementation="eager"))
    ft = FineTune(batch_size=2, seq_len=16, attn_implementation="eager")  # neither has an SDPA path in transformers
    real = track_hf(twin, ft, steps=2, kernel_scratch=False)
    assert_same_trace(dry_run_hf(twin, ft, steps=2), real)


def test_a_model_without_attention_heads_is_refused_by_name_before_any_dry_run(tmp_path, monkeypatch):
    import transformers

    from anatomy_helpers.prediction import hf_step

    path = _written(tmp_path, transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=300))
    monkeypatch.setattr(hf_step, "fake_run", lambda *a: pytest.fail("the dry run started"))
    with pytest.raises(ValueError, match=r"MambaConfig \(mamba\) has no num_attention_heads"):
        dry_run_hf(path, FineTune(attn_implementation="eager"))


def test_a_masked_lm_config_is_refused_as_not_causal(tmp_path):
    import transformers

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=300)
    path = _written(tmp_path, transformers.BertConfig(**sizes))
    with (
        torch.device("meta"),
        pytest.raises(ValueError, match=r"BertConfig \(bert\) is not a causal.*is_decoder=False"),
    ):
        build_model(path, attn_implementation="eager")
    with torch.device("meta"):  # a BERT decoder attends causally: built
        build_model(transformers.BertConfig(**sizes, is_decoder=True), attn_implementation="eager")
        # a decoder's cross-attention is not causal, its self-attention is: built
        build_model(transformers.BartConfig(d_model=64, vocab_size=300), attn_implementation="eager")


def test_a_config_json_leaving_sizes_to_the_class_defaults_is_refused_naming_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"leaves out hidden_size, num_hidden_layers, .*vocab_size") as e:
        hf_config(tmp_path)
    assert "num_key_value_heads" not in str(e.value)  # Llama's default is None: as many as the query heads
    full = hf_config("qwen2.5-0.5b").to_dict()
    del full["num_key_value_heads"]  # Qwen 2's class default is 32 key/value heads, not the query heads' count
    (tmp_path / "config.json").write_text(json.dumps(full))
    with pytest.raises(ValueError, match=r"leaves out num_key_value_heads: Qwen2Config \(qwen2\)"):
        hf_config(tmp_path)
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(ValueError, match=r"leaves out max_position_embeddings \(n_positions\)"):
        hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(gpt2 | {"n_positions": 128}))  # n_inner: 4 x hidden
    assert hf_config(tmp_path).n_inner is None
