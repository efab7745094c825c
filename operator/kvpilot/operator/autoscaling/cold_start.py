"""Cold starts measured on the ModelDeployment's own pods (issue 33 item 4). Pure.

A replica asked for now serves only once its pod is Ready, so the lead time a TTFT SLO's forecast
looks ahead (`policy.decide`, `Observations.cold_start_s`) is the time from a pod's creation to
its Ready condition: scheduling, image pull, model download or cache mount, process start, weight
load, warm-up and the readiness probe's period, all of it. Each Ready pod gives one sample; the
newest `KEEP` are kept in `status.autoscaling.coldStart`, so samples outlive their pods and an
operator restart, and the median and p95 are read from them, for the fleet and per node type
(the pod's node type label): the forecast's lead is the median of the node type new replicas go
to, once it has samples.

A pod that went unready and Ready again reports its last transition, which would overstate its
start: only pods whose containers never restarted and that are Ready now are sampled, and a pod
already sampled keeps its first sample.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpilot.contract import timestamps
from kvpilot.contract.resource import LABEL_NODE_TYPE

KEEP = 20  # samples kept: recent enough to follow a new image or node type, enough for a p95


@dataclass(frozen=True)
class Sample:
    pod: str
    ready_at: float  # unix seconds the pod became Ready
    seconds: float  # created -> Ready
    node_type: str = ""  # the pod's node type label; "" for a pod without one


@dataclass(frozen=True)
class Spread:
    """Median and p95 (nearest rank) of some samples' seconds."""

    median_s: float
    p95_s: float
    count: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Spread:
        ordered = sorted(seconds)
        p95 = ordered[math.ceil(0.95 * len(ordered)) - 1]
        return cls(statistics.median(ordered), p95, len(ordered))

    def to_dict(self) -> dict[str, Any]:
        return {
            "medianSeconds": round(self.median_s, 3),
            "p95Seconds": round(self.p95_s, 3),
            "samples": self.count,
        }


@dataclass(frozen=True)
class Summary:
    median_s: float
    p95_s: float
    samples: tuple[Sample, ...]
    # Per node type: a GPU type's image pull, model load and warm-up differ from another's
    by_node_type: Mapping[str, Spread] = field(default_factory=dict)

    def lead_s(self, node_type: str | None) -> float:
        """How far ahead to look for a replica asked for on `node_type`: its own median once it
        has samples, the fleet's until then."""
        own = self.by_node_type.get(node_type or "")
        return self.median_s if own is None else own.median_s

    def to_dict(self) -> dict[str, Any]:
        """`status.autoscaling.coldStart` (api.ColdStartStatus)."""
        return {
            **Spread(self.median_s, self.p95_s, len(self.samples)).to_dict(),
            "byNodeType": {name: spread.to_dict() for name, spread in self.by_node_type.items()},
            "recent": [_sample_dict(s) for s in self.samples],
        }


def _sample_dict(sample: Sample) -> dict[str, Any]:
    written = {"pod": sample.pod, "readyAt": sample.ready_at, "seconds": round(sample.seconds, 3)}
    return {**written, "nodeType": sample.node_type} if sample.node_type else written


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
    node_type = str((meta.get("labels") or {}).get(LABEL_NODE_TYPE, ""))
    return Sample(meta.get("name", ""), ready_at, seconds, node_type) if seconds >= 0 else None


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
    fleet = Spread.of([s.seconds for s in samples])
    types = sorted({s.node_type for s in samples if s.node_type})
    by_type = {t: Spread.of([s.seconds for s in samples if s.node_type == t]) for t in types}
    return Summary(fleet.median_s, fleet.p95_s, tuple(samples), by_type)


def samples_from_status(cold_start: Mapping[str, Any] | None) -> tuple[Sample, ...]:
    """The samples `Summary.to_dict` wrote; none when there are none or they do not parse (they
    are measured again from the pods that still exist)."""
    try:
        return tuple(
            Sample(
                str(s["pod"]),
                float(s["readyAt"]),
                float(s["seconds"]),
                str(s.get("nodeType") or ""),
            )
            for s in (cold_start or {}).get("recent") or []
        )
    except (KeyError, TypeError, ValueError):
        return ()


def measure(stored: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]]) -> Summary | None:
    """The cold-start summary after looking at the pods, from what status holds."""
    return summarize(merge(samples_from_status(stored), pods))
