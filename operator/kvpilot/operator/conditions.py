"""Status conditions of a ModelDeployment (Planned, Progressing, Ready, Degraded). Pure.

Each pass computes every condition afresh from what it saw; `merge` keeps `lastTransitionTime` of a
condition whose status did not change, so the timestamps say when something really changed and a
re-written status with equal content is a no-op for watchers that compare.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.api import Condition

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
) -> list[Condition]:
    """The four conditions, from the plan's outcome and the Deployments' progress."""
    if plan_error is not None:
        return [
            _condition(PLANNED, False, "PlanFailed", plan_error, generation),
            _condition(PROGRESSING, False, "PlanFailed", "nothing to roll out", generation),
            _condition(READY, False, "PlanFailed", plan_error, generation),
            _condition(DEGRADED, True, "PlanFailed", plan_error, generation),
        ]
    ready_text = f"{rollout.ready}/{rollout.replicas} replicas ready"
    is_ready = rollout.replicas > 0 and rollout.ready >= rollout.replicas
    if rollout.replicas == 0:
        ready_reason = "ScaledToZero"
    else:
        ready_reason = "ReplicasReady" if is_ready else "ReplicasNotReady"
    if num_unplaceable:
        degraded = (True, "InsufficientGPUs", f"{num_unplaceable} replicas wait for free GPUs")
    else:
        degraded = (False, "AsExpected", ready_text)
    return [
        _condition(PLANNED, True, "Planned", plan_summary, generation),
        _condition(
            PROGRESSING,
            not rollout.is_settled,
            "RollingOut" if not rollout.is_settled else "RolloutComplete",
            f"{rollout.updated}/{rollout.replicas} replicas updated",
            generation,
        ),
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
