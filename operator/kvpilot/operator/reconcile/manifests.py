"""Kubernetes objects for a ModelDeployment, built as data by pure `build_*` functions.

One Deployment `<name>-<node type>` per node type in use (GPU count, node selector and runtime
flags from that node type's plan), one Service across them, and optionally a PodMonitor. The pod
template carries a hash of everything the plan decided, so a changed plan rolls the pods even when
the change would otherwise be invisible in the template.

This module owns the objects; the pod inside a Deployment is runtime_pod.py's, the volumes and
mounts that hold the model and adapters volumes.py's, the children's names and labels naming.py's.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvpilot.contract.resource import LABEL_MODEL, LABEL_NODE_TYPE
from kvpilot.operator import api
from kvpilot.operator.autoscaling import metrics_reader
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning.planner import NodePlan

# The names (naming.py), the pod (runtime_pod.py) and its volumes (volumes.py) are this module's
# API too: callers name them as manifests.X.
from kvpilot.operator.reconcile.naming import (
    ANNOTATION_SPEC_HASH,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    MAX_NAME,
    Obj,
    child_name,
    labels,
    owner_reference,
    selector_labels,
    spec_hash,
)
from kvpilot.operator.reconcile.runtime_pod import (
    CONTAINER_SECURITY,
    DRAIN_DELAY_SECONDS,
    GPU_TOLERATIONS,
    MAX_NUM_SEQS_CAP,
    POD_SECURITY,
    READINESS_PERIOD_S,
    RUNTIME_UID,
    SCRATCH_VOLUMES,
    STARTUP_BOUND_S,
    adapter_secret,
    batch_limit,
    container_env,
    expected_checkpoint,
    fetch_container,
    gpu_resources,
    kv_offload_values,
    lora_env,
    lora_values,
    max_num_seqs,
    pod_spec,
    runtime_args,
    task_container,
)
from kvpilot.operator.reconcile.volumes import (
    CACHE_MOUNT,
    DRAFT_MOUNT,
    DRAFT_VOLUME,
    GIB,
    KV_DISK_HEADROOM,
    KV_DISK_MOUNT,
    KV_DISK_VOLUME,
    LORA_CLAIMS_MOUNT,
    MIB,
    MODEL_MOUNT,
    SCRATCH_MOUNT,
    ModelMount,
    adapter_claim_volumes,
    adapter_claims,
    cache_claim_name,
    draft_location,
    kv_disk_volume,
    model_location,
    quantity,
)

__all__ = [
    "ANNOTATION_SPEC_HASH",
    "CACHE_MOUNT",
    "CONTAINER_SECURITY",
    "DRAFT_MOUNT",
    "DRAFT_VOLUME",
    "DRAIN_DELAY_SECONDS",
    "ENGINE_TYPE",
    "GIB",
    "GPU_TOLERATIONS",
    "INFERENCE_POOL_API_VERSION",
    "KV_DISK_HEADROOM",
    "KV_DISK_MOUNT",
    "KV_DISK_VOLUME",
    "LABEL_ENGINE_TYPE",
    "LABEL_MANAGED_BY",
    "LABEL_MODEL",
    "LABEL_NODE_TYPE",
    "LORA_CLAIMS_MOUNT",
    "MANAGED_BY",
    "MAX_NAME",
    "MAX_NUM_SEQS_CAP",
    "MIB",
    "MODEL_MOUNT",
    "POD_SECURITY",
    "READINESS_PERIOD_S",
    "RUNTIME_UID",
    "SCRATCH_MOUNT",
    "SCRATCH_VOLUMES",
    "STARTUP_BOUND_S",
    "Manifest",
    "ModelMount",
    "Obj",
    "adapter_claim_volumes",
    "adapter_claims",
    "adapter_secret",
    "batch_limit",
    "build_all",
    "build_deployment",
    "build_inference_pool",
    "build_pod_monitor",
    "build_service",
    "cache_claim_name",
    "child_name",
    "container_env",
    "deep_merge",
    "draft_location",
    "endpoint",
    "expected_checkpoint",
    "fetch_container",
    "gpu_resources",
    "kv_disk_volume",
    "kv_offload_values",
    "labels",
    "lora_env",
    "lora_values",
    "max_num_seqs",
    "model_location",
    "owner_reference",
    "pod_spec",
    "quantity",
    "runtime_args",
    "selector_labels",
    "served_spec",
    "spec_hash",
    "task_container",
]

# The Gateway API Inference Extension's endpoint pickers read the engine's metrics by its names;
# the runtime exports vLLM's (DESIGN.md §3.4), so its pods say they are vLLM-compatible.
LABEL_ENGINE_TYPE = "inference.networking.k8s.io/engine-type"
ENGINE_TYPE = "vllm"
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"

Manifest = dict[str, Any]


def served_spec(spec: api.ModelDeploymentSpec, node_plan: NodePlan) -> api.ModelDeploymentSpec:
    """The spec as the node type's pods see it: spec.model is the variant planned there (its
    URI fetched, its Secret), served under spec.model's name."""
    if not node_plan.variant:
        return spec
    return spec.model_copy(update={"model": spec.model.variant(node_plan.variant)})


