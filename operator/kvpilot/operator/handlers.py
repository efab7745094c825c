"""kopf wiring only: which events ask for which pass. The logic is in reconcile/controller, the
queue that runs passes in reconcile/passes.py.

Every handler is async and runs on kopf's event loop; it only names a ModelDeployment and a kind
of pass (passes.PassScheduler's work queue runs them, one at a time per object, in threads).
- A ModelDeployment event -> full pass when it needs one: first seen since the start, a spec not
  applied yet (generation vs status.observedGeneration), or an autoscaler decision to apply.
  A failed pass is retried with backoff by passes.PassScheduler; an invalid spec is not.
- A child Deployment deleted or its spec changed by someone -> full pass (drift is put back);
  its status changed -> status-only pass (readyReplicas, Ready).
- Nodes and GPU pods are kept in kopf indexes; when the nodes' GPU facts change (a node pool
  added or removed), every ModelDeployment is re-planned once things settle (passes.Replanner).
- The autoscaler loop, the adapter sync and the re-planner are tasks on the same loop, started
  at startup, and so is the keeper of the leader-election Lease: kopf runs only in the instance
  holding it (cli.py). A ModelDeployment with LoRA, or a runtime pod turning Ready, nudges the
  adapter sync, so adapters reach new pods and new specs without waiting for its period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import kopf

from kvpilot.contract import resource
from kvpilot.operator import observability
from kvpilot.operator.adapters.sync import AdapterSync
from kvpilot.operator.autoscaling.loop import AutoscalerLoop
from kvpilot.operator.lease import LeaderLease
from kvpilot.operator.planning import inventory
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import conditions, dependents, desired_state, manifests, model_cache
from kvpilot.operator.reconcile.controller import INFERENCE_POOL_CRD, Controller, controller_owner
from kvpilot.operator.reconcile.passes import PassScheduler, Replanner
from kvpilot.operator.reconcile.workqueue import WorkQueue

MD = (resource.GROUP, resource.VERSION, resource.PLURAL)
CHILD_LABELS = {manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY}
log = logging.getLogger(__name__)


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's "last handled state" of an object, kept as nothing.

    kopf diffs each event against the last handled state for its change-detecting handlers
    (create/update/resume/field/delete) and its daemons and timers. kvpilot registers none of
    those (only event, index and startup/cleanup handlers; a unit test keeps it so), yet kopf
    builds that state for every event of every watched resource anyway: a deep copy of the
    body, copied twice more to strip its progress marks. In a burst of 200 creates that was a
    fifth of the operator's CPU, on the event loop (py-spy, bench.operator_scale). Nothing
    reads it here, so nothing is built or stored."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


@kopf.on.startup(id="configure")
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.persistence.diffbase_storage = NoDiffBase()
    if "controller" not in memo:
        raise kopf.PermanentError("start the operator with `kvpilot-operator run`")
    controller: Controller = memo["controller"]
    memo.setdefault("readiness", observability.Readiness())
    # kopf hands the indexes to startup handlers too; they are read on this loop only.
    pass_scheduler = PassScheduler(
        controller, kwargs["gpu_nodes"], kwargs["gpu_pods"], kwargs["model_deployments"]
    )
    memo["pass_scheduler"] = pass_scheduler
    memo["replanner"] = Replanner(pass_scheduler)
    memo["autoscaler"] = AutoscalerLoop(
        controller, controller.config.autoscaler_interval_seconds, pass_scheduler.known_inventory
    )
    memo["adapter_sync"] = AdapterSync(controller)
    loops = [
        pass_scheduler.run(),
        memo["replanner"].run(),
        memo["autoscaler"].run(),
        memo["adapter_sync"].run(),
    ]
    lease: LeaderLease | None = memo.get("lease")
    if lease is not None:  # losing it stops kopf (the stop flag cli.py gave it)
        loops.append(lease.keep(memo["lease_lost"]))
    names = ("passes", "replanner", "autoscaler", "adapter-sync", "lease")
    memo["tasks"] = [
        asyncio.create_task(loop, name=f"kvpilot-{name}")
        for name, loop in zip(names, loops, strict=False)
    ]
    memo["readiness"].started = True


@kopf.on.cleanup(id="stop-loops")
async def stop_loops(memo: Any, **_: Any) -> None:
    tasks = memo.get("tasks") or []
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    lease: LeaderLease | None = memo.get("lease")
    if lease is not None:  # let it go last, once nothing acts: a standby takes over at once
        await asyncio.to_thread(lease.release)


@kopf.index("", "v1", "nodes", id="gpu_nodes")
async def gpu_nodes(body: kopf.Body, name: str, **_: Any) -> dict[str, Any]:
    return {name: inventory.trim_node(body)}


@kopf.index(*MD, id="model_deployments")
async def model_deployments(
    namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> dict[str, Any] | None:
    return None if namespace is None else {namespace: dependents.indexed(namespace, name, spec)}


@kopf.index("", "v1", "pods", id="gpu_pods")
async def gpu_pods(body: kopf.Body, **_: Any) -> dict[str, Any] | None:
    trimmed = inventory.trim_pod(body)
    return None if trimmed is None else {trimmed["spec"]["nodeName"]: trimmed}


def _queue(memo: Any) -> WorkQueue:
    pass_scheduler: PassScheduler = memo["pass_scheduler"]
    return pass_scheduler.queue


@kopf.on.event(*MD, id="md")
async def md_event(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    """A full pass when the object needs one (desired_state.needs_full_pass): first seen since the
    start, its spec not applied yet (generation vs status.observedGeneration), or an autoscaler
    decision the children do not show (the autoscaler writes status only; this is its one way
    to pods). A watch event, not kopf's create/update handlers: those keep kopf's bookkeeping
    in an annotation, one more write and one more watch event per change."""
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    if namespace is None:
        return
    pass_scheduler: PassScheduler = memo["pass_scheduler"]
    key = (namespace, name)
    if event["type"] == "DELETED":
        # No finalizer: owner references let the garbage collector remove the children.
        log.info("ModelDeployment %s/%s deleted; children follow by owner reference", *key)
        pass_scheduler.forget(key)
    elif desired_state.needs_full_pass(body, first_sight=pass_scheduler.first_sight(key)):
        pass_scheduler.queue.put(key, True, dict(body))
    spec = body.get("spec") or {}
    if event["type"] != "DELETED" and (spec.get("adapters") or spec.get("lora") is not None):
        _nudge_adapters(memo)


def _nudge_adapters(memo: Any) -> None:
    sync: AdapterSync | None = memo.get("adapter_sync")
    if sync is not None:
        sync.nudge()


@kopf.on.event(*MD, id="md-wake", annotations={resource.WAKE_ANNOTATION: kopf.PRESENT})
async def md_wake(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    """A gateway holds requests for a ModelDeployment at zero replicas and stamped the wake
    annotation: the autoscaler task decides now, not on its next tick. Like the tick, that
    writes status only; the md handler then runs the pass that starts the replica. Every
    later event of the object comes here too, and the policy ignores a wake it has acted on."""
    if event["type"] == "DELETED" or "autoscaler" not in memo:
        return
    autoscaler: AutoscalerLoop = memo["autoscaler"]
    autoscaler.request_wake(dict(body))


def _pass_each(memo: Any, keys: Iterable[tuple[str, str]]) -> None:
    """A full pass of each ModelDeployment named."""
    for key in keys:
        _queue(memo).put(key, True)


def _indexed(memo: Any) -> list[Any]:
    pass_scheduler: PassScheduler = memo["pass_scheduler"]
    return pass_scheduler.model_deployments()


@kopf.on.event(*MD, id="md-fallback-target")
async def md_fallback_target(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    """A ModelDeployment came or went: those naming it as a fallback pass again, so their
    FallbacksResolved condition says so now rather than on their next spec change. The listing
    at startup (type None) is left to the md handler, which passes every object first seen."""
    if event["type"] not in ("ADDED", "DELETED"):
        return
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    if namespace is None:
        return
    _pass_each(memo, dependents.fallback_users(_indexed(memo), namespace, name))


@kopf.on.event("", "v1", "nodes", id="node-changes")
async def node_changed(memo: Any, **_: Any) -> None:
    # A per-object kopf timer would do this too, but kopf guards timers with a finalizer, and a
    # finalizer makes `kubectl delete` hang whenever the operator is down. One debounced task
    # re-plans every ModelDeployment instead (passes.Replanner).
    replanner: Replanner = memo["replanner"]
    replanner.notice()


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS, id="child-deployment")
async def child_deployment(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    owner = controller_owner(body)
    if owner is None:
        return
    pass_scheduler: PassScheduler = memo["pass_scheduler"]
    if event["type"] == "ADDED":
        # Our own create, whose pass reported it: remember its facts, so the next event (the
        # Deployment controller's revision annotation) is news only if it changes one of them.
        pass_scheduler.is_news(body)
        return
    # Someone changed the spec after the Deployment controller saw ours. Before it has seen any
    # (no observedGeneration yet) the Deployment is our fresh one: its first events are no drift.
    observed = (body.get("status") or {}).get("observedGeneration")
    drifted = observed is not None and body["metadata"].get("generation", 0) != observed
    deleted = event["type"] == "DELETED"
    if pass_scheduler.is_news(body, deleted):
        # Deleted or edited by someone: put it back. Else only its status moved: report it.
        pass_scheduler.queue.put((body["metadata"]["namespace"], owner), deleted or drifted)


@kopf.on.event("", "v1", "pods", labels=CHILD_LABELS, id="child-pod")
async def child_pod(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    """A runtime pod stuck on a container (a failed model fetch, a missing Secret) shows in its
    ModelDeployment's conditions; Deployments report no such thing, so this watches the pods.
    A pod getting better needs no pass here: it turns Ready, and its Deployment's event comes.
    A Ready pod nudges the adapter sync, which loads its adapters (if it has LoRA)."""
    if event["type"] != "DELETED" and _is_ready(body):
        _nudge_adapters(memo)
    if event["type"] == "DELETED" or conditions.pod_problem(body) is None:
        return
    owner = (body["metadata"].get("labels") or {}).get(manifests.LABEL_MODEL)
    if owner is not None:
        _queue(memo).put((body["metadata"]["namespace"], owner), False)


def _is_ready(pod: kopf.Body) -> bool:
    found = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in found)


@kopf.on.event("", "v1", "services", labels=CHILD_LABELS, id="child-service")
async def child_service(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    owner = controller_owner(body)
    if owner is not None and event["type"] == "DELETED":
        _queue(memo).put((body["metadata"]["namespace"], owner), True)


def _is_inference_pool_crd(name: str, **_: Any) -> bool:
    return name == INFERENCE_POOL_CRD


@kopf.on.event(
    "apiextensions.k8s.io",
    "v1",
    "customresourcedefinitions",
    when=_is_inference_pool_crd,
    id="inference-pool-crd",
)
async def inference_pool_crd(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    """The InferencePool CRD was installed (or changed) after the ModelDeployments that ask for
    a pool were planned: pass them again, so their pools appear now. The initial listing at
    startup (event type None) is left to the md handler, which passes every object first seen."""
    if event["type"] not in ("ADDED", "MODIFIED"):
        return
    _pass_each(memo, dependents.pool_users(_indexed(memo)))


@kopf.on.event(
    "batch", "v1", "jobs", labels={model_cache.LABEL_CACHE: kopf.PRESENT}, id="model-cache-job"
)
async def cache_job(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    """A model cache's fill Job moved on: every ModelDeployment using that cache passes again, to
    report it and, once it is Cached, to start replicas (the Job is shared, so not a child)."""
    namespace, claim = body["metadata"]["namespace"], body["metadata"]["name"]
    _pass_each(memo, dependents.cache_users(_indexed(memo), namespace, claim))


@kopf.on.event("batch", "v1", "jobs", labels={quality_job.LABEL_EVAL: kopf.PRESENT}, id="eval-job")
async def eval_job(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    """An eval Job moved on (or expired): every ModelDeployment of that model with an eval set
    passes again, to record the measurement, re-plan with it, or retry a Job that expired."""
    namespace = body["metadata"]["namespace"]
    cache = (body["metadata"].get("labels") or {}).get(quality_job.LABEL_CACHE, "")
    _pass_each(memo, dependents.eval_users(_indexed(memo), namespace, cache))
