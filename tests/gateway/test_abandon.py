"""A client that goes away leaves no budget charged: the gateway (a real aiohttp server with
`handler_cancellation`, as the CLI runs it) settles in its handler's `finally`, to its end even
though the handler is cancelled. Here the request waits for a replica (held at zero) when the
client leaves, so it was never sent upstream and its whole reservation comes back."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web

from kvpilot.gateway.budget.arithmetic import Price
from kvpilot.gateway.budget.config import KeysDocument, key_book
from kvpilot.gateway.budget.keys import KeyRing, KeysPolicy
from kvpilot.gateway.budget.policy import BudgetPolicy
from kvpilot.gateway.budget.store import MemoryStore
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.proxy import Gateway
from kvpilot.gateway.routing.routes import Route, RouteTable, ScaleTarget
from tests.support.server_process import free_port

KEYS = KeysDocument.model_validate(
    {"keys": [{"key": "sk-leaver", "limits": [{"unit": "total_tokens", "limit": 1000,
                                               "window": "1h"}]}]}
)  # fmt: skip
HELD = {"md_namespace": "ns", "md_name": "tiny-md", "model": "tiny"}


class NoopWaker:
    """The Waker protocol only (nothing to wake here: the client leaves first)."""

    async def wake(self, target: ScaleTarget) -> None:
        return None


def test_a_client_leaving_a_held_request_gets_its_reservation_back() -> None:
    asyncio.run(scenario())


async def scenario() -> None:
    table, metrics, store = RouteTable(), GatewayMetrics(), MemoryStore()
    table.put(Route("tiny", scale_target=ScaleTarget("ns", "tiny-md"), fallback_after_s=600))
    keys = KeysPolicy(KeyRing(key_book(KEYS.keys, KEYS.teams)))
    budget = BudgetPolicy(store, metrics, {"tiny": Price()}.get)
    gateway = Gateway(table, waker=NoopWaker(), metrics=metrics, policies=[keys, budget])
    runner = web.AppRunner(gateway.app(), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 100}
        headers = {"Authorization": "Bearer sk-leaver"}
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/completions"
            request = asyncio.ensure_future(session.post(url, json=body, headers=headers))
            await asyncio.wait_for(until(lambda: held(gateway) == 1), 10)
            assert totals(store) == {"total_tokens": 113.0}  # reserved
            request.cancel()  # the client goes away
            with contextlib.suppress(asyncio.CancelledError):
                await request
        await asyncio.wait_for(until(lambda: held(gateway) == 0), 10)
        await asyncio.wait_for(until(lambda: totals(store)["total_tokens"] == 0), 10)
        assert totals(store) == {"total_tokens": 0.0}
    finally:
        await runner.cleanup()


def totals(store: MemoryStore) -> dict[str, float]:
    return {key.split(":")[-3]: value for key, (value, _) in store.counters.items()
            if not key.endswith(":in_flight")}  # fmt: skip


def held(gateway: Gateway) -> float | None:
    return gateway.metrics.registry.get_sample_value("kvpilot_gateway_requests_held", HELD)


async def until(condition: object) -> None:
    assert callable(condition)
    while not condition():
        await asyncio.sleep(0.02)
