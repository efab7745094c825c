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
  gives the sequences a full cache holds), the output tokens a request makes (tokens / completions)
  and the decode step time at the batch it ran (running / tokens per second: each running sequence
  makes one token a step). The step time grows with the batch (each sequence adds its KV reads),
  so it is fitted as a line in the batch size by exponentially weighted least squares: a fleet
  sized to fill its slots runs bigger batches than the one measured, and slower ones. All of it
  is folded in with exponential weights, and kept in status.
- Sizing: arrivals are Poisson, so the sequences in flight fluctuate around their mean L by about
  sqrt(L); provisioning L + z sqrt(L) slots (square-root staffing, z the normal quantile of the
  SLO's percentile) keeps the chance that a request finds no free slot near 1 - percentile. L is
  solved at the batch the candidate fleet would run, since the step time depends on it. No credit
  is taken for the wait the SLO would allow: an excess of in-flight requests over the slots lasts
  about one service time (tens of seconds), far longer than a TTFT budget of seconds (measured:
  counting it as capacity cost the diurnal trace its 99%).
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
# Weight of a new observation in the exponential average: about 13 ticks (2 minutes) of memory.
# The slots and tokens a request describe the traffic's mix, which moves slowly; at 0.3 their
# noise alone moved the SLO sizing across a replica boundary on steady load.
LEARNING_WEIGHT = 0.15
# Shrinks the step time's slope towards flat while the batch has varied little (a ridge term, in
# sequences squared): the slope then moves smoothly as evidence comes, instead of jumping.
BATCH_SPREAD_PRIOR = 1.0
MAX_SIZED_REPLICAS = 4096  # where sizing gives up (bounds clamp far below)


@dataclass(frozen=True)
class StepFit:
    """Decode step time against the batch size per replica: exponentially weighted means,
    variance and covariance, i.e. a weighted least-squares line."""

    batch: float
    step_s: float
    batch_var: float = 0.0
    covariance: float = 0.0

    def slope(self) -> float:
        """Seconds per extra sequence, near 0 while the batch has varied little, never below 0
        (bigger batches never step faster; a negative fit is noise)."""
        return max(self.covariance / (self.batch_var + BATCH_SPREAD_PRIOR), 0.0)

    def at(self, batch: float) -> float:
        """The step time at `batch`, never below the one measured at a smaller batch."""
        return self.step_s + self.slope() * max(batch - self.batch, 0.0)

    def batch_within(self, step_s: float) -> float:
        """The largest batch whose step takes at most `step_s` on the fitted line (extended
        below the measured batch too); infinite when the step does not grow with the batch and
        already meets it, 0 when it does not grow and never meets it."""
        slope = self.slope()
        if slope <= 0:
            return math.inf if self.step_s <= step_s else 0.0
        return self.batch + (step_s - self.step_s) / slope

    def add(self, batch: float, step_s: float, weight: float) -> StepFit:
        db, ds = batch - self.batch, step_s - self.step_s
        return StepFit(
            batch=self.batch + weight * db,
            step_s=self.step_s + weight * ds,
            batch_var=(1 - weight) * (self.batch_var + weight * db * db),
            covariance=(1 - weight) * (self.covariance + weight * db * ds),
        )


@dataclass(frozen=True)
class ReplicaCapacity:
    """Concurrent sequences one replica holds, and how long a request runs there."""

    slots: float
    max_num_seqs: int
    tokens_per_request: float | None = None  # None until requests have completed
    step: StepFit | None = None  # None until tokens have been generated

    def __post_init__(self) -> None:
        if self.slots <= 0 or self.max_num_seqs < 1:
            raise ValueError("slots must be > 0 and max_num_seqs >= 1")
        if self.tokens_per_request is not None and self.tokens_per_request <= 0:
            raise ValueError("tokens per request must be > 0")

    def service_s(self, batch: float) -> float | None:
        """Seconds a request stays running on a replica running `batch` sequences."""
        if self.tokens_per_request is None or self.step is None:
            return None
        return self.tokens_per_request * self.step.at(batch)

    def to_dict(self) -> dict[str, Any]:
        step = self.step
        return {
            "slots": self.slots,
            "maxNumSeqs": self.max_num_seqs,
            "tokensPerRequest": self.tokens_per_request,
            "step": None
            if step is None
            else [step.batch, step.step_s, step.batch_var, step.covariance],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaCapacity:
        tokens, step = data.get("tokensPerRequest"), data.get("step")
        return cls(
            slots=float(data["slots"]),
            max_num_seqs=int(data["maxNumSeqs"]),
            tokens_per_request=None if tokens is None else float(tokens),
            step=None if step is None else StepFit(*(float(v) for v in step)),
        )


@dataclass(frozen=True)
class FleetSample:
    """One observation of the ready replicas, as the metrics adapter reads it (minute means)."""

    ready: int
    running: float  # sum over ready replicas
    kv_usage: float  # mean over ready replicas, 0-1
    completions_per_s: float  # summed over ready replicas
    tokens_per_s: float  # output tokens, summed over ready replicas


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
    slots, tokens, step = capacity.slots, capacity.tokens_per_request, capacity.step
    batch = sample.running / sample.ready
    if sample.kv_usage >= MIN_KV_USAGE_TO_LEARN:
        # running / usage: the sequences of the size now running that a full cache would hold
        held = batch / min(sample.kv_usage, 1.0)
        slots = _average(slots, min(float(capacity.max_num_seqs), held), weight)
    if sample.tokens_per_s > 0:
        seen = sample.running / sample.tokens_per_s  # one token per running sequence a step
        step = StepFit(batch, seen) if step is None else step.add(batch, seen, weight)
        if sample.completions_per_s > 0:
            made = sample.tokens_per_s / sample.completions_per_s
            tokens = made if tokens is None else _average(tokens, made, weight)
    return replace(capacity, slots=slots, tokens_per_request=tokens, step=step)


def _average(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new


def staffing_z(percentile: float) -> float:
    """The normal quantile of the SLO's percentile (95 -> 1.64, 99 -> 2.33)."""
    if not 50 <= percentile < 100:
        raise ValueError(f"percentile must be in [50, 100), got {percentile}")
    return NormalDist().inv_cdf(percentile / 100)


def within_tpot(capacity: ReplicaCapacity, tpot_s: float) -> ReplicaCapacity:
    """The capacity whose slots keep a token every `tpot_s` for each running sequence: every
    decode step makes one token per sequence and takes longer the bigger the batch, so a TPOT
    target caps the batch where the fitted step time reaches it. Unchanged while no step time is
    measured, or where the cap lies above the slots; never below one slot (a target no batch
    meets is then held as closely as one replica per sequence can)."""
    if capacity.step is None:
        return capacity
    cap = capacity.step.batch_within(tpot_s)
    if cap >= capacity.slots:
        return capacity
    return replace(capacity, slots=max(cap, 1.0))


def replicas_for(demand_per_s: float, capacity: ReplicaCapacity, z: float) -> int | None:
    """The fewest replicas whose slots hold the sequences `demand_per_s` keeps in flight at the
    batch those replicas would run, plus z standard deviations of Poisson fluctuation; None
    while the service time is unknown."""
    if capacity.service_s(0.0) is None:
        return None
    if demand_per_s <= 0:
        return 0
    for replicas in range(1, MAX_SIZED_REPLICAS + 1):
        in_flight = _in_flight(demand_per_s, capacity, replicas)
        if in_flight is not None and in_flight + z * math.sqrt(in_flight) <= (
            replicas * capacity.slots
        ):
            return replicas
    return MAX_SIZED_REPLICAS


def _in_flight(demand_per_s: float, capacity: ReplicaCapacity, replicas: int) -> float | None:
    """Sequences in flight: Little's law solved for its own batch (fixed-point iteration: the
    batch sets the step time, which sets the batch); None when the batch grows past the slots
    (the fleet cannot keep up)."""
    batch = 0.0
    for _ in range(50):
        service = capacity.service_s(batch) or 0.0
        following = demand_per_s * service / replicas
        if following > capacity.slots:
            return None
        if abs(following - batch) < 1e-3:
            break
        batch = following
    return batch * replicas
