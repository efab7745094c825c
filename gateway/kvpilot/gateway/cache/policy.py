"""The response cache as a gateway policy (exchange.py): answers a repeated deterministic request
from the store, and stores a miss's answer as it reaches the client.

- The request field `cache` (true | false) is the gateway's: checked (400 naming it otherwise)
  and never forwarded. `"cache": false` leaves the cache out entirely.
- `Cache-Control: no-cache` skips the lookup but stores the fresh answer (a refresh);
  `no-store` leaves the cache out entirely.
- Every key carries the caller's scope (cache/scope.py): a hit only answers a caller who could
  have had that answer from the upstream, and one tenant never sees another's entries.
- A hit carries `x-kvpilot-cache: hit` (a miss `miss`, a request kept out `skip`),
  `x-kvpilot-backend: cache` and `usage.prompt_tokens_details.cached_tokens` = every prompt token.
  It answers before the budget policy runs, but first asks the `HitGate` (the budget policy):
  a hit counts as a request against the key's limits (`rpm_limit`) and spends no tokens, and a
  key that is over a limit is refused as for any request.
- Only an answer that reached its end with status 200 from an upstream is stored: for a stream,
  every event parsed, no error event, `data: [DONE]` last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from kvpilot.gateway.budget.keys import CALLER
from kvpilot.gateway.cache import rules as cache_rules
from kvpilot.gateway.cache.config import CacheSettings
from kvpilot.gateway.cache.rules import Entry
from kvpilot.gateway.cache.scope import Who, scope_of
from kvpilot.gateway.cache.store import CacheStore, MemoryStore, RedisStore
from kvpilot.gateway.credentials import forwards_client_credential
from kvpilot.gateway.exchange import Exchange
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.upstream import error_response

HEADER = "x-kvpilot-cache"
STATE = "kvpilot.cache"  # the exchange's recording, kept on its aiohttp request


@dataclass
class Recorder:
    """A tap that keeps a copy of the answer the client gets, up to `max_bytes`."""

    max_bytes: int
    include_usage: bool = False  # the request asked for a stream's usage event
    data: bytearray = field(default_factory=bytearray)
    is_too_large: bool = False
    is_complete: bool = False

    def chunk(self, data: bytes) -> bytes:
        if not self.is_too_large:
            self.data += data
            if len(self.data) > self.max_bytes:
                self.is_too_large, self.data = True, bytearray()
        return data

    def end(self, complete: bool) -> bytes:
        self.is_complete = complete
        return b""

    def entry(self, stream: bool) -> Entry | None:
        if self.is_too_large or not self.is_complete:
            return None
        data = bytes(self.data)
        return (
            cache_rules.stream_entry(data, self.include_usage)
            if stream
            else cache_rules.json_entry(data)
        )


@dataclass(frozen=True)
class Recording:
    key: str
    recorder: Recorder


def build_store(settings: CacheSettings, metrics: GatewayMetrics) -> CacheStore | None:
    if not settings.enabled:
        return None
    on_evict = lambda reason: metrics.cache_evictions.labels(reason).inc()  # noqa: E731
    bounds = (settings.ttl_s, settings.max_entries, settings.max_bytes, on_evict)
    if settings.store == "redis" and settings.redis_url:
        return RedisStore(settings.redis_url, *bounds)
    return MemoryStore(*bounds)


class HitGate(Protocol):
    async def admit_hit(self, exchange: Exchange) -> web.StreamResponse | None:
        """None: the hit may be answered (and is counted); else the refusal to answer."""
        ...


class CachePolicy:
    def __init__(
        self,
        settings: CacheSettings,
        store: CacheStore | None,
        metrics: GatewayMetrics,
        upstream_key: bool = False,  # the gateway sends its own key to replicas
    ) -> None:
        self.settings, self.store, self.metrics = settings, store, metrics
        self.upstream_key = upstream_key
        self.gate: HitGate | None = None  # the budget policy, when keys are configured

    async def before(self, exchange: Exchange) -> web.StreamResponse | None:
        payload = exchange.payload
        if cache_rules.CACHE_FIELD in payload:
            asked = payload[cache_rules.CACHE_FIELD]
            if not isinstance(asked, bool) and asked is not None:
                message = "`cache` must be true or false (false: leave the response cache out)"
                return error_response(400, message, cache_rules.CACHE_FIELD)
            forwarded = {k: v for k, v in payload.items() if k != cache_rules.CACHE_FIELD}
            exchange.replace_payload(forwarded)  # the runtime does not know the field
        if self.store is None:
            return None
        return await self.look_up(exchange, payload, self.store)

    async def look_up(
        self, exchange: Exchange, payload: dict[str, Any], store: CacheStore
    ) -> web.StreamResponse | None:
        directives = cache_control(exchange.request.headers.get("Cache-Control", ""))
        scope = scope_of(self.settings.scope, self.who(exchange))
        verdict = cache_rules.verdict(exchange.kind, exchange.model, payload, scope)
        skip = ("request_field" if payload.get(cache_rules.CACHE_FIELD) is False else
                "no_store" if "no-store" in directives else verdict.skip)  # fmt: skip
        if skip or verdict.key is None:
            self.metrics.cache_skips.labels(exchange.model, skip).inc()
            exchange.headers[HEADER] = "skip"
            return None
        if "no-cache" not in directives:
            entry = await store.get(verdict.key)
            if entry is not None and entry.stream == exchange.inbound.stream:
                refusal = await self.gate.admit_hit(exchange) if self.gate else None
                if refusal is not None:
                    return refusal
                self.metrics.cache_hits.labels(exchange.model).inc()
                exchange.headers[HEADER] = "hit"  # the access log's too
                return await self.replay(exchange, entry)
        self.metrics.cache_misses.labels(exchange.model).inc()
        exchange.headers[HEADER] = "miss"
        recorder = Recorder(self.settings.max_entry_bytes, cache_rules.wants_usage(payload))
        exchange.taps.append(recorder)
        exchange.request[STATE] = Recording(verdict.key, recorder)
        return None

    def who(self, exchange: Exchange) -> Who:
        caller = exchange.request.get(CALLER)
        authorization = exchange.request.headers.get("Authorization")
        judged = forwards_client_credential(caller is not None, self.upstream_key)
        if caller is None:
            return Who(None, "", authorization, judged)
        return Who(caller.key_id, caller.team, authorization, judged)

    async def replay(self, exchange: Exchange, entry: Entry) -> web.StreamResponse:
        """The entry's bytes as they were rendered when stored (one write)."""
        headers = {**exchange.headers, "x-kvpilot-backend": "cache",
                   "x-kvpilot-target": exchange.model}  # fmt: skip
        if not entry.stream:
            return web.Response(body=entry.hit, content_type="application/json", headers=headers)
        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(exchange.request)
        await response.write(entry.hit)
        await response.write_eof()
        return response

    async def after(self, exchange: Exchange) -> None:
        recording = exchange.request.get(STATE)
        if self.store is None or not isinstance(recording, Recording):
            return
        if exchange.status != 200 or not exchange.served:
            return
        entry = recording.recorder.entry(exchange.inbound.stream)
        if entry is not None and await self.store.put(recording.key, entry):
            self.metrics.cache_stores.labels(exchange.model).inc()

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()


def cache_control(value: str) -> set[str]:
    """The directives of a Cache-Control header, lower case, without arguments."""
    return {part.split("=")[0].strip().lower() for part in value.split(",") if part.strip()}
