"""Cold starts measured on the ModelDeployment's own pods (issue 33 item 4). Pure.

A replica asked for now serves only once its pod is Ready, so the lead time a TTFT SLO's forecast
looks ahead (`policy.decide`, `Observations.cold_start_s`) is the time from a pod's creation to
its Ready condition: scheduling, image pull, model download or cache mount, process start, weight
load, warm-up and the readiness probe's period, all of it. Each Ready pod gives one sample; the
newest `KEEP` are kept in `status.autoscaling.coldStart`, so samples outlive their pods and an
operator restart, and the median (the forecast's lead) and p95 are read from them.

A pod that went unready and Ready again reports its last transition, which would overstate its
start: only pods whose containers never restarted and that are Ready now are sampled, and a pod
already sampled keeps its first sample.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.contract import timestamps

KEEP = 20  # samples kept: recent enough to follow a new image or node type, enough for a p95


@dataclass(frozen=True)
class Sample:
    pod: str
    ready_at: float  # unix seconds the pod became Ready
    seconds: float  # created -> Ready


@dataclass(frozen=True)
class Summary:
    median_s: float
    p95_s: float
    samples: tuple[Sample, ...]

    def to_dict(self) -> dict[str, Any]:
        """`status.autoscaling.coldStart` (api.ColdStartStatus)."""
        return {
            "medianSeconds": round(self.median_s, 3),
            "p95Seconds": round(self.p95_s, 3),
            "samples": len(self.samples),
            "recent": [
                {"pod": s.pod, "readyAt": s.ready_at, "seconds": round(s.seconds, 3)}
                for s in self.samples
            ],
        }


def sample_of(pod: Mapping[str, Any]) -> Sample | None:
    """The cold start of a pod that is Ready now and never restarted a container; None for any
    other (still starting, going away, or whose Ready time is not its first)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    created = meta.get("creationTimestamp")
    if not created or meta.get("deletionTimestamp"):
        return None
    if any((c.get("restartCount") or 0) > 0 for c in status.get("containerStatuses") or []):
        return None
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True" or not ready.get("lastTransitionTime"):
        return None
    ready_at = timestamps.unix(ready["lastTransitionTime"])
    seconds = ready_at - timestamps.unix(created)
    return Sample(meta.get("name", ""), ready_at, seconds) if seconds >= 0 else None


def merge(
    kept: Iterable[Sample], pods: Iterable[Mapping[str, Any]], keep: int = KEEP
) -> tuple[Sample, ...]:
    """The kept samples and those of pods not sampled yet, the newest `keep` by Ready time."""
    by_pod = {s.pod: s for s in kept}
    for pod in pods:
        found = sample_of(pod)
        if found is not None and found.pod not in by_pod:
            by_pod[found.pod] = found
    newest = sorted(by_pod.values(), key=lambda s: s.ready_at)[-keep:]
    return tuple(newest)


def summarize(samples: Sequence[Sample]) -> Summary | None:
    """Median and p95 (nearest rank) of the samples; None without any."""
    if not samples:
        return None
    ordered = sorted(s.seconds for s in samples)
    p95 = ordered[math.ceil(0.95 * len(ordered)) - 1]
    return Summary(statistics.median(ordered), p95, tuple(samples))


def samples_from_status(cold_start: Mapping[str, Any] | None) -> tuple[Sample, ...]:
    """The samples `Summary.to_dict` wrote; none when there are none or they do not parse (they
    are measured again from the pods that still exist)."""
    try:
        return tuple(
            Sample(str(s["pod"]), float(s["readyAt"]), float(s["seconds"]))
            for s in (cold_start or {}).get("recent") or []
        )
    except (KeyError, TypeError, ValueError):
        return ()


def measure(stored: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]]) -> Summary | None:
    """The cold-start summary after looking at the pods, from what status holds."""
    return summarize(merge(samples_from_status(stored), pods))
