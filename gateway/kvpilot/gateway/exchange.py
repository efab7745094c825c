"""The seam between the proxy and its policies (keys, budgets, the response cache, cascade rules).

The proxy turns each request into an `Exchange` and runs the gateway's policies around it, in
order: each policy's `before` may answer the request itself (401, a 429 over budget, a cache hit),
change where it goes (`model`: a cascade rule) or what is sent upstream (`replace_payload`), add
`taps` that see the response's bytes as they reach the client, and add `gates` that keep a
fallback from serving it (a model outside the key's allow-list, a target a cost limit cannot
price). The proxy records in `target` what it was sent to, so it is charged to what served.
Every policy whose `before` ran gets `after` once, in reverse order, whatever happened next, so a
reservation is always settled or released: also when the client goes away (aiohttp cancels the
handler), because the `after`s run to their end in a task of their own (`run_to_end`) that the
cancellation does not reach.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from aiohttp import web

from kvpilot.gateway.bodies import Inbound
from kvpilot.gateway.routing.routes import Fallback


class Tap(Protocol):
    """Sees a response on its way to the client; may filter it (one SSE event dropped, say)."""

    def chunk(self, data: bytes) -> bytes:
        """What the client gets for `data`; a filter may hold back part of an event."""
        ...

    def end(self, complete: bool) -> bytes:
        """The response ended (`complete`: it reached its end, e.g. `data: [DONE]`); returns
        anything held back, written before the end."""
        ...


# Why a fallback may not serve the exchange (None: it may).
Gate = Callable[[Fallback], str | None]


@dataclass
class Exchange:
    """One request as the policies see it."""

    request: web.Request
    kind: str  # bodies.COMPLETIONS or bodies.CHAT
    inbound: Inbound
    body: bytes  # what goes upstream
    model: str  # the served name it is routed to (a cascade rule may change it)
    taps: list[Tap] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)  # added to the client's response
    status: int = 0  # the status the client got, set before `after` runs
    served: bool = False  # an upstream (replica or provider) answered it
    sent: bool = False  # it was sent to an upstream (which may have generated for it)
    # The model or provider it was last sent to: once answered, the one that served it (a
    # fallback's name, not `model`), whose price its use is charged at.
    target: str = ""
    gates: list[Gate] = field(default_factory=list)

    def refusal_of(self, fallback: Fallback) -> str | None:
        """Why `fallback` may not serve this exchange, or None when every gate lets it."""
        for gate in self.gates:
            why = gate(fallback)
            if why is not None:
                return why
        return None

    @property
    def payload(self) -> dict[str, Any]:
        return self.inbound.payload

    def replace_payload(self, payload: dict[str, Any]) -> None:
        """Send `payload` upstream instead (fallbacks re-encode from it too)."""
        self.inbound = Inbound(self.inbound.model, self.inbound.stream, self.inbound.prefix,
                               payload)  # fmt: skip
        self.body = json.dumps(payload).encode()


class Policy(Protocol):
    async def before(self, exchange: Exchange) -> web.StreamResponse | None:
        """An answer ends the exchange here (the later policies and the upstream never see it)."""
        ...

    async def after(self, exchange: Exchange) -> None: ...


T = TypeVar("T")
_finishing: set[asyncio.Future[Any]] = set()  # run_to_end's tasks, held until they end


async def run_to_end(work: Awaitable[T]) -> tuple[T, bool]:
    """`work`'s result, and whether the caller was cancelled meanwhile. The caller's cancellation
    (a client that went away) does not stop `work`: a store call whose effect lands anyway (a
    reservation charged in Redis) is seen through, so its result is never lost. The caller must
    raise CancelledError itself when told it was cancelled."""
    task = asyncio.ensure_future(work)
    _finishing.add(task)
    task.add_done_callback(_finishing.discard)
    cancelled = False
    while True:
        try:
            return await asyncio.shield(task), cancelled
        except asyncio.CancelledError:
            if task.cancelled():  # the loop itself is shutting down
                raise
            cancelled = True


async def run_afters(policies: Sequence[Policy], exchange: Exchange) -> None:
    """Every policy's `after`, in reverse order, to its end even if the handler is cancelled
    (again) meanwhile; a cancellation that arrived is raised once they are done."""

    if not policies:
        return

    async def afters() -> None:
        for policy in reversed(policies):
            await policy.after(exchange)

    _, cancelled = await run_to_end(afters())
    if cancelled:
        raise asyncio.CancelledError


@runtime_checkable
class ModelsFilter(Protocol):
    """A policy that also decides what `GET /v1/models` shows a caller (the keys policy)."""

    def visible_models(self, request: web.Request, models: list[str]) -> list[str] | web.Response:
        """The models of `models` this caller may see, or the refusal to answer instead."""
        ...


def through_taps(taps: Sequence[Tap], data: bytes) -> bytes:
    for tap in taps:
        data = tap.chunk(data)
    return data


def end_taps(taps: Sequence[Tap], complete: bool) -> bytes:
    """What the taps held back, in order; each later tap also filters what earlier ones release."""
    held = b""
    for tap in taps:
        held = tap.chunk(held) if held else held
        held += tap.end(complete)
    return held
