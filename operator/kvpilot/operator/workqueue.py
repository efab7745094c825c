"""A work queue of reconcile passes keyed by namespace/name, on kopf's event loop.

What controller-runtime's workqueue gives a Go controller, in a few lines of asyncio:
- one pass at a time per key: a key being passed is never handed to a second worker, so passes
  of one ModelDeployment never overlap and nothing needs a lock;
- requests merge while they wait: a burst of a rollout's Deployment events for one object costs
  one more pass, not one per event. A merged request is full if any part was full (a full pass
  also refreshes status), and carries the body of the latest request (`None`: read it fresh);
- a request for a key that is being passed waits for that pass to end and then runs once more,
  so the last event of a burst is never lost (its pass starts after the event);
- full passes go before status-only ones, so a burst of creates gets its Deployments first and
  the status refreshes of the objects already made wait (FIFO within each kind).

Everything here runs on one event loop, so the dictionaries need no lock. `process` is awaited
by a fixed number of workers; the caller decides where its blocking part runs (a thread pool).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Key = tuple[str, str]
Body = Mapping[str, Any]
R = TypeVar("R")
log = logging.getLogger(__name__)


@dataclass
class Request(Generic[R]):
    full: bool
    body: Body | None
    waiters: list[asyncio.Future[R]] = field(default_factory=list)

    def merge(self, full: bool, body: Body | None) -> None:
        self.full = self.full or full
        self.body = body  # the latest word on the object; None means read it fresh


class WorkQueue(Generic[R]):
    def __init__(self, process: Callable[[Key, bool, Body | None], Awaitable[R]]) -> None:
        self.process = process
        self.waiting: dict[Key, Request[R]] = {}
        self.active: set[Key] = set()
        # (0 full | 1 status-only, arrival, key); an entry whose key is no longer waiting, or
        # went ahead as full already, is skipped
        self.ready: asyncio.PriorityQueue[tuple[int, int, Key]] = asyncio.PriorityQueue()
        self.arrivals = itertools.count()

    def put(self, key: Key, full: bool, body: Body | None = None) -> None:
        """Ask for a pass; no one waits for its outcome (a failure is logged, and the object's
        next event asks again)."""
        self._request(key, full, body)

    def wait(self, key: Key, full: bool, body: Body | None = None) -> asyncio.Future[R]:
        """Ask for a pass and get the outcome of the first pass that starts after this call."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._request(key, full, body).waiters.append(future)
        return future

    def _request(self, key: Key, full: bool, body: Body | None) -> Request[R]:
        request = self.waiting.get(key)
        if request is not None:
            upgraded = full and not request.full
            request.merge(full, body)
            if upgraded and key not in self.active:
                self._ready(key, request)  # now full: it goes ahead of the status passes
            return request
        request = self.waiting[key] = Request(full, body)
        if key not in self.active:  # else the worker passing it queues it again when done
            self._ready(key, request)
        return request

    def _ready(self, key: Key, request: Request[R]) -> None:
        self.ready.put_nowait((0 if request.full else 1, next(self.arrivals), key))

    def is_idle(self) -> bool:
        return not self.waiting and not self.active

    async def run(self, workers: int) -> None:
        """Run `workers` workers until cancelled."""
        async with asyncio.TaskGroup() as group:
            for _ in range(workers):
                group.create_task(self._work())

    async def _work(self) -> None:
        while True:
            _, _, key = await self.ready.get()
            if key in self.active or key not in self.waiting:
                continue  # a stale entry: the request went ahead under another one
            request = self.waiting.pop(key)
            self.active.add(key)
            try:
                await self._pass(key, request)
            finally:
                self.active.discard(key)
                if key in self.waiting:
                    self._ready(key, self.waiting[key])

    async def _pass(self, key: Key, request: Request[R]) -> None:
        try:
            result = await self.process(key, request.full, request.body)
        except asyncio.CancelledError:
            for waiter in request.waiters:
                waiter.cancel()
            raise
        except Exception as error:
            if not request.waiters:
                log.warning("pass of %s/%s failed: %s", *key, error)
            for waiter in request.waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            return
        for waiter in request.waiters:
            if not waiter.done():  # a handler that gave up (cancelled) no longer waits
                waiter.set_result(result)
