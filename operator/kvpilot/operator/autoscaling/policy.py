"""The autoscaling policy of DESIGN.md §3.5, as one pure function.

`decide(observations, bounds, state, now)` looks at what the ready replicas report (requests
waiting and running, KV-cache usage), proposes a replica count per signal, takes the largest, and
then damps it the way the HPA does: scale-up takes the smallest recommendation of the (short) up
window, scale-down the largest of the down window, scale-up is rate limited per step. Missing or
stale metrics hold the fleet where it is and say so, so a Prometheus outage never shrinks a
serving fleet.

The signals:
- KV demand: the KV-cache usage the ready replicas would have if they admitted their queue too
  (usage x in flight / running). Above the tolerance band it asks for ceil(ready x demand /
  target); below it, for the count at which a linear estimate sits at the band's lower edge,
  because usage grows faster than load (a bigger batch makes every decode step slower).
- Queue: more than the target waiting per ready replica asks for a running slot for every
  request in flight, ceil(ready x (running + waiting) / running); this also covers replicas whose
  batch, not their cache, is full.
A scale-down also waits `scale_down_settle_s` after any change, until the 1-minute KV mean
describes the fleet as it is.

With a TTFT SLO (`Bounds.ttft_slo_s`, issue 33) the count comes from demand instead: the arrival
rate forecast one measured cold start ahead (`forecast`), in sequences in flight, over what one
replica holds inside the SLO (`replica_capacity`, seeded by the planner and learned from the
replicas' own metrics, kept in the state). The queue and KV signals stay as guards that can only
add replicas, and only once the pods asked for are ready (until then the forecast has sized for
the queue already). The down window remembers the sizing for the arrival rate seen, not the
trend's extrapolation nor a guard's count, which ask again at every tick while they last.
While arrivals fall beyond noise the load has left, and the down window shortens to two leads
(measured cold start + a tick) when that is shorter than the user's (`_down_window_s`).
Without arrival rates, or before any request has completed, the SLO signal has nothing to size
from and the guards alone decide, as without an SLO.

All memory between decisions lives in `PolicyState`, which round-trips through a plain dict kept in
the ModelDeployment's `status.autoscaling`, so an operator restart loses nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvpilot.operator.autoscaling import forecast, replica_capacity
from kvpilot.operator.autoscaling.replica_capacity import ReplicaCapacity

# The cold start assumed until one has been measured: the one the simulator assumes for an
# 8B-class model on one GPU (docs/benchmarks.md); issue 33 measured 12-109 s on the dev cluster.
COLD_START_PRIOR_S = 60.0
DECISION_INTERVAL_S = 10.0  # the loop's tick: capacity asked for now is seen one tick later
RATE_WINDOW_S = 60.0  # of the minute means (KV usage, running, completions) the adapter reads
# Hysteresis of the SLO sizing (`_slo_band`), as shares of the forecast demand, tuned in the
# simulator (bench/autoscaler_sim.py, seeds 0-4). Without it steady load flapped between 4 and 5
# replicas (15.5 direction changes an hour). An up band alone lets the fleet run short on a slow
# rise (10%: the diurnal day at 98.2%); the down margin keeps a fleet from shrinking to the edge
# of what it holds, which is where a day's misses were (both at 10%: 99.4%, 1 change an hour).
# Steady load at 6/s, which 4 replicas hold with 10% to spare at times, still shrinks to 4.
SLO_UP_BAND = 0.1
SLO_DOWN_MARGIN = 0.1
# Leads (measured cold start + a tick) the down window lasts, at most, while arrivals fall beyond
# noise (`_down_window_s`). Ski rental: an idle replica held longer than it costs to bring one
# back is waste, and bringing one back costs its cold start in GPU time and, for about as long,
# requests served late. Tuned in the simulator (bench.autoscaler_coldstart, seeds 0-4): one lead
# cost 0.7 points of attainment on the spikes at a 60 s cold start (a spike soon after another
# found the fleet gone); two keep it, and at a 5 s cold start cut the spikes' and flash crowd's
# GPU-hours by 13% and 8% against the 120 s default.
FALL_HOLD_LEADS = 2.0


@dataclass(frozen=True)
class Bounds:
    """A ModelDeployment's autoscaling settings, resolved to numbers (defaults in one place)."""

    min_replicas: int = 1
    max_replicas: int = 4
    # The defaults were tuned in the simulator (bench/autoscaler_sim.py) and are the CRD's
    # defaults too (api.py reads them from here). The wide band is what keeps a fleet whose
    # right size sits between two counts from flapping under steady Poisson load: the 1-minute
    # KV mean of a replica near its right size swings by +/-0.1. Scale-up needs demand above
    # 0.85 x 1.2, which the queue provides as soon as requests wait.
    target_queue_length: float = 4.0  # waiting requests per ready replica
    target_kv_cache_utilization: float = 0.85  # used / total KV blocks, 0-1 (1-minute mean)
    tolerance: float = 0.2  # ratios within 1 +/- tolerance keep the current count
    scale_up_stabilization_seconds: float = 0.0
    # Shorter than the HPA's 300 s: the settle wait and the band's lower edge as the scale-down
    # aim already keep a shrink from undershooting, and a burst's fleet goes back sooner.
    scale_down_stabilization_seconds: float = 120.0
    # No scale-down this soon after a change: the KV-cache signal is a 1-minute mean, which right
    # after a change still mixes in the old fleet (a just-shrunk fleet looks emptier than it is).
    # A shorter scale-down window is a request for quicker scale-downs and caps this wait.
    scale_down_settle_s: float = 60.0
    max_scale_up_factor: float = 2.0  # a step may at least double ...
    max_scale_up_step: int = 4  # ... or add this many, whichever is more
    scale_to_zero_idle_seconds: float = 600.0  # only with min_replicas == 0
    max_metrics_age_s: float = 60.0
    ttft_slo_s: float | None = None  # spec.autoscaling.slo.ttftSeconds; None: no SLO signal
    slo_percentile: float = 95.0  # of requests whose TTFT the SLO bounds
    tpot_slo_s: float | None = None  # spec.autoscaling.slo.tpotSeconds: caps each replica's batch

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < 1:
            raise ValueError(
                f"need minReplicas >= 0 and maxReplicas >= 1, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas {self.min_replicas} is above maxReplicas {self.max_replicas}"
            )
        if self.target_queue_length <= 0:
            raise ValueError(f"targetQueueLength must be > 0, got {self.target_queue_length}")
        if not 0 < self.target_kv_cache_utilization <= 1:
            raise ValueError(
                "targetKVCacheUtilization must be in (0, 1], got "
                f"{self.target_kv_cache_utilization}"
            )
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        windows = (
            self.scale_up_stabilization_seconds,
            self.scale_down_stabilization_seconds,
            self.scale_down_settle_s,
        )
        if min(windows) < 0:
            raise ValueError("stabilization windows must be >= 0 seconds")
        if self.max_scale_up_factor < 1 or self.max_scale_up_step < 1:
            raise ValueError("scale-up rate limits must allow growth (factor >= 1, step >= 1)")
        if self.scale_to_zero_idle_seconds < 0 or self.max_metrics_age_s <= 0:
            raise ValueError("scaleToZeroIdleSeconds must be >= 0 and max metrics age > 0")
        if self.ttft_slo_s is not None and self.ttft_slo_s <= 0:
            raise ValueError(f"slo.ttftSeconds must be > 0, got {self.ttft_slo_s}")
        if self.tpot_slo_s is not None and (self.tpot_slo_s <= 0 or self.ttft_slo_s is None):
            raise ValueError(
                f"slo.tpotSeconds must be > 0 and come with slo.ttftSeconds, got {self.tpot_slo_s}"
            )
        replica_capacity.staffing_z(self.slo_percentile)  # raises when out of range


