"""Where cached answers live: in this process (an LRU bounded by entries and bytes, the default)
or in Redis (shared by every gateway replica). Entries expire after the TTL either way.

Redis holds each entry under `kvpilot:cache:<key>` with the TTL as its expiry; the total size is
the Redis server's to bound (`maxmemory` with `allkeys-lru`), as the gateway cannot see it.
A Redis that does not answer is a miss (get) or a lost store (put), logged once per outage:
the cache only ever saves work, so it fails open.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import redis.asyncio as redis

from kvpilot.gateway.cache import Entry

log = logging.getLogger("kvpilot.gateway.cache")
REDIS_PREFIX = "kvpilot:cache:"

# Called with why an entry left the store: "expired" or "size" (the LRU's bounds).
OnEvict = Callable[[str], None]


class CacheStore(Protocol):
    async def get(self, key: str) -> Entry | None: ...

    async def put(self, key: str, entry: Entry) -> bool:
        """Whether it was stored."""
        ...

    async def close(self) -> None: ...


class MemoryStore:
    """An LRU of entries in this process, bounded by `max_entries` and `max_bytes`."""

    def __init__(
        self,
        ttl_s: float,
        max_entries: int,
        max_bytes: int,
        on_evict: OnEvict = lambda _: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.max_entries, self.max_bytes = ttl_s, max_entries, max_bytes
        self.on_evict, self.clock = on_evict, clock
        self._entries: OrderedDict[str, tuple[float, Entry]] = OrderedDict()  # key -> expiry
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> Entry | None:
        found = self._entries.get(key)
        if found is None:
            return None
        expires, entry = found
        if expires <= self.clock():
            self._drop(key, "expired")
            return None
        self._entries.move_to_end(key)
        return entry

    async def put(self, key: str, entry: Entry) -> bool:
        size = entry.num_bytes()
        if size > self.max_bytes:
            return False
        if key in self._entries:
            self._remove(key)
        self._entries[key] = (self.clock() + self.ttl_s, entry)
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)), "size")  # the least recently used
        return True

    async def close(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def _drop(self, key: str, reason: str) -> None:
        self._remove(key)
        self.on_evict(reason)

    def _remove(self, key: str) -> None:
        _, entry = self._entries.pop(key)
        self.num_bytes -= entry.num_bytes()


class RedisStore:
    """Entries in Redis, shared by every gateway that names the same server and database."""

    def __init__(self, url: str, ttl_s: float, timeout_s: float = 0.5) -> None:
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.is_failing = False

    async def get(self, key: str) -> Entry | None:
        try:
            data = await self.client.get(REDIS_PREFIX + key)
        except (redis.RedisError, OSError) as error:
            self._failed("get", error)
            return None
        self._answered()
        if data is None:
            return None
        return Entry.from_bytes(data if isinstance(data, bytes) else data.encode())

    async def put(self, key: str, entry: Entry) -> bool:
        try:
            await self.client.set(REDIS_PREFIX + key, entry.to_bytes(), px=self.ttl_ms)
        except (redis.RedisError, OSError) as error:
            self._failed("put", error)
            return False
        self._answered()
        return True

    async def close(self) -> None:
        await self.client.aclose()

    def _failed(self, what: str, error: BaseException) -> None:
        if not self.is_failing:
            log.warning("cache: Redis %s failed (%s); the cache is bypassed until it answers",
                        what, error)  # fmt: skip
        self.is_failing = True

    def _answered(self) -> None:
        if self.is_failing:
            log.warning("cache: Redis answers again")
        self.is_failing = False
