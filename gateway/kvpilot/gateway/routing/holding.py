"""Holding requests for a model with no ready replica while it scales from zero (architecture §3.7).

A held request waits for discovery to put a backend in the RouteTable, asking the Waker for a
replica on arrival and again every `rewake_s` while it waits (the waker limits its own writes).
The queue per model is bounded: past `max_held` the request is turned away (429 unless a fallback
takes it), so a burst at zero replicas cannot pile up without bound in the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing.routes import Route, RouteTable
from kvpilot.gateway.routing.wake import Waker

log = logging.getLogger(__name__)
POLL_S = 0.5  # a change that lands between a check and the wait is seen this late at most


class Holding:
    def __init__(
        self,
        table: RouteTable,
        waker: Waker | None,
        metrics: GatewayMetrics,
        max_held: int,
        rewake_s: float = 5.0,
    ) -> None:
        self.table, self.waker, self.metrics = table, waker, metrics
        self.max_held, self.rewake_s = max_held, rewake_s
        self._held: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def can_hold(self, route: Route) -> bool:
        return self.waker is not None and route.scale_target is not None and not route.backends

    async def hold(self, route: Route, deadline: float) -> tuple[Route | None, str]:
        """The route once it has backends, or (None, why not) by the deadline."""
        model, target = route.model, route.scale_target
        if target is None:
            return None, "no_replicas"
        if self._held.get(model, 0) >= self.max_held:
            return None, "hold_queue_full"
        gauge = self.metrics.held.labels(target.namespace, target.name, model)
        self._held[model] = self._held.get(model, 0) + 1
        gauge.inc()
        try:
            return await self._wait_for_backends(route, deadline)
        finally:
            self._held[model] -= 1
            gauge.dec()

    async def _wait_for_backends(self, route: Route, deadline: float) -> tuple[Route | None, str]:
        loop = asyncio.get_running_loop()
        next_wake = loop.time()
        while (now := loop.time()) < deadline:
            current = self.table.get(route.model)
            if current is None:
                return None, "model_removed"
            if current.backends:
                return current, ""
            if now >= next_wake and current.scale_target is not None and self.waker is not None:
                self._spawn(self.waker.wake(current.scale_target))
                next_wake = now + self.rewake_s
            timeout = min(deadline - now, next_wake - now, POLL_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.table.changed(), timeout=max(timeout, 0.001))
        return None, "hold_timeout"

    def _spawn(self, wake: Coroutine[Any, Any, None]) -> None:
        """Wake in the background: a slow API server must not delay the wait for backends."""
        task = asyncio.ensure_future(self._logged(wake))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _logged(wake: Coroutine[Any, Any, None]) -> None:
        try:
            await wake
        except Exception:
            log.exception("waking a model from zero failed; the held requests wait on")