@dataclass(frozen=True)
class Observations:
    """What the metrics adapter saw for one ModelDeployment (or one node type of it).

    Sums and means are over ready pods only: pods still starting report nothing useful and
    must not be counted as capacity. With zero replicas, `requests_waiting` is what the gateways
    hold for the model (or 0), which is how a scaled-to-zero deployment wakes up.
    """

    current_replicas: int  # replicas the Deployments ask for now
    ready_replicas: int = 0  # ready pods whose metrics were read
    requests_waiting: float = 0.0  # sum over ready pods, plus requests_held and _queued
    requests_held: float = 0.0  # of those, held at gateways (no replica has seen them yet)
    # Of those, in the gateways' fair queues (flow control: the replicas are saturated).
    requests_queued: float = 0.0
    requests_running: float = 0.0  # sum over ready pods
    kv_cache_usage: float = 0.0  # mean over ready pods, 0-1
    sampled_at: float | None = None  # unix time of the oldest sample used; None: no data
    ttft_p95_s: float | None = None
    # Arrivals per second over the forecaster's short and long windows (None: not read).
    arrivals_short_per_s: float | None = None
    arrivals_long_per_s: float | None = None
    completions_per_s: float | None = None  # summed over ready pods, over 1 minute
    requests_running_1m: float | None = None  # requests_running averaged over the same minute
    tokens_per_s: float | None = None  # output tokens generated, summed over ready pods, 1 minute
    cold_start_s: float | None = None  # measured pod created -> ready (median); None: not yet
    # The share of requests whose TTFT met the SLO's target (attainment.WINDOW_S); None: no SLO
    # or no requests in the window.
    ttft_slo_attainment: float | None = None
    # The share of requests whose time per output token met the SLO's tpotSeconds; None: no such
    # target, or no request with two tokens in the window.
    tpot_slo_attainment: float | None = None
    error: str = ""  # why there is no data, for the MetricsAvailable condition

    @classmethod
    def unavailable(cls, current_replicas: int, error: str) -> Observations:
        return cls(current_replicas=current_replicas, error=error or "no metrics")

    def to_dict(self) -> dict[str, Any]:
        return {
            "currentReplicas": self.current_replicas,
            "readyReplicas": self.ready_replicas,
            "requestsWaiting": self.requests_waiting,
            "requestsHeld": self.requests_held,
            "requestsQueued": self.requests_queued,
            "requestsRunning": self.requests_running,
            "kvCacheUsage": round(self.kv_cache_usage, 4),
            "sampledAt": self.sampled_at,
            "ttftP95Seconds": self.ttft_p95_s,
            "arrivalsShortPerSecond": self.arrivals_short_per_s,
            "arrivalsLongPerSecond": self.arrivals_long_per_s,
            "completionsPerSecond": self.completions_per_s,
            "requestsRunning1m": self.requests_running_1m,
            "tokensPerSecond": self.tokens_per_s,
            "coldStartSeconds": self.cold_start_s,
            "ttftSloAttainment": self.ttft_slo_attainment,
            "tpotSloAttainment": self.tpot_slo_attainment,
            "error": self.error,
        }


