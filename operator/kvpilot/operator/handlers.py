"""kopf wiring only: which events start which pass. The logic is in reconcile/controller.

- ModelDeployment create/update(spec)/resume -> full pass; invalid spec -> PermanentError.
- A child Deployment deleted or its spec changed by someone -> full pass (drift is put back);
  its status changed -> status-only pass (readyReplicas, Ready).
- Nodes and GPU pods are kept in kopf indexes; when the nodes' GPU facts change (a node pool
  added or removed), every ModelDeployment is re-planned once things settle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from kvpilot.operator import (
    api,
    conditions,
    inventory,
    k8s,
    manifests,
    model_cache,
    observability,
    quality,
    quality_job,
    reconcile,
)
from kvpilot.operator.actuator import AutoscalerLoop
from kvpilot.operator.controller import (
    INFERENCE_POOL_CRD,
    Controller,
    Replanner,
    controller_owner,
)

MD = (api.GROUP, api.VERSION, api.PLURAL)
CHILD_LABELS = {manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY}
MAX_BACKOFF_SECONDS = 60
PEERING_LIFETIME_SECONDS = 20


@kopf.on.startup(id="configure")
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # The CRD's status schema prunes unknown fields, so kopf keeps its bookkeeping in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="kopf.kvpilot.dev"
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kopf.kvpilot.dev", key="last-handled-configuration"
    )
    # Instances of equal priority all pause while another one's peering record is alive; a
    # crashed instance's record thus blocks its replacement for this long (kopf's default: 60 s).
    settings.peering.lifetime = PEERING_LIFETIME_SECONDS
    settings.posting.level = logging.WARNING
    # Sync handlers mostly wait on the API; more workers keep a burst of creates from queueing.
    settings.execution.max_workers = 48
    settings.watching.server_timeout = 300
    if "controller" not in memo:
        raise kopf.PermanentError("start the operator with `kvpilot-operator run`")
    memo["replanner"] = Replanner(memo["controller"], _values)
    memo["replanner"].start()
    interval = memo["controller"].config.autoscaler_interval_seconds
    memo.setdefault("readiness", observability.Readiness())
    memo["autoscaler"] = AutoscalerLoop(
        memo["controller"],
        interval,
        memo["replanner"].inventory,
        memo.get("lease"),
        memo["readiness"],
    )
    memo["autoscaler"].start()
    memo["readiness"].started = True


@kopf.on.cleanup(id="stop-replanner")
def stop_replanner(memo: Any, **_: Any) -> None:
    if "replanner" in memo:
        memo["replanner"].stop()
    if "autoscaler" in memo:
        memo["autoscaler"].stop()


@kopf.index("", "v1", "nodes", id="gpu_nodes")
def gpu_nodes(body: kopf.Body, name: str, **_: Any) -> dict[str, Any]:
    return {name: inventory.trim_node(body)}


@kopf.index("", "v1", "pods", id="gpu_pods")
def gpu_pods(body: kopf.Body, **_: Any) -> dict[str, Any] | None:
    trimmed = inventory.trim_pod(body)
    return None if trimmed is None else {trimmed["spec"]["nodeName"]: trimmed}


def _values(index: Mapping[Any, Iterable[Any]]) -> list[Any]:
    """A snapshot of an index; kopf updates it on the event loop while handlers run in threads."""
    for _attempt in range(5):
        try:
            return [value for store in list(index.values()) for value in list(store)]
        except RuntimeError:  # changed size during iteration: take it again
            continue
    raise kopf.TemporaryError("node index kept changing; retrying", delay=1)


def _pass(
    memo: Any,
    namespace: str | None,
    name: str,
    nodes: Any,
    pods: Any,
    retry: int,
    full: bool = True,
    is_md_handler: bool = True,
    body: Any = None,
) -> None:
    controller: Controller = memo["controller"]
    if namespace is None:
        raise kopf.PermanentError("ModelDeployment is namespaced; got an object without namespace")
    started = time.monotonic()
    try:
        desired = controller.run_pass(namespace, name, _values(nodes), _values(pods), full, body)
    except ApiException as error:
        if error.status == 404:  # the object or its namespace went away mid-pass: nothing to do
            logging.getLogger(__name__).info("%s/%s is gone; pass dropped", namespace, name)
            return
        observability.record_reconcile(time.monotonic() - started, "error")
        delay = min(MAX_BACKOFF_SECONDS, 2**retry)
        raise kopf.TemporaryError(
            f"API error {error.status} {error.reason}", delay=delay
        ) from error
    invalid = desired is not None and desired.is_invalid_spec
    observability.record_reconcile(time.monotonic() - started, "invalid" if invalid else "success")
    # Only the ModelDeployment's own handlers stop on a bad spec; a child's event just refreshes.
    if desired is not None and desired.is_invalid_spec and is_md_handler:
        raise kopf.PermanentError(desired.error)
    if desired is not None and desired.needs_retry and is_md_handler:
        why = desired.error or "the eval set could not be read (QualityMeasured)"
        raise kopf.TemporaryError(why, delay=min(MAX_BACKOFF_SECONDS, 2**retry))


@kopf.on.resume(*MD, id="md-resume")
@kopf.on.create(*MD, id="md-create")
@kopf.on.update(*MD, id="md-update", field="spec")
def reconcile_md(
    namespace: str | None, name: str, body: kopf.Body, memo: Any, retry: int, **kwargs: Any
) -> None:
    # kopf passes the indexes by their ids as extra keyword arguments.
    _pass(memo, namespace, name, kwargs["gpu_nodes"], kwargs["gpu_pods"], retry, body=body)


@kopf.on.event(*MD, id="md-scaled")
def md_scaled(event: kopf.RawEvent, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    """The autoscaler wrote a decision to status that the children do not show yet: run the
    pass that applies it. The autoscaler loop writes status only; this is its one way to pods."""
    if event["type"] != "MODIFIED" or not reconcile.scale_pending(body):
        return
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    nodes, pods = kwargs["gpu_nodes"], kwargs["gpu_pods"]
    _pass(memo, namespace, name, nodes, pods, 0, is_md_handler=False, body=body)


@kopf.on.event(*MD, id="md-wake", annotations={api.WAKE_ANNOTATION: kopf.PRESENT})
def md_wake(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    """A gateway holds requests for a ModelDeployment at zero replicas and stamped the wake
    annotation: decide now, not on the next tick. Like the loop, this writes status only; the
    md-scaled handler then runs the pass that starts the replica. Every later event of the
    object comes here too, and the policy ignores a wake it has acted on."""
    if event["type"] == "DELETED" or "autoscaler" not in memo:
        return
    try:
        if memo["autoscaler"].wake(body):
            logging.getLogger(__name__).info(
                "woke %s/%s", body["metadata"].get("namespace"), body["metadata"]["name"]
            )
    except ApiException as error:  # the gateway wakes again, and the loop's tick sees it too
        logging.getLogger(__name__).warning("wake failed: %s %s", error.status, error.reason)


@kopf.on.event(*MD, id="md-fallback-target")
def md_fallback_target(event: kopf.RawEvent, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    """A ModelDeployment came or went: those naming it as a fallback pass again, so their
    FallbacksResolved condition says so now rather than on their next spec change. The listing
    at startup (type None) is left to the resume handlers."""
    if event["type"] not in ("ADDED", "DELETED"):
        return
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    if namespace is None:
        return
    controller: Controller = memo["controller"]
    try:
        users = controller.fallback_users(namespace, name)
    except ApiException as error:  # their next pass checks again
        logging.getLogger(__name__).warning("listing users of %s: %s", name, error.reason)
        return
    nodes, pods = kwargs["gpu_nodes"], kwargs["gpu_pods"]
    for user in users:
        _pass(memo, namespace, user, nodes, pods, 0, is_md_handler=False)


@kopf.on.delete(*MD, id="md-delete", optional=True)
def md_deleted(namespace: str | None, name: str, logger: Any, **_: Any) -> None:
    # No finalizer: owner references let the garbage collector remove Deployments and Service.
    logger.info(
        "ModelDeployment %s/%s deleted; children follow by owner reference", namespace, name
    )


@kopf.on.event("", "v1", "nodes", id="node-changes")
def node_changed(memo: Any, **kwargs: Any) -> None:
    # A per-object kopf timer would do this too, but kopf guards timers with a finalizer, and a
    # finalizer makes `kubectl delete` hang whenever the operator is down. One debounced loop
    # re-plans every ModelDeployment instead (controller.Replanner).
    memo["replanner"].notice(_values(kwargs["gpu_nodes"]), kwargs["gpu_nodes"], kwargs["gpu_pods"])


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS, id="child-deployment")
def child_deployment(event: kopf.RawEvent, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    owner = controller_owner(body)
    # ADDED is our own create (or the relisting after a restart, when resume handlers pass anyway).
    if owner is None or event["type"] == "ADDED":
        return
    status = body.get("status") or {}
    drifted = body["metadata"].get("generation", 0) != status.get("observedGeneration", 0)
    namespace, nodes, pods = body["metadata"]["namespace"], kwargs["gpu_nodes"], kwargs["gpu_pods"]
    deleted = event["type"] == "DELETED"
    if not memo["controller"].is_news(body, deleted):
        return
    if deleted or drifted:
        _pass(memo, namespace, owner, nodes, pods, 0, is_md_handler=False)
        return
    try:
        memo["controller"].refresh_status(namespace, owner, _values(nodes), _values(pods))
    except ApiException as error:  # the next status change refreshes again
        logging.getLogger(__name__).warning("status refresh failed: %s", error.reason)


@kopf.on.event("", "v1", "pods", labels=CHILD_LABELS, id="child-pod")
def child_pod(event: kopf.RawEvent, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    """A runtime pod stuck on a container (a failed model fetch, a missing Secret) shows in its
    ModelDeployment's conditions; Deployments report no such thing, so this watches the pods.
    A pod getting better needs no pass here: it turns Ready, and its Deployment's event comes."""
    if event["type"] == "DELETED" or conditions.pod_problem(body) is None:
        return
    owner = (body["metadata"].get("labels") or {}).get(manifests.LABEL_MODEL)
    if owner is None:
        return
    namespace, nodes, pods = body["metadata"]["namespace"], kwargs["gpu_nodes"], kwargs["gpu_pods"]
    try:
        memo["controller"].refresh_status(namespace, owner, _values(nodes), _values(pods))
    except ApiException as error:  # the pod's next status change refreshes again
        logging.getLogger(__name__).warning("status refresh failed: %s", error.reason)


