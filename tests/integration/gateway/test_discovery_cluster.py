"""Kubernetes discovery and the waker against the real API server of the dev cluster: routes
appear from ModelDeployments and EndpointSlices through the watches, follow a pod that turns
not-Ready or terminating, resolve a served-name conflict to the oldest, and the waker writes the
wake annotation."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kvpilot.gateway.discovery import KubernetesDiscovery, api_client
from kvpilot.gateway.kube_routes import SecretKey
from kvpilot.gateway.kube_wake import WAKE_ANNOTATION, KubernetesWaker
from kvpilot.gateway.routes import Backend, ScaleTarget
from kvpilot.operator import timestamps
from tests.integration.gateway.conftest import LoopTable
from tests.integration.helm.chart import require
from tests.integration.helm.release import Release
from tests.support.kube import get_json, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def model_deployment(name: str, served: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"uri": "hf://org/Model-7B", "servedName": served}},
    }


def endpoint_slice(service: str, endpoints: list[tuple[str, str, bool, bool]]) -> dict[str, Any]:
    """What the EndpointSlice controller writes for the operator's Service (its labels copied)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-manual",
            "labels": {"kubernetes.io/service-name": service, "kvpilot.dev/model": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
                "targetRef": {"kind": "Pod", "name": pod},
            }
            for pod, ip, ready, terminating in endpoints
        ],
    }


def apply(cluster: Any, namespace: str, doc: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc))


@pytest.fixture
def discovery(cluster: Any, crds: None, loop_table: LoopTable) -> Iterator[KubernetesDiscovery]:
    """Watching every namespace (the chart's default)."""
    source = KubernetesDiscovery(
        loop_table.table, loop_table.loop, api_client(str(cluster.kubeconfig))
    )
    source.start()
    assert source.synced.wait(timeout=30), "the first lists never arrived"
    yield source
    source.stop()


def backends_of(loop_table: LoopTable, model: str) -> tuple[Backend, ...] | None:
    route = loop_table.route(model)
    return route.backends if route else None


def test_routes_follow_deployments_and_endpoint_readiness(
    cluster: Any,
    namespace: str,
    discovery: KubernetesDiscovery,
    loop_table: LoopTable,
    caplog: pytest.LogCaptureFixture,
) -> None:
    served = f"chat-{namespace}"  # unique: the watch sees every namespace
    apply(cluster, namespace, model_deployment("llm", served))
    route = wait_until(lambda: loop_table.route(served), timeout_s=30, what="the route")
    assert route.scale_target == ScaleTarget(namespace, "llm") and route.backends == ()

    pods = [("llm-0", "10.9.0.1", True, False), ("llm-1", "10.9.0.2", True, False)]
    apply(cluster, namespace, endpoint_slice("llm", pods))
    want = (
        Backend(f"{namespace}/llm-0", "http://10.9.0.1:8000"),
        Backend(f"{namespace}/llm-1", "http://10.9.0.2:8000"),
    )
    wait_until(lambda: backends_of(loop_table, served) == want, 30, "two backends")

    pods[1] = ("llm-1", "10.9.0.2", False, False)  # not Ready
    apply(cluster, namespace, endpoint_slice("llm", pods))
    wait_until(lambda: backends_of(loop_table, served) == want[:1], 30, "llm-1 left")

    pods[0] = ("llm-0", "10.9.0.1", True, True)  # terminating, still ready (draining)
    apply(cluster, namespace, endpoint_slice("llm", pods))
    wait_until(lambda: backends_of(loop_table, served) == (), 30, "llm-0 left")

    # A second ModelDeployment claims the name: the oldest keeps it, and the log says so.
    caplog.set_level(logging.WARNING, logger="kvpilot.gateway.discovery")
    apply(cluster, namespace, model_deployment("llm-copy", served))
    wait_until(
        lambda: any("claimed by 2 ModelDeployments" in r.message for r in caplog.records),
        30,
        "the conflict in the log",
    )
    assert loop_table.route(served).scale_target == ScaleTarget(namespace, "llm")  # type: ignore[union-attr]

    cluster.kubectl("delete", "modeldeployment", "llm", "-n", namespace)
    wait_until(
        lambda: (r := loop_table.route(served)) and r.scale_target.name == "llm-copy",  # type: ignore[union-attr]
        30,
        "the route handed to the remaining ModelDeployment",
    )
    cluster.kubectl("delete", "modeldeployment", "llm-copy", "-n", namespace)
    wait_until(lambda: loop_table.route(served) is None, 30, "the route removed")


