"""AsyncEngine: the engine's asyncio driver for the server.

`Engine.step()` runs in one worker thread; each request's outputs reach its asyncio queue on the
event loop. `add_request`, `abort` and `stats` are safe from any thread (engine/engine.py).

The engine is built on the thread that steps it (`AsyncEngine.create`). On CPU every OS thread
that runs a parallel torch op keeps an OpenMP team of its own; once the process has more such
threads than cores, libgomp stops spinning between parallel regions and each region pays a
futex wake-up: a model loaded on one thread and stepped on another ran its decode steps at
about half speed on 2 cores, with both cores partly idle. To see it, time `Engine.step()` on a
thread other than the one that built the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Collection
from concurrent.futures import Future
from typing import Any

from kvpilot.runtime.engine.engine import Engine, NewRequest, RequestOutput
from kvpilot.runtime.engine.lora_slots import LoraRequest
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.stats import EngineStats

Listener = Callable[[list[RequestOutput], EngineStats], None]


class AsyncEngine:
    """Runs `Engine.step()` in a worker thread and streams each request's outputs to asyncio."""

    def __init__(self, engine: Engine, thread: EngineThread | None = None) -> None:
        """`thread`: the thread the engine was built on (see `create`)."""
        self.engine = engine
        self._thread = thread or EngineThread()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._listeners: list[Listener] = []
        self._wake = threading.Event()
        self._is_stopping = False
        self._running: Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    async def create(cls, build: Callable[[], Engine]) -> AsyncEngine:
        """The engine `build` makes, built on the thread that will step it (module docstring);
        what `build` raises is raised here."""
        thread = EngineThread()
        try:
            engine = await asyncio.wrap_future(thread.submit(build))
        except BaseException:
            thread.shutdown()
            raise
        return cls(engine, thread)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._is_stopping = False
        self._running = self._thread.submit(self._run)

    async def stop(self) -> None:
        self._is_stopping = True
        self._wake.set()
        if self._running is not None:
            await asyncio.wrap_future(self._running)
            self._running = None
        self._thread.shutdown()

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
        self, requests: Collection[NewRequest], lora: LoraRequest | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream several requests' outputs, interleaved as the steps make them, until all are
        finished (n > 1 choices, several prompts, all under LoRA adapter `lora` if not None:
        see `Engine.add_requests`). A bad prompt
        raises ValueError on the first iteration; leaving the loop early or cancelling aborts
        the requests still running."""
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        ids = [request_id for _, _, request_id in requests]
        if any(request_id in self._queues for request_id in ids):
            raise ValueError(f"request ids {ids}: one is already in use")
        self._queues.update(dict.fromkeys(ids, queue))
        try:
            self.engine.add_requests(requests, lora)
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
        """The step loop, on the engine's thread until `stop`."""
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
        for each in {id(q): q for q in self._queues.values()}.values():  # shared by a group
            each.put_nowait(error)


class EngineThread:
    """One daemon thread that runs what is submitted, in order: the engine's build, then its
    step loop. Not a ThreadPoolExecutor, whose threads are joined at interpreter exit: the step
    loop ends only when told to, and a process exiting without `stop` must not hang."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._serve, name="kvpilot-engine", daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((fn, future))
        return future

    def shutdown(self) -> None:
        """The thread ends after what was submitted before."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as error:  # handed to whoever awaits the future
                    future.set_exception(error)
