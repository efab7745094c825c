"""The fair queue (flow/vtc.py), pure: a discrete-event simulation of a model whose replicas run
`capacity` requests at once, each taking as many time steps as it has output tokens, with tenants
arriving at fixed intervals. Shares are of the weighted tokens served (VTC's service: prompt x 1 +
output x 2) while every tenant is backlogged (it has a request waiting)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import pytest

from kvpilot.gateway.flow.vtc import RUNNING, WAITING, FairQueue, Ticket, TokenWeights


@dataclass(frozen=True)
class Tenant:
    name: str
    every: float  # time between arrivals
    prompt: int = 100
    output: int = 20
    weight: float = 1.0
    band: int = 0


def simulate(
    tenants: list[Tenant], capacity: int, until: float = 4000.0, fair: bool = True
) -> dict[str, float]:
    """Weighted tokens served per tenant, counted for requests that ended while every tenant
    had one waiting. `fair=False`: every request is queued as one tenant (first come, first
    served), the baseline."""
    queue, weights = FairQueue(max_waiting_per_tenant=8), TokenWeights()
    events: list[tuple[float, int, object]] = []  # (time, order, an arrival or an end)
    order = 0

    def push(time: float, what: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (time, order, what))

    def run(started: list[Ticket] | None, now: float) -> None:
        for ticket in started or []:
            push(now + by_name[owner[ticket]].output, ticket)

    by_name = {t.name: t for t in tenants}
    owner: dict[Ticket, str] = {}  # the tenant a ticket is for (its queue name may be "all")
    for tenant in tenants:
        push(0.0, tenant)
    served = dict.fromkeys(by_name, 0.0)
    while events and events[0][0] < until:
        now, _, what = heapq.heappop(events)
        if isinstance(what, Tenant):
            # 4x the prompt: the gateway's estimate is a byte count, settled to usage at the end
            ticket = Ticket(what.name if fair else "all", what.band, what.weight,
                            estimate=4 * what.prompt)  # fmt: skip
            owner[ticket] = what.name
            started = queue.arrive(ticket, capacity)
            if started is None:  # its queue is full: refused
                del owner[ticket]
            run(started, now)
            push(now + what.every, what)
        elif isinstance(what, Ticket):
            spec = by_name[owner.pop(what)]
            backlogged = {owner[t] for t in owner if t.state == WAITING}
            if len(backlogged) == len(tenants):
                served[spec.name] += weights.input * spec.prompt + weights.output * spec.output
            run(queue.finish(what, spec.prompt, spec.output, capacity), now)
    return served


def shares(served: dict[str, float]) -> dict[str, float]:
    total = sum(served.values())
    assert total > 0, "no request ended while every tenant was backlogged"
    return {name: value / total for name, value in served.items()}


# capacity 4 x 20 steps: 0.2 requests per step; both demands exceed their fair share
CASES = [
    ("equal weights, 10:1 demand", [Tenant("a", 0.4), Tenant("b", 4.0)], {"a": 0.5, "b": 0.5}),
    ("weights 3:1", [Tenant("a", 0.4, weight=3), Tenant("b", 4.0)], {"a": 0.75, "b": 0.25}),
    ("weights 3:1, the light tenant weighs more",
     [Tenant("a", 0.4), Tenant("b", 4.0, weight=3)], {"a": 0.25, "b": 0.75}),
    ("equal weights, short vs long answers",
     [Tenant("a", 0.4, prompt=50, output=5), Tenant("b", 2.0, prompt=20, output=80)],
     {"a": 0.5, "b": 0.5}),
    ("three tenants, weights 2:1:1",
     [Tenant("a", 0.5, weight=2), Tenant("b", 1.0), Tenant("c", 4.0)],
     {"a": 0.5, "b": 0.25, "c": 0.25}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "tenants", "expected"), CASES, ids=[c[0] for c in CASES])
def test_backlogged_tenants_get_their_weighted_share(
    name: str, tenants: list[Tenant], expected: dict[str, float]
) -> None:
    got = shares(simulate(tenants, capacity=4))
    for tenant, share in expected.items():
        assert abs(got[tenant] - share) <= 0.05, (name, got)


def test_equal_weights_at_10_to_1_demand_each_get_45_percent() -> None:
    got = shares(simulate([Tenant("heavy", 0.4), Tenant("light", 4.0)], capacity=4))
    assert min(got.values()) >= 0.45, got


def test_without_fairness_the_heavy_tenant_takes_most() -> None:
    """The check above can fail: queued first come, first served, the heavy tenant's share is
    its share of the arrivals."""
    got = shares(simulate([Tenant("heavy", 0.4), Tenant("light", 4.0)], capacity=4, fair=False))
    assert got["heavy"] > 0.7, got  # 0.75 (the shared queue of 8 refuses some of its arrivals)


def test_strict_priority_between_bands() -> None:
    """A better band always goes first, however much its tenant was served already."""
    queue = FairQueue(max_waiting_per_tenant=8)
    first = Ticket("batch", 5, estimate=10)
    assert queue.arrive(first, 1) == [first]
    low = [Ticket("batch", 5, estimate=10) for _ in range(2)]
    high = [Ticket("chat", 0, estimate=10_000) for _ in range(2)]
    for ticket in [*low, *high]:
        assert queue.arrive(ticket, 1) == []
    order = []
    running = first
    for _ in range(4):
        (running,) = queue.finish(running, 100, 100, 1)
        order.append(running)
    assert order == [*high, *low]


# (action, ticket, the tickets started by it): capacity 2; "l*" are band 5, "h*" band 0; the
# two low ones run first. Preemptive: a slot held by a worse band is free to a better one (the
# replica preempts), and a worse band starts again only once the total is below the capacity.
PREEMPTIVE_STEPS = [
    ("arrive", "h1", ["h1"]), ("arrive", "h2", ["h2"]),  # 3, then 4 running: 2 of them high
    ("arrive", "h3", []),  # the high band holds both slots itself
    ("arrive", "l3", []),
    ("finish", "l1", []),  # 3 running, 2 high: h3 still waits, l3 too
    ("finish", "h1", ["h3"]),
    ("finish", "h2", []),  # l2 and h3 run: the capacity
    ("finish", "h3", ["l3"]),  # 1 running (l2): room for l3 at last
]  # fmt: skip
NOT_PREEMPTIVE_STEPS = [
    ("arrive", "h1", []), ("arrive", "h2", []), ("arrive", "l3", []),
    ("finish", "l1", ["h1"]), ("finish", "l2", ["h2"]), ("finish", "h1", ["l3"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("preemptive", "steps"),
    [(True, PREEMPTIVE_STEPS), (False, NOT_PREEMPTIVE_STEPS)],
    ids=["preemptive", "not preemptive"],
)
def test_preemptive_replicas_free_a_worse_bands_slot(
    preemptive: bool, steps: list[tuple[str, str, list[str]]]
) -> None:
    queue = FairQueue(max_waiting_per_tenant=8)
    tickets = {name: Ticket(name[0], 0 if name[0] == "h" else 5) for name in
               ("l1", "l2", "l3", "h1", "h2", "h3")}  # fmt: skip
    names = {id(ticket): name for name, ticket in tickets.items()}
    assert queue.arrive(tickets["l1"], 2, preemptive) == [tickets["l1"]]
    assert queue.arrive(tickets["l2"], 2, preemptive) == [tickets["l2"]]
    for action, name, want in steps:
        if action == "arrive":
            started = queue.arrive(tickets[name], 2, preemptive)
        else:
            started = queue.finish(tickets[name], 1, 1, 2, preemptive)
        assert [names[id(t)] for t in started or []] == want, (action, name)


def test_work_conserving_no_wait_while_there_is_room() -> None:
    queue = FairQueue(max_waiting_per_tenant=4)
    a, b, c = (Ticket("t", 3) for _ in range(3))
    assert queue.arrive(a, 2) == [a]
    assert queue.arrive(b, 2) == [b]
    assert queue.arrive(c, 2) == [] and c.state == WAITING
    assert queue.finish(a, 1, 1, 2) == [c] and c.state == RUNNING
    assert queue.arrive(Ticket("u", 9), None) != []  # no limit: everything runs


def test_capacity_that_grows_starts_those_waiting() -> None:
    queue = FairQueue(max_waiting_per_tenant=4)
    a, b = Ticket("t", 0), Ticket("t", 0)
    queue.arrive(a, 1)
    queue.arrive(b, 1)
    assert queue.fill(2) == [b]


def test_a_full_tenant_queue_is_refused_others_are_not() -> None:
    queue = FairQueue(max_waiting_per_tenant=2)
    assert queue.arrive(Ticket("a", 0), 1)
    assert queue.arrive(Ticket("a", 0), 1) == []
    assert queue.arrive(Ticket("a", 0), 1) == []
    assert queue.arrive(Ticket("a", 0), 1) is None
    assert queue.waiting("a", 0) == 2
    assert queue.arrive(Ticket("b", 0), 1) == []  # b's own queue has room


def test_a_tenant_that_was_idle_banks_no_credit() -> None:
    """B starts waiting after A ran alone for long: B's counter starts at A's, so B gets its
    share from then on, not everything until it catches up."""
    queue = FairQueue(max_waiting_per_tenant=8)
    running = Ticket("a", 0)
    queue.arrive(running, 1)
    for _ in range(50):
        queue.arrive(Ticket("a", 0), 1)
        (running,) = queue.finish(running, 100, 100, 1)
    queue.arrive(Ticket("a", 0), 1)
    queue.arrive(Ticket("b", 0), 1)
    assert queue.counter("b", 0) == queue.counter("a", 0) > 0


def test_leaving_and_idle_bands_are_forgotten() -> None:
    queue = FairQueue(max_waiting_per_tenant=8)
    a, b = Ticket("t", 7), Ticket("t", 7)
    queue.arrive(a, 1)
    queue.arrive(b, 1)
    queue.leave(b)
    assert queue.waiting("t", 7) == 0
    assert queue.finish(a, 5, 5, 1) == []
    assert queue.counter("t", 7) == 0.0 and queue.running == 0
    with pytest.raises(ValueError, match="not running"):
        queue.finish(a, 5, 5, 1)
