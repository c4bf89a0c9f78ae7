import time

import pytest
import torch

from anatomy_helpers import GPT, ModelConfig, get_batch, get_tokenizer, make_model, make_optimizer, train_step
from anatomy_helpers.core import model as model_module
from anatomy_helpers.core.data import max_seq_len
from anatomy_helpers.core.model import param_count


def test_parameter_count_matches_closed_form():
    cfg = ModelConfig(n_layer=3, d_model=96, n_head=4, seq_len=64)
    h, v, L, s = cfg.d_model, cfg.vocab_size, cfg.n_layer, cfg.seq_len
    # N = h*v + L*(12h^2 + 13h) + 2h for tied embeddings (see formulas.py); we add learned positions s*h.
    assert GPT(cfg).num_params() == h * v + L * (12 * h * h + 13 * h) + 2 * h + s * h


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(n_layer=3, d_model=96, n_head=4, seq_len=64),
        dict(n_layer=2, d_model=48, n_head=3, mlp_ratio=2, vocab_size=64, seq_len=20),
        dict(n_layer=1, d_model=32, n_head=2, mlp_ratio=1, attn_impl="sdpa", dtype="bfloat16", checkpoint="full"),
    ],
)
def test_formulas_param_count_matches_the_model(kwargs):
    cfg = ModelConfig(**kwargs)
    assert param_count(cfg) == GPT(cfg).num_params()


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
        (dict(dropout=-0.1), "dropout"),
        (dict(dropout=None), "dropout"),
        (dict(dropout="0.1"), "dropout"),
        (dict(dropout=True), "dropout"),
        (dict(dropout=float("nan")), "dropout"),
        (dict(dropout=float("inf")), "dropout"),
        (dict(vocab_size=10), "vocab_size"),
        (dict(seq_len=0), "seq_len"),
        (dict(checkpoint="sometimes"), "checkpoint"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        ModelConfig(**kwargs)


def test_config_errors_say_the_rule():
    with pytest.raises(ValueError, match="course text needs at least 59 token ids"):
        ModelConfig(vocab_size=58)


def test_edge_configs_are_accepted():
    ModelConfig(dropout=0)  # an int is a number too
    ModelConfig(vocab_size=64)  # padding the vocabulary, as nanoGPT does, is fine
    ModelConfig(seq_len=max_seq_len())
    ModelConfig(seq_len=max_seq_len() + 1)  # longer than the course text: a dry run needs none (get_batch refuses)


def test_too_many_parameters_fail_fast_with_the_size():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"48,000,241,000,000 parameters = [\d,.]+ GiB in float32; this machine has"):
        GPT(ModelConfig(d_model=1_000_000))  # about 180 TiB of weights
    assert time.perf_counter() - start < 1.0


def test_ram_check_runs_before_any_tensor_is_built(monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("a tensor was built before the RAM check")

    monkeypatch.setattr(model_module, "host_ram_bytes", lambda: 2**20)  # a 1 MiB machine
    monkeypatch.setattr(torch.nn, "Embedding", no_allocation)
    with pytest.raises(ValueError, match=r"this machine has 0\.0 GiB of RAM"):
        GPT(ModelConfig())


def test_ram_check_is_skipped_where_the_os_does_not_say(monkeypatch):
    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(model_module.os, "sysconf", no_sysconf)
    assert model_module.host_ram_bytes() is None
    assert GPT(ModelConfig(n_layer=1, d_model=32, n_head=2)).num_params() > 0


def test_too_long_input_is_refused():
    model = GPT(ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=16))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer(GPT(ModelConfig(n_layer=1, d_model=32, n_head=2)), "lion")
