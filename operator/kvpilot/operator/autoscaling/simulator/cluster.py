"""The discrete-event simulation of one model's fleet under one autoscaling policy.

Events: request arrivals (from the trace), sequence completions per replica, pods becoming ready
after their cold start, policy ticks and timeline samples. Between events nothing changes, so
time jumps from one to the next. Each replica keeps a decode clock (tokens decoded per running
sequence so far): every running sequence advances at the same rate, so a request admitted at clock
v with n output tokens finishes when the clock reaches v + n, and only the earliest finish of each
replica needs an event (re-planned whenever its batch size changes).

Routing is join-the-shortest-queue over ready replicas (waiting + running), as an endpoint picker
does. Requests that arrive while no replica is ready wait at the gateway (scale from zero). With
flow control (`Settings.max_in_flight_per_replica`, the gateway's `--max-in-flight-per-replica`)
the gateway lets at most that many requests per ready replica be in flight (waiting or running
on a replica, draining ones included) and queues the rest in arrival order (the fair queue with
one tenant; unbounded: no refusals, no deadline), sending the next as one ends or a replica
becomes ready. The replicas then receive requests only as fast as they serve them, which is what
the runtime's received counter reports (`received_*_per_s`).
Scale-down deletes starting pods first, then drains the least loaded ready ones: they stop taking
requests and leave once empty. GPU time counts from pod creation to deletion, cold start included.
"""

from __future__ import annotations

import bisect
import heapq
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvpilot.operator.autoscaling.simulator.capacity import CapacityModel
from kvpilot.operator.autoscaling.simulator.traces import FloatArray, Trace

FINISH, READY, TICK, SAMPLE = 0, 1, 2, 3  # tie order: free capacity before deciding
TIMELINE = ("t", "replicas", "ready", "waiting")
KV_AVERAGE_S = 60.0  # Prometheus avg_over_time window the metrics adapter uses for KV usage
# The windows of the rates a policy reads, as Prometheus rate()/histogram_quantile() would give
# them: arrivals over a short and a long window (the forecaster's), completions and TTFT over 1m.
ARRIVALS_SHORT_S, ARRIVALS_LONG_S, RATE_WINDOW_S = 30.0, 120.0, 60.0


@dataclass(frozen=True)
class FleetView:
    """What a policy may look at on a tick (the metrics a real one would read)."""

    now: float
    replicas: int  # pods asked for: starting + ready (draining ones are on their way out)
    ready: int
    waiting: int  # queued on ready pods + at the gateway
    running: int  # running on ready pods
    kv_usage: float  # mean over ready pods, 0-1
    kv_usage_1m: float  # the same averaged over the last minute of samples (avg_over_time)
    utilisation: float  # mean over ready pods of running / slots, capped at 1
    held: int = 0  # of waiting, at the gateway (no replica was ready when they arrived)
    queued: int = 0  # in the gateway's fair queue (flow control), not part of waiting
    running_1m: float = 0.0  # running on ready pods, averaged like kv_usage_1m
    arrivals_short_per_s: float = 0.0  # over ARRIVALS_SHORT_S, at the gateway
    arrivals_long_per_s: float = 0.0  # over ARRIVALS_LONG_S
    # The same windows at the replicas (the runtime's received counter): below the gateway's
    # while flow control queues requests, or while requests are held with no replica ready.
    received_short_per_s: float = 0.0
    received_long_per_s: float = 0.0
    completions_per_s: float = 0.0  # over RATE_WINDOW_S, on pods taking requests
    tokens_per_s: float = 0.0  # output tokens generated, over RATE_WINDOW_S, same pods
    ttft_p95_s: float | None = None  # of first tokens sent in the last RATE_WINDOW_S
    cold_start_s: float | None = None  # median created -> ready of pods started so far


class Policy(Protocol):
    name: str
    interval_s: float

    def desired(self, view: FleetView) -> int: ...


@dataclass(frozen=True)
class Settings:
    min_replicas: int = 1
    max_replicas: int = 16
    initial_replicas: int = 1  # ready at t=0
    sample_s: float = 10.0
    # Policies first decide after a minute of traffic, so that no windowed metric starts from
    # the empty history before t=0 (a running autoscaler would have seen the traffic).
    first_decision_s: float = 60.0
    # Flow control at the gateway: requests in flight per ready replica (None: no limit).
    max_in_flight_per_replica: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"need 0 <= min <= max and max >= 1, got {self.min_replicas}, {self.max_replicas}"
            )
        if self.max_in_flight_per_replica is not None and self.max_in_flight_per_replica < 1:
            raise ValueError(
                f"max_in_flight_per_replica must be >= 1, got {self.max_in_flight_per_replica}"
            )
        if not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial replicas {self.initial_replicas} outside min..max")


