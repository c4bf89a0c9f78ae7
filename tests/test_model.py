import pytest
import torch

from anatomy_helpers import GPT, ModelConfig, get_batch, get_tokenizer, make_model, make_optimizer, train_step


def test_parameter_count_matches_closed_form():
    cfg = ModelConfig(n_layer=3, d_model=96, n_head=4, seq_len=64)
    h, v, L, s = cfg.d_model, cfg.vocab_size, cfg.n_layer, cfg.seq_len
    # REFERENCES.md: N = h*v + L*(12h^2 + 13h) + 2h for tied embeddings; we add learned positions s*h.
    assert GPT(cfg).num_params() == h * v + L * (12 * h * h + 13 * h) + 2 * h + s * h


def test_default_vocab_matches_course_text():
    assert ModelConfig().vocab_size == get_tokenizer().vocab_size


def test_submodule_names_are_stable():
    names = dict(GPT(ModelConfig(n_layer=2)).named_modules())
    for name in [
        "tok_emb",
        "pos_emb",
        "blocks.0.ln1",
        "blocks.0.attn",
        "blocks.0.attn.qkv",
        "blocks.0.attn.proj",
        "blocks.1.ln2",
        "blocks.1.mlp",
        "blocks.1.mlp.fc",
        "blocks.1.mlp.gelu",
        "blocks.1.mlp.proj",
        "ln_f",
        "lm_head",
    ]:
        assert name in names, name


def test_manual_and_sdpa_attention_agree():
    x, y = get_batch(2, 32)
    losses = []
    for impl in ("manual", "sdpa"):
        model = make_model(device="cpu", n_layer=2, d_model=64, n_head=2, seq_len=32, attn_impl=impl)
        losses.append(model(x, y)[1].item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_full_checkpointing_gives_the_same_gradients():
    x, y = get_batch(2, 32)
    grads = []
    for mode in ("none", "full"):
        model = make_model(device="cpu", n_layer=2, d_model=64, n_head=2, seq_len=32, checkpoint=mode)
        model(x, y)[1].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_bf16_model_trains_on_cpu():
    model = make_model(device="cpu", n_layer=1, d_model=64, n_head=2, seq_len=32, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    loss = train_step(model, make_optimizer(model, "adamw"), *get_batch(2, 32))
    assert torch.isfinite(torch.tensor(loss))


def test_dropout_changes_training_but_not_eval():
    model = make_model(device="cpu", n_layer=1, d_model=64, n_head=2, seq_len=32, dropout=0.5)
    x, y = get_batch(2, 32)
    assert model(x, y)[1].item() != model(x, y)[1].item()
    model.eval()
    assert model(x, y)[1].item() == model(x, y)[1].item()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(d_model=100, n_head=3), "d_model"),
        (dict(n_layer=0), "n_layer"),
        (dict(seq_len=-1), "seq_len"),
        (dict(attn_impl="flash"), "attn_impl"),
        (dict(dtype="float16"), "dtype"),
        (dict(dropout=1.5), "dropout"),
        (dict(checkpoint="sometimes"), "checkpoint"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        ModelConfig(**kwargs)


def test_too_long_input_is_refused():
    model = GPT(ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=16))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer(GPT(ModelConfig(n_layer=1, d_model=32, n_head=2)), "lion")
