"""The builtin autoscaler's loop (issue 6 item 3): observe, decide, record, and let reconcile act;
and, on the same tick, status.cost for every ModelDeployment (issue 40 item 17).

Every `interval` seconds, for each ModelDeployment with `autoscaling.mode: builtin`:
  metrics (Prometheus, or the ready pods' /metrics) -> policy.decide -> status.autoscaling
  (desiredReplicas, lastDecision, metrics snapshot, policy state) + MetricsAvailable condition,
  an Event and a reconcile pass when the count changes. On a change the count is spread over the
  plan's node types (`status.autoscaling.replicasPerNodeType`): running replicas stay where they
  are, new ones go where GPUs are free, and replicas whose pods stay Unschedulable past
  `spillAfterSeconds` move to the next node type with room (a SpilledOver Event). Reconcile
  applies the spread; nothing here writes a Deployment, so server-side apply keeps a single owner
  of spec.replicas.

Every planned ModelDeployment, whatever its mode (`off`: spec's replicas; `external`: an HPA or
KEDA through the scale subresource), has its status.cost recorded about five times per cost
window when Prometheus is configured (cost_recording.py): cost is a fact of the traffic, not of
who scales. That writes status.cost alone, never a replica count.

Each tick LISTs the ModelDeployments and their runtime pods once (not per object). With more than
one operator instance, only the one holding the leader-election Lease runs kopf and so this loop
(lease.py).

A task on kopf's event loop, started by the startup handler, not a kopf timer: kopf timers put
a finalizer on every ModelDeployment, and then `kubectl delete` hangs whenever the operator is
down. The gateway's wake requests come to the same task (the `md-wake` handler queues them), so
a wake is decided at once and never races the tick. All state is in status, so a restart resumes
the stabilisation windows where they were.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvpilot.contract import k8s, resource, timestamps
from kvpilot.operator import api, observability
from kvpilot.operator.autoscaling import cold_start, cost_recording, metrics_reader, recording
from kvpilot.operator.autoscaling.policy import Decision, Observations, decide, wake
from kvpilot.operator.config import DeclaredNodeType
from kvpilot.operator.planning import inventory
from kvpilot.operator.reconcile import conditions, manifests, typed_status
from kvpilot.operator.reconcile.controller import COMPONENT, Controller

Obj = Mapping[str, Any]
log = logging.getLogger(__name__)


def autoscaling_spec(md: Obj) -> api.Autoscaling:
    """spec.autoscaling, parsed (the apiserver has applied the CRD's defaults and rules)."""
    return api.Autoscaling.model_validate((md.get("spec") or {}).get("autoscaling") or {})


def slo_ttft_s(md: Obj) -> float | None:
    """The TTFT target of spec.autoscaling.slo; None without one (no rates or attainment read)."""
    slo = autoscaling_spec(md).slo
    return None if slo is None else slo.ttft_seconds


def slo_tpot_s(md: Obj) -> float | None:
    """The TPOT target of spec.autoscaling.slo; None without one (its attainment is not read)."""
    slo = autoscaling_spec(md).slo
    return None if slo is None else slo.tpot_seconds


def serving_spec(md: Obj) -> api.Serving:
    """spec.serving, parsed: the batch and context the planner's capacity seed comes from."""
    return api.Serving.model_validate((md.get("spec") or {}).get("serving") or {})


def wake_of(
    md: Obj,
    status: api.ModelDeploymentStatus,
    autoscaling: api.Autoscaling,
    current: int,
    now: float,
) -> Decision | None:
    """What a pending wake (the gateway's annotation) asks for, given the parsed spec."""
    return wake(
        autoscaling.mode,
        recording.bounds_from_spec(autoscaling),
        recording.state_from_status(status),
        current,
        recording.wake_time(md),
        now,
    )


def measured_cold_start(
    status: api.ModelDeploymentStatus, pods: Sequence[Obj]
) -> cold_start.Summary | None:
    """The cold starts status holds, with those of the pods that became Ready since."""
    stored = status.autoscaling.cold_start
    return cold_start.measure(None if stored is None else typed_status.wire(stored), pods)


def decision_for(
    md: Obj, status: api.ModelDeploymentStatus, observations: Observations, now: float
) -> Decision:
    """The policy's decision, or a pending wake's where that asks for more (a wake that came
    while another instance held the Lease). With a TTFT SLO the planner's capacity seed goes
    along, for the policy to size with until it has learned the replicas' own."""
    autoscaling = autoscaling_spec(md)
    state = recording.state_from_status(status)
    bounds = recording.bounds_from_spec(autoscaling)
    prior = recording.planner_prior(serving_spec(md), status.plan) if autoscaling.slo else None
    decision = decide(observations, bounds, state, now, prior=prior)
    woken = wake_of(md, status, autoscaling, observations.current_replicas, now)
    return woken if woken is not None and woken.replicas > decision.replicas else decision


def is_builtin(md: Obj) -> bool:
    return autoscaling_spec(md).mode == "builtin"


def is_planned(status: api.ModelDeploymentStatus) -> bool:
    """Only a ModelDeployment with a node type that fits has replicas to scale; one whose plan
    failed waits for its spec or the cluster to change (reconcile reports why)."""
    return any(entry.fits for entry in status.plan)


def planned(listed: Sequence[Obj]) -> list[tuple[Obj, api.ModelDeploymentStatus]]:
    """The ModelDeployments with a plan, whatever their mode, each with its status parsed
    (once per tick)."""
    parsed = [(md, typed_status.of(md)) for md in listed]
    return [(md, status) for md, status in parsed if is_planned(status)]


def to_scale(
    looked_at: Sequence[tuple[Obj, api.ModelDeploymentStatus]],
) -> list[tuple[Obj, api.ModelDeploymentStatus]]:
    """Of the planned ModelDeployments, those the builtin autoscaler sizes."""
    return [(md, status) for md, status in looked_at if is_builtin(md)]


# Keys of status.autoscaling that change on every look; a write only for them would churn the
# object (and its resourceVersion, which GitOps tools watch) without telling anyone anything.
VOLATILE_KEYS = ("lastDecisionTime", "metrics")


def is_news(old: api.AutoscalingStatus, new: Obj) -> bool:
    """True when the decision, its reason, the policy state, metric availability or the SLO's
    attainment (to the percentage point: it moves a little every tick) changed."""
    written = typed_status.wire(old)
    return any(
        _steady(k, written.get(k)) != _steady(k, v)
        for k, v in new.items()
        if k not in VOLATILE_KEYS
    )


def _steady(key: str, value: Any) -> Any:
    """`value` without the fields that move every tick."""
    if key == "slo" and isinstance(value, dict):  # as written: no nulls
        steady = {k: v for k, v in value.items() if v is not None}
        for share in ("attainment", "tpotAttainment"):
            if share in steady:
                steady[share] = round(steady[share], 2)
        return steady
    return value


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
    old: Sequence[api.Condition], decision: Decision, now: str
) -> list[dict[str, Any]]:
    """status.conditions with MetricsAvailable set (transition time kept when unchanged)."""
    fresh = api.Condition.model_validate(recording.metrics_condition(decision))
    return [typed_status.wire(c) for c in conditions.merge(old, [fresh], now)]


