"""Budget arithmetic, pure: windows, limits, what a request reserves and what it settles to.

Windows are FIXED, aligned to the Unix epoch (`1m`, `5m`, `1h`, `1d`, `7d`...) or to the calendar
month in UTC (`month`): a counter per window, reset when the next window starts, so `Retry-After`
is exact (the window's end) and one Redis key per counter holds the whole state (LiteLLM's
`budget_duration` resets the same way). A request is admitted only when every limit it counts
against still has room for its whole reservation (prompt tokens as counted + `max_tokens` x `n`),
so settled use never exceeds a limit as long as the reservation bounds the real use (its cost at
the highest price of the models that may serve it: a fallback is charged at its own price).

A counter holds the settled use and the reservations of requests still in flight; the store keeps
the in-flight part beside it, so a refusal caused only by requests in flight says so and asks for
a retry when they finish, not at the window's end.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

UNITS = ("requests", "input_tokens", "output_tokens", "total_tokens", "cost")
WINDOW_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
NAMED_WINDOWS = {"minute": "1m", "hour": "1h", "day": "1d", "week": "7d"}
MONTH = "month"
_WINDOW = re.compile(r"^([1-9][0-9]*)([smhd])$")


@dataclass(frozen=True)
class Window:
    """A fixed window: `seconds` long, or a calendar month (seconds == 0)."""

    text: str
    seconds: int

    def index(self, now: float) -> int:
        if self.seconds:
            return int(now // self.seconds)
        moment = datetime.fromtimestamp(now, UTC)
        return moment.year * 12 + moment.month - 1

    def end(self, now: float) -> float:
        """When the window holding `now` ends (its counter resets)."""
        index = self.index(now)
        if self.seconds:
            return float((index + 1) * self.seconds)
        year, month = divmod(index + 1, 12)
        return datetime(year, month + 1, 1, tzinfo=UTC).timestamp()


def parse_window(text: str) -> Window:
    """`30s`, `1m`, `5m`, `1h`, `1d`, `30d`, `minute`, `hour`, `day`, `week` or `month`."""
    text = text.strip()
    if text == MONTH:
        return Window(MONTH, 0)
    match = _WINDOW.match(NAMED_WINDOWS.get(text, text))
    if match is None:
        raise ValueError(
            f"window {text!r} is not a duration like 1m, 1h, 1d, 30d or one of minute, hour, "
            "day, week, month"
        )
    return Window(text, int(match.group(1)) * WINDOW_SECONDS[match.group(2)])


@dataclass(frozen=True)
class Limit:
    """At most `limit` of `unit` per `window`, counted for one key or one team (`scope`)."""

    scope: str  # "key:<key_id>" or "team:<name>"
    unit: str
    limit: float
    window: Window
    slot: str = ""  # the Redis Cluster hash tag: the team, else the key's scope (`hash_tag`)

    def counter(self, now: float) -> str:
        """The store key of the current window's counter. Every counter a request is charged on
        (its key's and its team's) carries the same hash tag `{<team>}`, so they live in one
        Redis Cluster slot and one Lua script may touch them all."""
        tag = self.slot or self.scope
        window = f"{self.window.text}:{self.window.index(now)}"
        return f"kvpilot:budget:{{{tag}}}:{self.scope}:{self.unit}:{window}"

    def describe(self) -> str:
        return f"{self.scope} {self.unit} {self.limit:g} per {self.window.text}"


@dataclass(frozen=True)
class Price:
    """USD (or the operator's currency) per 1M tokens."""

    input_per_million: float = 0.0
    output_per_million: float = 0.0


@dataclass(frozen=True)
class Amounts:
    """Use of one request in every unit."""

    requests: float
    input_tokens: float
    output_tokens: float
    cost: float

    @property
    def total_tokens(self) -> float:
        return self.input_tokens + self.output_tokens

    def of(self, unit: str) -> float:
        return float(getattr(self, unit))


def upper_price(prices: Iterable[Price | None]) -> Price | None:
    """A price at least each given one's, for input and output alike (None: none is priced)."""
    known = [p for p in prices if p is not None]
    if not known:
        return None
    return Price(max(p.input_per_million for p in known),
                 max(p.output_per_million for p in known))  # fmt: skip


def amounts(
    requests: float, input_tokens: float, output_tokens: float, price: Price | None
) -> Amounts:
    cost = 0.0
    if price is not None:
        cost = (input_tokens * price.input_per_million
                + output_tokens * price.output_per_million) / 1e6  # fmt: skip
    return Amounts(requests, input_tokens, output_tokens, cost)


@dataclass(frozen=True)
class Charge:
    """One counter a request is charged on: its store key, the limit, and the amount."""

    counter: str
    limit: float
    amount: float
    expires_at: float  # the window's end: the counter is dropped then
    release: float = 0.0  # a settlement: the reservation no longer in flight


def in_flight_counter(counter: str) -> str:
    """The store key holding the part of `counter` reserved by requests still in flight (the
    same hash tag: one Redis Cluster slot)."""
    return f"{counter}:in_flight"


def charges(limits: list[Limit], use: Amounts, now: float) -> list[Charge]:
    return [Charge(lim.counter(now), lim.limit, use.of(lim.unit), lim.window.end(now))
            for lim in limits]  # fmt: skip


def settlement(reserved: list[Charge], limits: list[Limit], actual: Amounts) -> list[Charge]:
    """The adjustments (amount: actual - reserved) that turn each reservation into the use, each
    releasing its reservation from the in-flight part."""
    return [Charge(charge.counter, charge.limit, actual.of(lim.unit) - charge.amount,
                   charge.expires_at, release=charge.amount)
            for charge, lim in zip(reserved, limits, strict=True)]  # fmt: skip


IN_FLIGHT_RETRY_S = 1  # a request in flight settles within seconds; a client waits that long


def retry_after_s(limit: Limit, now: float, used: float = 0.0, in_flight: float = 0.0,
                  amount: float = 0.0) -> int:  # fmt: skip
    """Seconds until a request reserving `amount` may fit, its counter holding `used` of which
    `in_flight` is reserved by requests not yet settled: shortly, when the settled use leaves it
    room (only reservations in flight keep it out, and they settle to their use when those
    requests end), else when the window resets (a fixed window frees everything at its end)."""
    window_rest = max(1, math.ceil(limit.window.end(now) - now))
    if in_flight > 0 and settled_of(used, in_flight) + amount <= limit.limit:
        return min(IN_FLIGHT_RETRY_S, window_rest)
    return window_rest


def settled_of(used: float, in_flight: float) -> float:
    """A counter's settled part (in-flight reservations are part of it; float sums may drift)."""
    return max(0.0, used - min(max(in_flight, 0.0), used))
