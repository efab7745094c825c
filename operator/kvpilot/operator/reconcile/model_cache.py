"""The model cache: a PersistentVolumeClaim filled once by a Job, mounted read-only by every
replica (spec.model.cache), as KubeAI's cache profiles and KServe's LocalModelCache do it. Pure.

N replicas then do not download N times, and a scale-up loads from local storage. The claim and the
Job are named after the model's URI (`manifests.cache_claim_name`), so ModelDeployments of the
same model in a namespace share one cache. They are created once and never patched (a Job's pod
template is immutable, and a shared cache must not flip with one user's spec). Neither is owned
by a ModelDeployment unless `deleteWithModel` asks for it; each user then adds its own owner
reference, and the garbage collector deletes the cache with the last of them.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvpilot.contract import timestamps
from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning.planner import NodePlan
from kvpilot.operator.reconcile import jobs, manifests

Obj = Mapping[str, Any]

LABEL_CACHE = "kvpilot.dev/model-cache"
ANNOTATION_URI = "kvpilot.dev/model-uri"
# A failed fetch is retried this many times (each a new pod whose log says why) before the Job,
# and the cache with it, is Failed.
FILL_BACKOFF_LIMIT = 4
CHECKPOINT_BYTES_PER_PARAMETER = 2  # bf16/fp16 checkpoints, as hubs mostly publish them


def default_size(parameters: int) -> str:
    """Room for a 16-bit checkpoint, 20% for tokenizer files and the fetch's partial files, and
    1Gi for small models; an fp32 checkpoint needs cache.size set."""
    size = parameters * CHECKPOINT_BYTES_PER_PARAMETER * 1.2
    return f"{math.ceil(size / 2**30) + 1}Gi"


def owner_references(md: Obj, cache: api.ModelCache) -> list[dict[str, Any]]:
    if not cache.delete_with_model:
        return []
    reference = manifests.owner_reference(md)
    reference["controller"] = False  # shared: no single ModelDeployment controls it
    return [reference]


def build_claim(md: Obj, spec: api.ModelDeploymentSpec, parameters: int) -> manifests.Manifest:
    cache = _cache(spec)
    name = manifests.cache_claim_name(spec.model.uri)
    claim_spec: dict[str, Any] = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": cache.size or default_size(parameters)}},
    }
    if cache.storage_class_name is not None:
        claim_spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(md, spec, name),
        "spec": claim_spec,
    }


def build_fill_job(
    md: Obj, spec: api.ModelDeploymentSpec, node_plan: NodePlan, config: OperatorConfig
) -> manifests.Manifest:
    """The Job that fetches the model into the claim. It runs where the replicas will (the
    plan's node selector, without a GPU), so a ReadWriteOnce or zonal volume is reachable there."""
    name = manifests.cache_claim_name(spec.model.uri)
    # The fetch's summary (files, bytes, seconds) goes to the termination log, where `status`
    # reads it back; a failure's one-line error comes from the log (FallbackToLogsOnError).
    fetch = manifests.fetch_container(spec, config, "--summary-file=/dev/termination-log")
    pod = {
        "nodeSelector": dict(node_plan.node_type.node_selector),
        "tolerations": copy.deepcopy(manifests.GPU_TOLERATIONS),
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(manifests.POD_SECURITY),
        "containers": [fetch],
        "volumes": [
            *copy.deepcopy(manifests.SCRATCH_VOLUMES),
            {"name": "model", "persistentVolumeClaim": {"claimName": name}},
        ],
    }
    return jobs.build_job(
        name,
        md["metadata"]["namespace"],
        {LABEL_CACHE: name},
        {ANNOTATION_URI: spec.model.uri},
        {"spec": pod},
        backoff_limit=FILL_BACKOFF_LIMIT,
        owners=owner_references(md, _cache(spec)),
    )


def children(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    parameters: int,
    node_plan: NodePlan,
    config: OperatorConfig,
) -> list[manifests.Manifest]:
    """What the cache needs, claim first (the Job's pod waits for it to bind); [] without one."""
    if spec.model.cache is None:
        return []
    return [build_claim(md, spec, parameters), build_fill_job(md, spec, node_plan, config)]


def sources(spec: api.ModelDeploymentSpec) -> list[tuple[str, api.ModelDeploymentSpec]]:
    """What is cached, each as the spec its claim and fill Job are built from: spec.model ("")
    and every variant (its URI and Secret as spec.model, `manifests.served_spec`). Every variant
    is filled, served or not: its eval Job reads it from the cache, and a node type whose plan
    turns to it then starts from local storage."""
    return [
        ("", spec),
        *(
            (v.name, spec.model_copy(update={"model": spec.model.variant(v.name)}))
            for v in spec.model.variants
        ),
    ]


def all_children(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    parameters: Mapping[str, int],
    plans: Sequence[NodePlan],
    config: OperatorConfig,
) -> list[manifests.Manifest]:
    """Every source's cache (`sources`); [] without spec.model.cache. `parameters`: per source
    name, its parameter count (the claim's default size). A fill Job runs where a node type
    serving its source was planned, else where the first fitting one was."""
    fitting = [p for p in plans if p.fits]
    found: list[manifests.Manifest] = []
    for name, source in sources(spec):
        node_plan = next((p for p in fitting if p.variant == name), fitting[0])
        found += children(md, source, parameters[name], node_plan, config)
    return found


def status(claim_name: str, job: Obj | None, pods: Sequence[Obj]) -> api.CacheStatus:
    """The cache as its fill Job and the Job's pods report it."""
    if job is None:
        return api.CacheStatus(claim_name=claim_name, phase="Pending", message="fill Job not made")
    job_status = job.get("status") or {}
    finished = {
        c.get("type"): c for c in job_status.get("conditions") or [] if c.get("status") == "True"
    }
    if "Complete" in finished:
        summary = _summary(pods)
        seconds = _seconds_between(job_status.get("startTime"), job_status.get("completionTime"))
        return api.CacheStatus(
            claim_name=claim_name,
            phase="Cached",
            bytes=summary.get("bytes"),
            files=summary.get("files"),
            duration_seconds=summary.get("seconds", seconds),
        )
    failure = _last_failure(pods)
    if "Failed" in finished:
        why = finished["Failed"].get("message") or finished["Failed"].get("reason") or ""
        message = "; ".join(part for part in (why, failure) if part)
        return api.CacheStatus(claim_name=claim_name, phase="Failed", message=message)
    return api.CacheStatus(claim_name=claim_name, phase="Downloading", message=failure)


def _summary(pods: Sequence[Obj]) -> dict[str, Any]:
    """The fetch's JSON summary from the succeeded pod's termination message; {} if unreadable."""
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Succeeded":
            continue
        try:
            summary = json.loads(_terminated(pod).get("message") or "")
        except ValueError:
            continue
        if isinstance(summary, dict):
            return summary
    return {}


def _last_failure(pods: Sequence[Obj]) -> str:
    """The newest failed attempt's last log line (the fetch's one-line error), or ''."""
    failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
    failed.sort(key=lambda p: p["metadata"].get("creationTimestamp") or "")
    for pod in reversed(failed):
        lines = (_terminated(pod).get("message") or "").strip().splitlines()
        if lines:
            return lines[-1]
    return ""


def _terminated(pod: Obj) -> Obj:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return (statuses[0].get("state") or {}).get("terminated") or {}


def _seconds_between(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    return (timestamps.parse(end) - timestamps.parse(start)).total_seconds()


def _cache(spec: api.ModelDeploymentSpec) -> api.ModelCache:
    if spec.model.cache is None:
        raise ValueError("spec.model.cache is not set")
    return spec.model.cache


def _metadata(md: Obj, spec: api.ModelDeploymentSpec, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": md["metadata"]["namespace"],
        "labels": {LABEL_CACHE: name, manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY},
        "annotations": {ANNOTATION_URI: spec.model.uri},
        "ownerReferences": owner_references(md, _cache(spec)),
    }
