"""The `cache:` section of the gateway's static config, and the cache's settings once flags
(`--cache-store`, `--redis-url`) are applied.

    cache:
      enabled: true
      ttlSeconds: 600
      maxEntries: 10000          # the in-process store's bounds
      maxBytes: 268435456
      maxEntryBytes: 1048576     # a larger answer is not stored
      store: memory              # or redis (needs --redis-url or the config's redis.url)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

STORES = ("memory", "redis")


class CacheSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    enabled: bool = False
    ttl_seconds: float = Field(default=600.0, alias="ttlSeconds", gt=0)
    max_entries: int = Field(default=10_000, alias="maxEntries", ge=1)
    max_bytes: int = Field(default=256 * 1024 * 1024, alias="maxBytes", ge=1)
    max_entry_bytes: int = Field(default=1024 * 1024, alias="maxEntryBytes", ge=1)
    store: Literal["memory", "redis"] = "memory"


@dataclass(frozen=True)
class CacheSettings:
    """What the cache policy runs with (off: the policy only strips the request field)."""

    enabled: bool = False
    ttl_s: float = 600.0
    max_entries: int = 10_000
    max_bytes: int = 256 * 1024 * 1024
    max_entry_bytes: int = 1024 * 1024
    store: str = "memory"
    redis_url: str | None = None


def settings_from(spec: CacheSpec, store_flag: str | None, redis_url: str | None) -> CacheSettings:
    """The file's `cache:` with the flags applied: `--cache-store` turns the cache on with that
    store (the way to have one with `--discovery kubernetes`, which reads no file)."""
    store = store_flag or spec.store
    enabled = spec.enabled or store_flag is not None
    if enabled and store == "redis" and not redis_url:
        message = "the redis cache store needs --redis-url redis://HOST:PORT/DB (or redis.url)"
        raise ValueError(message)
    return CacheSettings(enabled, spec.ttl_seconds, spec.max_entries, spec.max_bytes,
                         min(spec.max_entry_bytes, spec.max_bytes), store, redis_url)  # fmt: skip
