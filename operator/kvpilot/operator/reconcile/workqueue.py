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
  the status refreshes of the objects already made wait (FIFO within each kind);
- a status-only request waits `status_delay` seconds before it is ready (controller-runtime's
  AddAfter), so the events of one rollout (a Deployment reports replicas, updated, ready, each
  a watch event) merge into one refresh even when a worker is free at once. A full request is
  never delayed, and one that comes meanwhile takes the waiting request ahead.

Everything here runs on one event loop, so the dictionaries need no lock. `process` is awaited
by a fixed number of workers; the caller decides where its blocking part runs (a thread pool) and
what a failure means (passes.PassScheduler retries with backoff); an error it lets through is
logged here, and the key is free for the next request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

Key = tuple[str, str]
Body = Mapping[str, Any]
log = logging.getLogger(__name__)


@dataclass
class Request:
    full: bool
    body: Body | None

    def merge(self, full: bool, body: Body | None) -> None:
        self.full = self.full or full
        self.body = body  # the latest word on the object; None means read it fresh


class WorkQueue:
    def __init__(
        self,
        process: Callable[[Key, bool, Body | None], Awaitable[object]],
        status_delay: float = 0.0,
    ) -> None:
        self.process = process
        self.status_delay = status_delay
        self.waiting: dict[Key, Request] = {}
        self.active: set[Key] = set()
        # (0 full | 1 status-only, arrival, key); an entry whose key is no longer waiting, or
        # went ahead as full already, is skipped
        self.ready: asyncio.PriorityQueue[tuple[int, int, Key]] = asyncio.PriorityQueue()
        self.arrivals = itertools.count()

    def put(self, key: Key, full: bool, body: Body | None = None) -> None:
        """Ask for a pass (merged into one that waits for this key, if any)."""
        request = self.waiting.get(key)
        if request is not None:
            upgraded = full and not request.full
            request.merge(full, body)
            if upgraded and key not in self.active:
                self._ready(key, request)  # now full: it goes ahead of the status passes
            return
        request = self.waiting[key] = Request(full, body)
        if key in self.active:
            return  # the worker passing it queues it again when done
        if full or self.status_delay <= 0:
            self._ready(key, request)
        else:  # a full request meanwhile goes ahead at once; this entry is then stale
            asyncio.get_running_loop().call_later(self.status_delay, self._ready, key, request)

    def _ready(self, key: Key, request: Request) -> None:
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

    async def _pass(self, key: Key, request: Request) -> None:
        try:
            await self.process(key, request.full, request.body)
        except Exception as error:
            log.warning("pass of %s/%s failed: %s", *key, error)
