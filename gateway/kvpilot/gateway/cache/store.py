"""Where cached answers live: in this process (an LRU bounded by entries and bytes, the default)
or in Redis (shared by every gateway replica, the same bounds). Entries expire after the TTL.

In Redis every key carries the hash tag `{kvpilot-cache}` (one Redis Cluster slot, as the scripts
need): an entry is `kvpilot:{kvpilot-cache}:e:<key>` with the TTL as its expiry, and three indexes
keep the bounds shared: `:lru` (a sorted set by last use, Redis's clock), `:expiry` (by expiry),
`:sizes` (a hash of entry sizes) and `:bytes` (their sum). A put is one Lua script: it forgets the
entries whose TTL passed (evicted, reason `expired`), stores the entry, then evicts the least
recently used until both bounds hold (reason `size`). A hit is one script too: GET and the LRU
touch. A Redis that does not answer is a miss (get) or a lost store (put), logged once per
outage: the cache only ever saves work, so it fails open.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import redis.asyncio as redis

from kvpilot.gateway.cache.rules import Entry

log = logging.getLogger("kvpilot.gateway.cache")
REDIS_PREFIX = "kvpilot:{kvpilot-cache}:"  # the hash tag keeps every cache key in one slot
ENTRY_PREFIX = REDIS_PREFIX + "e:"
LRU, EXPIRY, SIZES, TOTAL = (REDIS_PREFIX + name for name in ("lru", "expiry", "sizes", "bytes"))

# Redis's clock in microseconds, so every gateway replica orders uses alike.
NOW_US = "local t = redis.call('TIME') local now = t[1] * 1000000 + t[2]"

# KEYS: entry, lru, expiry, sizes, bytes; ARGV: member, data, ttl (us), max entries, max bytes,
# entry prefix. Returns {expired, evicted for size}.
PUT_LUA = (
    NOW_US
    + """
local member, data, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local max_entries, max_bytes, prefix = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local function forget(m)
  local size = tonumber(redis.call('HGET', KEYS[4], m) or '0')
  redis.call('HDEL', KEYS[4], m)
  redis.call('ZREM', KEYS[2], m)
  redis.call('ZREM', KEYS[3], m)
  redis.call('DECRBY', KEYS[5], size)
  redis.call('DEL', prefix .. m)
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, m in ipairs(gone) do forget(m) end
forget(member)
redis.call('SET', KEYS[1], data, 'PX', math.max(1, math.floor(ttl / 1000)))
redis.call('ZADD', KEYS[2], now, member)
redis.call('ZADD', KEYS[3], now + ttl, member)
redis.call('HSET', KEYS[4], member, #data)
redis.call('INCRBY', KEYS[5], #data)
local evicted = 0
while redis.call('ZCARD', KEYS[2]) > max_entries
    or tonumber(redis.call('GET', KEYS[5])) > max_bytes do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 1)
  local victim = oldest[1]
  if victim == member then victim = oldest[2] end
  if not victim then break end
  forget(victim)
  evicted = evicted + 1
end
return {#gone, evicted}
"""
)

# KEYS: entry, lru; ARGV: member. The entry, its use recorded.
GET_LUA = (
    NOW_US
    + """
local data = redis.call('GET', KEYS[1])
if data then redis.call('ZADD', KEYS[2], 'XX', now, ARGV[1]) end
return data
"""
)

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
    """Entries in Redis, shared by every gateway that names the same server and database, and
    bounded as the in-process LRU is (entries and bytes, over all replicas together)."""

    def __init__(
        self,
        url: str,
        ttl_s: float,
        max_entries: int,
        max_bytes: int,
        on_evict: OnEvict = lambda _: None,
        timeout_s: float = 0.5,
    ) -> None:
        self.ttl_us = max(1000, int(ttl_s * 1_000_000))
        self.max_entries, self.max_bytes, self.on_evict = max_entries, max_bytes, on_evict
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._put = self.client.register_script(PUT_LUA)
        self._get = self.client.register_script(GET_LUA)
        self.is_failing = False

    async def get(self, key: str) -> Entry | None:
        try:
            data = await self._get(keys=[ENTRY_PREFIX + key, LRU], args=[key])
        except (redis.RedisError, OSError) as error:
            self._failed("get", error)
            return None
        self._answered()
        if data is None:
            return None
        return Entry.from_bytes(data if isinstance(data, bytes) else data.encode())

    async def put(self, key: str, entry: Entry) -> bool:
        data = entry.to_bytes()
        if len(data) > self.max_bytes:
            return False
        keys = [ENTRY_PREFIX + key, LRU, EXPIRY, SIZES, TOTAL]
        args: list[bytes | str | int] = [
            key, data, self.ttl_us, self.max_entries, self.max_bytes, ENTRY_PREFIX
        ]  # fmt: skip
        try:
            expired, evicted = await self._put(keys=keys, args=args)
        except (redis.RedisError, OSError) as error:
            self._failed("put", error)
            return False
        self._answered()
        for reason, count in (("expired", expired), ("size", evicted)):
            for _ in range(int(count)):
                self.on_evict(reason)
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
