"""The policies the simulator compares on the same trace.

- kvpilot: the operator's own `policy.decide`, its state kept only as the status dict, with the
  defaults a ModelDeployment gets (no SLO: KV-cache and queue targets).
- kvpilot_slo: the same `policy.decide` given a TTFT SLO (issue 33): demand forecast one
  measured cold start ahead, capacity per replica seeded from the planner's batch and KV figures
  and learned from the metrics the operator reads (running, waiting, KV usage, completions,
  output tokens, TTFT p95, arrivals over 30 s and 120 s, the cold starts seen so far).
  Both read the gateway's demand as the metrics reader does (its fair queue as waiting, the
  larger of its arrivals and the replicas'); `KvpilotPolicy(gateway_signal=False)` reads the
  replicas alone, as the operator did before it read the fair queue (bench.autoscaler_flow).
- hpa: the Kubernetes HPA algorithm (15 s sync, 10% tolerance, 300 s scale-down stabilisation,
  scale-up at most max(100%, 4 pods) per period) on a utilisation metric: running sequences over
  the batch a replica holds, averaged over 60 s as a Prometheus adapter rate window would be.
- kubeai: KubeAI's autoscaler: every 10 s, average in-flight requests (waiting + running) over a
  10-minute window / target per replica; scale-down waits 30 s after the last scale-up.
- keda: a KEDA Prometheus trigger on waiting requests, threshold 5 per replica (AverageValue),
  driving the same HPA algorithm.
- fixed_max: always max replicas (the cost reference).
- oracle: knows the trace; provisions, one cold start ahead, the replicas the coming load needs
  at `headroom` of each replica's batch and KV capacity (the GPU-hours floor).

The targets of the baselines are set from the same capacity figure kvpilot uses (80% of what a
replica holds), so the comparison is between algorithms and signals, not between tunings.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from kvpilot.operator import api
from kvpilot.operator.autoscaling import recording
from kvpilot.operator.autoscaling.metrics_reader import arrivals_seen
from kvpilot.operator.autoscaling.policy import Bounds, Observations, PolicyState, decide
from kvpilot.operator.autoscaling.replica_capacity import ReplicaCapacity, seed
from kvpilot.operator.autoscaling.simulator.capacity import CapacityModel
from kvpilot.operator.autoscaling.simulator.cluster import FleetView, Policy, Settings
from kvpilot.operator.autoscaling.simulator.traces import Trace

NAMES = ("kvpilot", "kvpilot_slo", "hpa", "kubeai", "keda", "fixed_max", "oracle")
TARGET_FRACTION = 0.8


def user_bounds(
    min_replicas: int,
    max_replicas: int,
    ttft_slo_s: float | None = None,
    slo_percentile: float = 95.0,
) -> Bounds:
    """What a ModelDeployment that sets only min and max replicas gets: the CRD's defaults, read
    from the spec the way the operator reads it, so the simulator measures those; plus the TTFT
    SLO kvpilot_slo runs with (kvpilot runs without it)."""
    spec = api.Autoscaling(min_replicas=min_replicas, max_replicas=max_replicas)
    bounds = recording.bounds_from_spec(spec)
    return replace(bounds, ttft_slo_s=ttft_slo_s, slo_percentile=slo_percentile)


class KvpilotPolicy:
    def __init__(
        self,
        bounds: Bounds,
        prior: ReplicaCapacity | None = None,
        interval_s: float = 10.0,
        name: str = "kvpilot",
        gateway_signal: bool = True,
    ) -> None:
        self.name, self.interval_s, self.bounds = name, interval_s, bounds
        self.prior = prior  # the planner's seed: what the operator knows before any traffic
        self.status: dict[str, object] = {}  # as in status.autoscaling.state: nothing else kept
        # Whether it reads the gateway's fair queue and arrivals (metrics_reader), or the
        # replicas' figures alone (the held requests it always read).
        self.gateway_signal = gateway_signal

    def desired(self, view: FleetView) -> int:
        queued = view.queued if self.gateway_signal else 0
        short, long = view.received_short_per_s, view.received_long_per_s
        if self.gateway_signal:
            short = arrivals_seen(short, view.arrivals_short_per_s) or 0.0
            long = arrivals_seen(long, view.arrivals_long_per_s) or 0.0
        observations = Observations(
            current_replicas=view.replicas,
            ready_replicas=view.ready,
            requests_waiting=view.waiting + queued,
            requests_held=view.held,
            requests_queued=queued,
            requests_running=view.running,
            kv_cache_usage=view.kv_usage_1m,
            sampled_at=view.now,
            ttft_p95_s=view.ttft_p95_s,
            arrivals_short_per_s=short,
            arrivals_long_per_s=long,
            completions_per_s=view.completions_per_s,
            requests_running_1m=view.running_1m,
            tokens_per_s=view.tokens_per_s,
            cold_start_s=view.cold_start_s,
        )
        state = PolicyState.from_dict(self.status)
        decision = decide(observations, self.bounds, state, view.now, self.prior)
        self.status = decision.state.to_dict()
        return decision.replicas


# A metric for the HPA algorithm: (view, policy) -> (usage ratio, desired before damping)
HpaMetric = Callable[[FleetView, "HpaLike"], tuple[float, int]]


class HpaLike:
    """Kubernetes' HPA replica calculation and behaviour defaults (autoscaling/v2)."""

    def __init__(self, name: str, metric: HpaMetric, target: float, settings: Settings) -> None:
        self.name, self.metric, self.target = name, metric, target
        self.interval_s, self.tolerance, self.down_window_s = 15.0, 0.1, 300.0
        self.min, self.max = settings.min_replicas, settings.max_replicas
        self.recommendations: deque[tuple[float, int]] = deque()
        self.samples: deque[tuple[float, float]] = deque()  # for metrics averaged over time

    def desired(self, view: FleetView) -> int:
        current = view.replicas
        ratio, raw = self.metric(view, self)
        wanted = current if abs(ratio - 1.0) <= self.tolerance else raw
        wanted = max(self.min, min(self.max, wanted))
        recs = self.recommendations
        if not recs:
            recs.append((view.now, current))
        recs.append((view.now, wanted))
        while recs[0][0] <= view.now - self.down_window_s:
            recs.popleft()
        if wanted > current:
            return min(wanted, max(2 * current, current + 4))
        return min(current, max(r for _, r in recs))