@dataclass(frozen=True)
class PolicyState:
    """Everything `decide` remembers, small enough for the status subresource.

    `recommendations` holds (time, replicas) pairs inside the longest window. A run of equal
    consecutive values keeps only its newest time: for a windowed min or max that is the same.
    """

    recommendations: tuple[tuple[float, int], ...] = ()
    idle_since: float | None = None
    last_scale_time: float | None = None
    woken_at: float | None = None  # the last wake request acted on (its own time)
    capacity: ReplicaCapacity | None = None  # learned per replica, with a TTFT SLO only

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "recommendations": [[t, r] for t, r in self.recommendations],
            "idleSince": self.idle_since,
            "lastScaleTime": self.last_scale_time,
            "wokenAt": self.woken_at,
        }
        if self.capacity is not None:
            data["capacity"] = self.capacity.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> PolicyState:
        if not data:
            return cls()
        try:
            pairs = tuple((float(t), int(r)) for t, r in data.get("recommendations") or [])
            idle, last, woken = (data.get(k) for k in ("idleSince", "lastScaleTime", "wokenAt"))
            learned = data.get("capacity")
            return cls(
                recommendations=pairs,
                idle_since=None if idle is None else float(idle),
                last_scale_time=None if last is None else float(last),
                woken_at=None if woken is None else float(woken),
                capacity=None if learned is None else ReplicaCapacity.from_dict(learned),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"status.autoscaling.state is malformed: {data!r} ({exc})") from exc


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    state: PolicyState
    metrics_available: bool = True


