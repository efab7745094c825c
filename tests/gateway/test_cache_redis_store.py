"""The Redis cache store keeps the in-process LRU's bounds (entries, bytes) over every gateway
that shares it, evicting the least recently used and counting why each entry left; checked on a
real redis-server, reading the entries Redis holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

from kvpilot.gateway.cache.rules import Entry
from kvpilot.gateway.cache.store import ENTRY_PREFIX, TOTAL, RedisStore
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401

Scenario = Callable[[RedisStore, RedisStore], Awaitable[None]]


def entry(size: int) -> Entry:
    return Entry(False, b"x" * size)


STORED = len(entry(100).to_bytes())  # an entry's size in Redis (its tag included)


@pytest.fixture
def fresh(redis_server: RedisServer) -> Iterator[RedisServer]:  # noqa: F811
    redis_server.client().flushdb()
    yield redis_server


def run_on_two(
    server: RedisServer, scenario: Scenario, max_entries: int, max_bytes: int, ttl_s: float = 60
) -> list[str]:
    """`scenario` on two stores sharing the server (two gateway replicas); why entries left."""
    evicted: list[str] = []

    async def both() -> None:
        one, two = (RedisStore(server.url, ttl_s, max_entries, max_bytes, evicted.append)
                    for _ in range(2))  # fmt: skip
        try:
            await scenario(one, two)
        finally:
            await one.close()
            await two.close()

    asyncio.run(both())
    return evicted


def held(server: RedisServer) -> list[str]:
    names = server.client().keys(ENTRY_PREFIX + "*")
    return sorted(n.decode()[len(ENTRY_PREFIX) :] for n in names if isinstance(n, bytes))


@pytest.mark.parametrize(
    ("max_entries", "max_bytes", "left"),
    [(2, 10_000, ["a", "b"]), (10, 2 * STORED + 50, ["a", "b"]), (10, 10_000, ["a", "b", "c"])],
)
def test_the_least_recently_used_goes_when_a_bound_is_passed(
    fresh: RedisServer, max_entries: int, max_bytes: int, left: list[str]
) -> None:
    async def scenario(one: RedisStore, two: RedisStore) -> None:
        assert await one.put("c", entry(100))
        assert await two.put("b", entry(100))
        assert await two.get("c") == entry(100)  # c used most recently (on the other replica)
        assert await one.get("b") == entry(100)  # ...then b: c is the least recently used
        assert await two.put("a", entry(100))

    evicted = run_on_two(fresh, scenario, max_entries, max_bytes)
    assert held(fresh) == left
    assert evicted == ["size"] * (3 - len(left))
    assert int(fresh.client().get(TOTAL) or 0) == STORED * len(left)


def test_an_entry_over_the_byte_bound_is_not_stored(fresh: RedisServer) -> None:
    async def scenario(one: RedisStore, _: RedisStore) -> None:
        assert not await one.put("big", entry(STORED))

    assert run_on_two(fresh, scenario, 10, STORED) == []
    assert held(fresh) == []


def test_expired_entries_leave_the_bounds_and_are_counted(fresh: RedisServer) -> None:
    async def scenario(one: RedisStore, two: RedisStore) -> None:
        assert await one.put("old", entry(100))
        assert await one.put("old", entry(100))  # replaced: counted once
        deadline = time.monotonic() + 10
        while await two.get("old") is not None:  # its TTL (0.2 s) passes
            assert time.monotonic() < deadline, "the entry never expired"
            await asyncio.sleep(0.05)
        assert await two.put("new", entry(100))

    evicted = run_on_two(fresh, scenario, 1, 10_000, ttl_s=0.2)
    assert evicted == ["expired"]  # the bound of 1 entry did not push `new` out
    assert held(fresh) == ["new"]
    assert int(fresh.client().get(TOTAL) or 0) == STORED
