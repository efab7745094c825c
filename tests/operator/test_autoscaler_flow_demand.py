"""The policy given the demand kvpilot-gateway's flow control keeps from the replicas (issue 33):
the fair queue's requests and the gateway's arrival rate, through the metrics reader's pure
`aggregate`, against the same fleet read from the replicas alone.

The fleet: 2 replicas with every slot taken (48 running each, a full KV cache, 20 s a request),
nothing waiting on them, because the gateway lets at most 48 per replica through. They receive
what they complete, 4.8/s; 9/s reach the gateway and 60 wait in its fair queue."""

from __future__ import annotations

import pytest

from kvpilot.operator.autoscaling.metrics_reader import FleetRates, PodSample, aggregate
from kvpilot.operator.autoscaling.policy import Bounds, Observations, PolicyState, decide
from kvpilot.operator.autoscaling.replica_capacity import ReplicaCapacity, StepFit

NOW = 1_000_000.0
SLO = Bounds(min_replicas=1, max_replicas=20, ttft_slo_s=2.0, slo_percentile=95.0)
PLAIN = Bounds(min_replicas=1, max_replicas=20)
# 48 slots, 400 tokens a request at 0.05 s a step: 20 s a request
LEARNED = ReplicaCapacity(48.0, 64, tokens_per_request=400.0, step=StepFit(30.0, 0.05))
SERVED_PER_S = 2 * 48 / 20.0  # 4.8/s: what the two replicas complete, and so receive
ARRIVING_PER_S, QUEUED = 9.0, 60.0


def saturated(queued: float, gateway_per_s: float | None) -> Observations:
    """The fleet as the reader aggregates it, with the gateway's figures or without them."""
    pods = [PodSample(pod, "h100", 0.0, 48.0, 1.0, NOW) for pod in ("a", "b")]
    rates = FleetRates(
        arrivals_short_per_s=SERVED_PER_S,
        arrivals_long_per_s=SERVED_PER_S,
        completions_per_s=SERVED_PER_S,
        tokens_per_s=96 / 0.05,
        requests_running_1m=96.0,
        gateway_arrivals_short_per_s=gateway_per_s,
        gateway_arrivals_long_per_s=gateway_per_s,
    )
    return aggregate(pods, 2, NOW, rates=rates, requests_queued=queued)


def settled() -> PolicyState:
    return PolicyState(recommendations=((NOW - 1000.0, 2),), capacity=LEARNED)


BLIND = saturated(0.0, None)  # what the reader saw before the gateway's metrics
SEEN = saturated(QUEUED, ARRIVING_PER_S)


def test_the_reader_passes_the_gateways_demand_to_the_policy() -> None:
    assert (BLIND.requests_waiting, BLIND.arrivals_short_per_s) == (0.0, SERVED_PER_S)
    assert (SEEN.requests_waiting, SEEN.requests_queued) == (QUEUED, QUEUED)
    assert SEEN.arrivals_short_per_s == SEEN.arrivals_long_per_s == ARRIVING_PER_S


# (case, bounds, observations, replicas asked for, text in the reason)
CASES = [
    # KV 1.0 / 0.85 = 1.18 is inside the 20% band and nothing waits: the overload is invisible
    ("no SLO, replicas alone", PLAIN, BLIND, 2, "within tolerance"),
    # the KV demand with the queue admitted, 1.0 x (96 + 60) / 96 = 1.62 -> ceil(2 x 1.91) = 4
    # (the queue signal's running slot for each request in flight asks for 4 too)
    ("no SLO, the fair queue seen", PLAIN, SEEN, 4, "kv-cache 1.62 (usage 1.00 + queue)"),
    # 4.8/s x 20 s = 96 in flight + 1.645 sqrt(96) = 112 -> 3: one replica at a time, each
    # cold start, as the replicas fill again at the rate they serve
    ("SLO, replicas alone", SLO, BLIND, 3, "arrivals 4.80/s (30s), 4.80/s (120s); 48.0"),
    # 9/s + 60 waiting over a 70 s lead = 9.86/s: 197 in flight + 23 = 220 -> 5 replicas
    ("SLO, the gateway's arrivals and queue seen", SLO, SEEN, 5, "arrivals 9.00/s"),
]


@pytest.mark.parametrize(
    ("bounds", "observations", "replicas", "reason"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_flow_queued_demand_is_sized_for(
    bounds: Bounds, observations: Observations, replicas: int, reason: str
) -> None:
    decision = decide(observations, bounds, settled(), NOW)
    assert decision.replicas == replicas, decision.reason
    assert reason in decision.reason, decision.reason


def test_the_queue_guard_counts_the_fair_queue_under_an_slo() -> None:
    # The replicas' rate alone with the queue seen (a gateway too old to count arrivals): the
    # KV guard, given the queue, asks for more than the SLO sizing.
    queued_only = saturated(QUEUED, None)
    decision = decide(queued_only, SLO, settled(), NOW)
    assert decision.replicas == 4, decision.reason
    assert "guard kv-cache 1.62 (usage 1.00 + queue)" in decision.reason


def test_the_gateways_demand_shows_in_status() -> None:
    shown = SEEN.to_dict()
    assert (shown["requestsQueued"], shown["requestsWaiting"]) == (QUEUED, QUEUED)
    assert shown["arrivalsShortPerSecond"] == ARRIVING_PER_S
