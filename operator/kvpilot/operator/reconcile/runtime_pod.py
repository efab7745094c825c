"""The runtime pod's spec: the runtime container with its `serve` args, environment, resources
and probes, the init containers that fetch the model (and any `kvpilot-runtime` task container:
fetch, cache fill, eval), and the pod around them (security, tolerations, volumes).
"""

from __future__ import annotations

import copy
from typing import Any

from kvpilot.contract import adapter_cache, serve_config
from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning.inventory import GPU_RESOURCE
from kvpilot.operator.planning.planner import NodePlan, memory_request_bytes, user_memory_bytes
from kvpilot.operator.reconcile.volumes import (
    CACHE_MOUNT,
    DRAFT_MOUNT,
    DRAFT_VOLUME,
    KV_DISK_MOUNT,
    KV_DISK_VOLUME,
    LORA_CLAIMS_MOUNT,
    MODEL_MOUNT,
    SCRATCH_MOUNT,
    adapter_claim_volumes,
    adapter_claims,
    draft_location,
    kv_disk_volume,
    model_location,
    quantity,
)

RUNTIME_UID = 10001  # the user runtime/Dockerfile creates
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
