"""What the gateway knows of each replica's load: its own in-flight requests (exact, counted here),
the queue and KV usage the replica reports on /metrics (scraped every few seconds; the requests it
counts beyond ours are other gateway replicas' traffic), and replicas that just failed (passed
over for a short while)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract import metric_names as names
from kvpilot.gateway.routing.lora_affinity import LoraState, parse_lora_info
from kvpilot.gateway.routing.picking import ReplicaLoad
from kvpilot.gateway.routing.routes import Backend

log = logging.getLogger(__name__)

# Names the kvpilot runtime and vLLM export; the first one a replica reports wins.
WAITING = (names.REQUESTS_WAITING.vllm, names.REQUESTS_WAITING.kvpilot)
RUNNING = (names.REQUESTS_RUNNING.vllm, names.REQUESTS_RUNNING.kvpilot)
KV_USAGE = (
    names.KV_CACHE_USAGE.vllm,
    names.KV_CACHE_USAGE_BEFORE_VLLM_09,
    names.KV_CACHE_USAGE.kvpilot,
)


WANTED = frozenset((*WAITING, *RUNNING, *KV_USAGE))


def parse_replica_metrics(text: str) -> tuple[float, float]:
    """(requests running + waiting, KV usage 0-1) from a replica's /metrics text; 0 for what is
    missing."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(wanted_samples(text)):
        for sample in family.samples:
            if sample.name in WANTED:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value

    def first(names: tuple[str, ...]) -> float:
        return next((values[n] for n in names if n in values), 0.0)

    return first(RUNNING) + first(WAITING), first(KV_USAGE)


def wanted_samples(text: str) -> str:
    """The sample lines of the gauges read here, nothing else. A replica's /metrics runs to
    hundreds of lines (histograms); parsing them all held the gateway's event loop ~9 ms per
    scrape (every replica, every few seconds), in the way of the streams it relays."""
    return "\n".join(line for line in text.splitlines() if sample_name(line) in WANTED)


def sample_name(line: str) -> str:
    """The metric name a text-format line starts with ("#" for comments)."""
    return line.lstrip().split("{", 1)[0].split(" ", 1)[0]


class LoadBook:
    def __init__(self, eject_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.eject_s, self.clock = eject_s, clock
        self._in_flight: dict[str, int] = {}
        self._reported: dict[str, tuple[float, float]] = {}
        self._ejected_until: dict[str, float] = {}
        self._lora: dict[str, LoraState] = {}  # replicas' LoRA adapters in use, as last reported

    def start(self, name: str) -> None:
        self._in_flight[name] = self._in_flight.get(name, 0) + 1

    def finish(self, name: str) -> None:
        self._in_flight[name] = max(0, self._in_flight.get(name, 0) - 1)

    def report(self, name: str, num_requests: float, kv_usage: float) -> None:
        """What the replica reports (running + waiting, KV usage 0-1); the requests it counts
        beyond ours in flight now are other gateway replicas'."""
        others = max(0.0, num_requests - self._in_flight.get(name, 0))
        self._reported[name] = (others, kv_usage)

    def report_lora(self, name: str, state: LoraState | None) -> None:
        """The replica's adapters in use (None: it reports none, e.g. LoRA off or no answer)."""
        if state is None:
            self._lora.pop(name, None)
        else:
            self._lora[name] = state

    def lora_states(self) -> dict[str, LoraState]:
        return dict(self._lora)

    def eject(self, name: str) -> None:
        """A replica that refused a connection or answered 502/503: pass it over a while."""
        self._ejected_until[name] = self.clock() + self.eject_s
        self._reported.pop(name, None)

    def is_ejected(self, name: str) -> bool:
        return self._ejected_until.get(name, 0.0) > self.clock()

    def available(self, backends: Iterable[Backend], tried: set[str]) -> list[Backend]:
        """The backends not yet tried by this request, without the ejected ones unless only
        ejected ones are left (an ejected replica may be back; better to try than to fail)."""
        untried = [b for b in backends if b.name not in tried]
        return [b for b in untried if not self.is_ejected(b.name)] or untried

    def loads(self) -> dict[str, ReplicaLoad]:
        names = set(self._in_flight) | set(self._reported)
        return {name: self.load(name) for name in names}

    def load(self, name: str) -> ReplicaLoad:
        others, kv_usage = self._reported.get(name, (0.0, 0.0))
        return ReplicaLoad(self._in_flight.get(name, 0), others, kv_usage)


async def scrape_forever(
    session: aiohttp.ClientSession,
    book: LoadBook,
    backends: Callable[[], Iterable[Backend]],
    interval_s: float,
) -> None:
    """Read every backend's /metrics each `interval_s` into `book` (a replica that does not answer
    keeps no stale report)."""
    while True:
        await asyncio.gather(*(scrape_one(session, book, b) for b in set(backends())))
        await asyncio.sleep(interval_s)


async def scrape_one(session: aiohttp.ClientSession, book: LoadBook, backend: Backend) -> None:
    timeout = aiohttp.ClientTimeout(total=2)
    try:
        async with session.get(f"{backend.url}/metrics", timeout=timeout) as response:
            if response.status != 200:
                raise aiohttp.ClientError(f"/metrics answered {response.status}")
            text = await response.text()
            book.report(backend.name, *parse_replica_metrics(text))
            book.report_lora(backend.name, parse_lora_info(text))
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        log.debug("no metrics from %s: %s", backend.name, error)
        book.report(backend.name, 0.0, 0.0)
        book.report_lora(backend.name, None)
