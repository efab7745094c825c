"""A new ModelDeployment's two passes against the local control plane: the first applies only its
Deployment (what serves), the finishing pass the Service, the status and the Planned event, and
does not send the Deployment again. The passes run in this process (`Controller.run_pass`, as the
operator's worker threads call it) with every apply recorded; what they made is read back with
real `kubectl`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from kvpilot.contract import k8s
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import inventory
from kvpilot.operator.reconcile.controller import Controller
from tests.support.operator_cluster import apply_doc, condition, get, model_deployment, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
POOL = "l4-24gb"


def names(cluster: Any, kind: str, namespace: str) -> set[str]:
    return {o["metadata"]["name"] for o in get(cluster, kind, "-n", namespace)["items"]}


def planned_events(cluster: Any, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get(
        cluster, "events", "-n", namespace, "--field-selector", "reason=Planned"
    )["items"]
    return items


def test_a_new_object_gets_its_deployment_first_and_the_rest_in_the_finishing_pass(
    cluster: Any, crds: None, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = cluster.api_client()
    nodes: list[Mapping[str, Any]] = [
        inventory.trim_node(n) for n in get(cluster, "nodes")["items"]
    ]
    sent: list[tuple[str, str]] = []
    real_apply = k8s.apply

    def recorded_apply(api: Any, manifest: Mapping[str, Any], manager: str) -> dict[str, Any]:
        sent.append((manifest["kind"], manifest["metadata"]["name"]))
        return real_apply(api, manifest, manager)

    monkeypatch.setattr(k8s, "apply", recorded_apply)
    doc = model_deployment(
        "m",
        "hf://Qwen/Qwen2.5-0.5B-Instruct",
        placement={"nodeTypes": [POOL]},
        autoscaling={"mode": "off", "replicas": 1},
    )
    apply_doc(cluster, namespace, doc)
    body = get(cluster, "modeldeployment", "m", "-n", namespace)
    controller = Controller(client=client, config=OperatorConfig())

    first = controller.run_pass(namespace, "m", nodes, [], True, body)
    assert first is not None and first.applied_first is not None
    assert set(first.applied_first) == {("Deployment", f"m-{POOL}")}
    assert sent == [("Deployment", f"m-{POOL}")]
    assert names(cluster, "deployments", namespace) == {f"m-{POOL}"}
    assert names(cluster, "services", namespace) == set()
    assert "status" not in get(cluster, "modeldeployment", "m", "-n", namespace)
    assert not planned_events(cluster, namespace)

    # Its pod turns Ready before the finishing pass: no later event of the Deployment will come
    # to report that, so the finishing pass must read the Deployment as it is now.
    wait_for(
        lambda: get(cluster, "deployment", f"m-{POOL}", "-n", namespace)["status"].get(
            "readyReplicas"
        ),
        "the Deployment's pod Ready",
    )
    finished = controller.run_pass(namespace, "m", nodes, [], True, None, first.applied_first)
    assert finished is not None and finished.applied_first is None
    assert sent == [("Deployment", f"m-{POOL}"), ("Service", "m")]  # the Deployment once
    assert names(cluster, "services", namespace) == {"m"}
    md = get(cluster, "modeldeployment", "m", "-n", namespace)
    assert md["status"]["observedGeneration"] == md["metadata"]["generation"]
    assert md["status"]["readyReplicas"] == 1
    assert condition(md, "Ready")["status"] == "True"
    assert [(e["nodeType"], e["replicas"]) for e in md["status"]["plan"]] == [(POOL, 1)]
    assert [e["involvedObject"]["name"] for e in planned_events(cluster, namespace)] == ["m"]

    # Applied and reported: a later pass of the object is an ordinary one, all children applied.
    assert controller.run_pass(namespace, "m", nodes, [], True, None) is not None
    assert sent[2:] == [("Deployment", f"m-{POOL}"), ("Service", "m")]
