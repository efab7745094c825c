"""discovery.apply_routes (the loop side of the watch) and the waker's per-model rate limit."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client as k8s_client

from kvpilot.gateway.kube.discovery import apply_routes
from kvpilot.gateway.kube.wake import KubernetesWaker
from kvpilot.gateway.routing.routes import Backend, Route, RouteTable, ScaleTarget

A = Route("a", (Backend("ml/a-0", "http://10.0.0.1:8000"),), (), ScaleTarget("ml", "a"))
B = Route("b", (), ("a",), ScaleTarget("ml", "b"))


def changes(table: RouteTable, routes: list[Route]) -> bool:
    """Whether apply_routes woke the table's waiters."""

    async def run() -> bool:
        waiter = asyncio.ensure_future(table.changed())
        await asyncio.sleep(0)
        apply_routes(table, routes)
        await asyncio.sleep(0)
        woke = waiter.done()
        waiter.cancel()
        return woke

    return asyncio.run(run())


def test_apply_routes_makes_the_table_hold_exactly_the_routes() -> None:
    table = RouteTable()
    assert changes(table, [A, B])
    assert table.models() == ["a", "b"] and table.get("b") == B
    a_later = Route("a", (), (), ScaleTarget("ml", "a"))
    assert changes(table, [a_later])
    assert table.models() == ["a"] and table.get("a") == a_later


def test_unchanged_routes_wake_nobody() -> None:
    table = RouteTable()
    apply_routes(table, [A, B])
    assert not changes(table, [A, B])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("steps", "want"),
    [
        ([0.0], [True]),
        ([0.0, 1.0, 4.9], [True, False, False]),
        ([0.0, 5.0, 5.1, 10.0], [True, True, False, True]),
    ],
)
def test_waker_asks_at_most_once_per_model_per_interval(
    steps: list[float], want: list[bool]
) -> None:
    clock = Clock()
    waker = KubernetesWaker(k8s_client.ApiClient(), min_interval_s=5.0, clock=clock)
    start, got = clock.now, []
    for step in steps:
        clock.now = start + step
        got.append(waker.is_due(ScaleTarget("ml", "a")))
    assert got == want
    assert waker.is_due(ScaleTarget("ml", "b"))  # another model has its own interval
