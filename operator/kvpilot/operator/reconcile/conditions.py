"""Status conditions of a ModelDeployment (Planned, Progressing, Ready, Degraded). Pure.

Each pass computes every condition afresh from what it saw; `merge` keeps `lastTransitionTime` of a
condition whose status did not change, so the timestamps say when something really changed and a
re-written status with equal content is a no-op for watchers that compare.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.api import CacheStatus, Condition

PLANNED, PROGRESSING, READY, DEGRADED = "Planned", "Progressing", "Ready", "Degraded"


@dataclass(frozen=True)
class Rollout:
    """What the Deployments report, summed over node types."""

    replicas: int = 0  # desired, from the Deployments' spec
    ready: int = 0
    updated: int = 0
    is_settled: bool = True  # every Deployment observed its latest generation and rolled out


def summarize(deployments: Iterable[Mapping[str, Any]]) -> Rollout:
    replicas = ready = updated = 0
    settled = True
    for deployment in deployments:
        spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
        want = int(spec.get("replicas", 1))
        generation = (deployment.get("metadata") or {}).get("generation", 0)
        replicas += want
        ready += int(status.get("readyReplicas", 0))
        updated += int(status.get("updatedReplicas", 0))
        settled = settled and status.get("observedGeneration", 0) >= generation
        settled = settled and int(status.get("updatedReplicas", 0)) >= want
        settled = settled and int(status.get("replicas", 0)) == want
    return Rollout(replicas=replicas, ready=ready, updated=updated, is_settled=settled)


# Container states that will not fix themselves: the pod's own words say what to change.
STUCK_REASONS = (
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
)


def pod_problem(pod: Mapping[str, Any]) -> str | None:
    """`container: reason: last line of its message` of a pod stuck on one container (the model
    fetch's one-line error reaches here through FallbackToLogsOnError); None when none is."""
    status = pod.get("status") or {}
    containers = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for container in containers:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") not in STUCK_REASONS:
            continue
        terminated = (container.get("lastState") or {}).get("terminated") or {}
        message = terminated.get("message") or waiting.get("message") or ""
        last_line = (message.strip().splitlines() or [""])[-1]
        if not last_line and terminated:
            last_line = f"exit code {terminated.get('exitCode')}"
        return f"{container.get('name')}: {waiting['reason']}: {last_line}".rstrip(": ")
    return None


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int) -> Condition:
    return Condition.model_validate(
        {
            "type": kind,
            "status": "True" if ok else "False",
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
        }
    )


def compute(
    plan_error: str | None,
    plan_summary: str,
    rollout: Rollout,
    num_unplaceable: int,
    generation: int,
    pod_problems: Sequence[str] = (),
    cache: CacheStatus | None = None,
) -> list[Condition]:
    """The four conditions, from the plan's outcome, the Deployments' progress, the pods
    stuck on a container (`pod_problem`) and the model cache's fill."""
    if plan_error is not None:
        return [
            _condition(PLANNED, False, "PlanFailed", plan_error, generation),
            _condition(PROGRESSING, False, "PlanFailed", "nothing to roll out", generation),
            _condition(READY, False, "PlanFailed", plan_error, generation),
            _condition(DEGRADED, True, "PlanFailed", plan_error, generation),
        ]
    ready_text = f"{rollout.ready}/{rollout.replicas} replicas ready"
    is_ready = rollout.replicas > 0 and rollout.ready >= rollout.replicas
    if cache is not None and cache.phase != "Cached":
        ready_reason = "CacheFailed" if cache.phase == "Failed" else "FillingCache"
        ready_text = f"model cache {cache.claim_name}: {cache.phase}"
        if cache.message:
            ready_text = f"{ready_text}: {cache.message}"
    elif rollout.replicas == 0:
        ready_reason = "ScaledToZero"
    else:
        ready_reason = "ReplicasReady" if is_ready else "ReplicasNotReady"
    if cache is not None and cache.phase == "Failed":
        degraded = (True, "CacheFailed", ready_text)
    elif pod_problems:
        ready_text = f"{ready_text}; {pod_problems[0]}"
        degraded = (True, "PodsFailing", "; ".join(sorted(set(pod_problems))[:3]))
    elif num_unplaceable:
        degraded = (True, "InsufficientGPUs", f"{num_unplaceable} replicas wait for free GPUs")
    else:
        degraded = (False, "AsExpected", ready_text)
    progressing = (
        not rollout.is_settled,
        "RollingOut" if not rollout.is_settled else "RolloutComplete",
        f"{rollout.updated}/{rollout.replicas} replicas updated",
    )
    if cache is not None and cache.phase in ("Pending", "Downloading"):
        progressing = (True, "FillingCache", ready_text)
    return [
        _condition(PLANNED, True, "Planned", plan_summary, generation),
        _condition(PROGRESSING, *progressing, generation),
        _condition(READY, is_ready, ready_reason, ready_text, generation),
        _condition(DEGRADED, *degraded, generation),
    ]


def merge(old: Sequence[Condition], new: Sequence[Condition], now: str) -> list[Condition]:
    """New conditions, keeping the old transition time where the status did not change.

    Conditions of other types (the autoscaler's MetricsAvailable) are carried over untouched.
    """
    previous = {c.type: c for c in old}
    merged = []
    for condition in new:
        before = previous.get(condition.type)
        unchanged = before is not None and before.status == condition.status
        when = before.last_transition_time if unchanged and before else now
        merged.append(condition.model_copy(update={"last_transition_time": when}))
    seen = {c.type for c in new}
    merged += [c for c in old if c.type not in seen]
    return merged


def find(conditions: Sequence[Condition], kind: str) -> Condition | None:
    return next((c for c in conditions if c.type == kind), None)
