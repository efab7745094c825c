"""Kubernetes objects for a ModelDeployment, built as data by pure `build_*` functions.

One Deployment `<name>-<node type>` per node type in use (GPU count, node selector and runtime
flags from that node type's plan), one Service across them, and optionally a PodMonitor. The pod
template carries a hash of everything the plan decided, so a changed plan rolls the pods even when
the change would otherwise be invisible in the template.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.contract import adapter_cache, resource, serve_config
from kvpilot.contract.model_source import parse_model_uri
from kvpilot.contract.resource import LABEL_MODEL, LABEL_NODE_TYPE
from kvpilot.operator import api
from kvpilot.operator.autoscaling import metrics_reader
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning.inventory import GPU_RESOURCE
from kvpilot.operator.planning.planner import NodePlan, memory_request_bytes, user_memory_bytes

# The Gateway API Inference Extension's endpoint pickers read the engine's metrics by its names;
# the runtime exports vLLM's (DESIGN.md §3.4), so its pods say they are vLLM-compatible.
LABEL_ENGINE_TYPE = "inference.networking.k8s.io/engine-type"
ENGINE_TYPE = "vllm"
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
RUNTIME_UID = 10001  # the user runtime/Dockerfile creates
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_SPEC_HASH = "kvpilot.dev/spec-hash"
MANAGED_BY = "kvpilot-operator"
MODEL_MOUNT = "/mnt/models"
DRAFT_MOUNT = "/mnt/draft-model"  # speculative draft_model: fetched by its own init container
DRAFT_VOLUME = "draft-model"
CACHE_MOUNT = "/var/cache/kvpilot"
KV_DISK_MOUNT = "/var/lib/kvpilot/kv-offload"  # spec.runtime.kvOffload.disk's volume
KV_DISK_VOLUME = "kv-offload"
LORA_CLAIMS_MOUNT = "/mnt/lora-claims"  # pvc:// adapters' claims, each at its name under it
# An emptyDir disk tier's sizeLimit over its budget: each block file's header, and the one file
# being written under a temporary name, are not counted in the runtime's budget.
KV_DISK_HEADROOM = 1.05
GIB, MIB = api.GIB, api.MIB
# An emptyDir: the one writable scratch under readOnlyRootFilesystem (it hides what the image, or a
# local-pool node, has at that path).
SCRATCH_MOUNT = "/tmp"
MAX_NAME = 63
MAX_NUM_SEQS_CAP = (
    256  # the batch the runtime schedules; more KV room serves longer prompts instead
)
# A runtime loading its model for longer than this is restarted (a large model from slow storage
# takes minutes; the 15 minutes the startup probe has always allowed).
STARTUP_BOUND_S = 900
# Once started, how soon a replica that stops being ready (draining, overloaded) leaves the
# Service: 3 failures of 2 s.
READINESS_PERIOD_S = 2
DRAIN_DELAY_SECONDS = 5  # lets endpoints drop the pod before SIGTERM starts the runtime's drain
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}

Obj = Mapping[str, Any]
Manifest = dict[str, Any]


def child_name(md_name: str, node_type: str) -> str:
    """`<name>-<node type>`, shortened with a stable hash when it would pass 63 characters."""
    name = f"{md_name}-{node_type}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME - 9].rstrip('-')}-{digest}"


def selector_labels(md_name: str) -> dict[str, str]:
    return {LABEL_MODEL: md_name}


def labels(md_name: str, node_type: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "kvpilot-runtime",
        "app.kubernetes.io/instance": md_name,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_MODEL: md_name,
    }
    if node_type:
        out[LABEL_NODE_TYPE] = node_type
    return out


def owner_reference(md: Obj) -> dict[str, Any]:
    meta = md["metadata"]
    return {
        "apiVersion": f"{resource.GROUP}/{resource.VERSION}",
        "kind": resource.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def spec_hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ModelMount:
    """How the pod reaches the model: the --model value, the volume and mounts that hold it,
    and for hf:// and s3:// the init container that fetches it into that volume."""

    model_arg: str
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    needs_fetch: bool


