"""The fair queue's asyncio side: a request for a model waits here, in its tenant's queue, while
the model's replicas are saturated, and holds a slot from its first attempt to the end of its
answer (retries on other replicas included).

Saturated means: this gateway's requests in flight to the model reach `max_in_flight_per_replica`
x its replicas. That count is exact and current (the gateway starts and ends each request), where
the running and waiting figures a replica reports on /metrics are seconds old and count other
gateways' traffic too, so they cannot decide the next admission. Set the limit near the replicas'
`--max-num-seqs`: above it a replica queues the surplus first come, first served, where the
gateway cannot order it. Replicas that preempt by priority (`Route.takes_priority`) make a slot
held by a worse priority free to a better one (flow/vtc.py says why). Each gateway replica keeps
its own queue; with N of them, a replica sees up to N x the limit. A model with no replica (held
at zero, routing/holding.py) has no limit.

Without a limit every request starts at once (nothing waits), and the per-tenant metrics are still
kept. A request that waits past its deadline (the route's fallback-after) leaves the queue and goes
to the model's fallbacks, as a request that found no replica does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiohttp import web

from kvpilot.contract.priority import label
from kvpilot.gateway.exchange import Exchange
from kvpilot.gateway.flow.tenancy import Tenancy
from kvpilot.gateway.flow.vtc import RUNNING, FairQueue, Ticket, TokenWeights
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing.routes import Route, RouteTable
from kvpilot.gateway.usage import UsageTap

QUEUE_FULL, QUEUE_TIMEOUT = "tenant_queue_full", "queue_timeout"  # Outcome reasons


@dataclass(frozen=True)
class FlowOptions:
    max_in_flight_per_replica: int | None = None  # None: no limit, nothing waits
    max_waiting_per_tenant: int = 64  # per model and priority; more: 429
    weights: TokenWeights = field(default_factory=TokenWeights)

    def __post_init__(self) -> None:
        if self.max_in_flight_per_replica is not None and self.max_in_flight_per_replica <= 0:
            raise ValueError("--max-in-flight-per-replica must be > 0, got "
                             f"{self.max_in_flight_per_replica}")  # fmt: skip
        if self.max_waiting_per_tenant < 0:
            raise ValueError(
                f"--max-queued-per-tenant must be >= 0, got {self.max_waiting_per_tenant}"
            )
        if self.weights.input < 0 or self.weights.output < 0:
            raise ValueError(f"the token weights must be >= 0, got {self.weights}")


@dataclass
class Admission:
    """A request that holds a slot of `model`."""

    ticket: Ticket
    tenancy: Tenancy
    model: str
    entered: float  # time.perf_counter() when it reached the queue
    # Whose replicas' queue it waits in: `model`, or a LoRA adapter's base model, whose replicas
    # serve the base and every adapter alike (one limit for all of them).
    queue: str
    # The ModelDeployment's labels (md_namespace, md_name, model) for the demand the operator
    # reads (contract.metric_names.GATEWAY_*); None for a route without one (static config).
    deployment: tuple[str, str, str] | None = None
    ttft_seen: bool = False

    @property
    def labels(self) -> tuple[str, str, str]:
        return self.model, self.tenancy.tenant, label(self.tenancy.priority)


ADMISSION = web.RequestKey("kvpilot.flow", Admission)


class FlowGate:
    def __init__(self, table: RouteTable, options: FlowOptions, metrics: GatewayMetrics) -> None:
        self.table, self.options, self.metrics = table, options, metrics
        self._queues: dict[str, FairQueue] = {}
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}

    def declare_demand_series(self) -> None:
        """Every routed ModelDeployment's arrivals counter, at zero until its first request: the
        operator reads it through rate(), which counts nothing for a series until its second
        sample, so a counter born at the first request of a burst would hide that scrape's
        arrivals from the autoscaler (the runtime's counters are born with the server)."""
        for model in self.table.models():
            route = self.table.get(model)
            target = None if route is None else route.scale_target
            if target is not None:
                self.metrics.arrived.labels(target.namespace, target.name, model)

    def capacity(self, route: Route | None) -> int | None:
        limit = self.options.max_in_flight_per_replica
        if limit is None or route is None or not route.backends:
            return None
        return limit * len(route.backends)

    async def enter(self, route: Route, tenancy: Tenancy, estimate: int, deadline: float
                    ) -> Admission | str:  # fmt: skip
        """The admission once the request may go (at once when there is room), or why it may
        not (QUEUE_FULL, QUEUE_TIMEOUT: `deadline`, on the loop's clock, passed)."""
        replicas_of = route.adapter_of or route.model
        queue = self._queues.get(replicas_of)
        if queue is None:
            queue = FairQueue(self.options.max_waiting_per_tenant, self.options.weights)
            self._queues[replicas_of] = queue
        ticket = Ticket(tenancy.tenant, tenancy.priority, tenancy.weight, estimate)
        target = route.scale_target
        deployment = None if target is None else (target.namespace, target.name, route.model)
        admission = Admission(ticket, tenancy, route.model, time.perf_counter(), replicas_of,
                              deployment)  # fmt: skip
        if deployment is not None:  # refused ones too: demand the replicas did not take
            self.metrics.arrived.labels(*deployment).inc()
        started = queue.arrive(ticket, self.capacity(route), route.takes_priority)
        if started is None:
            self.metrics.flow_refusals.labels(*admission.labels).inc()
            return QUEUE_FULL
        self._wake(started)
        if ticket.state != RUNNING and not await self._wait(queue, admission, deadline):
            return QUEUE_TIMEOUT
        self.metrics.flow_queue_time.labels(*admission.labels).observe(
            time.perf_counter() - admission.entered
        )
        return admission

    async def _wait(self, queue: FairQueue, admission: Admission, deadline: float) -> bool:
        """Whether the ticket started by `deadline`; a client that goes away meanwhile leaves
        the queue (or gives its slot back when it had just started)."""
        loop = asyncio.get_running_loop()
        ticket, waiter = admission.ticket, loop.create_future()
        self._waiters[ticket] = waiter
        gauges = [self.metrics.flow_waiting.labels(*admission.labels)]
        if admission.deployment is not None:
            gauges.append(self.metrics.queued.labels(*admission.deployment))
        for gauge in gauges:
            gauge.inc()
        try:
            await asyncio.wait({waiter}, timeout=max(deadline - loop.time(), 0.0))
        except asyncio.CancelledError:
            if ticket.state == RUNNING:
                self.leave(admission, 0, 0)
            else:
                queue.leave(ticket)
            raise
        finally:
            for gauge in gauges:
                gauge.dec()
            self._waiters.pop(ticket, None)
        if ticket.state != RUNNING:
            queue.leave(ticket)
            return False
        return True

    def first_byte(self, admission: Admission) -> None:
        """TTFT per tenant and priority: from reaching the queue, so the wait counts."""
        if not admission.ttft_seen:
            admission.ttft_seen = True
            self.metrics.flow_ttft.labels(*admission.labels).observe(
                time.perf_counter() - admission.entered
            )

    def leave(self, admission: Admission, prompt_tokens: int, output_tokens: int) -> None:
        """The request ended having used these tokens: its slot goes to the next in turn."""
        queue = self._queues[admission.queue]
        route = self.table.get(admission.queue)
        capacity, preemptive = self.capacity(route), route is not None and route.takes_priority
        started = queue.finish(admission.ticket, prompt_tokens, output_tokens, capacity, preemptive)
        self._wake(started)
        served = self.metrics.flow_tokens
        served.labels(*admission.labels, "input").inc(prompt_tokens)
        served.labels(*admission.labels, "output").inc(output_tokens)

    def _wake(self, started: Iterable[Ticket]) -> None:
        for ticket in started:
            waiter = self._waiters.get(ticket)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)


def tokens_used(exchange: Exchange, estimate: int) -> tuple[int, int]:
    """(prompt, output) tokens an ended request used: the upstream's usage (read by the budget
    policy's tap, which asks streams for it), else the prompt's estimate and the chunks relayed
    (no keys, so one tenant: only the totals matter), or nothing for one never sent."""
    tap = next((t for t in exchange.taps if isinstance(t, UsageTap)), None)
    if tap is not None and tap.usage is not None:
        return tap.usage.prompt_tokens, tap.usage.completion_tokens
    if not exchange.sent:
        return 0, 0
    return estimate, tap.content_chunks if tap is not None else 0
