"""Pure helpers for the autoscaler loop: what to write where after `policy.decide`.

The loop (autoscaling/loop.py) gathers observations (autoscaling/metrics_reader.py), reads the
policy state back from `status.autoscaling` (`state_from_status`), calls `policy.decide`, spreads
the replica count over the plan's node types (`Placement` + `spread_replicas`, which also spills
replicas stuck Unschedulable to the next node type), writes the status patch (`status_patch`) that
reconcile applies, and emits an Event when the count changed (`event_message`). Everything here
is pure so it can be tested with tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvpilot.contract import resource, timestamps
from kvpilot.contract.resource import LABEL_NODE_TYPE
from kvpilot.operator import api
from kvpilot.operator.autoscaling import attainment, replica_capacity
from kvpilot.operator.autoscaling.policy import Bounds, Decision, Observations, PolicyState
from kvpilot.operator.autoscaling.replica_capacity import ReplicaCapacity
from kvpilot.operator.autoscaling.spread import is_given_up, spread_replicas
from kvpilot.operator.reconcile import manifests


def bounds_from_spec(autoscaling: api.Autoscaling) -> Bounds:
    """The policy's numbers from a ModelDeployment's parsed spec.autoscaling: every Bounds field
    the spec has, by the same name (tolerance is the policy's own), and the SLO's."""
    given = type(autoscaling).model_fields.keys() & {f.name for f in fields(Bounds)}
    numbers = {name: getattr(autoscaling, name) for name in given}
    slo = autoscaling.slo
    if slo is not None:
        numbers.update(
            ttft_slo_s=slo.ttft_seconds, slo_percentile=slo.percentile, tpot_slo_s=slo.tpot_seconds
        )
    return Bounds(**numbers)


def first_fitting_node_type(plan: Sequence[api.PlanEntry]) -> str | None:
    """Where new replicas go first (the spread fills the plan's fitting types in order)."""
    return next((entry.node_type for entry in plan if entry.fits), None)


def planner_prior(serving: api.Serving, plan: Sequence[api.PlanEntry]) -> ReplicaCapacity | None:
    """What one replica holds before any traffic (`replica_capacity.seed`), from the plan's first
    fitting node type, where new replicas go first: the batch limit the runtime is started with
    and its KV pool in tokens (the sequences it holds at full context x the context). None
    without a fitting node type; a TTFT SLO then has nothing to size from until it learns."""
    fitting = [entry for entry in plan if entry.fits and entry.max_concurrency > 0]
    if not fitting:
        return None
    held = fitting[0].max_concurrency
    batch = manifests.batch_limit(serving, held)
    return replica_capacity.seed(batch, held * serving.max_context_length)


def state_from_status(status: api.ModelDeploymentStatus) -> PolicyState:
    """The policy state `status_patch` wrote. It is not in the CRD's schema (status.autoscaling
    keeps unknown fields), so the typed status holds it among the extra fields."""
    return PolicyState.from_dict((status.autoscaling.model_extra or {}).get("state"))


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


def placement(status: api.ModelDeploymentStatus, pods: Sequence[Mapping[str, Any]]) -> Placement:
    """The Placement of a ModelDeployment from its status and its pods (pure).

    The replicas asked for per type are the autoscaler's last spread, else reconcile's plan.
    """
    fitting = [e for e in status.plan if e.fits]
    order = tuple(e.node_type for e in fitting)
    asked = status.autoscaling.replicas_per_node_type or {e.node_type: e.replicas for e in fitting}
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
        gpus_per_replica={e.node_type: max(1, e.tensor_parallel) for e in fitting},
        current={t: asked.get(t, 0) for t in order},
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
            return timestamps.unix(stamp) if stamp else None
    return None


def wake_time(md: Mapping[str, Any]) -> float | None:
    """When a gateway last asked to wake this ModelDeployment (its wake annotation), as unix
    seconds; None without one or when it is not an RFC 3339 time (then it is ignored)."""
    stamp = (((md.get("metadata") or {}).get("annotations")) or {}).get(resource.WAKE_ANNOTATION)
    if not stamp:
        return None
    try:
        moment = timestamps.parse(str(stamp))
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def spill_message(old: Mapping[str, int], new: Mapping[str, int], stuck: Sequence[str]) -> str:
    """The Event text when replicas leave node types where they could not be scheduled."""
    moved = ", ".join(f"{t} {old.get(t, 0)}->{n}" for t, n in new.items() if old.get(t, 0) != n)
    return f"Pods Unschedulable on {', '.join(stuck)} past the spill-over threshold: {moved}"


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


def slo_patch(slo: api.LatencySlo | None, observations: Observations) -> dict[str, Any] | None:
    """`status.autoscaling.slo`: the target and how it holds; None (a removal) without an SLO."""
    if slo is None:
        return None
    share = observations.ttft_slo_attainment
    tpot_share = observations.tpot_slo_attainment if slo.tpot_seconds is not None else None
    measured = [s for s in (share, tpot_share) if s is not None]
    return {
        "ttftSeconds": slo.ttft_seconds,
        "percentile": slo.percentile,
        "windowSeconds": attainment.WINDOW_S,
        "attainment": None if share is None else round(share, 4),
        "tpotSeconds": slo.tpot_seconds,
        "tpotAttainment": None if tpot_share is None else round(tpot_share, 4),
        "met": all(s * 100 >= slo.percentile for s in measured) if measured else None,
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
