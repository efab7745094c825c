"""API keys: who is calling (the first policy). With keys configured every request needs
`Authorization: Bearer <key>` (the scheme in any case, RFC 7235; 401 otherwise) and may only ask
for the models of its key's allow-list (403 naming the model); `GET /v1/models` needs a key too
and lists only those models. Keys are kept as sha256 hashes only; a key is named by the hash's
first characters (`key_id`) in metrics, logs and errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from kvpilot.gateway.budget.config import KeyEntry, hash_key
from kvpilot.gateway.credentials import bearer_token
from kvpilot.gateway.exchange import Exchange
from kvpilot.gateway.routing.routes import Fallback
from kvpilot.gateway.upstream import error_response


@dataclass(frozen=True)
class Caller:
    key_id: str
    team: str
    entry: KeyEntry


# exchange.request[CALLER]: the Caller, for the later policies (a typed key: aiohttp checks it)
CALLER = web.RequestKey("kvpilot.key", Caller)


class KeyRing:
    """The current keys (sha256 hex -> entry); a Kubernetes Secret watch replaces them whole."""

    def __init__(self, book: dict[str, KeyEntry]) -> None:
        self.book = book

    def replace(self, book: dict[str, KeyEntry]) -> None:
        self.book = book

    def lookup(self, authorization: str | None) -> KeyEntry | None:
        token = bearer_token(authorization)
        return None if token is None else self.book.get(hash_key(token))


class KeysPolicy:
    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring

    async def before(self, exchange: Exchange) -> web.StreamResponse | None:
        authorization = exchange.request.headers.get("Authorization")
        entry = self.ring.lookup(authorization)
        if entry is None:
            return unauthorized(authorization)
        if entry.models is not None and exchange.model not in entry.models:
            allowed = ", ".join(sorted(entry.models)) or "none"
            message = (f"key {entry.key_id} may not use model {exchange.model!r}; its models: "
                       f"{allowed}")  # fmt: skip
            return error_response(403, message, "model", "model_not_allowed")
        exchange.request[CALLER] = Caller(entry.key_id, entry.team, entry)
        exchange.gates.append(lambda fallback: fallback_not_allowed(entry, fallback))
        return None

    async def after(self, exchange: Exchange) -> None:
        pass

    def visible_models(self, request: web.Request, models: list[str]) -> list[str] | web.Response:
        """`GET /v1/models`: the served models the caller's key may use, or 401 without one."""
        authorization = request.headers.get("Authorization")
        entry = self.ring.lookup(authorization)
        if entry is None:
            return unauthorized(authorization)
        return [m for m in models if entry.models is None or m in entry.models]


def unauthorized(authorization: str | None) -> web.Response:
    given = "no API key was given" if not authorization else "the API key is not valid"
    message = f"{given}: send `Authorization: Bearer <key>` with a key of this gateway"
    return error_response(401, message, None, "invalid_api_key")


def fallback_not_allowed(entry: KeyEntry, fallback: Fallback) -> str | None:
    """A fallback model outside the key's allow-list may not serve it. A provider fallback
    stands in for the model asked for (which the key may use), so the list does not name it."""
    if entry.models is None or not isinstance(fallback, str) or fallback in entry.models:
        return None
    return f"key {entry.key_id} may not use model {fallback!r}"
