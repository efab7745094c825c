"""bench.slo_step's pure parts: the step's arrivals, its windows, attainment per window from the
runtime's TTFT histogram and from the client's own TTFTs, cold starts, and the verdict.

A request counts in the window in which its first token came, on both sides: that is when the
runtime observes its TTFT into `vllm:time_to_first_token_seconds`, so a window's rate of that
histogram in Prometheus and the client's requests in the same window are the same requests.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.contract import timestamps
from kvpilot.operator.autoscaling import attainment


@dataclass(frozen=True)
class Window:
    """A span of wall-clock time, unix seconds, start included and end excluded."""

    start: float
    end: float

    def overlaps(self, other: Window) -> bool:
        return self.start < other.end and other.start < self.end

    def holds(self, moment: float) -> bool:
        return self.start <= moment < self.end


def split(span: Window, width_s: float) -> list[Window]:
    """`span` cut into consecutive windows of `width_s`; a last piece shorter than that is left
    out (a histogram's rate over a shorter range would not be comparable)."""
    if not width_s > 0:
        raise ValueError(f"window width must be > 0 s, got {width_s}")
    count = math.floor((span.end - span.start) / width_s + 1e-9)
    return [Window(span.start + i * width_s, span.start + (i + 1) * width_s) for i in range(count)]


def step_arrivals(
    rate: float, base_s: float, factor: float, step_s: float, seed: int
) -> list[float]:
    """Send times (seconds from the start) of a Poisson process at `rate` per second for
    `base_s`, then at `factor` x `rate` for `step_s`. Exponential gaps are memoryless, so
    drawing afresh from the step on is still one Poisson process with a step in its rate."""
    if not rate > 0 or not factor > 0:
        raise ValueError(f"rate and factor must be > 0, got {rate} and {factor}")
    rng = random.Random(seed)
    times: list[float] = []
    for begin, end, per_s in ((0.0, base_s, rate), (base_s, base_s + step_s, rate * factor)):
        now = begin + rng.expovariate(per_s)
        while now < end:
            times.append(now)
            now += rng.expovariate(per_s)
    return times


def ttft_target(measured_s: float, headroom: float, bounds: Sequence[float]) -> float:
    """The smallest histogram bucket bound at or above `headroom` x `measured_s`: a target on a
    bound is counted exactly by the histogram, not interpolated inside a bucket."""
    wanted = headroom * measured_s
    above = [b for b in sorted(bounds) if b >= wanted and math.isfinite(b)]
    if not above:
        raise ValueError(f"no TTFT bucket bound at or above {wanted:.3f} s")
    return above[0]


@dataclass(frozen=True)
class Share:
    """Attainment in one window: the share (0-1) inside the target, of how many requests; share
    None when the window has none."""

    share: float | None
    requests: float

    def misses(self, percentile: float) -> bool:
        return self.share is not None and self.share < percentile / 100


def histogram_share(vector: list[dict[str, Any]], target_s: float, width_s: float) -> Share:
    """Attainment from a Prometheus instant vector of per-bucket rates over a window of
    `width_s` (the operator's `ttft_buckets_query`), read as the operator reads it."""
    found = attainment.from_buckets(attainment.buckets_from_vector(vector), target_s)
    return Share(None, 0.0) if found is None else Share(found.share, found.requests_per_s * width_s)


@dataclass(frozen=True)
class ClientRequest:
    """One request as the client saw it: when it was sent (unix seconds) and its TTFT (None:
    it failed, which counts as a miss at the time it was sent)."""

    sent_at: float
    ttft_s: float | None

    def counted_at(self) -> float:
        return self.sent_at if self.ttft_s is None else self.sent_at + self.ttft_s


def client_share(requests: Iterable[ClientRequest], window: Window, target_s: float) -> Share:
    """Attainment of the requests whose first token (or failure) came inside `window`."""
    inside = [r for r in requests if window.holds(r.counted_at())]
    if not inside:
        return Share(None, 0.0)
    met = sum(1 for r in inside if r.ttft_s is not None and r.ttft_s <= target_s)
    return Share(met / len(inside), float(len(inside)))


def cold_starts(pods: Iterable[Mapping[str, Any]], since: float) -> list[Window]:
    """Each runtime pod created at or after `since` that became Ready: creation to its Ready
    condition's lastTransitionTime, oldest first. A pod never Ready (unschedulable: the pool is
    full) is no cold start that ends: `never_ready` counts those."""
    found = []
    for pod in pods:
        created = timestamps.unix(pod["metadata"]["creationTimestamp"])
        ready = _ready_since(pod)
        if created >= since and ready is not None:
            found.append(Window(created, max(created, ready)))
    return sorted(found, key=lambda w: w.start)


def never_ready(pods: Iterable[Mapping[str, Any]], since: float) -> int:
    """Pods created at or after `since` that are not Ready."""
    return sum(
        1
        for pod in pods
        if timestamps.unix(pod["metadata"]["creationTimestamp"]) >= since
        and _ready_since(pod) is None
    )


def _ready_since(pod: Mapping[str, Any]) -> float | None:
    for condition in pod.get("status", {}).get("conditions", []):
        if condition["type"] == "Ready" and condition["status"] == "True":
            return timestamps.unix(condition["lastTransitionTime"])
    return None


@dataclass(frozen=True)
class Verdict:
    """Whether the SLO held except during at most one cold start: the windows that missed it,
    those a cold start overlaps (excused, from at most one cold start), and the rest."""

    missed: list[Window]
    unexcused: list[Window]
    cold_starts_used: int

    @property
    def held(self) -> bool:
        return not self.unexcused and self.cold_starts_used <= 1


def merged(windows: Sequence[Window]) -> list[Window]:
    """Overlapping windows joined: pods of one scale-up starting side by side are one cold start."""
    joined: list[Window] = []
    for window in sorted(windows, key=lambda w: w.start):
        if joined and window.start <= joined[-1].end:
            joined[-1] = Window(joined[-1].start, max(joined[-1].end, window.end))
        else:
            joined.append(window)
    return joined


def verdict(
    shares: Sequence[tuple[Window, Share]], cold: Sequence[Window], percentile: float
) -> Verdict:
    """A window misses when its share is under `percentile`; a missed window is excused when it
    overlaps a cold start (overlapping pod starts `merged` into one). Held: every miss excused,
    all by the same one cold start."""
    cold = merged(cold)
    missed = [window for window, share in shares if share.misses(percentile)]
    used: set[int] = set()
    unexcused = []
    for window in missed:
        overlapping = {i for i, start in enumerate(cold) if window.overlaps(start)}
        if not overlapping:
            unexcused.append(window)
        used |= overlapping
    return Verdict(missed, unexcused, len(used))


def reason_kind(reason: str) -> str:
    """A decision's reason without its figures or a queue that comes and goes: two ticks of the
    same kind of decision read the same, so a report lists only where the kind changed."""
    return re.sub(r"\d+(\.\d+)?", "#", re.sub(r", \d+ waiting", "", reason))
