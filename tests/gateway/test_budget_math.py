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
    settlement,
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
    if delta is None:
        assert deltas == []
    else:
        assert [d.amount for d in deltas] == [pytest.approx(delta)]
        assert deltas[0].counter == charged[0].counter
        assert deltas[0].amount + charged[0].amount == pytest.approx(actual)