def cache_claim_name(uri: str) -> str:
    """The model cache's claim (and fill Job) name: one per model source in a namespace, so
    ModelDeployments of the same model share it."""
    return f"kvpilot-model-cache-{spec_hash(uri)}"


def model_location(model: api.ModelSource) -> ModelMount:
    source = parse_model_uri(model.uri)
    read_only_mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if model.cache is not None:  # filled once by the cache Job (reconcile/model_cache.py)
        claim = {"claimName": cache_claim_name(model.uri), "readOnly": True}
        volume = {"name": "model", "persistentVolumeClaim": claim}
        return ModelMount(f"file://{MODEL_MOUNT}", [volume], [read_only_mount], needs_fetch=False)
    if source.scheme == "pvc":
        claim = {"claimName": source.location, "readOnly": True}
        volume = {"name": "model", "persistentVolumeClaim": claim}
        path = f"file://{MODEL_MOUNT}/{source.path}".rstrip("/")
        return ModelMount(path, [volume], [read_only_mount], needs_fetch=False)
    if source.is_fetched:
        volume = {"name": "model", "emptyDir": {}}
        return ModelMount(f"file://{MODEL_MOUNT}", [volume], [read_only_mount], needs_fetch=True)
    return ModelMount(model.uri, [], [], needs_fetch=False)


def draft_location(spec: api.ModelDeploymentSpec) -> ModelMount | None:
    """Where the pod holds spec.serving.speculative's draft model, if it names one: its own
    emptyDir, filled by its own init container (fetch_container with `draft`)."""
    if api.draft_source(spec) is None:
        return None
    volume = {"name": DRAFT_VOLUME, "emptyDir": {}}
    mount = {"name": DRAFT_VOLUME, "mountPath": DRAFT_MOUNT, "readOnly": True}
    return ModelMount(DRAFT_MOUNT, [volume], [mount], needs_fetch=True)


def runtime_args(
    spec: api.ModelDeploymentSpec, node_plan: NodePlan, port: int, grace_seconds: int
) -> list[str]:
    """`serve` flags by the runtime's own field names (serve_config.to_args refuses any other);
    optional ones only when they differ from the runtime's default."""
    # The runtime drains on SIGTERM; it must finish before the kubelet's SIGKILL, which comes
    # `grace_seconds` after the preStop hook started, with a margin for the process to exit.
    shutdown_timeout = max(1, grace_seconds - DRAIN_DELAY_SECONDS - 10)
    values = {
        "model": model_location(spec.model).model_arg,
        "served_name": api.served_name(spec.model),
        "quantization": node_plan.quantization,
        "max_model_len": spec.serving.max_context_length,
        "max_num_seqs": max_num_seqs(spec, node_plan),
        "gpu_memory_utilization": spec.serving.gpu_memory_utilization,
        "port": port,
        "shutdown_timeout": shutdown_timeout,
        "tensor_parallel_size": node_plan.tensor_parallel
        if node_plan.tensor_parallel > 1
        else None,
        "kv_cache_dtype": None
        if spec.serving.kv_cache_dtype == "auto"
        else spec.serving.kv_cache_dtype,
        "speculative_config": None
        if spec.serving.speculative is None
        else spec.serving.speculative.runtime_json(DRAFT_MOUNT),
        **kv_offload_values(spec.runtime.kv_offload),
        **lora_values(spec),
        "scheduling_policy": None
        if spec.serving.scheduling_policy == "fcfs"
        else spec.serving.scheduling_policy,
        "expect_checkpoint": expected_checkpoint(spec, node_plan),
    }
    return ["serve", *serve_config.to_args(values)]


