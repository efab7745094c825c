"""Drive the load: closed loop (N clients, each sends its next request when one finishes) or open
loop (requests leave at precomputed arrival times whether or not earlier ones have finished)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from .client import Endpoint, send
from .stats import RequestResult
from .workload import BenchRequest

Sender = Callable[[BenchRequest], Awaitable[RequestResult]]


async def closed_loop(
    requests: list[BenchRequest], concurrency: int, sender: Sender, on_done: Callable[[], None]
) -> list[RequestResult]:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: list[RequestResult | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))

    async def worker() -> None:
        for i in next_index:  # a shared iterator: each index goes to exactly one worker
            results[i] = await sender(requests[i])
            on_done()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return [r for r in results if r is not None]


async def open_loop(
    requests: list[BenchRequest],
    times: list[float],
    max_concurrency: int | None,
    sender: Sender,
    on_done: Callable[[], None],
) -> list[RequestResult]:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(request: BenchRequest) -> RequestResult:
        async with limit if limit else contextlib.nullcontext():
            result = await sender(request)
        on_done()
        return result

    tasks = []
    for request, at in zip(requests, times, strict=True):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # pacing the load generator, not waiting for a condition
        tasks.append(asyncio.create_task(one(request)))
    return list(await asyncio.gather(*tasks))


@dataclass(frozen=True)
class Load:
    """One stream of requests: a closed loop of `concurrency` clients, else open-loop `times`."""

    endpoint: Endpoint
    requests: list[BenchRequest]
    concurrency: int | None = None
    times: list[float] | None = None  # None: all at once
    max_concurrency: int | None = None
    delay_s: float = 0.0  # starts this long after the others

    def width(self) -> int:
        return self.concurrency or self.max_concurrency or len(self.requests)


async def drive(
    client: httpx.AsyncClient, load: Load, start: float, on_done: Callable[[], None]
) -> list[RequestResult]:
    async def sender(request: BenchRequest) -> RequestResult:
        return await send(client, load.endpoint, request, start)

    if load.delay_s > 0:
        await asyncio.sleep(load.delay_s)  # pacing the load generator, not waiting for a condition
    if load.concurrency is not None:
        return await closed_loop(load.requests, load.concurrency, sender, on_done)
    arrival = load.times if load.times is not None else [0.0] * len(load.requests)
    return await open_loop(load.requests, arrival, load.max_concurrency, sender, on_done)


async def run_loads(
    loads: list[Load], *, timeout_s: float, progress: bool
) -> tuple[list[list[RequestResult]], float]:
    """Every load at once from one start (so their timings share a clock); each load's results
    and the run's wall-clock duration in seconds."""
    width = sum(load.width() for load in loads)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    total = sum(len(load.requests) for load in loads)
    bar = tqdm(total=total, disable=not progress, unit="req", desc="kvpilot bench")
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()

        def done() -> None:
            bar.update(1)

        results = await asyncio.gather(*(drive(client, load, start, done) for load in loads))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def run(
    endpoint: Endpoint,
    requests: list[BenchRequest],
    *,
    concurrency: int | None,
    times: list[float] | None,
    max_concurrency: int | None,
    timeout_s: float,
    progress: bool,
) -> tuple[list[RequestResult], float]:
    """Send every request; returns the results and the run's wall-clock duration in seconds."""
    load = Load(endpoint, requests, concurrency, times, max_concurrency)
    (results,), duration = await run_loads([load], timeout_s=timeout_s, progress=progress)
    return results, duration