@dataclass
class RunResult:
    policy: str
    trace: str
    duration_s: float
    ttft_s: FloatArray
    gpu_hours: float
    scale_events: list[tuple[float, int, int]]  # (time, from, to)
    timeline: dict[str, list[float]] = field(default_factory=dict)  # t, replicas, ready, waiting


class _Replica:
    __slots__ = (
        "created_s",
        "gone_s",
        "is_draining",
        "kv_used",
        "last_s",
        "running",
        "vclock",
        "version",
        "waiting",
    )

    def __init__(self, now: float) -> None:
        self.created_s = now
        self.gone_s: float | None = None
        self.is_draining = False
        self.kv_used = 0
        self.last_s = now
        self.running: list[tuple[float, int, int]] = []  # heap of (finish clock, request, kv)
        self.vclock = 0.0
        self.version = 0
        self.waiting: deque[int] = deque()


class Simulation:
    def __init__(
        self, trace: Trace, policy: Policy, capacity: CapacityModel, settings: Settings
    ) -> None:
        self.trace, self.policy, self.cap, self.settings = trace, policy, capacity, settings
        self.arrival = trace.arrival_s.tolist()
        self.prompt = trace.prompt_tokens.tolist()
        self.output = trace.output_tokens.tolist()
        self.ttft = [math.nan] * trace.num_requests
        self.slots = capacity.slots(trace.mean_tokens())
        self.events: list[tuple[float, int, int, _Replica | None, int]] = []
        self.seq = 0
        self.starting: list[_Replica] = []
        self.serving: list[_Replica] = []
        self.all: list[_Replica] = []
        self.gateway: deque[int] = deque()  # held: no replica ready
        self.flow: deque[int] = deque()  # the fair queue: every replica at the in-flight limit
        self.in_flight = 0  # on replicas, draining ones included (the gateway's own count)
        self.received: list[float] = []  # when each request reached a replica, in order
        self.scale_events: list[tuple[float, int, int]] = []
        self.timeline: dict[str, list[float]] = {k: [] for k in TIMELINE}
        # (time, fleet mean KV usage, running on ready pods), every sample_s
        self.kv_samples: deque[tuple[float, float, int]] = deque()
        self.completions: deque[float] = deque()  # times, on pods taking requests
        self.tokens_total = 0.0  # output tokens generated on pods taking requests (a counter)
        self.token_samples: deque[tuple[float, float]] = deque([(0.0, 0.0)])  # (t, counter)
        self.first_tokens: deque[tuple[float, float]] = deque()  # (time sent, TTFT)
        self.cold_starts: list[float] = []  # of pods the policy asked for (not the initial ones)

    def run(self) -> RunResult:
        for _ in range(self.settings.initial_replicas):
            replica = self._create(0.0)
            self._on_ready(replica, 0.0)
        self._push(self.settings.first_decision_s, TICK, None)
        self._push(0.0, SAMPLE, None)
        self._loop()
        return self._result()

    def _loop(self) -> None:
        i, n, events = 0, len(self.arrival), self.events
        while True:
            next_arrival = self.arrival[i] if i < n else math.inf
            if events and events[0][0] <= next_arrival:
                t, kind, _, replica, version = heapq.heappop(events)
                self._on_event(t, kind, replica, version)
            elif i < n:
                self._on_arrival(i, next_arrival)
                i += 1
            else:
                return

    def _on_event(self, t: float, kind: int, replica: _Replica | None, version: int) -> None:
        if kind == FINISH and replica is not None and version == replica.version:
            self._on_finish(replica, t)
        elif kind == READY and replica is not None and replica.gone_s is None:
            self.starting.remove(replica)
            self.cold_starts.append(t - replica.created_s)
            self._on_ready(replica, t)
        elif kind == TICK:
            self._on_tick(t)
        elif kind == SAMPLE:
            self._on_sample(t)

    def _push(self, t: float, kind: int, replica: _Replica | None, version: int = 0) -> None:
        self.seq += 1
        # seq keeps the heap from ever comparing replicas; it is also a stable tie-break
        heapq.heappush(self.events, (t, kind, self.seq, replica, version))

    # ---- requests -------------------------------------------------------------------------

    def _on_arrival(self, idx: int, t: float) -> None:
        if not self.serving:
            self.gateway.append(idx)
        elif self.flow or not self._has_room():
            self.flow.append(idx)
        else:
            self._route(idx, t)

    def _has_room(self) -> bool:
        """Whether flow control lets one more request reach the replicas (no limit: always)."""
        limit = self.settings.max_in_flight_per_replica
        return limit is None or self.in_flight < limit * len(self.serving)

    def _release(self, t: float) -> None:
        """Send the fair queue's next requests while there is room."""
        while self.flow and self._has_room():
            self._route(self.flow.popleft(), t)

    def _route(self, idx: int, t: float) -> None:
        self.in_flight += 1
        self.received.append(t)
        serving = self.serving
        replica = serving[0] if len(serving) == 1 else min(serving, key=_load)
        replica.waiting.append(idx)
        if len(replica.waiting) == 1:  # otherwise it is blocked behind earlier requests
            self._advance(replica, t)
            if self._admit(replica, t):
                self._plan_finish(replica, t)

    def _advance(self, replica: _Replica, t: float) -> None:
        if replica.running:
            steps = (t - replica.last_s) / self.cap.step_time(len(replica.running))
            replica.vclock += steps
            if not replica.is_draining:
                self.tokens_total += steps * len(replica.running)
        replica.last_s = t

    def _admit(self, replica: _Replica, t: float) -> bool:
        """Start queued requests that fit (FIFO); True if any did."""
        cap, admitted = self.cap, False
        step = cap.step_time(len(replica.running))
        while replica.waiting:
            idx = replica.waiting[0]
            need = min(self.prompt[idx] + self.output[idx], cap.kv_cache_tokens)
            if (
                len(replica.running) >= cap.max_num_seqs
                or replica.kv_used + need > cap.kv_cache_tokens
            ):
                break
            replica.waiting.popleft()
            prefill = self.prompt[idx] / cap.prefill_tokens_per_s
            self.ttft[idx] = t - self.arrival[idx] + prefill + step
            self.first_tokens.append((t + prefill + step, self.ttft[idx]))
            heapq.heappush(replica.running, (replica.vclock + self.output[idx], idx, need))
            replica.kv_used += need
            admitted = True
        return admitted

    def _plan_finish(self, replica: _Replica, t: float) -> None:
        replica.version += 1
        if replica.running:
            left = max(replica.running[0][0] - replica.vclock, 0.0)
            done = t + left * self.cap.step_time(len(replica.running))
            self._push(done, FINISH, replica, replica.version)

    def _on_finish(self, replica: _Replica, t: float) -> None:
        self._advance(replica, t)
        running = replica.running
        while running and running[0][0] <= replica.vclock + 1e-6:
            replica.kv_used -= heapq.heappop(running)[2]
            self.in_flight -= 1
            if not replica.is_draining:
                self.completions.append(t)
        self._admit(replica, t)
        self._plan_finish(replica, t)
        if replica.is_draining and not _load(replica):
            replica.gone_s = t
        self._release(t)

    # ---- fleet ----------------------------------------------------------------------------

    def _create(self, t: float) -> _Replica:
        replica = _Replica(t)
        self.all.append(replica)
        return replica

    def _on_ready(self, replica: _Replica, t: float) -> None:
        replica.last_s = t
        self.serving.append(replica)
        while self.gateway:  # they passed the fair queue with no replica, as at the gateway
            self._route(self.gateway.popleft(), t)
        self._release(t)

    def _on_tick(self, t: float) -> None:
        view = self.view(t)
        wanted = self.policy.desired(view)
        wanted = max(self.settings.min_replicas, min(self.settings.max_replicas, wanted))
        if wanted != view.replicas:
            self.scale_events.append((t, view.replicas, wanted))
            self._scale(view.replicas, wanted, t)
        if t + self.policy.interval_s < self.trace.duration_s:
            self._push(t + self.policy.interval_s, TICK, None)

    def _scale(self, current: int, wanted: int, t: float) -> None:
        for _ in range(wanted - current):
            replica = self._create(t)
            self.starting.append(replica)
            self._push(t + self.cap.cold_start_s, READY, replica)
        for _ in range(current - wanted):
            if self.starting:
                self.starting.pop().gone_s = t  # the newest pod goes first
                continue
            victim = min(self.serving, key=_load)
            self.serving.remove(victim)
            victim.is_draining = True
            if not _load(victim):
                victim.gone_s = t

    def view(self, t: float) -> FleetView:
        serving = self.serving
        ready = len(serving)
        running = sum(len(r.running) for r in serving)
        kv = sum(r.kv_used for r in serving) / (self.cap.kv_cache_tokens * ready) if ready else 0.0
        util = sum(min(1.0, len(r.running) / self.slots) for r in serving) / ready if ready else 0.0
        while self.kv_samples and self.kv_samples[0][0] <= t - KV_AVERAGE_S:
            self.kv_samples.popleft()
        kv_1m = (sum(k for _, k, _ in self.kv_samples) + kv) / (len(self.kv_samples) + 1)
        running_1m = (sum(n for _, _, n in self.kv_samples) + running) / (len(self.kv_samples) + 1)
        return FleetView(
            now=t,
            replicas=ready + len(self.starting),
            ready=ready,
            waiting=sum(len(r.waiting) for r in serving) + len(self.gateway),
            held=len(self.gateway),
            queued=len(self.flow),
            running=running,
            kv_usage=kv,
            kv_usage_1m=kv_1m if ready else 0.0,
            utilisation=util,
            running_1m=running_1m if ready else 0.0,
            arrivals_short_per_s=self._arrivals(t, ARRIVALS_SHORT_S),
            arrivals_long_per_s=self._arrivals(t, ARRIVALS_LONG_S),
            received_short_per_s=_rate(self.received, t, ARRIVALS_SHORT_S),
            received_long_per_s=_rate(self.received, t, ARRIVALS_LONG_S),
            completions_per_s=self._completions(t),
            tokens_per_s=self._tokens_per_s(t),
            ttft_p95_s=self._ttft_p95(t),
            cold_start_s=statistics.median(self.cold_starts) if self.cold_starts else None,
        )

    def _arrivals(self, t: float, window_s: float) -> float:
        """Arrivals per second over the window ending at t (`_rate`)."""
        return _rate(self.arrival, t, window_s)

    def _tokens_per_s(self, t: float) -> float:
        """The token counter's rate over RATE_WINDOW_S, from the samples (as rate() would)."""
        while len(self.token_samples) > 1 and self.token_samples[1][0] <= t - RATE_WINDOW_S:
            self.token_samples.popleft()
        since, counted = self.token_samples[0]
        return (self._tokens_until(t) - counted) / (t - since) if t > since else 0.0

    def _tokens_until(self, t: float) -> float:
        """The token counter at t: what was counted plus each batch's steps since its last event
        (read without advancing the replicas, so sampling never perturbs the run)."""
        pending = sum(
            (t - r.last_s) / self.cap.step_time(len(r.running)) * len(r.running)
            for r in self.serving
            if r.running
        )
        return self.tokens_total + pending

    def _completions(self, t: float) -> float:
        while self.completions and self.completions[0] <= t - RATE_WINDOW_S:
            self.completions.popleft()
        return len(self.completions) / RATE_WINDOW_S

    def _ttft_p95(self, t: float) -> float | None:
        # first tokens are planned when a request is admitted, so some lie just after t
        while self.first_tokens and self.first_tokens[0][0] <= t - RATE_WINDOW_S:
            self.first_tokens.popleft()
        seen = [ttft for sent, ttft in self.first_tokens if sent <= t]
        return float(np.percentile(seen, 95)) if seen else None

    def _on_sample(self, t: float) -> None:
        queued = sum(len(r.waiting) for r in self.all if r.gone_s is None) + len(self.gateway)
        queued += len(self.flow)
        if self.serving:
            view = self.view(t)
            self.kv_samples.append((t, view.kv_usage, view.running))
        self.token_samples.append((t, self._tokens_until(t)))
        for key, value in (
            ("t", t),
            ("replicas", len(self.serving) + len(self.starting)),
            ("ready", len(self.serving)),
            ("waiting", queued),
        ):
            self.timeline[key].append(float(value))
        if t + self.settings.sample_s < self.trace.duration_s:
            self._push(t + self.settings.sample_s, SAMPLE, None)

    def _result(self) -> RunResult:
        end = self.trace.duration_s
        ttft = np.array(self.ttft, dtype=np.float64)
        # requests never served (e.g. stuck at the gateway with no replica) missed their SLO
        last = max(end, float(np.nanmax(ttft)) if np.isfinite(ttft).any() else end)
        unserved = np.isnan(ttft)
        ttft[unserved] = last + 1.0 - np.asarray(self.arrival)[unserved]
        seconds = sum(
            min(r.gone_s if r.gone_s is not None else end, end) - min(r.created_s, end)
            for r in self.all
        )
        return RunResult(
            policy=self.policy.name,
            trace=self.trace.name,
            duration_s=end,
            ttft_s=ttft,
            gpu_hours=seconds * self.cap.gpus_per_replica / 3600.0,
            scale_events=self.scale_events,
            timeline=self.timeline,
        )


def _rate(times: list[float], t: float, window_s: float) -> float:
    """Events per second over the window ending at t, from their sorted times. A window reaching
    back before t = 0 counts only the time the trace covers: the fleet is taken to have run
    before the trace at its first load, as `first_decision_s` assumes (a rate over empty history
    before t = 0 would read the first minute as a rise)."""
    count = bisect.bisect_right(times, t) - bisect.bisect_right(times, t - window_s)
    covered = min(window_s, t)
    return count / covered if covered > 0 else 0.0


def _load(replica: _Replica) -> int:
    return len(replica.waiting) + len(replica.running)


def simulate(
    trace: Trace, policy: Policy, capacity: CapacityModel, settings: Settings
) -> RunResult:
    return Simulation(trace, policy, capacity, settings).run()
