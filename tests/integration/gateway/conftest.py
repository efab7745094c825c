"""Fixtures of the gateway's cluster tests: the CRDs, a namespace, and a RouteTable whose event loop
runs in a thread of its own, as the gateway's does (discovery hands routes over to it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from hack.closedloop import apply_crds
from kvpilot.gateway.routing.routes import Route, RouteTable
from tests.support.kube import fresh_namespace
from tests.support.operator_cluster import Operator

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


@pytest.fixture(scope="module")
def crds(cluster: Any) -> None:
    apply_crds(cluster)


@pytest.fixture
def namespace(cluster: Any) -> Iterator[str]:
    with fresh_namespace(cluster, "gw") as name:
        yield name


@pytest.fixture
def loop_table() -> Iterator[LoopTable]:
    table = LoopTable()
    yield table
    table.close()


@pytest.fixture
def operator(cluster: Any, crds: None, tmp_path: Path) -> Iterator[Operator]:
    """The real operator (`kvpilot-operator run`), as tests/integration/operator runs it."""
    op = Operator(cluster, tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()