def test_a_namespaced_discovery_sees_only_its_namespaces(
    cluster: Any, crds: None, namespace: str, loop_table: LoopTable
) -> None:
    other = f"{namespace}-other"
    cluster.kubectl("create", "namespace", other)
    try:
        apply(cluster, namespace, model_deployment("mine", f"mine-{namespace}"))
        apply(cluster, other, model_deployment("theirs", f"theirs-{namespace}"))
        client = api_client(str(cluster.kubeconfig))
        source = KubernetesDiscovery(loop_table.table, loop_table.loop, client, [namespace])
        source.start()
        try:
            wait_until(lambda: loop_table.route(f"mine-{namespace}"), 30, "its own route")
            assert loop_table.route(f"theirs-{namespace}") is None
        finally:
            source.stop()
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_the_waker_annotates_the_model_deployment(
    cluster: Any, crds: None, namespace: str, loop_table: LoopTable
) -> None:
    sleepy = model_deployment("sleepy", f"sleepy-{namespace}")
    sleepy["metadata"]["annotations"] = {"team": "search"}
    apply(cluster, namespace, sleepy)
    waker = KubernetesWaker(api_client(str(cluster.kubeconfig)))
    before = datetime.now(UTC).replace(microsecond=0)
    loop_table.run(waker.wake(ScaleTarget(namespace, "sleepy")))
    md = get_json(cluster, "modeldeployment", "sleepy", "-n", namespace)
    stamp = md["metadata"]["annotations"][WAKE_ANNOTATION]
    assert stamp.endswith("Z")
    assert before <= timestamps.parse(stamp) <= datetime.now(UTC) + timedelta(seconds=1)
    assert md["metadata"]["annotations"]["team"] == "search"  # a merge: others stay
    # A model that does not exist: logged, not raised (the request stays held).
    loop_table.run(waker.wake(ScaleTarget(namespace, "nobody")))


@pytest.fixture
def gateway_identity(cluster: Any, crds: None, helm_binary: Path, tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig holding the token of the chart's gateway ServiceAccount (release installed
    without running pods: the discovery runs here, as that identity)."""
    release = Release.new(cluster, require(helm_binary), "gwr")
    release.install({"replicaCount": "0", "gateway.replicaCount": "0"})
    try:
        yield release.gateway().service_account_kubeconfig(tmp_path / "gateway-kubeconfig")
    finally:
        release.uninstall()
        cluster.kubectl("delete", "namespace", release.namespace, "--wait=false", check=False)


def test_discovery_and_waker_need_no_right_the_chart_does_not_grant(
    cluster: Any,
    namespace: str,
    gateway_identity: Path,
    loop_table: LoopTable,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvpilot.gateway")
    served = f"key-{namespace}"
    cluster.kubectl(
        "create",
        "secret",
        "generic",
        "provider-key",
        "-n",
        namespace,
        "--from-literal=api-key=sk-1",
    )
    md = model_deployment("llm", served)
    apply(cluster, namespace, md)
    apply(cluster, namespace, endpoint_slice("llm", [("llm-0", "10.9.1.1", True, False)]))
    client = api_client(str(gateway_identity))
    source = KubernetesDiscovery(loop_table.table, loop_table.loop, client)
    source.start()
    try:
        assert source.synced.wait(timeout=30), "the first lists never arrived"
        want = (Backend(f"{namespace}/llm-0", "http://10.9.1.1:8000"),)
        wait_until(lambda: backends_of(loop_table, served) == want, 30, "the route")
        loop_table.run(KubernetesWaker(client).wake(ScaleTarget(namespace, "llm")))
        annotations = get_json(cluster, "modeldeployment", "llm", "-n", namespace)["metadata"]
        assert WAKE_ANNOTATION in annotations.get("annotations", {})
        # a provider's API key: its Secret read by name (spec.routing names it)
        assert source.secret_value(SecretKey(namespace, "provider-key", "api-key")) == "sk-1"
    finally:
        source.stop()
    refusals = [r.message for r in caplog.records if "403" in r.message or "Forbidden" in r.message]
    assert not refusals
