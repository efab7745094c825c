"""status.cost for every ModelDeployment that serves, whatever scales it (issue 40 item 17).

Cost is a fact of the traffic, not of who scales: a fleet fixed by `autoscaling.mode: off` or
driven by an HPA or KEDA (`external`) costs money per request as much as one the builtin
autoscaler sizes. So the cost is recorded for every planned ModelDeployment, on the metrics
loop's tick (autoscaling/loop.py), beside the builtin decisions and independent of them: this
module writes status.cost only, never a replica count or status.autoscaling.

The figures come from `planning/cost.py` (pure); the traffic from Prometheus' rates over the
window (`metrics_reader.PrometheusMetrics.traffic`): without Prometheus there is no cost, as the
rates need its counters' history.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes import client as k8s_client

from kvpilot.contract import k8s, timestamps
from kvpilot.operator import api
from kvpilot.operator.autoscaling import metrics_reader
from kvpilot.operator.planning import cost
from kvpilot.operator.reconcile import manifests, typed_status

Obj = Mapping[str, Any]
log = logging.getLogger(__name__)


def replicas_by_node_type(pods: Sequence[Obj]) -> dict[str, int]:
    """Pods that exist and are not being deleted, per node type: what is billed (pure)."""
    counts: dict[str, int] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        node_type = (meta.get("labels") or {}).get(manifests.LABEL_NODE_TYPE, "")
        counts[node_type] = counts.get(node_type, 0) + 1
    return counts


def replica_prices(plan: Sequence[api.PlanEntry]) -> dict[str, float]:
    """Price of one replica-hour per node type, as the plan worked it out (pure)."""
    return {entry.node_type: entry.price_per_hour for entry in plan}


def cost_is_due(old: api.CostStatus | None, now: float, window_s: int) -> bool:
    """status.cost is refreshed about five times per window: often enough to follow the
    traffic, rarely enough not to churn the object (pure)."""
    measured = old.measured_at if old is not None else ""
    return not measured or now - timestamps.unix(measured) >= window_s / 5


def to_cost(
    planned: Sequence[tuple[Obj, api.ModelDeploymentStatus]], now: float, window_s: int
) -> list[tuple[Obj, api.ModelDeploymentStatus]]:
    """The ModelDeployments whose cost is due, of those with a plan: every autoscaling mode
    alike (pure)."""
    return [(md, status) for md, status in planned if cost_is_due(status.cost, now, window_s)]


def cost_patch(
    old: api.CostStatus | None,
    pods: Sequence[Obj],
    plan: Sequence[api.PlanEntry],
    traffic: Mapping[str, cost.Traffic],
    window: str,
    measured_at: str,
) -> dict[str, Any]:
    """The status patch: `cost` as a merge patch over the old one, so what no longer holds (a
    node type that stopped running, a reason) is removed, and nothing else (pure)."""
    figures = cost.cost_status(replicas_by_node_type(pods), replica_prices(plan), traffic, window)
    figures["measuredAt"] = measured_at
    # The keys the old cost has (defaults were never written): those `figures` lacks go.
    written = None if old is None else typed_status.wire(old, exclude_defaults=True)
    return {"cost": cost.merge_patch(written, figures)}


class CostRecorder:
    """Measures a ModelDeployment's traffic in Prometheus and writes its status.cost. Blocking
    (the Kubernetes client and the PromQL queries): the loop calls it in a thread."""

    def __init__(
        self,
        client: k8s_client.ApiClient,
        prometheus: metrics_reader.PrometheusMetrics,
        window_s: int,
    ) -> None:
        self.client, self.prometheus, self.window_s = client, prometheus, window_s

    def record(self, md: Obj, status: api.ModelDeploymentStatus, pods: Sequence[Obj]) -> None:
        """status.cost of `md` from the traffic over the window; an unreachable Prometheus
        leaves the last figures as they are (logged), the next tick tries again."""
        meta, window = md["metadata"], metrics_reader.prom_duration(self.window_s)
        try:
            traffic = self.prometheus.traffic(meta["namespace"], meta["name"], window)
        except metrics_reader.QUERY_ERRORS as error:
            log.warning("cost of %s/%s: %s", meta["namespace"], meta["name"], error)
            return
        patch = cost_patch(status.cost, pods, status.plan, traffic, window, timestamps.rfc3339())
        k8s.patch_status(self.client, meta["namespace"], meta["name"], patch)
