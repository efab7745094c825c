"""The open-loop sweep's offered rates (bench/gateway_routing.py): chosen from the closed loop's
req/s of random and prefix routing, or given with --rates."""

from __future__ import annotations

import argparse

import pytest

from bench.gateway_routing import parse_rates, sweep_rates


@pytest.mark.parametrize(
    ("random_rps", "prefix_rps", "rates"),
    [
        # the last run's closed loop: half of random's, random's, halfway to prefix's
        (22.2, 37.59, [11.1, 22.2, 29.9]),
        (10.0, 20.0, [5.0, 10.0, 15.0]),
        # prefix no faster (noise on a loaded machine): the last two coincide, two rates
        (10.0, 10.0, [5.0, 10.0]),
        (10.0, 8.0, [5.0, 10.0]),
        # rounding to one decimal never offers 0 req/s
        (0.08, 0.1, [0.1]),
    ],
)
def test_sweep_rates(random_rps: float, prefix_rps: float, rates: list[float]) -> None:
    assert sweep_rates(random_rps, prefix_rps) == rates


@pytest.mark.parametrize(
    ("text", "rates"),
    [("10", [10.0]), ("30,10.5,20", [10.5, 20.0, 30.0]), ("0.5, 2", [0.5, 2.0])],
)
def test_parse_rates(text: str, rates: list[float]) -> None:
    assert parse_rates(text) == rates


@pytest.mark.parametrize("text", ["0,10", "-1", "10,-2"])
def test_parse_rates_refuses_rates_not_above_zero(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_rates(text)
