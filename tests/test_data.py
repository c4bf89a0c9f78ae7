import math

import pytest
import torch

from anatomy_helpers import get_batch, get_tokenizer, load_text, make_model, make_optimizer, train_step


def test_text_is_small_and_shipped():
    text = load_text()
    assert 10_000 < len(text.encode()) <= 300_000
    assert text.startswith("THE SONNETS")


def test_tokenizer_round_trips():
    tok = get_tokenizer()
    s = "Shall I compare thee to a summer's day?"
    assert tok.decode(tok.encode(s)) == s
    with pytest.raises(ValueError, match="not in the tokenizer"):
        tok.encode("\u00e9")


def test_batches_are_deterministic_and_shifted():
    x1, y1 = get_batch(4, 16, step=3, seed=1)
    x2, y2 = get_batch(4, 16, step=3, seed=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (4, 16) and x1.dtype == torch.long
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, get_batch(4, 16, step=4, seed=1)[0])


def test_bad_batch_shapes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        get_batch(0, 16)
    with pytest.raises(ValueError, match="longer than the course text"):
        get_batch(1, 10**7)


def test_loss_goes_down_on_the_default_config():
    model = make_model(device="cpu")
    opt = make_optimizer(model, "adamw")
    losses = [train_step(model, opt, *get_batch(8, model.cfg.seq_len, step=i)) for i in range(30)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, (first, last)
    # better than guessing uniformly among the characters, ln(vocab), by a clear margin
    assert last < math.log(model.cfg.vocab_size) - 0.7, last
