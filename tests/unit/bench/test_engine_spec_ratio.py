"""The speculative-decoding benchmarks compare two configurations within each round (the runs
back to back), not best round against best round (bench.engine_spec.Ratio)."""

from __future__ import annotations

import pytest

from bench.engine_spec import Ratio, Run


def runs(*tok_s: float) -> list[Run]:
    return [Run(tok_s=rate, acceptance=0.0, tokens_per_step=1.0) for rate in tok_s]


@pytest.mark.parametrize(
    ("spec", "plain", "median", "low", "high"),
    [
        # one round: its ratio
        ((110.0,), (100.0,), 1.1, 1.1, 1.1),
        # odd: the middle round's ratio, however the rates drift between rounds
        ((99.0, 60.0, 202.0), (100.0, 50.0, 200.0), 1.01, 0.99, 1.2),
        # even: between the two middle ones
        ((90.0, 100.0, 110.0, 120.0), (100.0, 100.0, 100.0, 100.0), 1.05, 0.9, 1.2),
        # a pause of the machine halved one run: the median keeps to the other rounds
        ((101.0, 50.0, 102.0), (100.0, 100.0, 100.0), 1.01, 0.5, 1.02),
    ],
)
def test_ratio_compares_within_rounds(
    spec: tuple[float, ...], plain: tuple[float, ...], median: float, low: float, high: float
) -> None:
    ratio = Ratio.of(runs(*spec), runs(*plain))
    assert (ratio.median, ratio.low, ratio.high) == pytest.approx((median, low, high))


def test_ratio_needs_the_same_rounds() -> None:
    with pytest.raises(ValueError):
        Ratio.of(runs(1.0, 2.0), runs(1.0))


def test_ratio_reads_as_median_and_range() -> None:
    assert str(Ratio.of(runs(99.0, 110.0, 104.0), runs(100.0, 100.0, 100.0))) == (
        "1.04x (0.99-1.10)"
    )
