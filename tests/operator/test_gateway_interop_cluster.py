"""The operator's side of kvpilot-gateway on the local control plane, with the real operator.

- Wake from zero: the gateway's annotation brings a ModelDeployment at zero to one replica
  through the md-wake handler alone (the autoscaler loop's interval is longer than the test).
- spec.routing: the apiserver refuses a fallback to itself; a missing fallback ModelDeployment
  is a condition and an Event that follow it being created and deleted.
- Inference Extension: with the real InferencePool CRD (the pinned Go module's), the operator
  makes a pool that selects the runtime pods on their port; without it nothing breaks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hack.devcluster.build import ensure_module_file
from hack.devcluster.versions import INFERENCE_POOL_CRD
from kvpilot.contract import k8s
from tests.support.operator_cluster import (
    Operator,
    apply_doc,
    condition,
    events,
    get,
    is_ready,
    model_deployment,
    pods,
    ready_check,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

QWEN = "hf://Qwen/Qwen2.5-0.5B-Instruct"
ON_KWOK = {"placement": {"nodeTypes": ["l4-24gb"]}, "serving": {"maxContextLength": 2048}}
POOL_CRD = "inferencepools.inference.networking.k8s.io"


@pytest.fixture
def slow_loop_operator(cluster: Any, crds: None, tmp_path: Path) -> Iterator[Operator]:
    """An operator whose autoscaler loop never ticks during a test: only handlers act."""
    env = {"KVPILOT_AUTOSCALER_INTERVAL": "3600", "KVPILOT_PROMETHEUS_URL": ""}
    op = Operator(cluster, tmp_path / "operator.log", "--standalone", env=env)
    op.start()
    yield op
    op.stop()


def test_a_wake_scales_from_zero_at_once(
    cluster: Any, slow_loop_operator: Operator, namespace: str
) -> None:
    op, name = slow_loop_operator, "sleepy"
    autoscaling = {"mode": "builtin", "minReplicas": 0, "maxReplicas": 2}
    apply_doc(cluster, namespace, model_deployment(name, QWEN, autoscaling=autoscaling, **ON_KWOK))

    def planned_at_zero() -> dict[str, Any]:
        md = get(cluster, "md", name, "-n", namespace)
        status = md.get("status") or {}
        return md if status.get("plan") and status.get("replicas") == 0 else {}

    md = wait_for(planned_at_zero, "planned at zero replicas", op)
    assert condition(md, "Ready")["reason"] == "ScaledToZero"
    assert pods(cluster, namespace, name) == []

    # A status write over a version someone changed since is refused: what the wake handler
    # and the loop rely on to never undo each other's decision unseen.
    client = k8s.api_client(str(cluster.kubeconfig))
    with pytest.raises(k8s.ApiException) as refused:
        k8s.patch_status(client, namespace, name, {"replicas": 0}, resource_version="1")
    assert refused.value.status == 409

    woken_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    cluster.kubectl(
        "annotate", "md", name, "-n", namespace, f"kvpilot.dev/wake-requested-at={woken_at}"
    )
    md = wait_for(
        lambda: (m := get(cluster, "md", name, "-n", namespace))["status"]["replicas"] == 1 and m,
        "one replica after the wake",
        op,
        timeout=30,
    )
    autoscaling_status = md["status"]["autoscaling"]
    assert autoscaling_status["desiredReplicas"] == 1
    assert autoscaling_status["lastDecision"].startswith(
        "scale up 0->1: a request is waiting at a gateway"
    )
    state = autoscaling_status["state"]
    wake_s = datetime.fromisoformat(woken_at.replace("Z", "+00:00")).timestamp()
    assert state["wokenAt"] == pytest.approx(wake_s)
    assert state["idleSince"] == state["wokenAt"]  # the idle clock restarts from the wake
    wait_for(lambda: pods(cluster, namespace, name), "the woken replica's pod", op)
    wait_for(ready_check(cluster, namespace, name), f"{name} Ready", op)
    assert wait_for(lambda: events(cluster, namespace, name, "ScaledUp"), "a ScaledUp Event", op)[
        0
    ].startswith("Scaled from 0 to 1 replicas")
    # The same wake seen again (every later event of the object) changes nothing.
    cluster.kubectl("label", "md", name, "-n", namespace, "touched=yes")
    after = get(cluster, "md", name, "-n", namespace)
    assert after["status"]["autoscaling"]["state"]["wokenAt"] == state["wokenAt"]
    assert after["status"]["autoscaling"]["lastScaleTime"] == autoscaling_status["lastScaleTime"]


def test_fallbacks_refused_to_itself_and_reported_when_missing(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    to_itself = model_deployment(
        "loop", QWEN, routing={"fallbacks": [{"modelDeployment": "loop"}]}, **ON_KWOK
    )
    done = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps(to_itself), check=False
    )
    assert done.returncode != 0
    assert "a ModelDeployment cannot fall back to itself" in done.stderr
    cascades_to_itself = model_deployment(
        "loop", QWEN, routing={"cascade": [{"modelDeployment": "loop"}]}, **ON_KWOK
    )
    done = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps(cascades_to_itself), check=False
    )
    assert done.returncode != 0
    assert "a rule cannot send a ModelDeployment to itself" in done.stderr

    fallbacks = [
        {"modelDeployment": "small"},
        {"provider": {"baseURL": "https://api.example.com/v1", "model": "gpt-4o-mini"}},
    ]
    primary = model_deployment(
        "primary",
        QWEN,
        routing={"fallbacks": fallbacks},
        autoscaling={"mode": "off", "replicas": 1},
        **ON_KWOK,
    )
    apply_doc(cluster, namespace, primary)

    def resolved(status: str) -> dict[str, Any]:
        md = get(cluster, "md", "primary", "-n", namespace)
        found = condition(md, "FallbacksResolved")
        return found if found.get("status") == status else {}

    missing = wait_for(lambda: resolved("False"), "FallbacksResolved=False", operator)
    assert missing["reason"] == "FallbackMissing"
    assert "missing: small" in missing["message"]
    assert wait_for(
        lambda: events(cluster, namespace, "primary", "FallbackMissing"), "the Event", operator
    ) == ["spec.routing.fallbacks name missing ModelDeployments: small"]
    wait_for(ready_check(cluster, namespace, "primary"), "primary Ready all the same", operator)

    small = model_deployment("small", QWEN, autoscaling={"mode": "off", "replicas": 0}, **ON_KWOK)
    apply_doc(cluster, namespace, small)
    found = wait_for(lambda: resolved("True"), "FallbacksResolved=True once it exists", operator)
    assert found["message"] == "1/1 fallback ModelDeployments found"

    cluster.kubectl("delete", "md", "small", "-n", namespace)
    wait_for(lambda: resolved("False"), "FallbacksResolved=False once it is gone", operator)


@pytest.fixture
def no_pool_crd(cluster: Any) -> Iterator[None]:
    cluster.kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=true")
    yield
    cluster.kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=false")


def test_an_inference_pool_appears_with_the_crd_and_matches_the_pods(
    cluster: Any, no_pool_crd: None, operator: Operator, namespace: str
) -> None:
    picker = {"name": "pooled-epp", "port": {"number": 9002}}
    md = model_deployment(
        "pooled",
        QWEN,
        routing={"endpointPickerRef": picker},
        autoscaling={"mode": "off", "replicas": 2},
        **ON_KWOK,
    )
    apply_doc(cluster, namespace, md)
    # Without the CRD: the model serves and nothing complains.
    wait_for(ready_check(cluster, namespace, "pooled"), "pooled Ready without the CRD", operator)
    assert "inferencepools" not in cluster.kubectl("api-resources", "-o", "name").stdout
    assert "Traceback" not in operator.tail()

    crd = ensure_module_file(INFERENCE_POOL_CRD)
    cluster.kubectl("apply", "--server-side", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{POOL_CRD}")
    pool = wait_for(
        lambda: get(cluster, "inferencepool", "pooled", "-n", namespace),
        "the InferencePool once the CRD is installed",
        operator,
    )
    owner = get(cluster, "md", "pooled", "-n", namespace)["metadata"]["uid"]
    assert [ref["uid"] for ref in pool["metadata"]["ownerReferences"]] == [owner]
    assert pool["spec"]["endpointPickerRef"]["name"] == "pooled-epp"
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9002}

    # The pool's selector picks exactly this ModelDeployment's pods, on their serving port.
    selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    selected = get(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    assert sorted(p["metadata"]["name"] for p in selected) == sorted(
        p["metadata"]["name"] for p in pods(cluster, namespace, "pooled")
    )
    assert len(selected) == 2
    for pod in selected:
        assert pod["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"
        ports = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]]
        assert ports == [t["number"] for t in pool["spec"]["targetPorts"]]

    # The spec drops the picker: the pool goes, the model keeps serving.
    cluster.kubectl(
        "patch",
        "md",
        "pooled",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"routing": {"endpointPickerRef": None}}}),
    )

    def gone() -> bool:
        found = cluster.kubectl("get", "inferencepools", "-n", namespace, "-o", "name")
        return found.stdout.strip() == ""

    wait_for(gone, "the InferencePool deleted with the picker", operator)
    assert is_ready(cluster, namespace, "pooled")
