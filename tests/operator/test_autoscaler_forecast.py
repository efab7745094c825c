"""Table tests for kvpilot.operator.autoscaling.forecast: demand one cold start ahead."""

from __future__ import annotations

import math

import pytest

from kvpilot.operator.autoscaling.forecast import (
    ArrivalRates,
    forecast,
    significant_fall,
    significant_trend,
)

LEAD_S = 70.0  # a 60 s cold start plus a 10 s tick

# (case id, short rate, long rate, waiting, expected arrivals/s to provision for, trend/s2)
CASES = [
    ("steady load: the rate seen", 4.0, 4.0, 0.0, 4.0, 0.0),
    # 4.4 vs 4.0: sd of the difference is sqrt(4 x (1/30 - 1/120)) = 0.32, so 0.4 is noise
    ("a rise within Poisson noise: the long window's rate", 4.4, 4.0, 0.0, 4.0, 0.0),
    # 7.27 vs 5.97 is 3.4 sd (sd 0.39): seen on steady load at 6/s in the simulator, which at
    # 2 sd asked for 7 replicas where 4 held it
    ("a rise of 3.4 sd on steady load is still noise", 7.27, 5.97, 0.0, 5.97, 0.0),
    # +2/s over the 45 s between the windows' centres: 0.0444/s2, x 70 s = +3.1/s
    ("a significant rise is extrapolated over the lead", 8.0, 6.0, 0.0, 8.0 + 2 / 45 * 70, 2 / 45),
    # a step from 2 to 14/s seen at 14 (short) and 5 (long): x2 cap at 28
    ("a step's extrapolation is capped at twice the rate", 14.0, 5.0, 0.0, 28.0, 9 / 45),
    # 5.0 vs 6.0 is 2.6 sd (sd 0.39): a quiet half-minute, not a fall
    ("a fall within noise: the long window holds the fleet", 5.0, 6.0, 0.0, 6.0, 0.0),
    # 2.0 vs 6.0 is 10 sd: the load has left; the long window would hold it for two minutes
    ("a fall beyond noise: the short window's rate", 2.0, 6.0, 0.0, 2.0, 0.0),
    ("no traffic at all", 0.0, 0.0, 0.0, 0.0, 0.0),
]


@pytest.mark.parametrize(
    ("short", "long", "waiting", "arrivals", "trend"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_forecast_table(
    short: float, long: float, waiting: float, arrivals: float, trend: float
) -> None:
    ahead = forecast(ArrivalRates(short, long), waiting, LEAD_S)
    assert ahead.arrivals_per_s == pytest.approx(arrivals)
    assert ahead.trend_per_s2 == pytest.approx(trend)
    assert ahead.backlog_per_s == 0.0


def test_the_queue_is_a_backlog_cleared_within_the_lead() -> None:
    ahead = forecast(ArrivalRates(4.0, 4.0), waiting=140.0, lead_s=LEAD_S)
    assert ahead.backlog_per_s == pytest.approx(2.0)
    assert ahead.demand_per_s == pytest.approx(6.0)
    assert "140 waiting" in ahead.reason


def test_a_longer_cold_start_provisions_further_ahead() -> None:
    rates = ArrivalRates(8.0, 6.0)
    near, far = forecast(rates, 0.0, 20.0), forecast(rates, 0.0, 60.0)
    assert near.arrivals_per_s < far.arrivals_per_s


def test_significance_is_in_standard_deviations_of_poisson_noise() -> None:
    rates = ArrivalRates(5.0, 4.0)
    sd = math.sqrt(4.0 * (1 / 30 - 1 / 120))  # 0.316
    assert significant_trend(rates, significance=1.0 / sd - 0.01) > 0
    assert significant_trend(rates, significance=1.0 / sd + 0.01) == 0


@pytest.mark.parametrize(
    ("short", "long", "falling"),
    [(2.0, 6.0, True), (5.0, 6.0, False), (6.0, 6.0, False), (8.0, 6.0, False), (0.0, 0.0, False)],
)
def test_a_fall_is_flagged_only_beyond_noise(short: float, long: float, falling: bool) -> None:
    ahead = forecast(ArrivalRates(short, long), 0.0, LEAD_S)
    assert ahead.falling is falling
    assert ("falling" in ahead.reason) is falling


def test_a_fall_is_measured_in_standard_deviations_like_a_rise() -> None:
    rates = ArrivalRates(3.0, 4.0)
    sd = math.sqrt(4.0 * (1 / 30 - 1 / 120))  # 0.316
    assert significant_fall(rates, significance=1.0 / sd - 0.01)
    assert not significant_fall(rates, significance=1.0 / sd + 0.01)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: ArrivalRates(-1.0, 1.0),
        lambda: ArrivalRates(1.0, 1.0, short_window_s=120.0, long_window_s=30.0),
        lambda: forecast(ArrivalRates(1.0, 1.0), waiting=-1.0, lead_s=10.0),
        lambda: forecast(ArrivalRates(1.0, 1.0), waiting=0.0, lead_s=-1.0),
    ],
)
def test_invalid_inputs_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        bad()  # type: ignore[operator]
