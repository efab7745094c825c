"""The cascade policy: before a replica is picked, the first of the route's cascade rules
(routing/cascade_rules.py) that holds sends the request to its target model instead. The decision
is the response header `x-kvpilot-cascade: <rule index>-><target>` and
`kvpilot_gateway_cascade_total{model,target,rule}`."""

from __future__ import annotations

from aiohttp import web

from kvpilot.gateway.exchange import Exchange
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing.cascade_rules import choose, prompt_facts
from kvpilot.gateway.routing.routes import RouteTable

HEADER = "x-kvpilot-cascade"


class CascadePolicy:
    """Re-routes a request by its route's cascade rules (a policy, exchange.py)."""

    def __init__(self, table: RouteTable, metrics: GatewayMetrics) -> None:
        self.table, self.metrics = table, metrics

    async def before(self, exchange: Exchange) -> web.StreamResponse | None:
        route = self.table.get(exchange.model)
        if route is None or not route.cascade:
            return None
        index = choose(route.cascade, prompt_facts(exchange.kind, exchange.payload))
        if index is None:
            return None
        target = route.cascade[index].target
        if target is None or target == exchange.model or self.table.get(target) is None:
            return None  # a target not served (yet): the model asked for serves it
        self.metrics.cascade.labels(exchange.model, target, str(index)).inc()
        exchange.headers[HEADER] = f"{index}->{target}"
        exchange.model = target
        return None

    async def after(self, exchange: Exchange) -> None:
        return None
