"""What the gateway routes to: each served model name, its ready replicas and its fallbacks.

Discovery (the static config file, or a watch on the cluster) is the only writer of a RouteTable;
the proxy only reads it. A model's route is replaced whole, so a reader never sees half an update,
and every change wakes the requests held for a model that has no replica yet (scale from zero).
All methods run on the gateway's event loop; a discovery thread hands changes over with
`loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvpilot.gateway.budget.arithmetic import Price
from kvpilot.gateway.routing.cascade_rules import CascadeRule


@dataclass(frozen=True)
class Backend:
    """One replica: `url` is its base URL (scheme, host, port; no /v1), `name` what the
    `x-kvpilot-backend` response header says (the pod's namespace/name, or the URL)."""

    name: str
    url: str


@dataclass(frozen=True)
class Provider:
    """An external OpenAI-compatible endpoint used as a fallback: requests go to
    `base_url` + /chat/completions (base_url includes /v1) with `model` substituted."""

    name: str
    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ScaleTarget:
    """The ModelDeployment that serves a route, so a request can wake it from zero replicas."""

    namespace: str
    name: str


# A fallback is another served model's name (its own route is used) or an external provider.
Fallback = str | Provider


@dataclass(frozen=True)
class Route:
    model: str
    backends: tuple[Backend, ...] = ()
    fallbacks: tuple[Fallback, ...] = ()
    scale_target: ScaleTarget | None = None
    # How long a request may wait for a replica (held at zero, or retried) before the fallbacks;
    # None: the gateway's --fallback-after default. spec.routing.fallbackAfterSeconds.
    fallback_after_s: float | None = None
    # Tried in order before picking: the first that applies re-routes the request
    # (routing/cascade_policy.py).
    cascade: tuple[CascadeRule, ...] = ()
    # Per 1M tokens, for cost budgets and spend: the ModelDeployment's status.cost (None: unpriced).
    price: Price | None = None
    # The replicas take vLLM's `priority` field (they run `--scheduling-policy priority`); else
    # it is left out of the body, as a replica under fcfs refuses a priority it cannot honour.
    takes_priority: bool = False
    # A LoRA adapter's route: the base model's served name. Its replicas are the base model's,
    # picked preferring those that hold the adapter (routing/lora_affinity.py).
    adapter_of: str | None = None


class RouteTable:
    """The current route of every served model, and a way to wait for the next change."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}
        self._changed = asyncio.Event()

    def get(self, model: str) -> Route | None:
        return self._routes.get(model)

    def models(self) -> list[str]:
        return sorted(self._routes)

    def put(self, route: Route) -> None:
        self._routes[route.model] = route
        self._wake()

    def remove(self, model: str) -> None:
        if self._routes.pop(model, None) is not None:
            self._wake()

    def replace_all(self, routes: list[Route]) -> None:
        """The whole table at once (a config reload, or a watch that re-listed)."""
        self._routes = {route.model: route for route in routes}
        self._wake()

    async def changed(self) -> None:
        """Returns at the next put, remove or replace_all after the call."""
        await self._changed.wait()

    def _wake(self) -> None:
        # Set then swap: everyone waiting on the old event wakes, later waiters wait anew.
        event, self._changed = self._changed, asyncio.Event()
        event.set()