def _utilisation(view: FleetView, hpa: HpaLike) -> tuple[float, int]:
    hpa.samples.append((view.now, view.utilisation))
    while hpa.samples[0][0] <= view.now - 60.0:
        hpa.samples.popleft()
    average = sum(u for _, u in hpa.samples) / len(hpa.samples)
    ratio = average / hpa.target
    return ratio, math.ceil(view.ready * ratio - 1e-9)


def _waiting_average_value(view: FleetView, hpa: HpaLike) -> tuple[float, int]:
    ratio = view.waiting / (hpa.target * max(view.replicas, 1))
    return ratio, math.ceil(view.waiting / hpa.target - 1e-9)


class KubeAiLike:
    def __init__(self, target: float, settings: Settings) -> None:
        self.name, self.interval_s, self.target = "kubeai", 10.0, target
        self.window_s, self.scale_down_delay_s = 600.0, 30.0
        self.min, self.max = settings.min_replicas, settings.max_replicas
        self.samples: deque[tuple[float, int]] = deque()
        self.last_scale_up = -math.inf

    def desired(self, view: FleetView) -> int:
        self.samples.append((view.now, view.waiting + view.running))
        while self.samples[0][0] <= view.now - self.window_s:
            self.samples.popleft()
        average = sum(n for _, n in self.samples) / len(self.samples)
        wanted = max(self.min, min(self.max, math.ceil(average / self.target - 1e-9)))
        if wanted > view.replicas:
            self.last_scale_up = view.now
        elif wanted < view.replicas and view.now - self.last_scale_up < self.scale_down_delay_s:
            return view.replicas
        return wanted


