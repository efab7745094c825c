"""The budget policy (the last one before the upstream): reserve, forward, settle.

`before`: the caller's limits (its key's and its team's) are charged the request's reservation
(1 request, the prompt's token bound, `max_tokens` x `n` output tokens, their cost at the highest
price of the models that may serve it) in one atomic store call; a limit without room answers 429
with an OpenAI-style error naming it, what is used and what requests in flight hold, and
`Retry-After`: when those requests settle if only they keep it out, else when its window resets.
A stream asks the upstream for its usage (`stream_options`), which the UsageTap drops again when
the client did not ask. A request without `max_tokens` under a token or cost limit is sent with
the configured default, so the reservation bounds it. Under a cost limit, a fallback without a
price may not serve (`exchange.gates`): its cost could not be kept.

`after` (always, whatever happened): the reservation is settled to the usage the upstream reported;
a stream that broke or was abandoned settles the chunks it relayed; a request never sent upstream
gives everything back; a JSON request abandoned after it was sent keeps its reservation (see
`used`). Use is charged at the price of the model or provider that served it (a fallback's, not
the model asked for) and counted under its name. `after` runs to its end even when the client
went away (exchange.run_afters), and a reservation the store made while the client was leaving is
recorded before the handler stops, so none is left charged. Spend and tokens are counted per key,
team and the model that served.

Store failures: fail closed (503, the default) or open (admitted; its use is added when it ends
if the store answers again); each counts in a metric and the store's up/down changes are logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvpilot.gateway import bodies
from kvpilot.gateway.budget.arithmetic import (
    Amounts,
    Charge,
    Limit,
    Price,
    amounts,
    charges,
    retry_after_s,
    settled_of,
    settlement,
    upper_price,
)  # fmt: skip
from kvpilot.gateway.budget.keys import CALLER, Caller
from kvpilot.gateway.budget.store import BudgetStore, Denied, StoreError
from kvpilot.gateway.exchange import Exchange, run_to_end
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing.routes import Fallback
from kvpilot.gateway.upstream import error_response
from kvpilot.gateway.usage import UsageTap, prompt_count, prompt_tokens_bound

log = logging.getLogger("kvpilot.gateway.budget")
TOKEN_UNITS = ("input_tokens", "output_tokens", "total_tokens", "cost")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and the runtime's) when the field is absent
HIT_USE = Amounts(1, 0, 0, 0.0)  # what a cache hit is charged: one request


@dataclass(frozen=True)
class BudgetOptions:
    default_max_tokens: int = 1024  # sent upstream when a limited request has no max_tokens
    fail_open: bool = False  # admit requests while the store is down


@dataclass
class Reservation:
    caller: Caller
    model: str
    limits: list[Limit]
    charged: list[Charge]  # empty: admitted without a reservation (the store was down)
    reserved: Amounts
    price: Price | None  # reserved at: the highest of the models that may serve it
    tap: UsageTap


RESERVATION = web.RequestKey("kvpilot.budget", Reservation)  # what `after` settles


class BudgetPolicy:
    def __init__(
        self,
        store: BudgetStore,
        metrics: GatewayMetrics,
        price_of: Callable[[str], Price | None],
        options: BudgetOptions | None = None,
        fallbacks_of: Callable[[str], Sequence[Fallback]] = lambda _: (),
    ) -> None:
        self.store, self.metrics, self.price_of = store, metrics, price_of
        self.fallbacks_of = fallbacks_of  # a model's fallbacks, which may serve it instead
        self.options = options or BudgetOptions()
        self.store_up = True

    async def before(self, exchange: Exchange) -> web.StreamResponse | None:
        caller = exchange.request.get(CALLER)
        if not isinstance(caller, Caller):
            return None  # no keys configured: nothing to charge
        limits = list(caller.entry.limits)
        price = self.price_of(exchange.model)
        if price is None and any(lim.unit == "cost" for lim in limits):
            message = (f"model {exchange.model!r} has no price, so key {caller.key_id}'s cost "
                       "limit cannot be kept: give it one (prices: in the gateway config, or "
                       "the ModelDeployment's status.cost)")  # fmt: skip
            return error_response(403, message, "model", "model_not_priced")
        if any(lim.unit == "cost" for lim in limits):
            exchange.gates.append(lambda fallback: self.unpriced(caller, fallback))
        price = upper_price([price, *self.fallback_prices(exchange)])
        reserved = self.reservation(exchange, limits, price)
        refused = unusable_stream_options(exchange.payload) or first_too_big(limits, reserved)
        if refused is not None:
            return refused
        tap = UsageTap(exchange.inbound.stream, strip=not asks_usage(exchange.payload))
        exchange.taps.append(tap)
        if exchange.inbound.stream and tap.strip:
            options = {**(exchange.payload.get("stream_options") or {}), "include_usage": True}
            exchange.replace_payload({**exchange.payload, "stream_options": options})
        now = time.time()
        charged = charges(limits, reserved, now)
        # Seen through even if the client goes away meanwhile: Redis may have charged it
        # already, and only a recorded reservation is given back (`after`).
        refusal, cancelled = await run_to_end(self.reserve(charged, limits, reserved, now))
        if not isinstance(refusal, web.StreamResponse):
            exchange.request[RESERVATION] = Reservation(
                caller, exchange.model, limits, charged if refusal else [], reserved, price, tap
            )
        if cancelled:
            raise asyncio.CancelledError
        return refusal if isinstance(refusal, web.StreamResponse) else None

    def fallback_prices(self, exchange: Exchange) -> list[Price | None]:
        """The prices of the fallbacks that may serve this exchange."""
        return [self.price_of(fallback_name(f)) for f in self.fallbacks_of(exchange.model)
                if exchange.refusal_of(f) is None]  # fmt: skip

    def unpriced(self, caller: Caller, fallback: Fallback) -> str | None:
        name = fallback_name(fallback)
        if self.price_of(name) is not None:
            return None
        return (f"{name!r} has no price, so key {caller.key_id}'s cost limit could not be kept "
                f"(prices: {name})")  # fmt: skip

    def reservation(self, exchange: Exchange, limits: list[Limit], price: Price | None) -> Amounts:
        """The request's most: its prompt bound and max_tokens (set to the default when a token
        limit applies and the client gave none) for each of its `n` choices and prompts."""
        payload = exchange.payload
        max_out = max_tokens_of(payload, exchange.kind)
        if max_out is None:
            max_out = self.options.default_max_tokens
            if any(lim.unit in TOKEN_UNITS for lim in limits):
                exchange.replace_payload({**payload, "max_tokens": max_out})
        choices = positive_int(payload.get("n"), 1) * prompt_count(payload, exchange.kind)
        prompt = prompt_tokens_bound(payload, exchange.kind)
        return amounts(1, prompt, max_out * choices, price)

    async def reserve(
        self, charged: list[Charge], limits: list[Limit], reserved: Amounts, now: float
    ) -> web.StreamResponse | bool:
        """True: reserved; False: admitted unreserved (store down, failing open); or the
        refusal to answer."""
        if not charged:
            return True
        try:
            denied = await self.store.reserve(charged)
        except StoreError as error:
            self.store_failed("reserve", error)
            if self.options.fail_open:
                return False
            message = "the budget store is unavailable, so no request can be admitted; retry"
            return error_response(503, message, None, "budget_store_unavailable")
        self.store_answered()
        if denied is None:
            return True
        return self.over_limit(limits, reserved, denied, now)

    def over_limit(
        self, limits: list[Limit], reserved: Amounts, denied: Denied, now: float
    ) -> web.Response:
        limit, amount = limits[denied.index], reserved.of(limits[denied.index].unit)
        retry = retry_after_s(limit, now, denied.used, denied.in_flight, amount)
        self.metrics.budget_refusals.labels(limit.scope, limit.unit, limit.window.text).inc()
        settled = settled_of(denied.used, denied.in_flight)
        when = (f"the window resets in {retry}s" if retry_after_s(limit, now) == retry else
                f"retry in {retry}s, when requests in flight have settled")  # fmt: skip
        message = (f"over the limit {limit.describe()}: {settled:g} used and "
                   f"{denied.used - settled:g} reserved by requests in flight, and this "
                   f"request reserves {amount:g} (prompt tokens at most and max_tokens); "
                   f"{when}")  # fmt: skip
        code = "budget_exceeded" if limit.unit == "cost" else "rate_limit_exceeded"
        response = error_response(429, message, None, code)
        response.headers["Retry-After"] = str(retry)
        return response

    async def after(self, exchange: Exchange) -> None:
        reservation = exchange.request.get(RESERVATION)
        if not isinstance(reservation, Reservation):
            return
        target = exchange.target or reservation.model  # what served it (or was last tried)
        actual = used(reservation, exchange, self.price_of(target))
        log.debug("settle key %s: reserved %s, used %s (served %s by %s, status %s, usage %s)",
                  reservation.caller.key_id, reservation.reserved, actual, exchange.served,
                  target, exchange.status, reservation.tap.usage)  # fmt: skip
        self.count(reservation.caller, target, actual)
        if reservation.charged:
            deltas = settlement(reservation.charged, reservation.limits, actual)
        else:
            deltas = charges(reservation.limits, actual, time.time())
        try:
            await self.store.adjust(deltas)
        except StoreError as error:  # the reservation stays: counted high, never low
            self.store_failed("settle", error)
            return
        self.store_answered()

    def count(self, caller: Caller, model: str, actual: Amounts) -> None:
        tokens = self.metrics.tokens
        tokens.labels(caller.key_id, caller.team, model, "input").inc(actual.input_tokens)
        tokens.labels(caller.key_id, caller.team, model, "output").inc(actual.output_tokens)
        self.metrics.spend.labels(caller.key_id, caller.team, model).inc(actual.cost)

    def store_failed(self, operation: str, error: Exception) -> None:
        decision = "admitted" if self.options.fail_open or operation == "settle" else "refused"
        self.metrics.budget_store_errors.labels(operation, decision).inc()
        self.metrics.budget_store_up.set(0)
        if self.store_up:
            action = "admitting unreserved" if self.options.fail_open else "refusing (503)"
            log.error("budget store down (%s: %s): %s requests until it answers", operation,
                      error, action)  # fmt: skip
        self.store_up = False

    def store_answered(self) -> None:
        self.metrics.budget_store_up.set(1)
        if not self.store_up:
            log.warning("budget store answers again")
        self.store_up = True

    async def admit_hit(self, exchange: Exchange) -> web.StreamResponse | None:
        """A cache hit (cache/policy.py's HitGate) is admitted exactly when the same request
        would be (its whole reservation fits every limit of the caller), then counted as one
        request that spent no tokens and no cost: a key over its budget or its `rpm_limit` is
        refused for a cached prompt too (issue 40). None: admitted."""
        caller = exchange.request.get(CALLER)
        if not isinstance(caller, Caller) or not caller.entry.limits:
            return None
        limits = list(caller.entry.limits)
        reserved = self.reservation(exchange, limits, self.price_of(exchange.model))
        too_big = first_too_big(limits, reserved)
        if too_big is not None:
            return too_big
        now = time.time()
        charged = charges(limits, reserved, now)
        answer, cancelled = await run_to_end(self.reserve_hit(charged, limits, reserved, now))
        if cancelled:
            raise asyncio.CancelledError
        return answer

    async def reserve_hit(
        self, charged: list[Charge], limits: list[Limit], reserved: Amounts, now: float
    ) -> web.StreamResponse | None:
        answer = await self.reserve(charged, limits, reserved, now)
        if isinstance(answer, web.StreamResponse):
            return answer
        if answer:  # reserved: all of it given back but the request
            try:
                await self.store.adjust(settlement(charged, limits, HIT_USE))
            except StoreError as error:  # the reservation stays: counted high, never low
                self.store_failed("settle", error)
        return None


def used(reservation: Reservation, exchange: Exchange, price: Price | None) -> Amounts:
    """What the request used, priced at `price` (what served it): the upstream's usage when it
    reported one. Else, when part of an answer reached the client (a stream cut off, or abandoned
    by the client): the prompt bound and the content chunks relayed (a JSON answer without usage:
    its whole reservation). An error answer, or a request never sent upstream (refused, or
    abandoned while it waited), used nothing. A request abandoned after it was sent, before any of
    its answer came back: a stream used its prompt (each decoded token is sent as it is made, and
    none came); a JSON answer keeps its reservation, as the upstream may have generated up to
    max_tokens before it noticed."""
    tap, reserved = reservation.tap, reservation.reserved
    if tap.usage is not None:
        return amounts(1, tap.usage.prompt_tokens, tap.usage.completion_tokens, price)
    if exchange.status >= 400 or not exchange.sent:
        return amounts(0, 0, 0, price)
    if tap.seen or (exchange.status == 0 and tap.stream):
        output = min(tap.content_chunks, reserved.output_tokens) if tap.stream else (
            reserved.output_tokens)  # fmt: skip
        return amounts(1, reserved.input_tokens, output, price)
    if exchange.status == 0:  # a JSON answer abandoned (the client went away) before it came
        return amounts(1, reserved.input_tokens, reserved.output_tokens, price)
    return amounts(0, 0, 0, price)  # answered without an upstream answer: nothing used


def fallback_name(fallback: Fallback) -> str:
    return fallback if isinstance(fallback, str) else fallback.name


def first_too_big(limits: list[Limit], reserved: Amounts) -> web.Response | None:
    """A request whose reservation alone is over a limit can never be admitted: 400 naming
    the field to lower (a 429 would have the client retry forever)."""
    for limit in limits:
        if reserved.of(limit.unit) > limit.limit:
            param = "messages" if limit.unit == "input_tokens" else "max_tokens"
            message = (f"this request reserves {reserved.of(limit.unit):g} against the limit "
                       f"{limit.describe()}, more than the whole limit: lower {param}")  # fmt: skip
            return error_response(400, message, param, "over_limit")
    return None


def unusable_stream_options(payload: dict[str, Any]) -> web.Response | None:
    """`stream_options` the policy cannot add `include_usage` to: the 400 the runtime would
    answer (found by the gateway's schemathesis run: it was a 500)."""
    options = payload.get("stream_options")
    if options is None or isinstance(options, dict):
        return None
    message = '`stream_options` must be an object, like {"include_usage": true}, or null'
    return error_response(400, message, "stream_options", "invalid_type")


def max_tokens_of(payload: dict[str, Any], kind: str) -> int | None:
    """The request's output bound; None when it has none (chat without one). Null is unset,
    as the runtime reads it: a completion's `"max_tokens": null` is the default 16."""
    if kind == bodies.COMPLETIONS and payload.get("max_tokens") is None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    fields = ("max_completion_tokens", "max_tokens") if kind == bodies.CHAT else ("max_tokens",)
    for name in fields:
        value = payload.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def positive_int(value: Any, default: int) -> int:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default
    )


def asks_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
