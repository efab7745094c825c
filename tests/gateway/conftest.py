"""Fixtures of the gateway's tests.

Process tests: two real `kvpilot-runtime serve` replicas of tiny-llama (checking an API key, so
the provider fallback's `Authorization: Bearer` is proven) and a real `kvpilot-gateway` process in
front. Cluster tests: a namespace (the CRDs and the operator are tests/conftest.py's), and a
RouteTable whose event loop runs in a thread of its own, as the gateway's does (discovery hands
routes over to it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from kvpilot.gateway.routing.routes import Route, RouteTable
from tests.support.gateway_process import GatewayProcess, start_replicas
from tests.support.kube import fresh_namespace
from tests.support.server_process import RuntimeServer, free_port

API_KEY = "sk-gateway-test"
REPLICA_ARGS = ("--max-model-len", "2048", "--max-num-seqs", "16", "--api-key", API_KEY)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeServer]:
    """One tiny-llama replica batching 4 with a 512-token context (a module may override it)."""
    args = ["--max-model-len", "512", "--max-num-seqs", "4"]
    (started,) = start_replicas(1, args, tmp_path_factory.mktemp("replica"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RuntimeServer]]:
    started = start_replicas(2, list(REPLICA_ARGS), tmp_path_factory.mktemp("replicas"))
    yield started
    for replica in started:
        replica.stop()  # one may have been killed by a test: its code is not checked here


@pytest.fixture(scope="module")
def gateway(
    replicas: list[RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    a, b = replicas
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    provider = {"baseURL": f"{b.url}/v1", "model": "tiny", "apiKeyEnv": "TEST_PROVIDER_KEY"}
    config = {
        "models": [
            {"name": "tiny", "backends": [a.url, b.url]},
            {"name": "broken", "backends": [dead], "fallbacks": ["tiny"]},
            {"name": "external", "backends": [dead], "fallbacks": [{"provider": provider}]},
            {"name": "nowhere", "backends": [dead]},
        ]
    }
    workdir = tmp_path_factory.mktemp("gateway")
    process = GatewayProcess(
        config, workdir, "--max-request-body-bytes", "65536", TEST_PROVIDER_KEY=API_KEY
    )
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]


T = TypeVar("T")


class LoopTable:
    """A RouteTable on an event loop in a background thread; read it from the test's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.table = RouteTable()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def route(self, model: str) -> Route | None:
        async def get() -> Route | None:
            return self.table.get(model)

        return self.run(get())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def namespace(cluster: Any) -> Iterator[str]:
    with fresh_namespace(cluster, "gw") as name:
        yield name


@pytest.fixture
def loop_table() -> Iterator[LoopTable]:
    table = LoopTable()
    yield table
    table.close()
