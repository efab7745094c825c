"""The gateway's HTTP side (aiohttp): OpenAI endpoints in, replicas and fallbacks out.

A request for model M: its route (404 listing the served models when there is none), its turn in
the fair queue while M's replicas are saturated (flow/gate.py), a replica picked by the policy
(routing/picking.py), retried on another replica while nothing reached the client (bounded, with
jitter), held while M has no replica and can be woken (routing/holding.py),
then M's fallbacks in order (those the request may use, `Exchange.gates`); the response says who
served it (`x-kvpilot-backend`, `x-kvpilot-target`), and so does `Exchange.target`, for its
charge. `/health` is liveness (the process answers), `/ready` readiness (its checks pass).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpilot.gateway import bodies
from kvpilot.gateway.bodies import BadRequestError, Inbound
from kvpilot.gateway.budget.keys import CALLER
from kvpilot.gateway.cache.policy import HEADER as CACHE
from kvpilot.gateway.credentials import upstream_authorization
from kvpilot.gateway.exchange import Exchange, ModelsFilter, Policy, run_afters
from kvpilot.gateway.flow.gate import (
    ADMISSION,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    FlowGate,
    FlowOptions,
    tokens_used,
)  # fmt: skip
from kvpilot.gateway.flow.tenancy import ANONYMOUS, TENANCY
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing import lora_affinity
from kvpilot.gateway.routing.affinity import Affinity
from kvpilot.gateway.routing.holding import Holding
from kvpilot.gateway.routing.load import LoadBook, scrape_forever
from kvpilot.gateway.routing.picking import PickPolicy, home, pick
from kvpilot.gateway.routing.routes import Backend, Provider, Route, RouteTable
from kvpilot.gateway.routing.wake import Waker
from kvpilot.gateway.unknown_routes import explain_unknown_routes
from kvpilot.gateway.upstream import Hop, Refusal, error_response, forward
from kvpilot.gateway.usage import prompt_tokens_bound

access_log = logging.getLogger("kvpilot.gateway.access")


UPSTREAM_IDLE_S = 4.0
ADAPTER_NOT_LOADED = "adapter_not_loaded"  # a retry's reason (kvpilot_gateway_retries_total)
WAIT_REFUSALS = {  # why the fair queue sent a request away (429 unless a fallback takes it)
    QUEUE_FULL: "your tenant has as many requests waiting as it may (--max-queued-per-tenant)",
    QUEUE_TIMEOUT: "the request waited longer than --fallback-after for its turn",
}


@dataclass(frozen=True)
class ProxyOptions:
    policy: PickPolicy = field(default_factory=PickPolicy)
    prefix_chars: int = 256  # of the prompt (chat: the messages, system first) keying affinity
    max_attempts: int = 3  # replicas tried per request before the fallbacks
    retry_backoff_s: float = 0.02  # times a random 0.5-1.5, per retry
    fallback_after_s: float = 30.0  # longest wait for a replica (held at zero) before fallbacks
    max_held_per_model: int = 256
    max_body_bytes: int = 16 * 1024 * 1024  # as the runtime's --max-request-body-bytes
    connect_timeout_s: float = 5.0
    scrape_interval_s: float = 2.0  # replicas' /metrics (queue, KV usage)
    eject_s: float = 5.0  # a replica that refused a connection or answered 502/503 sits out
    upstream_api_key: str | None = field(default=None, repr=False)  # sent to replicas
    flow: FlowOptions = field(default_factory=FlowOptions)  # the fair queue (flow/gate.py)


@dataclass
class Outcome:
    """How a request ended, for its log line and metrics."""

    response: web.StreamResponse | None = None
    target: str = "none"
    backend: str = ""
    attempts: int = 0
    reason: str = ""
    refusal: Refusal | None = None
    skipped: list[str] = field(default_factory=list)  # why fallbacks were not tried


class Gateway:
    def __init__(
        self,
        table: RouteTable,
        options: ProxyOptions | None = None,
        waker: Waker | None = None,
        metrics: GatewayMetrics | None = None,
        policies: Sequence[Policy] = (),
    ) -> None:
        self.table, self.options = table, options or ProxyOptions()
        self.policies = list(policies)  # run in order around each request (exchange.py)
        self.metrics = metrics or GatewayMetrics()
        self.book = LoadBook(eject_s=self.options.eject_s)
        self.affinity = Affinity()  # prompt prefix -> the replica it went to (routing/picking.py)
        self.holding = Holding(table, waker, self.metrics, self.options.max_held_per_model)
        self.flow = FlowGate(table, self.options.flow, self.metrics)
        self.session: aiohttp.ClientSession | None = None
        # `/ready` asks each: why the gateway cannot serve now (None: it can)
        self.readiness: list[Callable[[], Awaitable[str | None]]] = []

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.options.max_body_bytes, middlewares=[explain_unknown_routes]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.prometheus)
        app.cleanup_ctx.append(self._client_session)
        return app

    async def _client_session(self, _: web.Application) -> AsyncIterator[None]:
        # A pool per replica; idle connections close before the replica's own idle timeout
        # (uvicorn's 5 s), so a request is never sent on a connection the replica is closing.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_IDLE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.options.connect_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        scraper = asyncio.ensure_future(
            scrape_forever(self.session, self.book, self.all_backends,
                           self.options.scrape_interval_s)
        )  # fmt: skip
        yield
        scraper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scraper
        await self.session.close()

    def all_backends(self) -> list[Backend]:
        routes = (self.table.get(model) for model in self.table.models())
        return [b for route in routes if route is not None for b in route.backends]

    async def health(self, _: web.Request) -> web.Response:
        """Liveness: the process answers. Never what it depends on (a Redis that is down must
        not get the gateway restarted)."""
        return web.Response(text="ok")

    async def ready(self, _: web.Request) -> web.Response:
        """Readiness: 503 naming what keeps the gateway from serving (the budget store)."""
        for check in self.readiness:
            why = await check()
            if why is not None:
                return error_response(503, f"not ready: {why}", None, "not_ready")
        return web.Response(text="ok")

    async def prometheus(self, _: web.Request) -> web.Response:
        self.flow.declare_demand_series()
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_models(self, request: web.Request) -> web.Response:
        """Every routed model, or (with keys) those the caller's key may use."""
        models = self.table.models()
        for policy in self.policies:
            if isinstance(policy, ModelsFilter):
                visible = policy.visible_models(request, models)
                if isinstance(visible, web.Response):
                    return visible
                models = visible
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvpilot"}
                for m in models]  # fmt: skip
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, bodies.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, bodies.CHAT)

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        started = time.perf_counter()  # not the loop's clock: uvloop's counts whole ms
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            limit = self.options.max_body_bytes
            return error_response(413, f"the body is over {limit} bytes; send a shorter prompt")
        try:
            inbound = bodies.parse_body(raw, kind, self.options.prefix_chars)
        except BadRequestError as error:
            return error_response(400, str(error), error.param)
        exchange = Exchange(request, kind, inbound, raw, inbound.model)
        ran: list[Policy] = []
        outcome = Outcome()
        try:
            response = await self.apply_policies(exchange, ran)
            if response is None:
                response, outcome = await self.route_and_send(exchange)
            exchange.status = response.status
        finally:  # each reservation settled or released, whatever happened (a client gone too)
            await run_afters(ran, exchange)
        self.record(inbound, outcome, response.status, started, exchange.headers.get(CACHE, ""))
        return response

    async def apply_policies(
        self, exchange: Exchange, ran: list[Policy]
    ) -> web.StreamResponse | None:
        for policy in self.policies:
            ran.append(policy)
            answered = await policy.before(exchange)
            if answered is not None:
                return answered
        return None

    async def route_and_send(self, exchange: Exchange) -> tuple[web.StreamResponse, Outcome]:
        route = self.table.get(exchange.model)
        if route is None:
            served = ", ".join(self.table.models()) or "none"
            message = f"model {exchange.model!r} is not served here; served models: {served}"
            return error_response(404, message, "model", "model_not_found"), Outcome()
        outcome = await self.dispatch(exchange, route)
        exchange.served = outcome.response is not None
        return outcome.response or refused_response(outcome, exchange.model), outcome

    async def dispatch(self, exchange: Exchange, route: Route) -> Outcome:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (route.fallback_after_s or self.options.fallback_after_s)
        first = await self.in_turn(exchange, self.body_for(exchange, route), route, deadline)
        if first.response is not None:
            return first
        last, skipped = first, list[str]()
        for fallback in route.fallbacks:
            name = fallback if isinstance(fallback, str) else fallback.name
            why_not = exchange.refusal_of(fallback)  # the key's allow-list, an unpriced target
            if why_not is not None:
                skipped.append(why_not)
                continue
            self.metrics.fallbacks.labels(exchange.model, name, first.reason).inc()
            if isinstance(fallback, Provider):
                outcome = await self.to_provider(exchange, fallback)
            else:
                outcome = await self.to_fallback_model(exchange, fallback)
            if outcome.response is not None:
                outcome.reason = first.reason  # why it fell back, for the log line
                return outcome
            last = outcome if outcome.refusal else last
        return Outcome(reason=first.reason, refusal=last.refusal, attempts=first.attempts,
                       skipped=skipped)  # fmt: skip

    async def to_fallback_model(self, exchange: Exchange, model: str) -> Outcome:
        route = self.table.get(model)
        if route is None:
            return Outcome(reason="no_route")
        body = self.body_for(exchange, route)
        now = asyncio.get_running_loop().time()  # no holding for a fallback: its deadline passed
        return await self.to_replicas(exchange, body, route, now)

    def body_for(self, exchange: Exchange, route: Route) -> bytes:
        """The body for `route`'s replicas: its model's name, and the request's priority when
        they take the field."""
        tenancy = exchange.request.get(TENANCY, ANONYMOUS)
        priority = tenancy.priority if route.takes_priority else None
        return bodies.for_upstream(exchange.payload, exchange.body, route.model, priority)

    async def in_turn(
        self, exchange: Exchange, body: bytes, route: Route, deadline: float
    ) -> Outcome:
        """`to_replicas` once the fair queue lets the request go; its slot is held until the
        answer ended, then charged the tokens it used."""
        estimate = prompt_tokens_bound(exchange.payload, exchange.kind)
        tenancy = exchange.request.get(TENANCY, ANONYMOUS)
        admission = await self.flow.enter(route, tenancy, estimate, deadline)
        if isinstance(admission, str):
            return Outcome(target=route.model, reason=admission)
        exchange.request[ADMISSION] = admission
        outcome: Outcome | None = None
        try:
            outcome = await self.to_replicas(exchange, body, route, deadline)
            return outcome
        finally:  # None: the client went away, maybe mid-answer (the tap saw what it got)
            served = outcome is None or outcome.response is not None
            self.flow.leave(admission, *(tokens_used(exchange, estimate) if served else (0, 0)))

    async def to_replicas(
        self, exchange: Exchange, body: bytes, route: Route, deadline: float
    ) -> Outcome:
        """Try `route`'s replicas (holding while it has none and can be woken) until one answers
        or none is left; nothing reaches the client unless one answered."""
        outcome, tried = Outcome(target=route.model), set[str]()
        while outcome.attempts < self.options.max_attempts:
            route = self.table.get(route.model) or route  # discovery may have changed it
            candidates = self.book.available(route.backends, tried)
            if not candidates:
                is_late = deadline <= asyncio.get_running_loop().time()
                if is_late or not self.holding.can_hold(route):
                    outcome.reason = outcome.reason or "no_replicas"
                    return outcome
                held, why = await self.holding.hold(route, deadline)
                if held is None:
                    outcome.reason = why
                    return outcome
                continue
            backend = self.pick(exchange.inbound.prefix, route, candidates)
            if backend is None:  # pick returns one whenever candidates is not empty
                return outcome
            if outcome.attempts:
                await self.before_retry(exchange.model, outcome.reason)
            outcome.attempts += 1
            tried.add(backend.name)
            if await self.try_backend(exchange, body, route, backend, outcome):
                return outcome
        return outcome

    def pick(self, prefix: str, route: Route, candidates: list[Backend]) -> Backend | None:
        """The replica for this attempt; under prefix affinity, the key's home is remembered
        (per model: two models' replicas never share a prefix cache). For a LoRA adapter, among
        the replicas that hold it while one is within the load bound (lora_affinity)."""
        policy = self.options.policy
        if route.adapter_of is not None and policy.strategy != "random" and policy.lora_affinity:
            candidates = lora_affinity.preferred(
                route.model, candidates, self.book.loads(), self.book.lora_states(),
                policy.load_factor, policy.kv_hot,
            )  # fmt: skip
        if policy.strategy != "prefix":  # random and least-load keep no book
            return pick(policy, prefix, candidates, self.book.loads())
        placed_key = f"{route.model}\n{prefix}"
        placement = self.affinity.placement(placed_key)
        backend = pick(policy, prefix, candidates, self.book.loads(), placement=placement)
        if backend is not None:
            names = [b.name for b in route.backends] or [backend.name]
            self.affinity.settle(placed_key, home(prefix, names, placement, policy.key_factor))
        return backend

    async def try_backend(
        self, exchange: Exchange, body: bytes, route: Route, backend: Backend, outcome: Outcome
    ) -> bool:
        headers = {"Content-Type": "application/json"}
        if authorization := authorization_for_replicas(exchange, self.options.upstream_api_key):
            headers["Authorization"] = authorization
        url = f"{backend.url}/v1/{exchange.kind}"
        # A replica that has not loaded the adapter yet (a new pod) answers 404: try another.
        retry = {404: ADAPTER_NOT_LOADED} if route.adapter_of is not None else {}
        hop = Hop(url, backend.name, route.model, headers, exchange.headers, retry)
        self.metrics.picks.labels(exchange.model, backend.name).inc()
        self.book.start(backend.name)
        try:
            answer = await self.send(exchange, hop, body)
        finally:
            self.book.finish(backend.name)
        if isinstance(answer, Refusal):
            outcome.reason, outcome.refusal = answer.reason, answer
            # a saturated replica is alive, and one without the adapter serves the rest; a
            # failing one sits out
            if answer.status not in (429, 404):
                self.book.eject(backend.name)
            return False
        outcome.response, outcome.backend, outcome.target = answer, backend.name, route.model
        return True

    async def to_provider(self, exchange: Exchange, provider: Provider) -> Outcome:
        headers = {"Content-Type": "application/json"}
        if provider.api_key:
            headers["Authorization"] = f"Bearer {provider.api_key}"
        url = f"{provider.base_url.rstrip('/')}/{exchange.kind}"
        hop = Hop(url, provider.base_url, provider.name, headers, exchange.headers)
        body = bodies.for_upstream(exchange.payload, exchange.body, provider.model, None)
        answer = await self.send(exchange, hop, body)
        if isinstance(answer, Refusal):
            return Outcome(reason=answer.reason, refusal=answer, attempts=1)
        return Outcome(answer, provider.name, provider.base_url, attempts=1)

    async def send(self, exchange: Exchange, hop: Hop, body: bytes) -> web.StreamResponse | Refusal:
        if self.session is None:
            raise RuntimeError("the gateway's client session opens with its app (Gateway.app)")
        sent = time.perf_counter()
        ttft = self.metrics.ttft.labels(exchange.model, hop.target)
        admission = exchange.request.get(ADMISSION)

        def first_byte() -> None:
            ttft.observe(time.perf_counter() - sent)
            if admission is not None:
                self.flow.first_byte(admission)

        stream = exchange.inbound.stream
        exchange.sent = True  # from here the upstream may generate for it
        exchange.target = hop.target  # charged at its price if it serves (or is abandoned)
        return await forward(
            self.session, exchange.request, hop, body, stream, first_byte, exchange.taps
        )

    async def before_retry(self, model: str, reason: str) -> None:
        self.metrics.retries.labels(model, reason).inc()
        await asyncio.sleep(self.options.retry_backoff_s * random.uniform(0.5, 1.5))

    def record(
        self, inbound: Inbound, outcome: Outcome, status: int, started: float, cache: str
    ) -> None:
        self.metrics.requests.labels(inbound.model, outcome.target, str(status)).inc()
        elapsed_ms = (time.perf_counter() - started) * 1000
        line = {"event": "request", "model": inbound.model, "target": outcome.target,
                "backend": outcome.backend, "status": status, "stream": inbound.stream,
                "attempts": outcome.attempts, "reason": outcome.reason, "cache": cache,
                "duration_ms": round(elapsed_ms, 3)}  # fmt: skip
        access_log.info(json.dumps(line))


