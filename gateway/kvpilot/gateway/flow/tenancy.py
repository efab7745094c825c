"""Who a request is for and at what priority (the policy after the keys policy).

The tenant is the key's team, else the key alone (`key:<id>`), else, with no keys configured, one
tenant for everyone (`-`). The priority is the key's (or its team's; 0 without keys), or a worse
one the request asks for (flow/priority.py); a better one is a 400. What it decides is read by the
fair queue (flow/gate.py) and sent to replicas that take vLLM's `priority` field.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from kvpilot.gateway.bodies import BadRequestError
from kvpilot.gateway.budget.keys import CALLER, Caller
from kvpilot.gateway.exchange import Exchange
from kvpilot.gateway.flow import priority
from kvpilot.gateway.upstream import error_response


@dataclass(frozen=True)
class Tenancy:
    tenant: str
    priority: int  # lower runs first
    weight: float = 1.0


ANONYMOUS = Tenancy("-", 0)  # every caller of a gateway without keys
TENANCY = web.RequestKey("kvpilot.tenancy", Tenancy)


class TenancyPolicy:
    async def before(self, exchange: Exchange) -> web.StreamResponse | None:
        caller = exchange.request.get(CALLER)
        base = tenancy_of(caller if isinstance(caller, Caller) else None)
        who = f"key {caller.key_id}" if isinstance(caller, Caller) else "a caller without a key"
        try:
            asked = priority.requested(exchange.request.headers.get(priority.HEADER),
                                       exchange.payload.get("priority"))  # fmt: skip
            chosen = priority.effective(base.priority, asked, who)
        except BadRequestError as error:
            return error_response(400, str(error), error.param, "invalid_priority")
        exchange.request[TENANCY] = Tenancy(base.tenant, chosen, base.weight)
        return None

    async def after(self, exchange: Exchange) -> None:
        pass


def tenancy_of(caller: Caller | None) -> Tenancy:
    if caller is None:
        return ANONYMOUS
    return Tenancy(caller.entry.tenant, caller.entry.priority, caller.entry.weight)
