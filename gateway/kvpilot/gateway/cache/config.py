"""The `cache:` section of the gateway's static config, and the cache's settings once flags
(`--cache-store`, `--redis-url`) are applied.

    cache:
      enabled: true
      ttlSeconds: 600
      maxEntries: 10000          # the in-process store's bounds
      maxBytes: 268435456
      maxEntryBytes: 1048576     # a larger answer is not stored
      store: memory              # or redis (needs --redis-url or the config's redis.url)
      scope: team                # who shares answers under gateway keys (cache/scope.py):
                                 # team (default), key, or shared (flag: --cache-scope)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvpilot.gateway.cache.scope import DEFAULT_SCOPE, SCOPES

STORES = ("memory", "redis")


class CacheSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    enabled: bool = False
    ttl_seconds: float = Field(default=600.0, alias="ttlSeconds", gt=0)
    max_entries: int = Field(default=10_000, alias="maxEntries", ge=1)
    max_bytes: int = Field(default=256 * 1024 * 1024, alias="maxBytes", ge=1)
    max_entry_bytes: int = Field(default=1024 * 1024, alias="maxEntryBytes", ge=1)
    store: Literal["memory", "redis"] = "memory"
    scope: str = DEFAULT_SCOPE

    @field_validator("scope")
    @classmethod
    def _known_scope(cls, value: str) -> str:
        return known_scope(value)


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
    scope: str = DEFAULT_SCOPE


def known_scope(value: str) -> str:
    if value not in SCOPES:
        raise ValueError(
            f"cache scope {value!r} is not one of team (callers of one team share cached "
            "answers, the default), key (each API key its own) or shared (every caller)"
        )
    return value


def settings_from(
    spec: CacheSpec, store_flag: str | None, redis_url: str | None, scope_flag: str | None = None
) -> CacheSettings:
    """The file's `cache:` with the flags applied: `--cache-store` turns the cache on with that
    store (the way to have one with `--discovery kubernetes`, which reads no file),
    `--cache-scope` sets its scope."""
    store = store_flag or spec.store
    scope = known_scope(scope_flag or spec.scope)
    enabled = spec.enabled or store_flag is not None
    if enabled and store == "redis" and not redis_url:
        message = "the redis cache store needs --redis-url redis://HOST:PORT/DB (or redis.url)"
        raise ValueError(message)
    return CacheSettings(enabled, spec.ttl_seconds, spec.max_entries, spec.max_bytes,
                         min(spec.max_entry_bytes, spec.max_bytes), store, redis_url,
                         scope)  # fmt: skip