def decide(
    observations: Observations,
    bounds: Bounds,
    state: PolicyState,
    now: float,
    prior: ReplicaCapacity | None = None,
) -> Decision:
    """The replica count for the next interval, why, and the state to store for the next call.

    `prior` is the planner's capacity per replica before any traffic (`replica_capacity.seed`);
    it matters only with a TTFT SLO, until the state holds a learned one."""
    current = observations.current_replicas
    if current < 0:
        raise ValueError(f"current replicas must be >= 0, got {current}")
    problem = metrics_problem(observations, bounds, now)
    if problem:
        held = clamp(current, bounds.min_replicas, bounds.max_replicas)
        reason = f"hold at {held}: {problem}; never scale down on missing data"
        return _finish(current, held, reason, state, now, metrics_available=False)
    idle_since = _idle_since(observations, state, now)
    state = replace(state, idle_since=idle_since)
    if _may_scale_to_zero(observations, bounds, idle_since, now):
        idle_for = now - (idle_since if idle_since is not None else now)
        limit = bounds.scale_to_zero_idle_seconds
        reason = f"scale to zero: idle for {idle_for:.0f}s >= {limit:.0f}s"
        return _finish(current, 0, reason, replace(state, recommendations=()), now)
    raw, why = recommend(observations, bounds)
    seen = raw
    keep_s = _longest_window(bounds)  # the user's windows: a shortened one keeps its history
    if bounds.ttft_slo_s is not None:
        steady = _settled(now, state.last_scale_time, RATE_WINDOW_S)
        capacity = _learn(observations, state.capacity or prior, steady)
        state = replace(state, capacity=capacity)
        ask = _slo_recommend(observations, bounds, capacity, (raw, why))
        raw, why, seen = ask.replicas, ask.reason, ask.remembered
        bounds = replace(bounds, scale_down_stabilization_seconds=ask.down_window_s)
    floor = _floor(bounds, current)
    wanted = clamp(raw, floor, bounds.max_replicas)
    # Like the HPA, a policy without history (new object, lost status) starts from the current
    # count, so it cannot scale down before a full window has passed.
    seed = state.recommendations or ((now, current),)
    history = _record(seed, now, wanted, keep_s)
    # The down window remembers what the load seen asks for (`_slo_recommend`); with no up
    # window, a need that lasts asks again at the next tick.
    kept = clamp(seen, floor, bounds.max_replicas)
    remembered = history if kept == wanted else _record(seed, now, kept, keep_s)
    settled = _settled(now, state.last_scale_time, _settle_s(bounds))
    stabilised = _stabilise(current, history, bounds, now, settled)
    limited = _rate_limit(current, stabilised, bounds)
    final = clamp(limited, floor, bounds.max_replicas)
    steps = (current, raw, wanted, stabilised, limited, final)
    reason = _explain(steps, why, bounds, settled)
    return _finish(current, final, reason, replace(state, recommendations=remembered), now)


def wake(
    mode: str,
    bounds: Bounds,
    state: PolicyState,
    current: int,
    requested_at: float | None,
    now: float,
) -> Decision | None:
    """One replica at once for a request waiting at a gateway while nothing runs; None when the
    wake changes nothing.

    The gateway asks by stamping the time on the ModelDeployment (its wake annotation). A wake
    counts when it is newer than the last scale (a wake from before the scale to zero is stale)
    and than the last wake acted on, when the fleet is at zero with minReplicas 0, and only for
    the builtin autoscaler (`off` and `external` fleets are someone else's to size). The idle
    clock restarts from the wake, so the new replica serves the held requests instead of
    meeting an idle period that began before it existed.
    """
    if mode != "builtin" or requested_at is None:
        return None
    if current > 0 or bounds.min_replicas > 0 or not is_new_wake(state, requested_at):
        return None
    replicas = clamp(1, bounds.min_replicas, bounds.max_replicas)
    woken = replace(
        state,
        woken_at=requested_at,
        idle_since=requested_at,
        recommendations=((now, replicas),),
    )
    waited = f"{now - requested_at:.1f}s"
    reason = f"scale up 0->{replicas}: a request is waiting at a gateway (woken {waited} ago)"
    return _finish(current, replicas, reason, woken, now)


