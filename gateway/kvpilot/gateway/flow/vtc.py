"""The fair queue in front of a model's replicas, pure (no clock, no I/O): strict priority between
bands, virtual token counters (VTC, Sheng et al. 2024, arXiv 2401.00588) between tenants inside a
band, and work-conserving (a request waits only while every slot is taken).

Preemptive (the replicas run `--scheduling-policy priority`, so a request of a better priority
preempts running ones of a worse one there): a request counts only the slots held by bands as good
as its own or better, so a slot held by a worse band is free to it. Otherwise an urgent request
would wait at the gateway for a slot the flood holds, for as long as a flood request runs, however
quickly the replica would have made room. A worse band starts only when the total running is below
the capacity again, so the replicas get at most the capacity x the bands running at once.

Each (band, tenant) has a counter of the service it got: `input` x prompt tokens + `output` x
output tokens, divided by the tenant's weight. The next request is the head of the lowest band
that has any waiting, from the tenant of that band with the smallest counter. A tenant that starts
waiting has its counter lifted to the smallest of those already waiting in its band (or, when none
is, to that of the last tenant started there), so time spent idle is not banked as credit.

A request is charged its prompt estimate when it starts (VTC charges the prompt at admission, so a
tenant with many requests running is counted before they end) and settled to what it used (the
upstream's usage) when it ends. A band with nothing waiting or running forgets its counters, so
memory is bounded by the requests alive.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

# A ticket's life: waiting in its tenant's queue, running (holding a slot), done.
NEW, WAITING, RUNNING, DONE = "new", "waiting", "running", "done"


@dataclass(frozen=True)
class TokenWeights:
    # VTC's defaults: an output token costs twice a prompt token (decode steps vs one prefill)
    input: float = 1.0
    output: float = 2.0


@dataclass(eq=False)
class Ticket:
    tenant: str
    band: int  # the request's priority: lower runs first
    weight: float = 1.0  # the tenant's share; > 0
    estimate: int = 0  # prompt tokens charged when it starts
    state: str = NEW
    seq: int = 0  # arrival order, set by the queue


@dataclass
class _Band:
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)  # only non-empty ones
    counters: dict[str, float] = field(default_factory=dict)
    running: int = 0
    last_started: float = 0.0  # the counter of the tenant started last


class FairQueue:
    def __init__(self, max_waiting_per_tenant: int, weights: TokenWeights | None = None) -> None:
        if max_waiting_per_tenant < 0:
            raise ValueError(f"max_waiting_per_tenant must be >= 0, got {max_waiting_per_tenant}")
        self.max_waiting = max_waiting_per_tenant
        self.weights = weights or TokenWeights()
        self.running = 0
        self._bands: dict[int, _Band] = {}
        self._seq = itertools.count()

    def arrive(
        self, ticket: Ticket, capacity: int | None, preemptive: bool = False
    ) -> list[Ticket] | None:
        """The tickets started now (`ticket` among them when it need not wait), or None when
        its tenant already has `max_waiting` waiting (the caller refuses it). `capacity`: the
        requests that may run at once (None: no limit); `preemptive`: the replicas preempt by
        priority (the module's docstring)."""
        band = self._bands.setdefault(ticket.band, _Band())
        queue = band.queues.get(ticket.tenant)
        has_room = self._has_room(capacity, ticket.band if preemptive else None)
        is_free = not band.queues and has_room and not self._waiting_before(ticket)
        if not is_free and len(queue or ()) >= self.max_waiting:
            self._forget_if_idle(ticket.band)
            return None
        if queue is None:
            band.counters[ticket.tenant] = self._lifted(band, ticket.tenant)
            queue = band.queues[ticket.tenant] = deque()
        ticket.seq, ticket.state = next(self._seq), WAITING
        queue.append(ticket)
        return self.fill(capacity, preemptive)

    def fill(self, capacity: int | None, preemptive: bool = False) -> list[Ticket]:
        """Start waiting tickets while there is room (after `capacity` grew, say)."""
        started = []
        while (ticket := self._next()) is not None and self._has_room(
            capacity, ticket.band if preemptive else None
        ):
            self._start(ticket)
            started.append(ticket)
        return started

    def finish(
        self,
        ticket: Ticket,
        prompt_tokens: int,
        output_tokens: int,
        capacity: int | None,
        preemptive: bool = False,
    ) -> list[Ticket]:
        """A running ticket ended having used these tokens: settle its tenant's counter, free
        its slot, and return the tickets started in its place."""
        if ticket.state != RUNNING:
            raise ValueError(f"finish() of a ticket that is {ticket.state}, not running")
        band = self._bands[ticket.band]
        used = self.weights.input * prompt_tokens + self.weights.output * output_tokens
        charged = self.weights.input * ticket.estimate
        if ticket.tenant in band.counters:
            band.counters[ticket.tenant] += (used - charged) / ticket.weight
        ticket.state = DONE
        band.running -= 1
        self.running -= 1
        self._forget_if_idle(ticket.band)
        return self.fill(capacity, preemptive)

    def leave(self, ticket: Ticket) -> None:
        """A waiting ticket gives up (its client went away, or its deadline passed)."""
        if ticket.state != WAITING:
            raise ValueError(f"leave() of a ticket that is {ticket.state}, not waiting")
        band = self._bands[ticket.band]
        queue = band.queues[ticket.tenant]
        queue.remove(ticket)
        if not queue:
            del band.queues[ticket.tenant]
        ticket.state = DONE
        self._forget_if_idle(ticket.band)

    def waiting(self, tenant: str, band: int) -> int:
        state = self._bands.get(band)
        return len(state.queues.get(tenant, ())) if state else 0

    def counter(self, tenant: str, band: int) -> float:
        state = self._bands.get(band)
        return state.counters.get(tenant, 0.0) if state else 0.0

    def _has_room(self, capacity: int | None, band: int | None = None) -> bool:
        """A slot free for a request of `band` (None: any slot taken counts)."""
        if capacity is None:
            return True
        if band is None:
            return self.running < capacity
        held = sum(b.running for number, b in self._bands.items() if number <= band)
        return held < capacity

    def _waiting_before(self, ticket: Ticket) -> bool:
        """Someone of a band as good or better waits already (only a capacity that just grew
        leaves one waiting with room free; fill() starts them first)."""
        return any(b.queues for number, b in self._bands.items() if number <= ticket.band)

    def _lifted(self, band: _Band, tenant: str) -> float:
        """The counter of a tenant that starts waiting: never below the smallest of those
        waiting (or the last one started when none waits)."""
        others = [band.counters[t] for t in band.queues if t != tenant]
        floor = min(others) if others else band.last_started
        return max(band.counters.get(tenant, 0.0), floor)

    def _next(self) -> Ticket | None:
        """The head of the best band's queue whose tenant has the smallest counter (ties: the
        earliest arrival)."""
        waiting = [number for number, band in self._bands.items() if band.queues]
        if not waiting:
            return None
        band = self._bands[min(waiting)]
        tenant = min(band.queues, key=lambda t: (band.counters[t], band.queues[t][0].seq))
        return band.queues[tenant][0]

    def _start(self, ticket: Ticket) -> None:
        band = self._bands[ticket.band]
        queue = band.queues[ticket.tenant]
        queue.popleft()
        if not queue:
            del band.queues[ticket.tenant]
        band.counters[ticket.tenant] += self.weights.input * ticket.estimate / ticket.weight
        band.last_started = band.counters[ticket.tenant]
        band.running += 1
        self.running += 1
        ticket.state = RUNNING

    def _forget_if_idle(self, number: int) -> None:
        band = self._bands.get(number)
        if band is not None and not band.queues and band.running == 0:
            del self._bands[number]
