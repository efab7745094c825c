"""The operator's PodMonitor follows `spec.monitoring` where the Prometheus Operator's CRD
exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.operator_cluster import (
    Operator,
    apply_doc,
    get,
    is_ready,
    model_deployment,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


POD_MONITOR_CRD_NAME = "podmonitors.monitoring.coreos.com"
POD_MONITOR_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": POD_MONITOR_CRD_NAME},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {
            "kind": "PodMonitor",
            "listKind": "PodMonitorList",
            "plural": "podmonitors",
            "singular": "podmonitor",
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


@pytest.fixture
def pod_monitor_crd(cluster: Any) -> Iterator[None]:
    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(POD_MONITOR_CRD))
    name = POD_MONITOR_CRD_NAME
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{name}")
    yield
    cluster.kubectl("delete", "crd", name, "--wait=false", check=False)


def test_a_pod_monitor_follows_the_spec_on_and_off(
    cluster: Any, pod_monitor_crd: None, operator: Operator, namespace: str
) -> None:
    md = model_deployment(
        "watched",
        "hf://Qwen/Qwen2.5-0.5B-Instruct",
        placement={"nodeTypes": ["l4-24gb"]},
        autoscaling={"mode": "off", "replicas": 1},
        monitoring={"podMonitor": True},
    )
    apply_doc(cluster, namespace, md)
    monitor = wait_for(
        lambda: get(cluster, "podmonitor", "watched", "-n", namespace),
        "the PodMonitor",
        operator,
    )
    owner = get(cluster, "modeldeployment", "watched", "-n", namespace)["metadata"]["uid"]
    assert [ref["uid"] for ref in monitor["metadata"]["ownerReferences"]] == [owner]
    assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"

    cluster.kubectl(
        "patch",
        "modeldeployment",
        "watched",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"monitoring": {"podMonitor": False}}}),
    )

    def gone() -> bool:
        found = cluster.kubectl("get", "podmonitor", "-n", namespace, "-o", "name")
        return found.stdout.strip() == ""

    wait_for(gone, "the PodMonitor deleted once monitoring is off", operator)
    assert is_ready(cluster, namespace, "watched")  # the model kept serving
