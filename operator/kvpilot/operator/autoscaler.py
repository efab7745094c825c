"""Pure helpers for the autoscaler loop: what to write where after `policy.decide`.

The loop (actuator.py) gathers observations (metrics.py), reads the policy state back from
`status.autoscaling` (`state_from_status`), calls `policy.decide`, spreads the replica count over
the plan's node types (`Placement` + `spread_replicas`, which also spills replicas stuck
Unschedulable to the next node type), writes the status patch (`status_patch`) that reconcile
applies, and emits an Event when the count changed (`event_message`). Everything here is pure so
it can be tested with tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpilot.operator import timestamps
from kvpilot.operator.manifests import LABEL_NODE_TYPE
from kvpilot.operator.policy import Bounds, Decision, Observations, PolicyState

# spec.autoscaling field -> Bounds field (the CRD's camelCase names)
SPEC_FIELDS = {
    "minReplicas": "min_replicas",
    "maxReplicas": "max_replicas",
    "targetQueueLength": "target_queue_length",
    "targetKVCacheUtilization": "target_kv_cache_utilization",
    "scaleUpStabilizationSeconds": "scale_up_stabilization_s",
    "scaleDownStabilizationSeconds": "scale_down_stabilization_s",
    "scaleToZeroIdleSeconds": "scale_to_zero_idle_s",
}


def bounds_from_spec(autoscaling: Mapping[str, Any]) -> Bounds:
    """Bounds from a ModelDeployment's spec.autoscaling; absent (None) fields keep defaults."""
    given = {
        SPEC_FIELDS[k]: v for k, v in autoscaling.items() if k in SPEC_FIELDS and v is not None
    }
    return Bounds(**given)


def state_from_status(status: Mapping[str, Any] | None) -> PolicyState:
    autoscaling = (status or {}).get("autoscaling") or {}
    return PolicyState.from_dict(autoscaling.get("state"))


def spread_replicas(
    total: int,
    node_types_in_plan_order: Sequence[str],
    free_gpus_per_type: Mapping[str, int],
    gpus_per_replica: Mapping[str, int] | int,
    current_per_type: Mapping[str, int],
    unschedulable_since: Mapping[str, float | None],
    now: float,
    spill_after_s: float,
    *,
    pending_per_type: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Replicas per node type for `total` replicas.

    Replicas that run stay where they are (moving them would restart them); a smaller total
    removes pending replicas first, then replicas of the least preferred types; a larger one
    goes to the first types in plan order whose free GPUs hold it. What fits nowhere waits on
    the first type not given up on. A type whose pods have been Unschedulable for at least
    `spill_after_s` is given up on: its pending replicas (`pending_per_type`) move on to the
    next types that fit, and it gets no new ones (taints, CPU or memory can leave a node with
    free GPUs and no room).
    """
    order = list(node_types_in_plan_order)
    _check_spread_input(total, order, gpus_per_replica)
    per_replica = _per_type(gpus_per_replica, order)
    spilled = {t for t in order if is_given_up(unschedulable_since.get(t), now, spill_after_s)}
    pending = {t: max(0, (pending_per_type or {}).get(t, 0)) for t in order}
    placed = {t: max(0, current_per_type.get(t, 0)) for t in order}
    for t in spilled:  # give up on the pods that never got GPUs there
        placed[t] -= min(placed[t], pending[t])
        pending[t] = 0
    _shrink(placed, pending, sum(placed.values()) - total, order)
    missing = total - sum(placed.values())
    for t in order:
        if t in spilled:  # the scheduler found no room there, whatever the free GPUs say
            continue
        room = max(0, free_gpus_per_type.get(t, 0) // per_replica[t] - pending[t])
        add = min(missing, room)
        placed[t] += add
        missing -= add
    if missing > 0:
        waiting_on = next((t for t in order if t not in spilled), order[0])
        placed[waiting_on] += missing
    return placed


@dataclass(frozen=True)
class Placement:
    """Where a ModelDeployment's replicas are asked for and stuck, per fitting node type."""

    order: tuple[str, ...]  # fitting node types in plan order
    gpus_per_replica: Mapping[str, int]  # the plan's tensor-parallel degree per type
    current: Mapping[str, int]  # replicas asked for per type
    pending: Mapping[str, int]  # of those, pods the scheduler found no room for
    unschedulable_since: Mapping[str, float]  # earliest such verdict per type (unix seconds)

    def spilling(self, now: float, spill_after_s: float) -> list[str]:
        """Node types whose pods have waited Unschedulable for `spill_after_s` or more."""
        return [
            t
            for t in self.order
            if self.pending.get(t)
            and is_given_up(self.unschedulable_since.get(t), now, spill_after_s)
        ]

    def spread(
        self, total: int, free_gpus: Mapping[str, int], now: float, spill_after_s: float
    ) -> dict[str, int]:
        return spread_replicas(
            total,
            self.order,
            free_gpus,
            self.gpus_per_replica,
            self.current,
            {t: self.unschedulable_since.get(t) for t in self.order},
            now,
            spill_after_s,
            pending_per_type=self.pending,
        )


def placement(status: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]) -> Placement:
    """The Placement of a ModelDeployment from its status and its pods (pure).

    The replicas asked for per type are the autoscaler's last spread, else reconcile's plan.
    """
    status = status or {}
    fitting = [e for e in status.get("plan") or [] if e.get("fits")]
    order = tuple(str(e["nodeType"]) for e in fitting)
    asked = (status.get("autoscaling") or {}).get("replicasPerNodeType") or {
        e["nodeType"]: e.get("replicas", 0) for e in fitting
    }
    pending: dict[str, int] = {}
    since: dict[str, float] = {}
    for pod in pods:
        node_type = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_NODE_TYPE, "")
        stuck_at = unschedulable_since(pod)
        if node_type in order and stuck_at is not None:
            pending[node_type] = pending.get(node_type, 0) + 1
            since[node_type] = min(since.get(node_type, stuck_at), stuck_at)
    return Placement(
        order=order,
        gpus_per_replica={
            str(e["nodeType"]): max(1, int(e.get("tensorParallel") or 1)) for e in fitting
        },
        current={t: int(asked.get(t) or 0) for t in order},
        pending=pending,
        unschedulable_since=since,
    )