def expected_checkpoint(spec: api.ModelDeploymentSpec, node_plan: NodePlan) -> str | None:
    """The kind of checkpoint the pod must find (its --expect-checkpoint) where the plan came
    from a config.json the user gave (spec.model.configMapRef), not from the checkpoint the pod
    loads: planned as AWQ int4, a 16-bit checkpoint there would be quantised to int4 at load and
    served as something never planned. None elsewhere (what was read is what is fetched), so
    other pods keep the args they had."""
    if spec.model.config_map_ref is None or node_plan.variant:
        return None
    return node_plan.checkpoint


def kv_offload_values(offload: api.KvOffload | None) -> dict[str, object]:
    """The runtime's KV-tier flags for spec.runtime.kvOffload (none when it is absent)."""
    if offload is None:
        return {}
    disk = offload.disk
    return {
        "kv_offloading_size": offload.host_gi_b,
        "kv_offloading_disk_path": None if disk is None else KV_DISK_MOUNT,
        "kv_offloading_disk_size": None if disk is None else disk.size_gi_b,
    }


def kv_disk_volume(offload: api.KvOffload | None) -> dict[str, Any] | None:
    """The disk tier's volume: the claim or hostPath the spec names, else an emptyDir sized to
    the tier (so the kubelet evicts a pod whose tier outgrew it rather than fill the node)."""
    disk = None if offload is None else offload.disk
    if disk is None:
        return None
    if disk.claim_name is not None:
        return {"name": KV_DISK_VOLUME, "persistentVolumeClaim": {"claimName": disk.claim_name}}
    if disk.host_path is not None:
        return {
            "name": KV_DISK_VOLUME,
            "hostPath": {"path": disk.host_path, "type": "DirectoryOrCreate"},
        }
    limit = quantity(math.ceil(disk.size_gi_b * KV_DISK_HEADROOM * GIB / MIB) * MIB)
    return {"name": KV_DISK_VOLUME, "emptyDir": {"sizeLimit": limit}}


def quantity(num_bytes: int) -> str:
    """Bytes as a Kubernetes quantity in the largest binary unit that holds them whole."""
    for suffix, size in (("Ti", 2**40), ("Gi", GIB), ("Mi", MIB), ("Ki", 2**10)):
        if num_bytes % size == 0:
            return f"{num_bytes // size}{suffix}"
    return str(num_bytes)


def lora_values(spec: api.ModelDeploymentSpec) -> dict[str, Any]:
    """The runtime's LoRA slots (spec.lora). Not the adapters: adapters/sync.py loads them
    through the runtime's API, so the template, and so the pods, stay when adapters change."""
    if not spec.lora_enabled:
        return {}
    slots = spec.lora_slots
    return {
        "enable_lora": True,
        "max_loras": slots.max_loras,
        "max_lora_rank": slots.max_lora_rank,
        "max_cpu_loras": slots.max_cpu_loras,
        # with the model cache, the adapters' fill Jobs put them in its claim (adapters/cache_fill)
        "lora_cache_dir": None
        if spec.model.cache is None
        else f"{MODEL_MOUNT}/{adapter_cache.CACHE_SUBDIR}",
        "lora_claims": tuple(f"{c}={LORA_CLAIMS_MOUNT}/{c}" for c in adapter_claims(spec)),
    }


def adapter_claims(spec: api.ModelDeploymentSpec) -> list[str]:
    """The claims pvc:// adapters name, sorted: each mounted read-only at LORA_CLAIMS_MOUNT/CLAIM
    (a claim new to the spec changes the template, so it rolls the pods; its adapters do not)."""
    sources = (parse_model_uri(a.uri) for a in spec.adapters)
    return sorted({s.location for s in sources if s.scheme == "pvc"})


