"""Where budget counters live: in this process (one replica) or in Redis (shared by replicas).

`reserve` is all-or-nothing and atomic: every counter has room for its amount and all are
incremented, or none is and the first full one is named. In Redis one Lua script does it, so two
gateway replicas never both take the last room; a counter expires at its window's end. Beside
each counter the store keeps the part of it reserved by requests still in flight (a reservation
adds to both, its settlement releases it), so a refusal can tell settled use from reservations.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvpilot.gateway.budget.arithmetic import Charge, in_flight_counter


class StoreError(RuntimeError):
    """The store could not answer (Redis down, timed out)."""


@dataclass(frozen=True)
class Denied:
    index: int  # of the first charge that did not fit
    used: float  # what its counter holds already (settled use and reservations in flight)
    in_flight: float = 0.0  # of `used`: reserved by requests not settled yet


class BudgetStore(Protocol):
    async def reserve(self, charges: Sequence[Charge]) -> Denied | None: ...

    async def adjust(self, deltas: Sequence[Charge]) -> None:
        """Add each `amount` (negative: give back) to its counter and take its `release` off
        the counter's in-flight part; a counter whose window has ended is left alone; a missing
        one is created (a request admitted while the store was down settles its use)."""
        ...

    async def read(self, counter: str) -> float: ...

    async def ping(self) -> None:
        """Return when the store answers; StoreError when it does not (readiness)."""
        ...

    async def close(self) -> None: ...


class MemoryStore:
    """Counters in a dict: for a single gateway replica (the default without --redis-url)."""

    def __init__(self) -> None:
        self.counters: dict[str, tuple[float, float]] = {}  # key -> (value, expires_at)

    def _value(self, key: str, now: float) -> float:
        value, expires_at = self.counters.get(key, (0.0, 0.0))
        return value if expires_at > now else 0.0

    async def reserve(self, charges: Sequence[Charge]) -> Denied | None:
        now = time.time()
        for index, charge in enumerate(charges):
            used = self._value(charge.counter, now)
            if used + charge.amount > charge.limit:
                return Denied(index, used, self._value(in_flight_counter(charge.counter), now))
        for charge in charges:
            self._add(charge.counter, charge.amount, charge.expires_at, now)
            self._add(in_flight_counter(charge.counter), charge.amount, charge.expires_at, now)
        self._drop_expired(now)
        return None

    async def adjust(self, deltas: Sequence[Charge]) -> None:
        now = time.time()
        for delta in deltas:
            if delta.expires_at > now:
                self._add(delta.counter, delta.amount, delta.expires_at, now)
                if delta.release:
                    self._add(in_flight_counter(delta.counter), -delta.release,
                              delta.expires_at, now)  # fmt: skip

    def _add(self, key: str, amount: float, expires_at: float, now: float) -> None:
        self.counters[key] = (self._value(key, now) + amount, expires_at)

    async def read(self, counter: str) -> float:
        return self._value(counter, time.time())

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _drop_expired(self, now: float) -> None:
        if len(self.counters) > 10_000:  # bounded: old windows' counters go
            self.counters = {k: v for k, v in self.counters.items() if v[1] > now}


# KEYS: n counters, then their n in-flight parts; ARGV: per counter (limit, amount, expire-at ms).
# Returns 0, or {index, used, in flight}.
RESERVE_LUA = """
local n = #KEYS / 2
for i = 1, n do
  local used = tonumber(redis.call('GET', KEYS[i]) or '0')
  if used + tonumber(ARGV[3 * i - 1]) > tonumber(ARGV[3 * i - 2]) then
    return {i, tostring(used), redis.call('GET', KEYS[n + i]) or '0'}
  end
end
for i = 1, n do
  for _, key in ipairs({KEYS[i], KEYS[n + i]}) do
    redis.call('INCRBYFLOAT', key, ARGV[3 * i - 1])
    redis.call('PEXPIREAT', key, ARGV[3 * i])
  end
end
return 0
"""

# KEYS: n counters, then their n in-flight parts; ARGV: per counter (delta, minus the release,
# expire-at ms), then now (ms). A counter of a window that has ended is not recreated.
ADJUST_LUA = """
local now = tonumber(ARGV[#ARGV])
local n = #KEYS / 2
for i = 1, n do
  local expires_at = tonumber(ARGV[3 * i])
  if expires_at > now then
    redis.call('INCRBYFLOAT', KEYS[i], ARGV[3 * i - 2])
    redis.call('PEXPIREAT', KEYS[i], expires_at)
    if tonumber(ARGV[3 * i - 1]) ~= 0 then
      redis.call('INCRBYFLOAT', KEYS[n + i], ARGV[3 * i - 1])
      redis.call('PEXPIREAT', KEYS[n + i], expires_at)
    end
  end
end
return 0
"""


class RedisStore:
    """Counters in Redis, shared by every gateway replica. Short timeouts and no retries: a
    request must not wait on a Redis that is down (the policy fails closed or open at once);
    the pool reconnects on the next command once Redis answers again."""

    def __init__(self, url: str, timeout_s: float = 0.5) -> None:
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        self._reserve = self.client.register_script(RESERVE_LUA)
        self._adjust = self.client.register_script(ADJUST_LUA)

    async def reserve(self, charges: Sequence[Charge]) -> Denied | None:
        args: list[float | int] = []
        for charge in charges:
            args += [charge.limit, charge.amount, int(charge.expires_at * 1000)]
        try:
            result = await self._reserve(keys=with_in_flight(charges), args=args)
        except aioredis.RedisError as error:
            raise StoreError(f"redis: {error}") from error
        if result == 0:
            return None
        return Denied(int(result[0]) - 1, float(result[1]), float(result[2]))

    async def adjust(self, deltas: Sequence[Charge]) -> None:
        if not deltas:
            return
        args: list[float | int] = []
        for delta in deltas:
            args += [delta.amount, -delta.release, int(delta.expires_at * 1000)]
        try:
            await self._adjust(keys=with_in_flight(deltas), args=[*args, int(time.time() * 1000)])
        except aioredis.RedisError as error:
            raise StoreError(f"redis: {error}") from error

    async def read(self, counter: str) -> float:
        try:
            value = await self.client.get(counter)
        except aioredis.RedisError as error:
            raise StoreError(f"redis: {error}") from error
        return float(value or 0)

    async def ping(self) -> None:
        try:
            await self.client.ping()
        except aioredis.RedisError as error:
            raise StoreError(f"redis: {error}") from error

    async def close(self) -> None:
        await self.client.aclose()


def with_in_flight(charges: Sequence[Charge]) -> list[str]:
    """The scripts' KEYS: the counters, then their in-flight parts in the same order."""
    counters = [c.counter for c in charges]
    return counters + [in_flight_counter(c) for c in counters]
