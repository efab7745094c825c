"""The speculative-decoding benchmarks' figures: two configurations compared within each round
(the runs back to back), not best round against best round (bench.engine_spec.Ratio), and what
the steps with proposals cost net, priced at the rate of the steps without in the same run
(Counts.net_cost)."""

from __future__ import annotations

import pytest

from bench.engine_spec import MIN_STEPS_WITHOUT, Counts, Ratio, Run


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


def counts(with_: tuple[int, int, float], without: tuple[int, int, float]) -> Counts:
    """A 10 s run whose steps of 4 sequences or more, with proposals and without, are
    (steps, tokens, seconds)."""
    return Counts(1000, 10.0, 100, 0, 0, *with_, *without)


@pytest.mark.parametrize(
    ("with_", "without", "net"),
    [
        # 100 tokens in 2 s with proposals; without, 32 tokens take 0.1 s, so 100 would have
        # taken 0.3125 s: 1.6875 s more, of 10
        ((10, 100, 2.0), (30, 960, 3.0), 0.16875),
        # proposals gave tokens faster than steps without: a gain
        ((10, 640, 1.0), (30, 960, 3.0), -0.1),
        # the same rate: nothing lost or won, however big the steps with proposals were
        ((10, 480, 1.5), (30, 960, 3.0), 0.0),
    ],
)
def test_net_cost_prices_tokens_at_the_rate_without_proposals(
    with_: tuple[int, int, float], without: tuple[int, int, float], net: float
) -> None:
    assert counts(with_, without).net_cost() == pytest.approx(net)


@pytest.mark.parametrize(
    ("with_", "without"),
    [
        ((0, 0, 0.0), (30, 960, 3.0)),  # nothing proposed
        ((10, 100, 2.0), (MIN_STEPS_WITHOUT - 1, 600, 2.0)),  # too few steps for a rate
    ],
)
def test_net_cost_needs_both_kinds_of_step(
    with_: tuple[int, int, float], without: tuple[int, int, float]
) -> None:
    assert counts(with_, without).net_cost() is None


def test_steps_add_up_by_kind() -> None:
    total = Counts.of_step(40, 0.2, True) + Counts.of_step(32, 0.1, False)
    total += Counts.of_step(32, 0.1, False)
    assert total == Counts(0, 0.0, 0, 0, 0, 1, 40, 0.2, 2, 64, 0.2)