def build_deployment(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    node_plan: NodePlan,
    replicas: int,
    config: OperatorConfig,
) -> Manifest:
    md_name, node_type = md["metadata"]["name"], node_plan.node_type.name
    spec = served_spec(spec, node_plan)
    pod_labels = labels(md_name, node_type)
    template = {
        "metadata": {
            "labels": {**pod_labels, LABEL_ENGINE_TYPE: ENGINE_TYPE},
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(config.runtime_port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec(spec, node_plan, config),
    }
    template = deep_merge(template, spec.runtime.pod_template)
    template["metadata"].setdefault("annotations", {})[ANNOTATION_SPEC_HASH] = spec_hash(template)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(md, child_name(md_name, node_type), pod_labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {LABEL_MODEL: md_name, LABEL_NODE_TYPE: node_type}},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
            },
            "template": template,
        },
    }


def build_service(md: Obj, config: OperatorConfig) -> Manifest:
    md_name = md["metadata"]["name"]
    return _named_like_md(
        md,
        "v1",
        "Service",
        {
            "type": "ClusterIP",
            "selector": selector_labels(md_name),
            "ports": [{"name": "http", "port": config.runtime_port, "targetPort": "http"}],
        },
    )


def build_pod_monitor(md: Obj) -> Manifest:
    md_name = md["metadata"]["name"]
    return _named_like_md(
        md,
        "monitoring.coreos.com/v1",
        "PodMonitor",
        {
            "selector": {"matchLabels": selector_labels(md_name)},
            "podMetricsEndpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    # a TTFT SLO's forecast reads arrivals as a 30 s rate(): six samples
                    "interval": "5s",
                    "relabelings": _series_labels(),
                }
            ],
        },
    )


def build_inference_pool(
    md: Obj, picker: api.EndpointPickerRef, config: OperatorConfig
) -> Manifest:
    """The Inference Extension's InferencePool over this ModelDeployment's runtime pods, so a
    Gateway with an endpoint picker (Envoy Gateway, kgateway, Istio) routes to them unchanged."""
    md_name = md["metadata"]["name"]
    return _named_like_md(
        md,
        INFERENCE_POOL_API_VERSION,
        "InferencePool",
        {
            "selector": {"matchLabels": selector_labels(md_name)},
            "targetPorts": [{"number": config.runtime_port}],
            "endpointPickerRef": picker.model_dump(by_alias=True, exclude_none=True),
        },
    )


def _named_like_md(md: Obj, api_version: str, kind: str, spec: dict[str, Any]) -> Manifest:
    """A child that stands for the whole ModelDeployment (not one node type's Deployment): it
    takes the ModelDeployment's name and its labels without a node type."""
    md_name = md["metadata"]["name"]
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _metadata(md, md_name, labels(md_name)),
        "spec": spec,
    }


def _series_labels() -> list[dict[str, Any]]:
    """Pod labels -> the series labels the autoscaler's PromQL groups by
    (metrics_reader.PROM_LABEL_*), as the dev cluster's Prometheus config makes them too; the
    Prometheus Operator adds `namespace` and `pod` itself."""
    return [
        {
            "sourceLabels": [f"__meta_kubernetes_pod_label_{_prom_name(label)}"],
            "targetLabel": target,
        }
        for label, target in (
            (LABEL_MODEL, metrics_reader.PROM_LABEL_MODEL),
            (LABEL_NODE_TYPE, metrics_reader.PROM_LABEL_NODE_TYPE),
        )
    ]


def _prom_name(label: str) -> str:
    """A Kubernetes label as kubernetes_sd names it: every character not [a-zA-Z0-9_] -> `_`."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def build_all(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    plans: Sequence[NodePlan],
    replicas: Sequence[int],
    config: OperatorConfig,
    has_pod_monitor_crd: bool = False,
    has_inference_pool_crd: bool = False,
) -> list[Manifest]:
    """Every child the ModelDeployment should have; anything else it owns is stale."""
    children = [
        build_deployment(md, spec, p, n, config)
        for p, n in zip(plans, replicas, strict=True)
        if p.fits and (n > 0 or p is _first_fitting(plans))
    ]
    children.append(build_service(md, config))
    if spec.monitoring.pod_monitor and has_pod_monitor_crd:
        children.append(build_pod_monitor(md))
    picker = spec.routing.endpoint_picker_ref
    if picker is not None and has_inference_pool_crd:
        children.append(build_inference_pool(md, picker, config))
    return children


def _first_fitting(plans: Sequence[NodePlan]) -> NodePlan | None:
    # Kept even at zero replicas, so scale-from-zero has a Deployment to scale.
    return next((p for p in plans if p.fits), None)


def endpoint(md: Obj, config: OperatorConfig) -> str:
    meta = md["metadata"]
    return f"http://{meta['name']}.{meta['namespace']}.svc:{config.runtime_port}/v1"


def _metadata(md: Obj, name: str, child_labels: Mapping[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": md["metadata"]["namespace"],
        "labels": dict(child_labels),
        "ownerReferences": [owner_reference(md)],
    }


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` wins; nested mappings merge, lists and scalars replace."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
