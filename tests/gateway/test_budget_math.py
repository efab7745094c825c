"""Budget arithmetic: fixed windows, what a request reserves, how it settles."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from kvpilot.gateway.budget.arithmetic import (
    Limit,
    Price,
    amounts,
    charges,
    parse_window,
    retry_after_s,
    settled_of,
    settlement,
    upper_price,
)


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("1m", 60), ("minute", 60), ("5m", 300), ("1h", 3600), ("hour", 3600),
     ("1d", 86400), ("day", 86400), ("week", 7 * 86400), ("30d", 30 * 86400), ("month", 0)],
)  # fmt: skip
def test_windows_parse(text: str, seconds: int) -> None:
    assert parse_window(text).seconds == seconds


@pytest.mark.parametrize("text", ["", "0m", "1y", "h", "1.5h", "monthly", "-1m"])
def test_bad_windows_say_what_to_write(text: str) -> None:
    with pytest.raises(ValueError, match="like 1m, 1h, 1d"):
        parse_window(text)


@pytest.mark.parametrize(
    ("window", "now", "end"),
    [
        ("1m", "2026-12-03T19:30:10", "2026-12-03T19:31:00"),
        ("1h", "2026-12-03T19:30:10", "2026-12-03T20:00:00"),
        ("1d", "2026-12-03T19:30:10", "2026-12-04T00:00:00"),
        ("month", "2026-12-03T19:30:10", "2027-01-01T00:00:00"),  # a year rolls over
        ("month", "2026-02-28T23:59:59", "2026-03-01T00:00:00"),
    ],
)
def test_a_fixed_window_ends_on_its_boundary(window: str, now: str, end: str) -> None:
    assert parse_window(window).end(at(now)) == at(end)


def test_a_new_window_has_a_new_counter_and_retry_after_counts_to_its_start() -> None:
    limit = Limit("key:abc", "total_tokens", 2000, parse_window("1h"))
    now = at("2026-12-03T19:30:00")
    assert limit.counter(now) == limit.counter(now + 1799)
    assert limit.counter(now) != limit.counter(now + 1800)
    assert retry_after_s(limit, now) == 1800
    assert retry_after_s(limit, now + 1799.5) == 1


@pytest.mark.parametrize(
    ("unit", "reserved", "actual", "delta"),
    [
        ("requests", 1, 1, None),  # nothing to change
        ("input_tokens", 40, 12, -28),
        ("output_tokens", 100, 37, -63),
        ("total_tokens", 140, 49, -91),
        ("cost", 100 * 2.0 / 1e6, 37 * 2.0 / 1e6, -63 * 2.0 / 1e6),  # output priced only
    ],
)
def test_settlement_turns_the_reservation_into_the_use(
    unit: str, reserved: float, actual: float, delta: float | None
) -> None:
    price = Price(input_per_million=0.0, output_per_million=2.0)
    limit = Limit("team:research", unit, 10_000, parse_window("1h"))
    now = at("2026-12-03T19:30:00")
    charged = charges([limit], amounts(1, 40, 100, price), now)
    assert charged[0].amount == pytest.approx(reserved)
    deltas = settlement(charged, [limit], amounts(1, 12, 37, price))
    assert [d.amount for d in deltas] == [pytest.approx(delta or 0.0)]
    assert deltas[0].counter == charged[0].counter
    assert deltas[0].amount + charged[0].amount == pytest.approx(actual)
    assert deltas[0].release == charged[0].amount  # no longer in flight


HOUR = Limit("key:abc", "output_tokens", 100, parse_window("1h"))
HALF_PAST = at("2026-12-03T19:30:00")


@pytest.mark.parametrize(
    ("used", "in_flight", "amount", "retry"),
    [
        (80, 80, 40, 1),  # only requests in flight keep it out: they settle soon
        (80, 60, 80, 1),  # 20 settled + 80 fits once they settle
        (80, 0, 40, 1800),  # real spend: the window's end
        (80, 30, 80, 1800),  # 50 settled + 80 does not fit even then
        (100, 100, 101, 1800),  # more than the whole limit (first_too_big answers 400 first)
        (80, 80.0000001, 40, 1),  # float drift: in flight never above the counter
        (80, -0.0000001, 40, 1800),  # nor below zero
    ],
)  # fmt: skip
def test_retry_after_is_short_when_only_requests_in_flight_hold_the_room(
    used: float, in_flight: float, amount: float, retry: int
) -> None:
    assert retry_after_s(HOUR, HALF_PAST, used, in_flight, amount) == retry


def test_retry_after_in_flight_never_passes_the_window_end() -> None:
    assert retry_after_s(HOUR, HALF_PAST + 1799.5, 80, 80, 40) == 1


@pytest.mark.parametrize(
    ("used", "in_flight", "settled"),
    [(80, 80, 0), (80, 30, 50), (80, 0, 80), (80, 90, 0), (80, -1, 80), (0, 0, 0)],
)
def test_settled_is_the_counter_less_what_is_in_flight(
    used: float, in_flight: float, settled: float
) -> None:
    assert settled_of(used, in_flight) == settled


@pytest.mark.parametrize(
    ("prices", "upper"),
    [
        ([], None),
        ([None, None], None),
        ([Price(100, 100), Price(1, 1)], Price(100, 100)),  # a cheap fallback: the model's
        ([Price(1, 1), Price(100, 100)], Price(100, 100)),  # a dear fallback bounds it
        ([Price(5, 1), None, Price(1, 9)], Price(5, 9)),  # input and output apart
    ],
)
def test_a_reservation_is_priced_at_the_dearest_model_that_may_serve(
    prices: list[Price | None], upper: Price | None
) -> None:
    assert upper_price(prices) == upper
