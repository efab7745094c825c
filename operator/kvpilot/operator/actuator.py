"""The builtin autoscaler's loop (issue 6 item 3): observe, decide, record, and let reconcile act.

Every `interval` seconds, for each ModelDeployment with `autoscaling.mode: builtin`:
  metrics (Prometheus, or the ready pods' /metrics) -> policy.decide -> status.autoscaling
  (desiredReplicas, lastDecision, metrics snapshot, policy state) + MetricsAvailable condition,
  an Event and a reconcile pass when the count changes. The reconcile spreads desiredReplicas
  over node types in plan order; nothing here writes a Deployment, so server-side apply keeps a
  single owner of spec.replicas.

A thread, not a kopf timer: kopf timers put a finalizer on every ModelDeployment, and then
`kubectl delete` hangs whenever the operator is down. All state is in status, so a restart
resumes the stabilisation windows where they were.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kvpilot.operator import api, autoscaler, conditions, inventory, k8s, manifests, observability
from kvpilot.operator import metrics as metrics_source
from kvpilot.operator.controller import COMPONENT, Controller
from kvpilot.operator.policy import Decision, Observations, decide

Obj = Mapping[str, Any]
log = logging.getLogger(__name__)


def is_builtin(md: Obj) -> bool:
    spec = md.get("spec") or {}
    return ((spec.get("autoscaling") or {}).get("mode") or "builtin") == "builtin"


def is_planned(md: Obj) -> bool:
    """Only a ModelDeployment with a node type that fits has replicas to scale; one whose plan
    failed waits for its spec or the cluster to change (reconcile reports why)."""
    return any(entry.get("fits") for entry in (md.get("status") or {}).get("plan") or [])


# Keys of status.autoscaling that change on every look; a write only for them would churn the
# object (and its resourceVersion, which GitOps tools watch) without telling anyone anything.
VOLATILE_KEYS = ("lastDecisionTime", "metrics")


def is_news(old: Obj, new: Obj) -> bool:
    """True when the decision, its reason, the policy state or metric availability changed."""
    return any(old.get(k) != v for k, v in new.items() if k not in VOLATILE_KEYS)


def ready_pod_urls(pods: Sequence[Obj], port: int) -> tuple[dict[str, str], dict[str, str]]:
    """(pod name -> /metrics URL, pod name -> node type) for the ready pods (pure)."""
    urls, node_types = {}, {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if not ready or not status.get("podIP") or meta.get("deletionTimestamp"):
            continue
        notes = meta.get("annotations") or {}
        path = notes.get("prometheus.io/path", "/metrics")
        urls[meta["name"]] = (
            f"http://{status['podIP']}:{notes.get('prometheus.io/port', port)}{path}"
        )
        node_types[meta["name"]] = (meta.get("labels") or {}).get(manifests.LABEL_NODE_TYPE, "")
    return urls, node_types


def metrics_condition_patch(
    old: Sequence[Obj], decision: Decision, now: str
) -> list[dict[str, Any]]:
    """status.conditions with MetricsAvailable set (transition time kept when unchanged)."""
    current = [api.Condition.model_validate(c) for c in old]
    fresh = api.Condition.model_validate(autoscaler.metrics_condition(decision))
    merged = conditions.merge(current, [fresh], now)
    return [c.model_dump(by_alias=True, exclude_none=True) for c in merged]


class AutoscalerLoop:
    def __init__(self, controller: Controller, interval_s: float) -> None:
        self.controller = controller
        self.interval_s = interval_s
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="kvpilot-autoscaler", daemon=True)
        url = controller.config.prometheus_url
        self.prometheus = metrics_source.PrometheusMetrics(url) if url else None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            for md in self.safe_list():
                if is_builtin(md) and is_planned(md):
                    self.scale_one(md)

    def safe_list(self) -> list[dict[str, Any]]:
        try:
            return self.controller.list_model_deployments()
        except k8s.ApiException as error:
            log.warning("autoscaler: cannot list ModelDeployments: %s", error.reason)
            return []

    def scale_one(self, md: Obj) -> None:
        meta = md["metadata"]
        try:
            pods = self.model_pods(meta["namespace"], meta["name"])
            current = int((md.get("status") or {}).get("replicas") or 0)
            observations = self.observe(meta["namespace"], meta["name"], current, pods)
            decision = self.decide(md, observations)
            self.record(md, observations, decision)
            if decision.replicas != current:
                self.act(md, current, decision)
        except (k8s.ApiException, ValueError) as error:  # one bad object never stops the loop
            log.warning("autoscaler: %s/%s: %s", meta["namespace"], meta["name"], error)

    def model_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        selector = f"{manifests.LABEL_MODEL}={name}"
        return k8s.list_objects(self.controller.client, "v1", "Pod", namespace, selector)

    def observe(self, namespace: str, name: str, current: int, pods: Sequence[Obj]) -> Observations:
        urls, node_types = ready_pod_urls(pods, self.controller.config.runtime_port)
        if self.prometheus is not None:
            observations = self.prometheus.observe(namespace, name, current, set(urls))
        elif not urls:
            observations = Observations(current_replicas=current, sampled_at=time.time())
        else:
            observations = asyncio.run(metrics_source.observe_pods(urls, node_types, current))
        if observations.error:
            observability.record_metrics_error("prometheus" if self.prometheus else "pods")
        return observations

    def decide(self, md: Obj, observations: Observations) -> Decision:
        spec = md.get("spec") or {}
        bounds = autoscaler.bounds_from_spec(spec.get("autoscaling") or {})
        return decide(
            observations, bounds, autoscaler.state_from_status(md.get("status")), time.time()
        )

    def record(self, md: Obj, observations: Observations, decision: Decision) -> None:
        meta, status = md["metadata"], md.get("status") or {}
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        autoscaling = autoscaler.status_patch(decision, observations, time.time())
        if not is_news(status.get("autoscaling") or {}, autoscaling):
            return
        patch = {
            "autoscaling": autoscaling,
            "conditions": metrics_condition_patch(status.get("conditions") or [], decision, now),
        }
        k8s.patch_status(self.controller.client, meta["namespace"], meta["name"], patch)

    def act(self, md: Obj, current: int, decision: Decision) -> None:
        meta = md["metadata"]
        direction = "up" if decision.replicas > current else "down"
        observability.record_scale(direction)
        message = autoscaler.event_message(current, decision) or decision.reason
        k8s.emit_event(
            self.controller.client,
            md,
            "Normal",
            "ScaledUp" if direction == "up" else "ScaledDown",
            message,
            COMPONENT,
        )
        nodes = [
            inventory.trim_node(n) for n in k8s.list_objects(self.controller.client, "v1", "Node")
        ]
        pods = [
            p
            for p in map(inventory.trim_pod, k8s.list_objects(self.controller.client, "v1", "Pod"))
            if p
        ]
        self.controller.run_pass(meta["namespace"], meta["name"], nodes, pods)
