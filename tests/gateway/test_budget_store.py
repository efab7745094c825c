"""Both budget stores (this process's memory, a real redis-server) keep the same contract:
reserve is all-or-nothing and atomic, adjust settles, a window's counter expires at its end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from kvpilot.gateway.budget.arithmetic import Charge
from kvpilot.gateway.budget.store import BudgetStore, Denied, MemoryStore, RedisStore, StoreError
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401

Scenario = Callable[[BudgetStore], Awaitable[None]]


@pytest.fixture(params=["memory", "redis"])
def run(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,  # noqa: F811
) -> Callable[[Scenario], None]:
    """Runs a scenario on a fresh store of the kind the param names (on its own event loop)."""
    redis_server.client().flushdb()

    async def on_store(scenario: Scenario) -> None:
        is_memory = request.param == "memory"
        store: BudgetStore = MemoryStore() if is_memory else RedisStore(redis_server.url)
        try:
            await scenario(store)
        finally:
            await store.close()

    return lambda scenario: asyncio.run(on_store(scenario))


def charge(counter: str, limit: float, amount: float, ttl_s: float = 60) -> Charge:
    return Charge(counter, limit, amount, time.time() + ttl_s)


def test_reserve_takes_room_until_none_is_left(run: Callable[[Scenario], None]) -> None:
    async def scenario(store: BudgetStore) -> None:
        assert await store.reserve([charge("a", 100, 60)]) is None
        assert await store.reserve([charge("a", 100, 41)]) == Denied(0, 60.0, 60.0)
        assert await store.reserve([charge("a", 100, 40)]) is None  # exactly full is allowed
        assert await store.read("a") == 100

    run(scenario)


def test_reserve_is_all_or_nothing_and_names_the_full_counter(
    run: Callable[[Scenario], None],
) -> None:
    async def scenario(store: BudgetStore) -> None:
        await store.reserve([charge("team", 100, 90)])
        assert await store.reserve([charge("key", 1000, 5), charge("team", 100, 20)]) == Denied(
            1, 90, 90
        )
        assert await store.read("key") == 0  # the key's counter was not charged either

    run(scenario)


def test_adjust_settles_and_a_counter_expires_with_its_window(
    run: Callable[[Scenario], None],
) -> None:
    async def scenario(store: BudgetStore) -> None:
        await store.reserve([charge("a", 100, 80, ttl_s=0.5)])
        await store.adjust([charge("a", 100, -50, ttl_s=0.5)])
        assert await store.read("a") == pytest.approx(30)
        await asyncio.sleep(0.7)
        assert await store.read("a") == 0
        await store.adjust(
            [Charge("a", 100, 5, time.time() - 1)]
        )  # a window that ended: left alone
        assert await store.read("a") == 0
        await store.adjust([charge("b", 100, 7)])  # admitted unreserved (fail open): created
        assert await store.read("b") == 7

    run(scenario)


def test_a_refusal_tells_settled_use_from_reservations_in_flight(
    run: Callable[[Scenario], None],
) -> None:
    """Issue 40 item 7: a reservation is in flight until its settlement releases it."""

    async def scenario(store: BudgetStore) -> None:
        first, second = charge("a", 100, 80), charge("a", 100, 10)
        assert await store.reserve([first]) is None
        assert await store.reserve([second]) is None
        assert await store.reserve([charge("a", 100, 40)]) == Denied(0, 90, 90)  # all in flight
        await store.adjust([Charge("a", 100, 70 - 80, first.expires_at, release=80)])
        assert await store.reserve([charge("a", 100, 40)]) == Denied(0, 80, 10)  # 70 settled
        await store.adjust([Charge("a", 100, 0, second.expires_at, release=10)])
        assert await store.reserve([charge("a", 100, 40)]) == Denied(0, 80, 0)
        assert await store.read("a") == 80
        await store.adjust([charge("b", 100, 7)])  # admitted unreserved: nothing in flight
        assert await store.reserve([charge("b", 100, 99)]) == Denied(0, 7, 0)

    run(scenario)


def test_concurrent_reservations_never_overfill(run: Callable[[Scenario], None]) -> None:
    async def scenario(store: BudgetStore) -> None:
        results = await asyncio.gather(*(store.reserve([charge("a", 1000, 90)]) for _ in range(40)))
        assert sum(result is None for result in results) == 11  # 11 x 90 = 990 <= 1000
        assert await store.read("a") == 990

    run(scenario)


def test_redis_down_is_a_store_error_and_it_recovers(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    asyncio.run(outage(redis_server))


async def outage(redis_server: RedisServer) -> None:  # noqa: F811
    store = RedisStore(redis_server.url)
    assert await store.reserve([charge("x", 10, 1)]) is None
    await store.ping()
    redis_server.stop()
    try:
        with pytest.raises(StoreError, match="redis"):
            await store.reserve([charge("x", 10, 1)])
        with pytest.raises(StoreError, match="redis"):
            await store.ping()  # readiness: /ready answers 503
    finally:
        redis_server.start()
    await store.ping()
    assert await store.reserve([charge("x", 10, 1)]) is None  # the Lua script is loaded again
    await store.close()
