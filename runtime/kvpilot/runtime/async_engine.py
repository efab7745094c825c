"""AsyncEngine: the engine's asyncio driver for the server.

`Engine.step()` runs in one worker thread; each request's outputs reach its asyncio queue on the
event loop. `add_request`, `abort` and `stats` are safe from any thread (engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Callable, Collection

from kvpilot.runtime.engine import Engine, NewRequest, RequestOutput
from kvpilot.runtime.engine_stats import EngineStats
from kvpilot.runtime.sampling import SamplingParams

Listener = Callable[[list[RequestOutput], EngineStats], None]


class AsyncEngine:
    """Runs `Engine.step()` in a worker thread and streams each request's outputs to asyncio."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._listeners: list[Listener] = []
        self._wake = threading.Event()
        self._is_stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._is_stopping = False
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._is_stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def add_step_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs until finished (see `generate_many`)."""
        async for output in self.generate_many([(prompt, params, request_id)]):
            yield output

    async def generate_many(
        self, requests: Collection[NewRequest]
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream several requests' outputs, interleaved as the steps make them, until all are
        finished (n > 1 choices, several prompts: see `Engine.add_requests`). A bad prompt
        raises ValueError on the first iteration; leaving the loop early or cancelling aborts
        the requests still running."""
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        ids = [request_id for _, _, request_id in requests]
        if any(request_id in self._queues for request_id in ids):
            raise ValueError(f"request ids {ids}: one is already in use")
        self._queues.update(dict.fromkeys(ids, queue))
        try:
            self.engine.add_requests(requests)
        except BaseException:
            for request_id in ids:
                del self._queues[request_id]
            raise
        self._wake.set()
        running = set(ids)
        try:
            while running:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    running.discard(item.request_id)
                yield item
        finally:
            for request_id in ids:
                self._queues.pop(request_id, None)
            for request_id in running:  # consumer went away or was cancelled
                self.abort(request_id)

    def _run(self) -> None:
        self.engine.on_work = self._wake.set
        while not self._is_stopping:
            self._wake.clear()
            if not self.engine.has_steppable_work():
                self._wake.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:
                self._deliver_error(error)
                continue
            stats = self.engine.stats()
            for listener in self._listeners:
                with contextlib.suppress(Exception):
                    listener(outputs, stats)
            if self._loop is not None and outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _deliver_error(self, error: Exception) -> None:
        for request_id in list(self._queues):
            self.engine.abort(request_id)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, error)

    def _fail_all(self, error: Exception) -> None:
        for queue in {id(q): q for q in self._queues.values()}.values():  # shared by a group
            queue.put_nowait(error)