def is_new_wake(state: PolicyState, requested_at: float) -> bool:
    """Newer than the last scale and the last wake acted on."""
    seen = [t for t in (state.last_scale_time, state.woken_at) if t is not None]
    return not seen or requested_at > max(seen)


def metrics_problem(observations: Observations, bounds: Bounds, now: float) -> str:
    """'' when the observations can be trusted, else why not."""
    if observations.error:
        return f"metrics unavailable ({observations.error})"
    if observations.sampled_at is None:
        return "metrics unavailable (no samples)"
    age = now - observations.sampled_at
    if age > bounds.max_metrics_age_s:
        return f"metrics stale (newest sample {age:.0f}s old > {bounds.max_metrics_age_s:.0f}s)"
    return ""


def recommend(observations: Observations, bounds: Bounds) -> tuple[int, str]:
    """The largest per-signal recommendation and which signal made it, before any damping."""
    current, ready = observations.current_replicas, observations.ready_replicas
    if ready == 0:
        # Nothing ready to measure per replica; only a queue (e.g. at a gateway) can ask for pods.
        need = math.ceil(observations.requests_waiting / bounds.target_queue_length)
        return max(current, need), f"{observations.requests_waiting:g} waiting, 0 ready"
    kv_wanted, kv_why = _kv_signal(observations, bounds)
    queue_wanted, queue_why = _queue_signal(observations, bounds)
    if queue_wanted > kv_wanted:
        return queue_wanted, queue_why
    return kv_wanted, kv_why


def _learn(
    observations: Observations, capacity: ReplicaCapacity | None, steady: bool
) -> ReplicaCapacity | None:
    """The capacity refined by this observation, learned only from a fleet that has been the
    same for a whole rate window: the minute means of a fleet that just changed mix two fleets
    (new pods dilute the per-pod KV mean before they take their share of the load)."""
    if (
        capacity is None
        or not steady
        or observations.ready_replicas < observations.current_replicas
    ):
        return capacity
    # Little's law and the KV per sequence need the running count averaged over the minute the
    # completions, tokens and KV usage are averaged over: an instant reading would not match them
    # while the load moves.
    running = observations.requests_running_1m
    sample = replica_capacity.FleetSample(
        ready=observations.ready_replicas,
        running=observations.requests_running if running is None else running,
        kv_usage=observations.kv_cache_usage,
        completions_per_s=observations.completions_per_s or 0.0,
        tokens_per_s=observations.tokens_per_s or 0.0,
    )
    return replica_capacity.learn(capacity, sample)


@dataclass(frozen=True)
class _SloAsk:
    """What the SLO sizing asks of `decide`."""

    replicas: int
    reason: str
    remembered: int  # the count the down window is to remember
    down_window_s: float  # the down window for this tick (`_down_window_s`)


