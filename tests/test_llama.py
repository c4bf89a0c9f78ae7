"""The Llama-shaped block: RMSNorm, SwiGLU, rotary positions, grouped-query attention, tied or untied head."""

import pytest
import torch

from anatomy_helpers import GPT, ModelConfig, get_batch, make_model, make_optimizer, train_step
from anatomy_helpers.core.model import LlamaBlock, RMSNorm, apply_rotary, llama_param_count, param_count, rotary_tables
from anatomy_helpers.prediction.dryrun import dry_run_config

LLAMA = dict(block="llama", n_layer=2, d_model=64, n_head=4, seq_len=32)

#: The Ultra-Scale Playbook's Llama 3.2 1B: 16 layers, hidden 2048, 32 heads, 8 kv heads, MLP 8192, tied.
PLAYBOOK_1B = dict(
    block="llama", n_layer=16, d_model=2048, n_head=32, n_kv_head=8, mlp_ratio=4, vocab_size=128256, seq_len=4096
)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(n_kv_head=2),
        dict(n_kv_head=1, tie_embeddings=False),
        dict(n_kv_head=4, mlp_ratio=3, vocab_size=100),
    ],
)
def test_param_count_closed_form_matches_the_model(kwargs):
    cfg = ModelConfig(**{**LLAMA, **kwargs})
    model = GPT(cfg)
    h, v, L, k, d, F = cfg.d_model, cfg.vocab_size, cfg.n_layer, cfg.kv_heads, cfg.head_dim, cfg.mlp_ratio * 64
    # q and out-proj h^2 each, k and v h*k*d each, three SwiGLU matrices h*F, two RMSNorms; embedding, final norm
    expected = h * v + L * (2 * h * h + 2 * h * k * d + 3 * h * F + 2 * h) + h + (0 if cfg.tie_embeddings else h * v)
    assert model.num_params() == param_count(cfg) == llama_param_count(cfg) == expected
    assert isinstance(model.blocks[0], LlamaBlock) and isinstance(model.ln_f, RMSNorm)
    assert not hasattr(model, "pos_emb")
    assert (model.lm_head.weight is model.tok_emb.weight) == cfg.tie_embeddings


def test_untied_gpt2_head_adds_h_times_v():
    tied, untied = ModelConfig(), ModelConfig(tie_embeddings=False)
    assert (
        GPT(untied).num_params() - GPT(tied).num_params()
        == tied.d_model * tied.vocab_size
        == (param_count(untied) - param_count(tied))
    )


def test_playbook_1b_model_states_from_the_config_alone():
    cfg = ModelConfig(**PLAYBOOK_1B)
    n = param_count(cfg)
    assert round(n / 1e9, 2) == 1.24
    assert round(n * 4 / 2**30, 2) == 4.60  # fp32 parameters (the Playbook's "4.60 GB")
    assert round(2 * n * 4 / 2**30, 2) == 9.21  # Adam's two fp32 moments ("9.21 GB")


def test_playbook_1b_dry_run_model_states():
    cfg = ModelConfig(**{**PLAYBOOK_1B, "seq_len": 128, "attn_impl": "sdpa"})
    trace = dry_run_config(cfg, batch_size=1, steps=1, foreach=True)
    n = param_count(cfg)
    rotary = cfg.n_layer * 2 * cfg.seq_len * (cfg.head_dim // 2) * 4  # cos and sin buffers, (s, D/2) fp32 per layer
    assert trace.baseline["parameters"] == n * 4 + rotary
    state = trace.phase(1, "optimizer").at_end["optimizer_state"]
    n_tensors = len(_param_shapes(cfg))
    assert state == 2 * n * 4 + 4 * n_tensors  # exp_avg, exp_avg_sq, and a 4-byte step per tensor


def _param_shapes(cfg):
    with torch.device("meta"):
        return [p.shape for p in GPT(cfg).parameters()]


def test_rotary_keeps_norms_and_rotates_relative_positions():
    cos, sin = rotary_tables(8, 4)
    assert cos.shape == sin.shape == (8, 2)
    x = torch.randn(1, 1, 8, 4)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation
    torch.testing.assert_close(y[..., 0, :], x[..., 0, :])  # position 0 turns by 0


@pytest.mark.parametrize("impl", ["manual", "sdpa"])
def test_llama_trains_and_attention_impls_agree(impl):
    x, y = get_batch(2, 32)
    model = make_model(device="cpu", attn_impl=impl, n_kv_head=2, **LLAMA)
    assert torch.isfinite(torch.tensor(train_step(model, make_optimizer(model), x, y)))


def test_manual_and_sdpa_give_the_same_llama_loss():
    x, y = get_batch(2, 32)
    losses = [make_model(device="cpu", attn_impl=i, n_kv_head=2, **LLAMA)(x, y)[1].item() for i in ("manual", "sdpa")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block="mamba"), "ModelConfig.block"),
        (dict(block="llama", n_head=4, n_kv_head=3), "ModelConfig.n_kv_head"),
        (dict(block="llama", n_head=4, n_kv_head=0), "ModelConfig.n_kv_head"),
        (dict(n_head=4, n_kv_head=2), "ModelConfig.n_kv_head"),
        (dict(tie_embeddings="yes"), "ModelConfig.tie_embeddings"),
        (dict(block="llama", d_model=12, n_head=4), "even"),
    ],
)
def test_bad_llama_configs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kwargs)
