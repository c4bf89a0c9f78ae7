"""The shared argument checks: every refusal names the argument and shows the value; good values come back."""

import math

import pytest

from anatomy_helpers.core.checks import (
    int_in,
    one_of,
    optional_callable,
    positive_int,
    positive_number,
    torch_at_least,
    whole_bytes,
)


@pytest.mark.parametrize("bad", [0, -1, 1.0, 2.5, "2", True, None, math.nan])
def test_positive_int_refuses(bad):
    with pytest.raises(ValueError, match=r"^world_size must be a positive integer, got "):
        positive_int("world_size", bad)


def test_positive_int_bounds_and_returns_an_int():
    assert positive_int("n", 3) == 3 and type(positive_int("n", 7)) is int
    with pytest.raises(ValueError, match=r"n must be an integer from 1 to 4, got 5"):
        positive_int("n", 5, at_most=4)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0, -1e-3, "1e-3", True, None])
def test_positive_number_refuses(bad):
    with pytest.raises(ValueError, match=r"^lr must be a finite positive number, got "):
        positive_number("lr", bad)


def test_positive_number_allows_zero_when_asked():
    assert positive_number("p", 0, allow_zero=True) == 0.0
    assert positive_number("lr", 3) == 3.0


@pytest.mark.parametrize("bad", [1.5, math.nan, math.inf, "100", 0, -512, True])
def test_whole_bytes_refuses(bad):
    with pytest.raises(ValueError, match=r"^size must be a positive whole number of bytes, got "):
        whole_bytes("size", bad)


def test_whole_bytes_takes_whole_floats():
    assert whole_bytes("size", 1024.0) == 1024 and whole_bytes("size", 0, allow_zero=True) == 0


def test_int_in_one_of_and_callables():
    assert int_in("seed", 0, 0, 2**32, "2**32") == 0
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\), got -1"):
        int_in("seed", -1, 0, 2**32, "2**32")
    assert one_of("impl", "fused", ("single", "fused")) == "fused"
    with pytest.raises(ValueError, match=r"impl must be one of \('single', 'fused'\), got 'triton'"):
        one_of("impl", "triton", ("single", "fused"))
    assert optional_callable("after_step", None) is None and optional_callable("after_step", print) is print
    with pytest.raises(ValueError, match=r"after_step must be a function \(or None\), got str 'x'"):
        optional_callable("after_step", "x")


def test_torch_at_least_reads_major_and_minor_and_says_how_to_upgrade():
    torch_at_least((2, 11), "x", version="2.11.0+cu130")
    torch_at_least((2, 9), "x", version="2.13.0")  # 13 > 9: compared as numbers, not as text
    old = r"a dry run of ranks needs torch 2\.11 or newer; this is torch 2\.10\.0\+cu128"
    with pytest.raises(RuntimeError, match=old):
        torch_at_least((2, 11), "a dry run of ranks", version="2.10.0+cu128")
    with pytest.raises(RuntimeError, match=r"pip install -U 'torch>=2\.9'"):
        torch_at_least((2, 9), "real ranks", version="2.6.0")


@pytest.mark.parametrize(
    "rank, world_size, why",
    [
        (0, 0, "world_size must be a positive integer"),
        (2, 2, r"rank must be in \[0, world_size\) = \[0, 2\)"),
        (-1, 2, "rank must be in"),
        (True, 2, "rank must be in"),
        (0, 5, "world_size must be an integer from 1 to 4"),
    ],
)
def test_rank_of_world_is_the_one_check_of_a_rank_and_its_world(rank, world_size, why):
    from anatomy_helpers.core.checks import rank_of_world

    with pytest.raises(ValueError, match=why):
        rank_of_world(rank, world_size, at_most=4 if world_size == 5 else None)
    assert rank_of_world(1, 2) == (1, 2)