def unschedulable_since(pod: Mapping[str, Any]) -> float | None:
    """When the scheduler last said it has no room for this pod; None if it is not stuck."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or (pod.get("spec") or {}).get("nodeName"):
        return None
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            stamp = condition.get("lastTransitionTime")
            return from_rfc3339(stamp) if stamp else None
    return None


def from_rfc3339(rfc3339_time: str) -> float:
    return datetime.fromisoformat(rfc3339_time.replace("Z", "+00:00")).timestamp()


def spill_message(old: Mapping[str, int], new: Mapping[str, int], stuck: Sequence[str]) -> str:
    """The Event text when replicas leave node types where they could not be scheduled."""
    moved = ", ".join(f"{t} {old.get(t, 0)}->{n}" for t, n in new.items() if old.get(t, 0) != n)
    return f"Pods Unschedulable on {', '.join(stuck)} past the spill-over threshold: {moved}"


def is_given_up(unschedulable_since: float | None, now: float, spill_after_s: float) -> bool:
    """A node type's pods have waited Unschedulable long enough to move elsewhere."""
    return unschedulable_since is not None and now - unschedulable_since >= spill_after_s


def _shrink(placed: dict[str, int], pending: dict[str, int], excess: int, order: list[str]) -> None:
    """Remove `excess` replicas in place: pending ones first, then the least preferred types."""
    for pool in (pending, placed):
        for t in reversed(order):
            take = min(max(excess, 0), pool[t], placed[t])
            placed[t] -= take
            pending[t] -= min(take, pending[t])
            excess -= take


def _check_spread_input(
    total: int, order: list[str], gpus_per_replica: Mapping[str, int] | int
) -> None:
    if total < 0:
        raise ValueError(f"total replicas must be >= 0, got {total}")
    if not order:
        raise ValueError("no node type in the plan fits this model; nothing to spread over")
    if len(set(order)) != len(order):
        raise ValueError(f"node types repeat in the plan order: {order}")
    values = [gpus_per_replica] if isinstance(gpus_per_replica, int) else gpus_per_replica.values()
    if any(v < 1 for v in values):
        raise ValueError(f"gpus per replica must be >= 1, got {gpus_per_replica}")


def _per_type(gpus_per_replica: Mapping[str, int] | int, order: list[str]) -> dict[str, int]:
    if isinstance(gpus_per_replica, int):
        return dict.fromkeys(order, gpus_per_replica)
    missing = [t for t in order if t not in gpus_per_replica]
    if missing:
        raise ValueError(f"gpus per replica unknown for node types {missing}")
    return {t: gpus_per_replica[t] for t in order}


def rfc3339(unix_s: float | None) -> str | None:
    if unix_s is None:
        return None
    return timestamps.rfc3339_from_unix(unix_s)


def status_patch(decision: Decision, observations: Observations, now: float) -> dict[str, Any]:
    """The `status.autoscaling` object: what was decided, on what, and the policy state to
    read back on the next run (also after an operator restart)."""
    metrics = observations.to_dict()
    metrics["sampledAt"] = rfc3339(observations.sampled_at)
    return {
        "desiredReplicas": decision.replicas,
        "lastDecision": decision.reason,
        "lastDecisionTime": rfc3339(now),
        "lastScaleTime": rfc3339(decision.state.last_scale_time),
        "metricsAvailable": decision.metrics_available,
        "metrics": metrics,
        "state": decision.state.to_dict(),
    }


def per_type_patch(old: Mapping[str, Any], new: Mapping[str, int]) -> dict[str, int | None]:
    """`replicasPerNodeType` as a merge patch: node types no longer in the spread are removed."""
    return {**dict.fromkeys((t for t in old if t not in new), None), **new}


def metrics_condition(decision: Decision) -> dict[str, str]:
    """The MetricsAvailable condition's status, reason and message for this decision."""
    if decision.metrics_available:
        return {
            "type": "MetricsAvailable",
            "status": "True",
            "reason": "MetricsRead",
            "message": "queue and KV-cache metrics are fresh",
        }
    return {
        "type": "MetricsAvailable",
        "status": "False",
        "reason": "MetricsMissing",
        "message": decision.reason,
    }


def event_message(current: int, decision: Decision) -> str | None:
    """The Event text for a scale, or None when the count did not change."""
    if decision.replicas == current:
        return None
    return f"Scaled from {current} to {decision.replicas} replicas: {decision.reason}"