def _slo_recommend(
    observations: Observations,
    bounds: Bounds,
    capacity: ReplicaCapacity | None,
    guard: tuple[int, str],
) -> _SloAsk:
    """Replicas for the demand forecast one cold start ahead, the guards (queue, KV) only adding
    to it; the guards alone while the SLO signal has nothing to size from. Also the count the
    down window is to remember: the sizing for the arrival rate seen, without the trend's
    extrapolation and without the guards; and the down window itself, shorter while arrivals
    fall beyond noise.

    Both are asked for again at every tick while they last (scale-up has no window), and a
    spike's fleet must not be held for a whole down window by an extrapolation that did not come
    true, nor by a guard's backlog once it has drained. Held by them, a fleet stayed at the
    maximum for two minutes after each spike (bench.autoscaler_sim, spikes and flash)."""
    short, long = observations.arrivals_short_per_s, observations.arrivals_long_per_s
    window = bounds.scale_down_stabilization_seconds
    if capacity is None or short is None or long is None:
        why = f"{guard[1]} (no SLO sizing: no arrival rates or capacity)"
        return _SloAsk(guard[0], why, guard[0], window)
    cold_start = observations.cold_start_s
    lead = (COLD_START_PRIOR_S if cold_start is None else cold_start) + DECISION_INTERVAL_S
    rates = forecast.ArrivalRates(short, long)
    ahead = forecast.forecast(rates, observations.requests_waiting, lead)
    z = replica_capacity.staffing_z(bounds.slo_percentile)
    sized = capacity
    if bounds.tpot_slo_s is not None:
        sized = replica_capacity.within_tpot(capacity, bounds.tpot_slo_s)
    current = observations.current_replicas
    banded = _slo_band(ahead.demand_per_s, sized, z, current)
    if banded is None:
        why = f"{guard[1]} (no SLO sizing: no request has completed yet)"
        return _SloAsk(guard[0], why, guard[0], window)
    window = _down_window_s(bounds, lead, ahead.falling)
    wanted, band_note = banded
    seen = wanted
    if ahead.trend_per_s2 > 0:
        at_seen_rate = _slo_band(short + ahead.backlog_per_s, sized, z, current)
        seen = wanted if at_seen_rate is None else at_seen_rate[0]
    why = (
        f"SLO {_slo_terms(bounds)}: {ahead.reason}; "
        f"{sized.slots:.1f} slots{_tpot_cap(capacity, sized)}, "
        f"{capacity.tokens_per_request or 0:.0f} tokens/request{band_note}"
    )
    # While pods start, the queue is the one the forecast already sized for; the guards speak
    # for what it missed once the fleet it asked for is ready.
    if guard[0] > max(wanted, current) and observations.ready_replicas >= current:
        why = f"guard {guard[1]} (SLO sizing {wanted}{_kept(seen, guard[0])})"
        return _SloAsk(guard[0], why, seen, window)
    return _SloAsk(wanted, why + _kept(seen, wanted), seen, window)


def _down_window_s(bounds: Bounds, lead_s: float, falling: bool) -> float:
    """The user's down window, or while arrivals fall beyond noise `FALL_HOLD_LEADS` leads
    (measured cold start + a tick) if that is shorter: the load has left, and holding its fleet
    longer than a replica takes to come back costs more than bringing one back. Never longer
    than the user's `scaleDownStabilizationSeconds`, which stays a cap; on a plateau or a
    slow fall it applies whole, as it does to the guards."""
    window = bounds.scale_down_stabilization_seconds
    if not falling:
        return window
    return min(window, FALL_HOLD_LEADS * lead_s)


def _kept(seen: int, asked: int) -> str:
    """The note that the down window remembers less than is asked for now."""
    return f"; down window keeps {seen}" if seen < asked else ""


def _slo_band(
    demand_per_s: float, capacity: ReplicaCapacity, z: float, current: int
) -> tuple[int, str] | None:
    """The SLO sizing with hysteresis around the current count, and a note when it moved it;
    None while the service time is unknown.

    The sizing's inputs (the 120 s arrival rate, the learned slots and tokens a request) each
    carry a few percent of noise, so a fleet whose right size lies near an integer boundary
    would be sized one replica up and down every few minutes (measured: 15.5 direction changes
    an hour on steady load, 430 scale events in a simulated day). A scale-up on the sizing
    alone waits until the current fleet no longer holds the demand less `SLO_UP_BAND`, and a
    scale-down goes only to a fleet that holds the demand plus `SLO_DOWN_MARGIN`, which the
    fleet it leaves will not be asked back to at the next noise (a replica given back is a
    cold start away when asked for again)."""
    sized = replica_capacity.replicas_for(demand_per_s, capacity, z)
    if sized is None:
        return None
    if sized > current:
        low = replica_capacity.replicas_for(demand_per_s * (1 - SLO_UP_BAND), capacity, z)
        if low is not None and low <= current:
            return current, f"; sized {sized}, {current} hold it less {SLO_UP_BAND:.0%}"
    if sized < current:
        high = replica_capacity.replicas_for(demand_per_s * (1 + SLO_DOWN_MARGIN), capacity, z)
        kept = min(current, sized if high is None else high)
        if kept != sized:
            return kept, f"; sized {sized}, {kept} with {SLO_DOWN_MARGIN:.0%} to spare"
    return sized, ""