class FixedMax:
    def __init__(self, settings: Settings) -> None:
        self.name, self.interval_s, self.max = "fixed_max", 60.0, settings.max_replicas

    def desired(self, view: FleetView) -> int:
        return self.max


class Oracle:
    def __init__(
        self,
        trace: Trace,
        capacity: CapacityModel,
        settings: Settings,
        headroom: float = 0.9,
        name: str = "oracle",
    ) -> None:
        self.name, self.interval_s = name, 10.0
        self.lead_s = capacity.cold_start_s + self.interval_s
        self.need = needed_replicas(trace, capacity, headroom)
        self.min, self.max = settings.min_replicas, settings.max_replicas

    def desired(self, view: FleetView) -> int:
        start = int(view.now)
        ahead = self.need[start : start + math.ceil(self.lead_s) + 1]
        wanted = int(ahead.max()) if len(ahead) else self.min
        return max(self.min, min(self.max, wanted))


def needed_replicas(
    trace: Trace, capacity: CapacityModel, headroom: float, smooth_s: int = 60
) -> np.ndarray:
    """Replicas the trace needs, per second: every request holds a batch slot and its KV from
    arrival until it would finish on a replica running at `headroom` of its batch; the demand
    is averaged over `smooth_s` so that the plan follows the load, not each arrival."""
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    batch = capacity.slots(trace.mean_tokens()) * headroom
    tokens = np.minimum(trace.prompt_tokens + trace.output_tokens, capacity.kv_cache_tokens)
    start = trace.arrival_s
    end = start + trace.output_tokens * capacity.step_time(round(batch))
    grid = np.arange(math.ceil(trace.duration_s) + 1, dtype=np.float64)
    order = np.argsort(end)
    started = np.searchsorted(start, grid, "right")
    ended = np.searchsorted(end[order], grid, "right")
    sequences = started - ended
    kv = np.concatenate([[0], np.cumsum(tokens)])[started]
    kv -= np.concatenate([[0], np.cumsum(tokens[order])])[ended]
    by_batch = _rolling_mean(sequences, smooth_s) / (capacity.max_num_seqs * headroom)
    by_kv = _rolling_mean(kv, smooth_s) / (capacity.kv_cache_tokens * headroom)
    return np.ceil(np.maximum(by_batch, by_kv) - 1e-9).astype(np.int64)


def _rolling_mean(values: np.ndarray, width: int) -> np.ndarray:
    """Mean of values[i : i + width] (looking ahead, clipped at the end)."""
    sums = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    idx = np.arange(len(values))
    stop = np.minimum(idx + width, len(values))
    return (sums[stop] - sums[idx]) / (stop - idx)


def planner_seed(capacity: CapacityModel) -> ReplicaCapacity:
    """What the planner knows of a replica before traffic: its batch limit and KV cache (not the
    trace's request sizes, nor step times: those are learned from the metrics)."""
    return seed(capacity.max_num_seqs, capacity.kv_cache_tokens)


def build(
    name: str, trace: Trace, capacity: CapacityModel, settings: Settings, bounds: Bounds
) -> Policy:
    slots = capacity.slots(trace.mean_tokens())
    if name == "kvpilot":
        return KvpilotPolicy(replace(bounds, ttft_slo_s=None))
    if name == "kvpilot_slo":
        if bounds.ttft_slo_s is None:
            raise ValueError("kvpilot_slo needs a TTFT SLO in the bounds (user_bounds ttft_slo_s)")
        return KvpilotPolicy(bounds, planner_seed(capacity), name=name)
    if name == "hpa":
        return HpaLike("hpa", _utilisation, TARGET_FRACTION, settings)
    if name == "kubeai":
        return KubeAiLike(TARGET_FRACTION * slots, settings)
    if name == "keda":
        return HpaLike("keda", _waiting_average_value, 5.0, settings)
    if name == "fixed_max":
        return FixedMax(settings)
    if name == "oracle":
        return Oracle(trace, capacity, settings)
    raise ValueError(f"unknown policy {name!r}: use one of {', '.join(NAMES)}")