@kopf.on.event("", "v1", "services", labels=CHILD_LABELS, id="child-service")
def child_service(event: kopf.RawEvent, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    owner = controller_owner(body)
    if owner is not None and event["type"] == "DELETED":
        namespace, nodes, pods = (
            body["metadata"]["namespace"],
            kwargs["gpu_nodes"],
            kwargs["gpu_pods"],
        )
        _pass(memo, namespace, owner, nodes, pods, 0, is_md_handler=False)


def _is_inference_pool_crd(name: str, **_: Any) -> bool:
    return name == INFERENCE_POOL_CRD


@kopf.on.event(
    "apiextensions.k8s.io",
    "v1",
    "customresourcedefinitions",
    when=_is_inference_pool_crd,
    id="inference-pool-crd",
)
def inference_pool_crd(event: kopf.RawEvent, memo: Any, **kwargs: Any) -> None:
    """The InferencePool CRD was installed (or changed) after the ModelDeployments that ask for
    a pool were planned: pass them again, so their pools appear now. The initial listing at
    startup (event type None) is left to the resume handlers, which pass every object anyway."""
    if event["type"] not in ("ADDED", "MODIFIED"):
        return
    controller: Controller = memo["controller"]
    try:
        users = controller.pool_users()
    except ApiException as error:  # the CRD's next event, or a spec change, asks again
        logging.getLogger(__name__).warning("listing pool users: %s", error.reason)
        return
    for namespace, name in users:
        _pass(
            memo, namespace, name, kwargs["gpu_nodes"], kwargs["gpu_pods"], 0, is_md_handler=False
        )


@kopf.on.event(
    "batch", "v1", "jobs", labels={model_cache.LABEL_CACHE: kopf.PRESENT}, id="model-cache-job"
)
def cache_job(event: kopf.RawEvent, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    """A model cache's fill Job moved on: every ModelDeployment using that cache passes again, to
    report it and, once it is Cached, to start replicas (the Job is shared, so not a child)."""
    namespace, claim = body["metadata"]["namespace"], body["metadata"]["name"]
    controller: Controller = memo["controller"]
    try:
        users = controller.cache_users(namespace, claim)
    except ApiException as error:  # the Job's next event asks again
        logging.getLogger(__name__).warning("listing users of %s: %s", claim, error.reason)
        return
    for name in users:
        _pass(
            memo, namespace, name, kwargs["gpu_nodes"], kwargs["gpu_pods"], 0, is_md_handler=False
        )


@kopf.on.event("batch", "v1", "jobs", labels={quality_job.LABEL_EVAL: kopf.PRESENT}, id="eval-job")
def eval_job(event: kopf.RawEvent, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    """An eval Job moved on (or expired): every ModelDeployment of that model with an eval set
    passes again, to record the measurement, re-plan with it, or retry a Job that expired."""
    namespace = body["metadata"]["namespace"]
    cache = (body["metadata"].get("labels") or {}).get(quality_job.LABEL_CACHE, "")
    controller: Controller = memo["controller"]
    try:
        mds = k8s.list_objects(controller.client, k8s.MD_API_VERSION, api.KIND, namespace)
    except ApiException as error:  # the Job's next event asks again
        logging.getLogger(__name__).warning("listing users of %s: %s", cache, error.reason)
        return
    for name in quality.users(mds, cache):
        _pass(
            memo, namespace, name, kwargs["gpu_nodes"], kwargs["gpu_pods"], 0, is_md_handler=False
        )
