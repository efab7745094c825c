"""Manifests: the Deployment/Service/PodMonitor data, checked field by field and against the
Kubernetes 1.37 OpenAPI schema (kubernetes-validate, strict: unknown fields fail)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvpilot.contract.memory import ModelFacts
from kvpilot.operator import api
from kvpilot.operator.autoscaling import metrics_reader
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.reconcile import manifests

CONFIG = OperatorConfig(runtime_image="registry.local/kvpilot-runtime:test")
MD = {
    "apiVersion": "kvpilot.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "qwen", "namespace": "ml", "uid": "1234-uid", "generation": 3},
}
H100 = NodeType(
    name="h100-80gb",
    product="NVIDIA-H100-80GB-HBM3",
    gpu_memory_mib=81559,
    gpus_per_node=8,
    price_per_hour=98.32,
    node_selector={"kvpilot.dev/node-type": "h100-80gb"},
    nodes=("h0",),
    free_gpus_per_node=(8,),
)
FACTS = ModelFacts(parameters=70_000_000_000, layers=80, kv_heads=8, head_dim=128)


def spec(**overrides: Any) -> api.ModelDeploymentSpec:
    data: dict[str, Any] = {"model": {"uri": "hf://Qwen/Qwen2.5-72B-Instruct"}}
    data.update(overrides)
    return api.parse_spec(data)


def plan_for(s: api.ModelDeploymentSpec) -> planner.NodePlan:
    return planner.plan_node_type(planner.PlanRequest.from_spec(s, FACTS), H100)


def deployment(s: api.ModelDeploymentSpec | None = None, replicas: int = 2) -> dict[str, Any]:
    s = s or spec()
    return manifests.build_deployment(MD, s, plan_for(s), replicas, CONFIG)


def test_deployment_carries_the_plan() -> None:
    d = deployment()
    pod = d["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert d["metadata"]["name"] == "qwen-h100-80gb"
    assert d["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"
    assert d["spec"]["replicas"] == 2
    assert d["spec"]["selector"]["matchLabels"] == {
        "kvpilot.dev/model": "qwen",
        "kvpilot.dev/node-type": "h100-80gb",
    }
    assert pod["nodeSelector"] == {"kvpilot.dev/node-type": "h100-80gb"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # 70B bf16 at 4096 x 8 (10 GiB KV): tp 2 needs 65.2 + 5 + 4.3 = 74.5 > 71.7 GiB -> tp 4
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert container["image"] == CONFIG.runtime_image
    assert container["args"] == [
        "serve",
        "--model=file:///mnt/models",  # the init container fetched hf:// into this volume
        "--served-name=Qwen2.5-72B-Instruct",
        "--quantization=bf16",
        "--max-model-len=4096",
        f"--max-num-seqs={min(plan_for(spec()).max_concurrency, 256)}",
        "--gpu-memory-utilization=0.9",
        "--port=8000",
        "--shutdown-timeout=105",  # 120 s grace - 5 s preStop - 10 s margin
        "--tensor-parallel-size=4",
    ]


def test_pod_is_safe_and_drains() -> None:
    template = deployment()["spec"]["template"]
    pod, (container,) = template["spec"], template["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    # Ready as soon as the engine is: the startup probe asks /ready every second, for as long
    # as a large model may take to load
    startup = container["startupProbe"]
    assert (startup["httpGet"]["path"], startup["periodSeconds"]) == ("/ready", 1)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    assert container["readinessProbe"]["periodSeconds"] <= 2
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert pod["terminationGracePeriodSeconds"] >= 60
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    cache = next(m for m in container["volumeMounts"] if m["name"] == "cache")
    assert cache["mountPath"] == manifests.CACHE_MOUNT
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert template["metadata"]["labels"]["kvpilot.dev/model"] == "qwen"


def test_spec_hash_rolls_pods_when_the_plan_changes() -> None:
    def spec_hash(d: dict[str, Any]) -> str:
        return d["spec"]["template"]["metadata"]["annotations"][manifests.ANNOTATION_SPEC_HASH]

    base = spec_hash(deployment())
    assert spec_hash(deployment()) == base  # deterministic
    assert spec_hash(deployment(replicas=5)) == base  # scaling is not a new plan
    longer = spec(serving={"maxContextLength": 16384})
    assert spec_hash(deployment(longer)) != base


def test_pvc_models_are_mounted_read_only() -> None:
    d = deployment(spec(model={"uri": "pvc://weights/llama/70b"}))
    pod = d["spec"]["template"]["spec"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in pod["volumes"]
    assert "--model=file:///mnt/models/llama/70b" in pod["containers"][0]["args"]


@pytest.mark.parametrize("uri", ["hf://Qwen/Qwen2.5-7B-Instruct@main", "s3://models/qwen-7b"])
def test_fetched_models_come_through_an_init_container(uri: str) -> None:
    s = spec(
        model={"uri": uri, "secretRef": {"name": "model-creds"}},
        runtime={"env": [{"name": "HF_ENDPOINT", "value": "http://hub.local"}]},
    )
    pod = deployment(s)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["args"] == ["fetch", f"--model={uri}", "--to=/mnt/models"]
    assert init["envFrom"] == [{"secretRef": {"name": "model-creds"}}]  # tokens never inline
    assert {"name": "HF_ENDPOINT", "value": "http://hub.local"} in init["env"]
    assert {"name": "model", "mountPath": "/mnt/models"} in init["volumeMounts"]
    assert {"name": "model", "emptyDir": {}} in pod["volumes"]
    (runtime,) = pod["containers"]
    assert "--model=file:///mnt/models" in runtime["args"]
    assert "envFrom" not in runtime  # the runtime itself never sees the token
    assert {"name": "model", "mountPath": "/mnt/models", "readOnly": True} in runtime[
        "volumeMounts"
    ]


def test_local_models_need_no_init_container() -> None:
    pod = deployment(spec(model={"uri": "file:///srv/models/qwen"}))["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert "--model=file:///srv/models/qwen" in pod["containers"][0]["args"]


def test_pod_template_overrides_merge() -> None:
    s = spec(
        runtime={
            "podTemplate": {
                "spec": {"priorityClassName": "llm"},
                "metadata": {"labels": {"team": "a"}},
            },
            "resources": {"requests": {"cpu": "4", "memory": "32Gi"}},
            "env": [{"name": "X", "value": "1"}],
        }
    )
    template = deployment(s)["spec"]["template"]
    assert template["spec"]["priorityClassName"] == "llm"
    assert template["metadata"]["labels"]["team"] == "a"
    assert template["metadata"]["labels"]["kvpilot.dev/model"] == "qwen"
    container = template["spec"]["containers"][0]
    assert container["resources"]["requests"] == {
        "cpu": "4",
        "memory": "32Gi",
        "nvidia.com/gpu": "4",
    }
    assert {"name": "X", "value": "1"} in container["env"]


@pytest.mark.parametrize("wants_monitor", [False, True])
@pytest.mark.parametrize("has_crd", [False, True])
def test_build_all(wants_monitor: bool, has_crd: bool) -> None:
    s = spec(monitoring={"podMonitor": wants_monitor})
    plans = [plan_for(s)]
    children = manifests.build_all(MD, s, plans, [1], CONFIG, has_crd)
    kinds = [c["kind"] for c in children]
    assert kinds[:2] == ["Deployment", "Service"]
    assert ("PodMonitor" in kinds) == (wants_monitor and has_crd)
    service = children[1]
    assert service["spec"]["selector"] == {"kvpilot.dev/model": "qwen"}
    assert service["metadata"]["name"] == "qwen"


def test_zero_replicas_keep_the_first_deployment_only() -> None:
    s = spec()
    second = planner.plan_node_type(
        planner.PlanRequest.from_spec(s, FACTS),
        NodeType(
            name="b",
            product="",
            gpu_memory_mib=81559,
            gpus_per_node=8,
            price_per_hour=1.0,
            node_selector={},
        ),
    )
    children = manifests.build_all(MD, s, [plan_for(s), second], [0, 0], CONFIG)
    assert [c["metadata"]["name"] for c in children] == ["qwen-h100-80gb", "qwen"]


@pytest.mark.parametrize("builder", ["deployment", "service"])
def test_manifests_validate_against_the_kubernetes_schema(builder: str) -> None:
    obj = deployment() if builder == "deployment" else manifests.build_service(MD, CONFIG)
    kubernetes_validate.validate(obj, "1.37.0", strict=True)


def test_child_names_stay_within_63_characters() -> None:
    name = manifests.child_name("m" * 48, "nvidia-h100-80gb-hbm3-80gb-x8")
    assert len(name) == 63
    assert name == manifests.child_name("m" * 48, "nvidia-h100-80gb-hbm3-80gb-x8")
    assert name != manifests.child_name("m" * 48, "nvidia-h100-80gb-hbm3-80gb-x4")
    assert manifests.child_name("qwen", "t4") == "qwen-t4"


def test_the_schema_check_can_fail() -> None:
    broken = deployment()
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37.0", strict=True)


@pytest.mark.parametrize(
    ("serving", "expected"),
    [
        ({"maxContextLength": 4096, "targetConcurrency": 4, "maxNumSeqs": 3}, 3),
        ({"maxContextLength": 4096, "targetConcurrency": 4}, None),  # from the plan
    ],
)
def test_max_num_seqs_is_the_users_cap_when_given(
    serving: dict[str, Any], expected: int | None
) -> None:
    s = spec(serving=serving)
    want = expected or min(plan_for(s).max_concurrency, 256)
    assert manifests.max_num_seqs(s, plan_for(s)) == want


def test_pod_monitor_gives_series_the_labels_the_autoscaler_queries() -> None:
    s = spec(monitoring={"podMonitor": True})
    children = manifests.build_all(MD, s, [plan_for(s)], [1], CONFIG, has_pod_monitor_crd=True)
    deployment, monitor = children[0], children[-1]
    assert monitor["kind"] == "PodMonitor"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    # what kubernetes_sd offers for each pod label, and what metrics_reader.py's PromQL groups by
    offered = {
        "__meta_kubernetes_pod_label_" + k.replace(".", "_").replace("/", "_").replace("-", "_"): k
        for k in pod_labels
    }
    made = {r["targetLabel"]: offered[r["sourceLabels"][0]] for r in endpoint["relabelings"]}
    assert made == {
        metrics_reader.PROM_LABEL_MODEL: "kvpilot.dev/model",
        metrics_reader.PROM_LABEL_NODE_TYPE: "kvpilot.dev/node-type",
    }


PICKER = {"name": "qwen-epp", "port": {"number": 9002}}


@pytest.mark.parametrize("picker", [None, PICKER])
@pytest.mark.parametrize("has_crd", [False, True])
def test_an_inference_pool_only_with_a_picker_and_the_crd(
    picker: dict[str, Any] | None, has_crd: bool
) -> None:
    s = spec(routing={"endpointPickerRef": picker} if picker else {})
    children = manifests.build_all(MD, s, [plan_for(s)], [1], CONFIG, False, has_crd)
    pools = [c for c in children if c["kind"] == "InferencePool"]
    assert len(pools) == (1 if picker and has_crd else 0)


def test_the_inference_pool_selects_the_runtime_pods_on_their_port() -> None:
    s = spec(routing={"endpointPickerRef": {**PICKER, "failureMode": "FailOpen"}})
    pool = manifests.build_inference_pool(MD, s.routing.endpoint_picker_ref, CONFIG)  # type: ignore[arg-type]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "qwen" and pool["metadata"]["namespace"] == "ml"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"kvpilot.dev/model": "qwen"}},
        "targetPorts": [{"number": CONFIG.runtime_port}],
        "endpointPickerRef": {
            "group": "",
            "kind": "Service",
            "name": "qwen-epp",
            "port": {"number": 9002},
            "failureMode": "FailOpen",
        },
    }
    pod = deployment(s)["spec"]["template"]
    selected = pool["spec"]["selector"]["matchLabels"].items()
    assert selected <= pod["metadata"]["labels"].items()
    ports = pod["spec"]["containers"][0]["ports"]
    assert [p["containerPort"] for p in ports] == [pool["spec"]["targetPorts"][0]["number"]]


def test_runtime_pods_say_they_are_vllm_compatible() -> None:
    labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert labels["inference.networking.k8s.io/engine-type"] == "vllm"
    # the label is the pods' alone: the Deployment's selector stays as it was
    assert (
        "inference.networking.k8s.io/engine-type"
        not in deployment()["spec"]["selector"]["matchLabels"]
    )


def kv_offload(disk: dict[str, Any] | None = None) -> dict[str, Any]:
    """runtime.kvOffload: a 16 GiB host tier, and with `disk` a 100 GiB disk tier."""
    tiers: dict[str, Any] = {"hostGiB": 16}
    if disk is not None:
        tiers["disk"] = {"sizeGiB": 100, **disk}
    return {"kvOffload": tiers}


@pytest.mark.parametrize(
    ("resources", "memory"),
    [
        ({}, ({"memory": "16Gi"}, {})),
        ({"requests": {"memory": "8Gi"}}, ({"memory": "24Gi"}, {})),
        (
            {"requests": {"memory": "8Gi"}, "limits": {"memory": "12Gi"}},
            ({"memory": "24Gi"}, {"memory": "28Gi"}),
        ),
        ({"requests": {"memory": "1.5Gi", "cpu": "4"}}, ({"memory": "17920Mi", "cpu": "4"}, {})),
    ],
)
def test_the_host_tier_grows_the_memory_request_and_a_given_limit(
    resources: dict[str, Any], memory: tuple[dict[str, str], dict[str, str]]
) -> None:
    s = spec(runtime={"resources": resources, **kv_offload()})
    got = deployment(s)["spec"]["template"]["spec"]["containers"][0]["resources"]
    gpus = {"nvidia.com/gpu": "1"}  # the KV tiers plan one GPU per replica
    assert got == {"requests": {**memory[0], **gpus}, "limits": {**memory[1], **gpus}}


def test_without_kv_offload_the_memory_is_the_users() -> None:
    s = spec(runtime={"resources": {"requests": {"memory": "8Gi"}}})
    got = deployment(s)["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert got["requests"]["memory"] == "8Gi" and "memory" not in got["limits"]


@pytest.mark.parametrize(
    ("disk", "volume"),
    [
        (None, None),
        ({}, {"emptyDir": {"sizeLimit": "105Gi"}}),  # 100 GiB + 5% for the files' headers
        ({"claimName": "kv-blocks"}, {"persistentVolumeClaim": {"claimName": "kv-blocks"}}),
        (
            {"hostPath": "/mnt/nvme/kv"},
            {"hostPath": {"path": "/mnt/nvme/kv", "type": "DirectoryOrCreate"}},
        ),
    ],
)
def test_the_disk_tier_is_a_volume_at_the_path_the_runtime_is_given(
    disk: dict[str, Any] | None, volume: dict[str, Any] | None
) -> None:
    s = spec(runtime=kv_offload(disk))
    pod = deployment(s)["spec"]["template"]["spec"]
    kubernetes_validate.validate(deployment(s), "1.37.0", strict=True)
    args = pod["containers"][0]["args"]
    assert "--kv-offloading-size=16.0" in args
    volumes = [v for v in pod["volumes"] if v["name"] == manifests.KV_DISK_VOLUME]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "kv-offload"]
    if volume is None:
        assert volumes == mounts == []
        assert not any(a.startswith("--kv-offloading-disk") for a in args)
        return
    assert volumes == [{"name": "kv-offload", **volume}]
    assert mounts == [{"name": "kv-offload", "mountPath": manifests.KV_DISK_MOUNT}]
    assert f"--kv-offloading-disk-path={manifests.KV_DISK_MOUNT}" in args
    assert "--kv-offloading-disk-size=100.0" in args
