"""Scale from zero: a request for a model with a scale target and no replica is held while the
gateway asks its Waker for one, and is served by the real runtime process started after the
request arrived, once discovery (here: the test, writing the RouteTable) puts it in the route."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvpilot.gateway.proxy import Gateway
from kvpilot.gateway.routing.routes import Backend, Route, RouteTable, ScaleTarget
from tests.support.gateway_process import STARTUP_TIMEOUT_S
from tests.support.server_process import RuntimeServer, free_port

pytestmark = pytest.mark.slow
TARGET = ScaleTarget("team-a", "tiny-md")
HELD = {"md_namespace": "team-a", "md_name": "tiny-md", "model": "tiny"}


class RecordingWaker:
    """The test double of the Waker only: records what the gateway asked to wake."""

    def __init__(self) -> None:
        self.calls: list[ScaleTarget] = []

    async def wake(self, target: ScaleTarget) -> None:
        self.calls.append(target)


def test_a_held_request_is_served_by_the_replica_started_after_it(tmp_path: Path) -> None:
    replicas: list[RuntimeServer] = []
    try:
        asyncio.run(scenario(tmp_path, replicas))
    finally:
        assert [r.stop() for r in replicas] == [0] * len(replicas)


async def scenario(tmp_path: Path, replicas: list[RuntimeServer]) -> None:
    table, waker = RouteTable(), RecordingWaker()
    table.put(Route("tiny", scale_target=TARGET, fallback_after_s=600))
    gateway = Gateway(table, waker=waker)
    runner = web.AppRunner(gateway.app(), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4}
            url = f"http://127.0.0.1:{port}/v1/completions"
            request = asyncio.ensure_future(session.post(url, json=body))
            await asyncio.wait_for(held_becomes(gateway, 1), 30)
            assert waker.calls[0] == TARGET
            # The replica starts only now; the request waits for it, held.
            replica = RuntimeServer([], tmp_path / "replica.log", wait=False)
            replicas.append(replica)
            await asyncio.to_thread(replica.wait_ready, STARTUP_TIMEOUT_S)
            assert not request.done()
            table.put(Route("tiny", (Backend("team-a/tiny-0", replica.url),), (), TARGET, 600))
            response = await asyncio.wait_for(request, 120)
            assert response.status == 200, await response.text()
            assert response.headers["x-kvpilot-backend"] == "team-a/tiny-0"
            assert (await response.json())["usage"]["completion_tokens"] == 4
            assert held(gateway) == 0
    finally:
        await runner.cleanup()


def held(gateway: Gateway) -> float | None:
    return gateway.metrics.registry.get_sample_value("kvpilot_gateway_requests_held", HELD)


async def held_becomes(gateway: Gateway, value: float) -> None:
    while held(gateway) != value:
        await asyncio.sleep(0.05)
