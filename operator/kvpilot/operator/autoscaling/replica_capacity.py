"""What one replica sustains inside a TTFT SLO: seeded before traffic, learned from it (issue 33
item 2).

Under continuous batching a request's TTFT stays near its prefill time as long as a batch slot
(and KV room) is free when it arrives; once every slot is taken, requests queue and TTFT grows
with the queue. So the capacity that holds a TTFT SLO is a number of concurrent sequences per
replica (`slots`), and a fleet's demand is the sequences its arrivals keep in flight: arrival rate
x the time one request stays running (Little's law).

- Seed: before any traffic the planner knows the batch limit (`max_num_seqs`) and the KV cache
  its memory arithmetic leaves, in tokens; with an assumed request size that gives the slots. The
  time a request stays running is unknown until requests complete.
- Learned: every observation with traffic measures the KV a sequence takes (running / KV usage
  gives the sequences a full cache holds) and the time a request runs (running / completions per
  second). Both are folded in with an exponential average, and kept in status.
- Sizing: arrivals are Poisson, so the sequences in flight fluctuate around their mean L by about
  sqrt(L); provisioning L + z sqrt(L) slots (square-root staffing, z the normal quantile of the
  SLO's percentile) keeps the chance that a request finds no free slot near 1 - percentile.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Any

# The request size the seed assumes (prompt + output tokens) before any traffic is measured.
ASSUMED_REQUEST_TOKENS = 1024.0
# Below this KV usage a replica's cache says too little about the KV a sequence takes.
MIN_KV_USAGE_TO_LEARN = 0.05
LEARNING_WEIGHT = 0.3  # weight of a new observation in the exponential average


@dataclass(frozen=True)
class ReplicaCapacity:
    """Concurrent sequences one replica holds, and how long a request stays running there."""

    slots: float
    max_num_seqs: int
    service_s: float | None = None  # None until requests have completed

    def __post_init__(self) -> None:
        if self.slots <= 0 or self.max_num_seqs < 1:
            raise ValueError("slots must be > 0 and max_num_seqs >= 1")
        if self.service_s is not None and self.service_s <= 0:
            raise ValueError("service time must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return {
            "slots": round(self.slots, 3),
            "maxNumSeqs": self.max_num_seqs,
            "serviceSeconds": None if self.service_s is None else round(self.service_s, 4),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaCapacity:
        service = data.get("serviceSeconds")
        return cls(
            slots=float(data["slots"]),
            max_num_seqs=int(data["maxNumSeqs"]),
            service_s=None if service is None else float(service),
        )


@dataclass(frozen=True)
class FleetSample:
    """One observation of the ready replicas, as the metrics adapter reads it."""

    ready: int
    running: float  # sum over ready replicas
    kv_usage: float  # mean over ready replicas, 0-1
    completions_per_s: float  # summed over ready replicas


def seed(
    max_num_seqs: int, kv_cache_tokens: int, request_tokens: float = ASSUMED_REQUEST_TOKENS
) -> ReplicaCapacity:
    """The planner's estimate before traffic: the batch limit, or the requests the KV cache holds
    at the assumed size, whichever is fewer."""
    if kv_cache_tokens < 1 or request_tokens <= 0:
        raise ValueError("KV cache tokens and request size must be > 0")
    return ReplicaCapacity(min(float(max_num_seqs), kv_cache_tokens / request_tokens), max_num_seqs)


def learn(
    capacity: ReplicaCapacity, sample: FleetSample, weight: float = LEARNING_WEIGHT
) -> ReplicaCapacity:
    """The capacity refined by one observation; unchanged where the observation says nothing."""
    if sample.ready < 1 or sample.running <= 0:
        return capacity
    slots, service = capacity.slots, capacity.service_s
    if sample.kv_usage >= MIN_KV_USAGE_TO_LEARN:
        # running / usage: the sequences of the size now running that a full cache would hold
        held = (sample.running / sample.ready) / min(sample.kv_usage, 1.0)
        slots = _average(slots, min(float(capacity.max_num_seqs), held), weight)
    if sample.completions_per_s > 0:
        seen = sample.running / sample.completions_per_s  # Little's law
        service = seen if service is None else _average(service, seen, weight)
    return replace(capacity, slots=slots, service_s=service)


def _average(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new


def staffing_z(percentile: float) -> float:
    """The normal quantile of the SLO's percentile (95 -> 1.64, 99 -> 2.33)."""
    if not 50 <= percentile < 100:
        raise ValueError(f"percentile must be in [50, 100), got {percentile}")
    return NormalDist().inv_cdf(percentile / 100)


def replicas_for(demand_per_s: float, capacity: ReplicaCapacity, z: float) -> int | None:
    """Replicas whose slots hold the sequences `demand_per_s` keeps in flight plus z standard
    deviations of Poisson fluctuation; None while the service time is unknown."""
    if capacity.service_s is None:
        return None
    in_flight = max(demand_per_s, 0.0) * capacity.service_s
    return math.ceil((in_flight + z * math.sqrt(in_flight)) / capacity.slots - 1e-9)