def _slo_terms(bounds: Bounds) -> str:
    tpot = "" if bounds.tpot_slo_s is None else f" tpot {bounds.tpot_slo_s:g}s"
    return f"ttft {bounds.ttft_slo_s:g}s{tpot} p{bounds.slo_percentile:g}"


def _tpot_cap(learned: ReplicaCapacity, sized: ReplicaCapacity) -> str:
    """How the TPOT target capped the slots, if it did."""
    if sized.slots >= learned.slots:
        return ""
    return f" (TPOT caps the batch; {learned.slots:.1f} held by KV and batch limit)"


def kv_demand(observations: Observations) -> float:
    """KV-cache usage the ready replicas would have if they also admitted their queue.

    Queued requests wait because the cache (or the batch) is full, so they are demand the usage
    gauge does not show yet; each is assumed to need as much cache as a running one."""
    running, waiting = observations.requests_running, observations.requests_waiting
    if running <= 0:
        return observations.kv_cache_usage
    return observations.kv_cache_usage * (running + waiting) / running


def _kv_signal(observations: Observations, bounds: Bounds) -> tuple[int, str]:
    """Replicas for the KV-cache target: up to the target when above the band; down only to
    where a linear estimate puts usage at the band's lower edge. The estimate is optimistic for
    a smaller fleet: every extra sequence in a batch slows each decode step, so sequences stay
    longer and usage grows faster than the load per replica."""
    current, ready = observations.current_replicas, observations.ready_replicas
    demand, target = kv_demand(observations), bounds.target_kv_cache_utilization
    ratio = demand / target
    if ratio > 1 + bounds.tolerance:
        wanted, note = math.ceil(ready * ratio - 1e-9), f"ratio {ratio:.2f}"
    elif ratio < 1 - bounds.tolerance:
        low_edge = target * (1 - bounds.tolerance)
        wanted, note = math.ceil(ready * demand / low_edge - 1e-9), f"ratio {ratio:.2f}"
    else:
        wanted, note = current, "within tolerance"
    usage = observations.kv_cache_usage
    seen = f"{usage:.2f}" if demand == usage else f"{demand:.2f} (usage {usage:.2f} + queue)"
    return wanted, f"kv-cache {seen} vs target {target:g} ({note}, {ready} ready)"


def _queue_signal(observations: Observations, bounds: Bounds) -> tuple[int, str]:
    """A queue longer than the target per replica asks for a running slot for every request in
    flight: ceil(ready x (running + waiting) / running). The queue's length itself is not a
    measure of missing capacity (it grows for as long as capacity is short), so dividing it by
    the target would overshoot; this also covers replicas whose batch, not cache, is full."""
    ready = observations.ready_replicas
    running, waiting = observations.requests_running, observations.requests_waiting
    per_replica = waiting / ready
    if per_replica <= bounds.target_queue_length * (1 + bounds.tolerance):
        return 0, f"queue {per_replica:.2f}/replica within target {bounds.target_queue_length:g}"
    in_flight = (
        (running + waiting) / running if running > 0 else per_replica / bounds.target_queue_length
    )
    wanted = math.ceil(ready * in_flight - 1e-9)
    why = (
        f"queue {per_replica:.2f}/replica vs target {bounds.target_queue_length:g} "
        f"({running:g} running, {waiting:g} waiting, {ready} ready)"
    )
    return wanted, why


def clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _floor(bounds: Bounds, current: int) -> int:
    """min_replicas, except that a running fleet with minReplicas 0 keeps one replica until the
    idle rule (not a momentary zero reading) takes it to zero."""
    if bounds.min_replicas > 0 or current == 0:
        return bounds.min_replicas
    return 1


def _idle_since(observations: Observations, state: PolicyState, now: float) -> float | None:
    busy = (
        observations.requests_waiting > 0
        or observations.requests_running > 0
        or observations.kv_cache_usage > 0
    )
    if busy:
        return None
    return state.idle_since if state.idle_since is not None else now


