"""bench.slo_step's pure parts: the step's arrivals, window arithmetic, attainment per window from
histogram buckets and from the client's TTFTs, cold starts from pods, and the verdict."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.slo_step_common import (
    ClientRequest,
    Share,
    Window,
    client_share,
    cold_starts,
    histogram_share,
    merged,
    never_ready,
    reason_kind,
    split,
    step_arrivals,
    ttft_target,
    verdict,
)


@pytest.mark.parametrize(
    ("start", "end", "width", "expected"),
    [
        (0, 90, 30, [(0, 30), (30, 60), (60, 90)]),
        (0, 100, 30, [(0, 30), (30, 60), (60, 90)]),  # the short last piece is left out
        (10, 35, 30, []),
        (100, 160, 20, [(100, 120), (120, 140), (140, 160)]),
    ],
)
def test_split_cuts_full_windows(
    start: float, end: float, width: float, expected: list[tuple[float, float]]
) -> None:
    assert split(Window(start, end), width) == [Window(a, b) for a, b in expected]


def test_split_refuses_a_width_of_zero() -> None:
    with pytest.raises(ValueError, match="window width must be > 0"):
        split(Window(0, 10), 0)


@pytest.mark.parametrize(
    ("a", "b", "overlap"),
    [
        ((0, 10), (5, 15), True),
        ((0, 10), (10, 20), False),  # end excluded
        ((0, 10), (2, 3), True),
        ((5, 6), (0, 5), False),
    ],
)
def test_window_overlap(a: tuple[float, float], b: tuple[float, float], overlap: bool) -> None:
    assert Window(*a).overlaps(Window(*b)) is overlap
    assert Window(*b).overlaps(Window(*a)) is overlap


def test_step_arrivals_quadruple_the_rate_at_the_step() -> None:
    times = step_arrivals(rate=5.0, base_s=400, factor=4.0, step_s=400, seed=0)
    before = sum(1 for t in times if t < 400)
    after = len(times) - before
    assert times == sorted(times) and times[0] > 0 and times[-1] < 800
    # Poisson counts: 2,000 +- 45 and 8,000 +- 89 (one standard deviation); 4 sigma each way
    assert abs(before - 2000) < 4 * math.sqrt(2000)
    assert abs(after - 8000) < 4 * math.sqrt(8000)
    assert step_arrivals(5.0, 400, 4.0, 400, seed=0) == times  # the seed fixes the run


@pytest.mark.parametrize(
    ("measured", "headroom", "expected"),
    [
        (0.03, 2.0, 0.06),
        (0.06, 2.0, 0.25),
        (0.2, 2.5, 0.5),  # on a bound exactly
        (0.4, 2.0, 1.0),
    ],
)
def test_ttft_target_is_the_next_bucket_bound(
    measured: float, headroom: float, expected: float
) -> None:
    bounds = (0.01, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)
    assert ttft_target(measured, headroom, bounds) == expected


def test_ttft_target_beyond_the_buckets_is_refused() -> None:
    with pytest.raises(ValueError, match="no TTFT bucket bound"):
        ttft_target(10.0, 2.0, (0.1, 1.0, math.inf))


def vector(rates: dict[str, float]) -> list[dict[str, Any]]:
    """A Prometheus instant vector summed by `le`, as the API returns it."""
    return [{"metric": {"le": le}, "value": [0, str(rate)]} for le, rate in rates.items()]


@pytest.mark.parametrize(
    ("rates", "target", "share", "requests"),
    [
        # 2 req/s over a 30 s window: 60 requests, 1.8/s of them under 0.25 s
        ({"0.1": 1.0, "0.25": 1.8, "0.5": 2.0, "+Inf": 2.0}, 0.25, 0.9, 60),
        # between bounds: linear inside the bucket (histogram_quantile's assumption)
        ({"0.1": 1.0, "0.5": 2.0, "+Inf": 2.0}, 0.3, 0.75, 60),
        # a target beyond the last finite bound counts what is under that bound
        ({"0.1": 1.0, "1": 1.5, "+Inf": 2.0}, 5.0, 0.75, 60),
        # every request inside
        ({"0.1": 2.0, "+Inf": 2.0}, 0.1, 1.0, 60),
        # a window without requests, or without two scrapes (NaN)
        ({"0.1": 0.0, "+Inf": 0.0}, 0.1, None, 0),
        ({"0.1": float("nan"), "+Inf": float("nan")}, 0.1, None, 0),
    ],
)
def test_histogram_share(
    rates: dict[str, float], target: float, share: float | None, requests: float
) -> None:
    found = histogram_share(vector(rates), target, width_s=30)
    assert found.share == (None if share is None else pytest.approx(share))
    assert found.requests == pytest.approx(requests)


@pytest.mark.parametrize(
    ("requests", "share", "count"),
    [
        # sent at 5 with a 2 s TTFT: counted at 7, inside [0, 10)
        ([ClientRequest(5, 2.0), ClientRequest(1, 0.1)], 0.5, 2),
        # first token at 11: the next window's
        ([ClientRequest(9, 2.0), ClientRequest(1, 0.1)], 1.0, 1),
        # a failure counts as a miss when it was sent
        ([ClientRequest(3, None), ClientRequest(1, 0.5)], 0.5, 2),
        # exactly on the target is inside it (the histogram's `le`)
        ([ClientRequest(1, 1.0)], 1.0, 1),
        ([], None, 0),
    ],
)
def test_client_share(requests: list[ClientRequest], share: float | None, count: float) -> None:
    assert client_share(requests, Window(0, 10), target_s=1.0) == Share(share, count)


def pod(created: str, ready: str | None, status: str = "True") -> dict[str, Any]:
    conditions = [] if ready is None else [
        {"type": "Ready", "status": status, "lastTransitionTime": ready}
    ]  # fmt: skip
    return {"metadata": {"creationTimestamp": created}, "status": {"conditions": conditions}}


T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def test_cold_starts_of_the_pods_created_during_the_run() -> None:
    pods = [
        pod("2027-01-15T07:59:00Z", "2027-01-15T07:59:09Z"),  # before the run: not counted
        pod("2027-01-15T08:01:00Z", "2027-01-15T08:01:07Z"),
        pod("2027-01-15T08:00:30Z", "2027-01-15T08:00:30Z", status="False"),  # not Ready
        pod("2027-01-15T08:00:20Z", None),  # Pending: no Ready condition at all
        pod("2027-01-15T08:00:10Z", "2027-01-15T08:00:21Z"),
    ]
    assert cold_starts(pods, since=T0) == [Window(T0 + 10, T0 + 21), Window(T0 + 60, T0 + 67)]
    assert never_ready(pods, since=T0) == 2


@pytest.mark.parametrize(
    ("windows", "expected"),
    [
        ([(0, 10), (5, 12), (20, 30)], [(0, 12), (20, 30)]),
        ([(20, 30), (0, 10)], [(0, 10), (20, 30)]),
        ([(0, 10), (10, 11)], [(0, 11)]),
        ([], []),
    ],
)
def test_merged_joins_overlapping_cold_starts(
    windows: list[tuple[float, float]], expected: list[tuple[float, float]]
) -> None:
    assert merged([Window(*w) for w in windows]) == [Window(*w) for w in expected]


MET, MISSED, EMPTY = Share(0.99, 50), Share(0.80, 50), Share(None, 0)


@pytest.mark.parametrize(
    ("shares", "cold", "held", "num_missed", "num_unexcused", "used"),
    [
        ([MET, MET, MET], [], True, 0, 0, 0),
        ([MET, MISSED, MET], [(12, 18)], True, 1, 0, 1),  # inside one cold start
        ([MET, MISSED, MISSED], [(15, 25)], True, 2, 0, 1),  # one cold start across two windows
        ([MET, MISSED, MISSED], [], False, 2, 2, 0),  # no cold start to excuse them
        ([MISSED, MET, MISSED], [(5, 8), (25, 28)], False, 2, 0, 2),  # two cold starts
        ([MISSED, MET, MISSED], [(5, 8), (6, 9)], False, 2, 1, 1),  # merged; one miss outside
        ([EMPTY, MET], [], True, 0, 0, 0),  # a window without requests misses nothing
    ],
)
def test_verdict(
    shares: list[Share],
    cold: list[tuple[float, float]],
    held: bool,
    num_missed: int,
    num_unexcused: int,
    used: int,
) -> None:
    windows = split(Window(0, 10 * len(shares)), 10)
    found = verdict(list(zip(windows, shares, strict=True)), [Window(*c) for c in cold], 95.0)
    assert (len(found.missed), len(found.unexcused), found.cold_starts_used) == (
        num_missed,
        num_unexcused,
        used,
    )
    assert found.held is held


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("hold at 2: SLO ttft 5s p95: arrivals 0.57/s (30s); 2.0 slots",
         "hold at 2: SLO ttft 5s p95: arrivals 0.61/s (30s); 2.0 slots", True),
        ("hold at 2: SLO ttft 5s p95: arrivals 0.50/s (30s), 2 waiting; 2.0 slots",
         "hold at 2: SLO ttft 5s p95: arrivals 0.64/s (30s); 2.0 slots", True),
        ("hold at 2: SLO ttft 5s p95: arrivals 0.5/s (30s)",
         "hold at 2: guard queue 3.50/replica vs target 2 (SLO sizing 5)", False),
        ("scale up 1->2: SLO", "hold at 2: SLO", False),
    ],
)  # fmt: skip
def test_reason_kind(a: str, b: str, same: bool) -> None:
    assert (reason_kind(a) == reason_kind(b)) is same
