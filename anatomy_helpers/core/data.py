"""The course data: Shakespeare's sonnets (public domain), character by character.

No downloads: the text ships inside the package. Batches are a pure function of
(seed, step), so every run of a notebook sees the same tokens.
"""

from __future__ import annotations

import random
from functools import lru_cache
from importlib import resources

import torch

from .checks import int_in, positive_int

TEXT_FILE = "sonnets.txt"
SEED_LIMIT = 2**32  # seeds and steps live in [0, 2**32), the range numpy's seed accepts


def seed_everything(seed: int = 0) -> None:
    """Seed Python's and torch's random generators (and numpy's, if installed)."""
    seed = int_in("seed_everything: seed", seed, 0, SEED_LIMIT, "2**32")
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional for the model itself
        return
    np.random.seed(seed)


@lru_cache(maxsize=1)
def load_text() -> str:
    """The whole course text as one string."""
    return resources.files(__package__).joinpath("text", TEXT_FILE).read_text(encoding="utf-8")


class CharTokenizer:
    """Maps each distinct character of a text to an integer id and back."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        try:
            return [self.stoi[c] for c in s]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@lru_cache(maxsize=1)
def get_tokenizer() -> CharTokenizer:
    return CharTokenizer(load_text())


@lru_cache(maxsize=1)
def _token_ids() -> torch.Tensor:
    return torch.tensor(get_tokenizer().encode(load_text()), dtype=torch.long)


def max_seq_len() -> int:
    """The longest sequence a course batch can hold: the text's length in tokens minus one (targets are shifted)."""
    return len(_token_ids()) - 1


def check_text_seq_len(seq_len: int, name: str = "seq_len") -> int:
    """``seq_len``, or a ValueError naming ``name`` when it is longer than a course batch can hold
    (:func:`max_seq_len`): what a real run on the course text needs. A dry run needs no text: any length."""
    if seq_len > max_seq_len():
        raise ValueError(
            f"{name}={seq_len} is longer than the course text allows ({len(_token_ids())} characters, so at most "
            f"{max_seq_len()} once targets are shifted by one), and a real run draws its batches from it; a dry run "
            "needs no text (python -m anatomy_helpers predict, dry_run_config): any length"
        )
    return seq_len


def get_batch(
    batch_size: int = 8,
    seq_len: int = 128,
    *,
    step: int = 0,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of next-character prediction examples.

    Returns ``(x, y)``, both (batch_size, seq_len) int64, where ``y`` is ``x``
    shifted by one character. The same (seed, step) always gives the same batch.
    """
    batch_size = positive_int("get_batch: batch_size", batch_size)
    seq_len = positive_int("get_batch: seq_len", seq_len)
    step = int_in("get_batch: step", step, 0, SEED_LIMIT, "2**32")
    seed = int_in("get_batch: seed", seed, 0, SEED_LIMIT, "2**32")
    data = _token_ids()
    check_text_seq_len(seq_len, "get_batch: seq_len")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    # Starts are drawn from [0, len - seq_len - 1); at the longest seq_len that range is empty,
    # so draw from [0, 1): the one window there is. Shorter sequences draw exactly as before.
    starts = torch.randint(max(len(data) - seq_len - 1, 1), (batch_size,), generator=g)
    x = torch.stack([data[i : i + seq_len] for i in starts.tolist()])  # (B, T)
    y = torch.stack([data[i + 1 : i + 1 + seq_len] for i in starts.tolist()])  # (B, T)
    return x.to(device), y.to(device)


# Encode the text once at import, so the first get_batch() inside a tracker does not
# show the 200 KB token tensor as a new allocation of that step.
_token_ids()