def authorization_for_replicas(exchange: Exchange, own_key: str | None) -> str | None:
    """The gateway's own upstream key when it has one; else, without gateway keys, the client's
    (a replica may check it itself); a key the gateway authenticated goes no further."""
    client = exchange.request.headers.get("Authorization")
    return upstream_authorization(client, CALLER in exchange.request, own_key)


def refused_response(outcome: Outcome, model: str) -> web.Response:
    """No replica or fallback answered: the last upstream refusal as it was (a 429 stays a 429
    with its Retry-After), else 429 for a full hold queue, else 503 (naming the fallbacks this
    request may not use)."""
    refusal = outcome.refusal
    if refusal is not None and refusal.status is not None:
        headers = {**refusal.headers, "x-kvpilot-target": "none"}
        return web.Response(status=refusal.status, body=refusal.body, headers=headers)
    if outcome.reason == "hold_queue_full":
        message = f"too many requests are waiting for {model!r} to start; retry shortly"
        return error_response(429, message)
    if outcome.reason in (QUEUE_FULL, QUEUE_TIMEOUT):
        message = f"{model!r} is saturated and {WAIT_REFUSALS[outcome.reason]}; retry shortly"
        return error_response(429, message, None, outcome.reason)
    message = f"no replica of {model!r} could take the request ({outcome.reason})"
    if outcome.skipped:
        message += f", and its fallbacks could not be used ({'; '.join(outcome.skipped)})"
    return error_response(503, message + "; retry shortly")