def adapter_claim_volumes(
    spec: api.ModelDeploymentSpec,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pvc:// adapters' claims as the pod's volumes and the runtime's read-only mounts."""
    claims = adapter_claims(spec)
    volumes = [
        {"name": f"lora-claim-{i}", "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
        for i, c in enumerate(claims)
    ]
    mounts = [
        {"name": f"lora-claim-{i}", "mountPath": f"{LORA_CLAIMS_MOUNT}/{c}", "readOnly": True}
        for i, c in enumerate(claims)
    ]
    return volumes, mounts


def adapter_secret(spec: api.ModelDeploymentSpec) -> str | None:
    """The Secret the runtime fetches adapters with (one: api checks the adapters agree)."""
    return next(iter(api.adapter_secrets(spec)), None)


def fetch_container(
    spec: api.ModelDeploymentSpec,
    config: OperatorConfig,
    *extra_args: str,
    draft: api.ModelSource | None = None,
) -> dict[str, Any]:
    """The container that copies an hf:// or s3:// model into the model volume (a pod's init
    container, or the cache fill Job's), or with `draft` the speculative draft model into its
    volume; the Secret named by spec.model.secretRef is its environment (tokens never appear in
    the spec)."""
    uri, volume, mount = (
        (spec.model.uri, "model", MODEL_MOUNT)
        if draft is None
        else (draft.uri, DRAFT_VOLUME, DRAFT_MOUNT)
    )
    mounts = [
        {"name": "cache", "mountPath": CACHE_MOUNT},
        {"name": "tmp", "mountPath": SCRATCH_MOUNT},
        {"name": volume, "mountPath": mount},
    ]
    return task_container(
        "fetch-model" if draft is None else "fetch-draft-model",
        spec.runtime.image or config.runtime_image,
        ["fetch", f"--model={uri}", f"--to={mount}", *extra_args],
        container_env(spec),
        mounts,
        secret=None if spec.model.secret_ref is None else spec.model.secret_ref.name,
    )


def task_container(
    name: str,
    image: str,
    args: list[str],
    env: list[dict[str, Any]],
    mounts: list[dict[str, Any]],
    *,
    secret: str | None = None,
    resources: dict[str, Any] | None = None,
    security: dict[str, Any] = CONTAINER_SECURITY,
) -> dict[str, Any]:
    """A container that runs one `kvpilot-runtime` subcommand (`args`) to completion: a fetch
    (an init container, a cache fill Job's) or an eval Job's. `secret`: a Secret whose keys are
    its environment (tokens never appear in the spec)."""
    container: dict[str, Any] = {
        "name": name,
        "image": image,  # no `command`: its ENTRYPOINT runs kvpilot-runtime under tini
        "args": args,
        "env": env,
        # Its --summary-file=/dev/termination-log, or on a failure its log's one-line error, is
        # the pod's termination message, which the operator reads back (status, conditions).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **({} if resources is None else {"resources": resources}),
        "securityContext": security,
        "volumeMounts": mounts,
    }
    return {**container, **_secret_env(secret)}


def container_env(spec: api.ModelDeploymentSpec) -> list[dict[str, str]]:
    env = [{"name": "HF_HOME", "value": CACHE_MOUNT}]
    return env + [{"name": e.name, "value": e.value} for e in spec.runtime.env]


def lora_env(spec: api.ModelDeploymentSpec) -> list[dict[str, str]]:
    """vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, which the operator
    calls to change a running pod's adapters."""
    if not spec.lora_enabled:
        return []
    return [{"name": serve_config.LORA_RUNTIME_UPDATES_ENV, "value": "true"}]


def _secret_env(secret: str | None) -> dict[str, Any]:
    return {} if secret is None else {"envFrom": [{"secretRef": {"name": secret}}]}


def max_num_seqs(spec: api.ModelDeploymentSpec, node_plan: NodePlan) -> int:
    return batch_limit(spec.serving, node_plan.max_concurrency)


def batch_limit(serving: api.Serving, max_concurrency: int) -> int:
    """The runtime's --max-num-seqs: the user's cap if given; else what the plan holds at full
    context (`max_concurrency`), capped, but never below the target concurrency."""
    if serving.max_num_seqs is not None:
        return serving.max_num_seqs
    return max(serving.target_concurrency, min(max_concurrency, MAX_NUM_SEQS_CAP))


def gpu_resources(spec: api.ModelDeploymentSpec, gpus: int) -> dict[str, dict[str, str]]:
    """The user's requests and limits with the GPUs, and the memory grown by the host KV tier:
    the request always (the scheduler then places the tier), the limit only where one is set."""
    requests = dict(spec.runtime.resources.get("requests", {}))
    limits = dict(spec.runtime.resources.get("limits", {}))
    requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(gpus)
    offload = spec.runtime.kv_offload
    if offload is not None:
        requests["memory"] = quantity(memory_request_bytes(spec))
        if "memory" in limits:
            limits["memory"] = quantity(user_memory_bytes(spec, "limits") + offload.host_bytes)
    return {"requests": requests, "limits": limits}


def _container(
    spec: api.ModelDeploymentSpec, node_plan: NodePlan, config: OperatorConfig
) -> dict[str, Any]:
    draft = draft_location(spec)
    model_mounts = [*model_location(spec.model).mounts, *(draft.mounts if draft else [])]
    if kv_disk_volume(spec.runtime.kv_offload) is not None:
        model_mounts.append({"name": KV_DISK_VOLUME, "mountPath": KV_DISK_MOUNT})
    model_mounts += adapter_claim_volumes(spec)[1]
    port = config.runtime_port
    return {
        "name": "runtime",
        "image": spec.runtime.image or config.runtime_image,
        # No `command`: the image's ENTRYPOINT (`tini -- kvpilot-runtime`) runs these args, so
        # tini stays PID 1, forwarding SIGTERM and reaping the server's children.
        "args": runtime_args(spec, node_plan, port, config.termination_grace_seconds),
        # A runtime that cannot start says why in its last log line; the pod status carries it
        # to the ModelDeployment's Degraded condition (conditions.pod_problem).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": container_env(spec) + lora_env(spec),
        **_secret_env(adapter_secret(spec)),
        "resources": gpu_resources(spec, node_plan.tensor_parallel),
        "readinessProbe": _probe("/ready", period=READINESS_PERIOD_S, failures=3),
        "livenessProbe": _probe("/health", period=10, failures=6),
        # On /ready every second, so the pod is Ready within a second of its engine (a start
        # is seconds: docs/benchmarks.md, cold start); it holds liveness off while the weights
        # load, up to STARTUP_BOUND_S.
        "startupProbe": _probe("/ready", period=1, failures=STARTUP_BOUND_S),
        "lifecycle": {"preStop": {"sleep": {"seconds": DRAIN_DELAY_SECONDS}}},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [
            {"name": "cache", "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": SCRATCH_MOUNT},
            *model_mounts,
        ],
    }


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 3,
    }


# runtime/Dockerfile's user; above 10000 so it maps to no user of the node
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": RUNTIME_UID,
    "runAsGroup": RUNTIME_UID,
    "fsGroup": RUNTIME_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
GPU_TOLERATIONS = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
SCRATCH_VOLUMES = [
    {"name": "cache", "emptyDir": {}},
    {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
]


def pod_spec(
    spec: api.ModelDeploymentSpec, node_plan: NodePlan, config: OperatorConfig
) -> dict[str, Any]:
    model, draft = model_location(spec.model), draft_location(spec)
    pod: dict[str, Any] = {
        "nodeSelector": dict(node_plan.node_type.node_selector),
        "tolerations": copy.deepcopy(GPU_TOLERATIONS),
        "terminationGracePeriodSeconds": config.termination_grace_seconds,
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY),
        "containers": [_container(spec, node_plan, config)],
        "volumes": [
            *copy.deepcopy(SCRATCH_VOLUMES),
            *model.volumes,
            *(draft.volumes if draft else []),
            *filter(None, [kv_disk_volume(spec.runtime.kv_offload)]),
            *adapter_claim_volumes(spec)[0],
        ],
    }
    fetches = [fetch_container(spec, config)] if model.needs_fetch else []
    if draft is not None:
        fetches.append(fetch_container(spec, config, draft=api.draft_source(spec)))
    if fetches:
        pod["initContainers"] = fetches
    return pod


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