def _may_scale_to_zero(
    observations: Observations, bounds: Bounds, idle_since: float | None, now: float
) -> bool:
    # The idle period is its own stabilisation window, so this bypasses the down window.
    return (
        bounds.min_replicas == 0
        and observations.current_replicas > 0
        and idle_since is not None
        and now - idle_since >= bounds.scale_to_zero_idle_seconds
    )


def _longest_window(bounds: Bounds) -> float:
    return max(bounds.scale_up_stabilization_seconds, bounds.scale_down_stabilization_seconds)


def _record(
    history: tuple[tuple[float, int], ...], now: float, replicas: int, keep_s: float
) -> tuple[tuple[float, int], ...]:
    kept = [(t, r) for t, r in history if now - keep_s <= t <= now]
    if kept and kept[-1][1] == replicas:
        kept.pop()  # the newer time of an equal run is all a windowed min/max needs
    kept.append((now, replicas))
    return tuple(kept)


def _stabilise(
    current: int,
    history: tuple[tuple[float, int], ...],
    bounds: Bounds,
    now: float,
    settled: bool,
) -> int:
    """HPA's rule: go up to the smallest recommendation of the up window, down to the largest of
    the down window, otherwise stay. The newest recommendation always counts, so a zero window
    means no damping. A scale-down also waits until the last change has settled."""
    up = _window_extreme(history, now, bounds.scale_up_stabilization_seconds, min)
    if up > current:
        return up
    down = _window_extreme(history, now, bounds.scale_down_stabilization_seconds, max)
    if down < current and settled:
        return down
    return current


def _window_extreme(
    history: tuple[tuple[float, int], ...],
    now: float,
    window_s: float,
    pick: Callable[[list[int]], int],
) -> int:
    *older, (_, latest) = history
    return pick([r for t, r in older if t > now - window_s] + [latest])


def _settle_s(bounds: Bounds) -> float:
    return min(bounds.scale_down_settle_s, bounds.scale_down_stabilization_seconds)


def _settled(now: float, last_scale_time: float | None, wait_s: float) -> bool:
    """Whether the metrics describe the fleet as it is: right after a change, the 1-minute KV
    mean still mixes in the old fleet, which makes a just-shrunk fleet look emptier than it is."""
    return last_scale_time is None or now - last_scale_time >= wait_s


def _rate_limit(current: int, wanted: int, bounds: Bounds) -> int:
    if wanted <= current:
        return wanted
    allowed = max(
        math.ceil(current * bounds.max_scale_up_factor), current + bounds.max_scale_up_step
    )
    return min(wanted, allowed)


def _explain(
    steps: tuple[int, int, int, int, int, int], why: str, bounds: Bounds, settled: bool
) -> str:
    """steps: current, raw, wanted (in bounds), after the windows, after the rate limit, final."""
    current, raw, wanted, stabilised, limited, final = steps
    if final == current:
        if wanted < current and not settled:
            settle = f"{_settle_s(bounds):.0f}s"
            return f"hold at {current}: wants {wanted}, last change under {settle} ago; {why}"
        if wanted < current:
            window = f"{bounds.scale_down_stabilization_seconds:.0f}s"
            return f"hold at {current}: wants {wanted}, {window} down window not passed; {why}"
        if wanted > current:
            return f"hold at {current}: wants {wanted}, up window not passed; {why}"
        return f"hold at {current}: {why}"
    verb = "scale up" if final > current else "scale down"
    notes = []
    if stabilised != wanted:
        notes.append(f"window max/min {stabilised}")
    if limited != stabilised:
        notes.append(f"rate limit {limited}")
    if final != limited or raw != wanted:
        notes.append(f"bounds {bounds.min_replicas}..{bounds.max_replicas}")
    extra = f" ({', '.join(notes)})" if notes else ""
    return f"{verb} {current}->{final}{extra}: {why}"


def _finish(
    current: int,
    replicas: int,
    reason: str,
    state: PolicyState,
    now: float,
    metrics_available: bool = True,
) -> Decision:
    if replicas != current:
        state = replace(state, last_scale_time=now)
    return Decision(replicas, reason, state, metrics_available)