Inventory = tuple[list[Any], list[Any]]
# A decision on the object as it is now (and its status, parsed).
Decide = Callable[[Obj, api.ModelDeploymentStatus], Decision | None]


@dataclass(frozen=True)
class Seen:
    """One ModelDeployment as a tick or a wake found it: the object, its parsed status, its
    runtime pods and what their metrics say."""

    md: Obj
    status: api.ModelDeploymentStatus
    pods: Sequence[Obj]
    observations: Observations
    cold_starts: cold_start.Summary | None = None  # None: status.autoscaling.coldStart unchanged


class AutoscalerLoop:
    """A task on kopf's event loop: a tick every `interval_s`, and the gateway's wake requests in
    between, one at a time, so the loop and a wake never race each other on this instance. The
    blocking API calls run in threads; the index snapshot and the pod scrapes run on the loop."""

    def __init__(
        self,
        controller: Controller,
        interval_s: float,
        indexes: Callable[[], Inventory | None] | None = None,
    ) -> None:
        self.controller = controller
        self.indexes = indexes  # the kopf watch indexes' snapshot, once they follow the cluster
        self.interval_s = interval_s
        self.wakes: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.wake_bodies: dict[tuple[str, str], Obj] = {}  # the latest body per queued wake
        url = controller.config.prometheus_url
        self.prometheus = metrics_reader.PrometheusMetrics(url) if url else None
        window_s = controller.config.cost_window_seconds
        self.cost = (
            cost_recording.CostRecorder(controller.client, self.prometheus, window_s)
            if self.prometheus is not None
            else None
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval_s
        while True:
            try:
                async with asyncio.timeout_at(due):
                    key = await self.wakes.get()
            except TimeoutError:
                due = loop.time() + self.interval_s
                await self.survive(self.tick())
                continue
            await self.survive(self.wake(self.wake_bodies.pop(key)))

    async def survive(self, work: Awaitable[object]) -> None:
        """Run one tick or wake. An error nothing below expected (the API unreachable, a bug) is
        logged, and the next tick tries again: it must not end the loop for good."""
        try:
            await work
        except Exception:
            log.exception("autoscaler: a tick or wake failed; the next tick tries again")

    async def tick(self) -> None:
        """One look at every planned ModelDeployment, two LISTs in all (not one per object):
        the builtin ones are scaled, and every one whose cost is due has it recorded, whatever
        its mode (cost is a fact of the traffic, not of who scales)."""
        looked_at = planned(await asyncio.to_thread(self.safe_list))
        scaled = to_scale(looked_at)
        costed = self.costed(looked_at)
        try:
            pods = await asyncio.to_thread(self.model_pods) if scaled or costed else {}
        except k8s.ApiException as error:
            log.warning("autoscaler: cannot list runtime pods: %s", error.reason)
            return
        for md, status in scaled:
            await self.scale_one(md, status, pods.get(key_of(md), []))
        for md, status in costed:
            await asyncio.to_thread(self.record_cost, md, status, pods.get(key_of(md), []))

    def costed(
        self, looked_at: Sequence[tuple[Obj, api.ModelDeploymentStatus]]
    ) -> list[tuple[Obj, api.ModelDeploymentStatus]]:
        """The ModelDeployments whose status.cost is due now (none without Prometheus)."""
        if self.cost is None:
            return []
        return cost_recording.to_cost(looked_at, time.time(), self.cost.window_s)

    def record_cost(self, md: Obj, status: api.ModelDeploymentStatus, pods: Sequence[Obj]) -> None:
        """status.cost of one ModelDeployment (in a thread); one bad object never stops the
        loop, and writes nothing else: its replicas stay its owner's."""
        if self.cost is None:  # without Prometheus `costed` selects none
            return
        try:
            self.cost.record(md, status, pods)
        except (k8s.ApiException, ValueError) as error:
            meta = md["metadata"]
            log.warning("cost: %s/%s: %s", meta["namespace"], meta["name"], error)

    def safe_list(self) -> list[dict[str, Any]]:
        try:
            return self.controller.list_model_deployments()
        except k8s.ApiException as error:
            log.warning("autoscaler: cannot list ModelDeployments: %s", error.reason)
            return []

    async def scale_one(
        self, md: Obj, status: api.ModelDeploymentStatus, pods: Sequence[Obj]
    ) -> None:
        meta = md["metadata"]
        try:
            observations = await self.observe(
                meta["namespace"], meta["name"], status.replicas, pods, slo_ttft_s(md),
                slo_tpot_s(md),
            )  # fmt: skip
            starts = measured_cold_start(status, pods)
            if starts is not None:  # the forecast's lead: a median measured, not 60 s assumed
                lead = starts.lead_s(recording.first_fitting_node_type(status.plan))
                observations = replace(observations, cold_start_s=lead)
            await self.act(
                Seen(md, status, pods, observations, starts),
                lambda fresh, fresh_status: self.decide(fresh, fresh_status, observations),
            )
        except (k8s.ApiException, ValueError) as error:  # one bad object never stops the loop
            log.warning("autoscaler: %s/%s: %s", meta["namespace"], meta["name"], error)

    def request_wake(self, md: Obj) -> bool:
        """A gateway's wake request (the `md-wake` handler, on kopf's loop): queued for the loop
        to decide now rather than on its next tick. True when it was worth queueing."""
        # Every event of an annotated object comes here: the pure check first, API calls later.
        if not is_builtin(md):
            return False
        status = typed_status.of(md)
        if not is_planned(status) or self.wake_decision(md, status, status.replicas) is None:
            return False
        key = (md["metadata"].get("namespace", ""), md["metadata"]["name"])
        if key not in self.wake_bodies:
            self.wakes.put_nowait(key)
        self.wake_bodies[key] = md
        return True

    async def wake(self, md: Obj) -> bool:
        """Act on a queued wake: True when it asked for a replica."""
        meta, status = md["metadata"], typed_status.of(md)  # the queued body: its latest event
        try:
            pods = await asyncio.to_thread(
                k8s.list_objects,
                self.controller.client,
                "v1",
                "Pod",
                meta["namespace"],
                f"{manifests.LABEL_MODEL}={meta['name']}",
            )
            observations = await self.observe(
                meta["namespace"], meta["name"], status.replicas, pods
            )

            def woken(fresh: Obj, fresh_status: api.ModelDeploymentStatus) -> Decision | None:
                return self.wake_decision(fresh, fresh_status, fresh_status.replicas)

            woke = await self.act(Seen(md, status, pods, observations), woken)
        except k8s.ApiException as error:  # the gateway wakes again, and the tick sees it too
            log.warning("wake of %s failed: %s %s", meta["name"], error.status, error.reason)
            return False
        if woke:
            log.info("woke %s/%s", meta["namespace"], meta["name"])
        return woke

    async def act(self, seen: Seen, decide: Decide) -> bool:
        """Decide on `seen` and record it (in a thread: it writes status)."""
        snapshot = self.indexes() if self.indexes is not None else None
        return await asyncio.to_thread(self.act_now, seen, decide, snapshot)

    def act_now(
        self, seen: Seen, decide: Decide, snapshot: Inventory | None, attempts: int = 3
    ) -> bool:
        """Record a decision only over the version decided on: another writer of
        status.autoscaling in between (another instance, an old Lease holder) means deciding
        again on the object as it is now, so neither undoes the other's decision unseen."""
        for _attempt in range(attempts):
            decision = decide(seen.md, seen.status)
            if decision is None:
                return False
            try:
                self.place(seen, decision, snapshot)
                return True
            except k8s.ApiException as error:
                if error.status != 409:
                    raise
            meta = seen.md["metadata"]
            fresh = k8s.get(
                self.controller.client,
                k8s.MD_API_VERSION,
                resource.KIND,
                meta["namespace"],
                meta["name"],
            )
            if fresh is None:
                return False
            seen = replace(seen, md=fresh, status=typed_status.of(fresh))
        name = seen.md["metadata"]["name"]
        log.info("autoscaler: %s kept changing; the next tick decides", name)
        return False

    def place(self, seen: Seen, decision: Decision, snapshot: Inventory | None = None) -> None:
        """Spread the decided count over node types when it changes or pods are stuck, record
        it in status and announce it. Only status is written here: the watch on the
        ModelDeployment sees the decision and runs the reconcile that applies it
        (handlers.md_event), so children are touched by the reconcile alone."""
        now, spill_after = time.time(), self.controller.config.spill_after_seconds
        current, where = seen.status.replicas, recording.placement(seen.status, seen.pods)
        stuck = where.spilling(now, spill_after)
        if decision.replicas == current and not stuck:
            self.record(seen, decision, None)
            return
        nodes, all_pods = snapshot or self.list_inventory()
        free = free_gpus(nodes, all_pods, where, self.controller.config.node_types)
        per_type = where.spread(decision.replicas, free, now, spill_after)
        self.record(seen, decision, per_type)
        if decision.replicas != current:
            self.announce_scale(seen.md, current, decision)
        elif per_type != dict(where.current):  # else stuck, but no other type has room yet
            self.announce(
                seen.md, "SpilledOver", recording.spill_message(where.current, per_type, stuck)
            )

    def model_pods(self) -> dict[tuple[str, str], list[dict[str, Any]]]:
        """Runtime pods in the watched namespace(s), by (namespace, ModelDeployment name)."""
        namespace = self.controller.config.namespace or None
        found = k8s.list_objects(
            self.controller.client, "v1", "Pod", namespace, manifests.LABEL_MODEL
        )
        return pods_by_model(found)

    async def observe(
        self,
        namespace: str,
        name: str,
        current: int,
        pods: Sequence[Obj],
        ttft_target_s: float | None = None,
        tpot_target_s: float | None = None,
    ) -> Observations:
        urls, node_types = ready_pod_urls(pods, self.controller.config.runtime_port)
        if self.prometheus is not None:
            prometheus = self.prometheus
            observations = await asyncio.to_thread(
                lambda: prometheus.observe(
                    namespace,
                    name,
                    current,
                    set(urls),
                    slo_ttft_s=ttft_target_s,
                    slo_tpot_s=tpot_target_s,
                )
            )
        elif not urls:
            observations = Observations(current_replicas=current, sampled_at=time.time())
        else:
            observations = await metrics_reader.observe_pods(urls, node_types, current)
        if observations.error:
            observability.record_metrics_error("prometheus" if self.prometheus else "pods")
        return observations

    def decide(
        self, md: Obj, status: api.ModelDeploymentStatus, observations: Observations
    ) -> Decision:
        return decision_for(md, status, observations, time.time())

    def wake_decision(
        self, md: Obj, status: api.ModelDeploymentStatus, current: int, now: float | None = None
    ) -> Decision | None:
        when = time.time() if now is None else now
        return wake_of(md, status, autoscaling_spec(md), current, when)

    def record(self, seen: Seen, decision: Decision, per_type: Mapping[str, int] | None) -> None:
        meta, old, status = seen.md["metadata"], seen.status.autoscaling, seen.status
        now = timestamps.rfc3339()
        # A merge patch, not the model: its nulls delete what no longer holds (a metric gone,
        # a policy timer reset, a node type left out of the spread).
        autoscaling = recording.status_patch(decision, seen.observations, time.time())
        if per_type is not None:
            spread = old.replicas_per_node_type
            autoscaling["replicasPerNodeType"] = recording.per_type_patch(spread, per_type)
        if seen.cold_starts is not None:
            autoscaling["coldStart"] = seen.cold_starts.to_dict()
        slo = recording.slo_patch(autoscaling_spec(seen.md).slo, seen.observations)
        if slo is not None or old.slo is not None:
            autoscaling["slo"] = slo
        if not is_news(old, autoscaling):
            return
        patch = {
            "autoscaling": autoscaling,
            "conditions": metrics_condition_patch(status.conditions, decision, now),
        }
        version = meta.get("resourceVersion")
        k8s.patch_status(self.controller.client, meta["namespace"], meta["name"], patch, version)

    def announce_scale(self, md: Obj, current: int, decision: Decision) -> None:
        direction = "up" if decision.replicas > current else "down"
        observability.record_scale(direction)
        message = recording.event_message(current, decision) or decision.reason
        self.announce(md, "ScaledUp" if direction == "up" else "ScaledDown", message)

    def announce(self, md: Obj, reason: str, message: str) -> None:
        k8s.emit_event(self.controller.client, md, "Normal", reason, message, COMPONENT)

    def list_inventory(self) -> Inventory:
        """Nodes and GPU pods, trimmed, LISTed (before the watch indexes follow the cluster)."""
        client = self.controller.client
        nodes = [inventory.trim_node(n) for n in k8s.list_objects(client, "v1", "Node")]
        pods = [p for p in map(inventory.trim_pod, k8s.list_objects(client, "v1", "Pod")) if p]
        return nodes, pods


def key_of(md: Obj) -> tuple[str, str]:
    """(namespace, name): how `pods_by_model` groups a ModelDeployment's pods."""
    meta = md["metadata"]
    return meta["namespace"], meta["name"]


def pods_by_model(pods: Sequence[Obj]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Pods grouped by (namespace, the ModelDeployment their label names) (pure)."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        model = (meta.get("labels") or {}).get(manifests.LABEL_MODEL)
        if model:
            grouped.setdefault((meta.get("namespace", ""), model), []).append(dict(pod))
    return grouped


def free_gpus(
    nodes: Sequence[Obj],
    pods: Sequence[Obj],
    where: recording.Placement,
    declared: Sequence[DeclaredNodeType] = (),
) -> dict[str, int]:
    """Free GPUs per node type of the plan, counted in whole replicas (a replica never spans two
    nodes), so that `spread_replicas`' GPUs // GPUs per replica gives the free slots."""
    free = {}
    for node_type in inventory.discover(nodes, pods, declared):
        if node_type.name in where.order:
            per_replica = where.gpus_per_replica[node_type.name]
            free[node_type.name] = node_type.num_free_slots(per_replica) * per_replica
    return free
