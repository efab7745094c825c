"""Kubernetes discovery and the waker against the real API server of the dev cluster: routes
appear from ModelDeployments and their pods through the watches, follow a pod that turns
not-Ready or terminating, resolve a served-name conflict to the oldest, and the waker writes the
wake annotation."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kvpilot.contract import timestamps
from kvpilot.contract.resource import WAKE_ANNOTATION
from kvpilot.gateway.kube.discovery import (
    MODEL_DEPLOYMENTS,
    GoneError,
    KubernetesDiscovery,
    api_client,
)
from kvpilot.gateway.kube.routes import SecretKey
from kvpilot.gateway.kube.wake import KubernetesWaker
from kvpilot.gateway.routing.routes import Backend, Provider, Route, ScaleTarget
from tests.gateway.conftest import LoopTable
from tests.support.helm_chart import require
from tests.support.helm_release import Release
from tests.support.kube import get_json, wait_until
from tests.support.operator_cluster import Operator, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def model_deployment(name: str, served: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"uri": "hf://org/Model-7B", "servedName": served}},
    }


def runtime_pod(cluster: Any, namespace: str, node: str, name: str, model: str) -> None:
    """A pod labelled as the operator labels runtime pods, bound to a node no kubelet serves,
    so the test alone writes its status (what a kubelet would write)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"kvpilot.dev/model": model}},
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "runtime",
                    "image": "kvpilot/runtime:test",
                    "ports": [{"name": "http", "containerPort": 8000}],
                }
            ],
        },
    }
    apply(cluster, namespace, pod)


def set_status(cluster: Any, namespace: str, name: str, ip: str, ready: bool) -> None:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "conditions": [condition]}
    cluster.kubectl(
        "patch",
        "pod",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


@pytest.fixture
def bare_node(cluster: Any) -> Iterator[str]:
    """A Node that neither kwok nor the pod runner manages: pods bound to it keep the status the
    test writes, and a deleted one stays terminating."""
    name = f"gw-bare-{uuid.uuid4().hex[:6]}"
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(node))
    yield name
    pods = cluster.kubectl(
        "get", "pods", "-A", "--field-selector", f"spec.nodeName={name}", "-o", "json"
    )
    for pod in json.loads(pods.stdout)["items"]:
        meta = pod["metadata"]
        cluster.kubectl(
            "delete",
            "pod",
            meta["name"],
            "-n",
            meta["namespace"],
            "--grace-period=0",
            "--force",
            check=False,
        )
    cluster.kubectl("delete", "node", name, "--wait=false", check=False)


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


def test_routes_follow_deployments_and_pod_readiness(
    cluster: Any,
    namespace: str,
    bare_node: str,
    discovery: KubernetesDiscovery,
    loop_table: LoopTable,
    caplog: pytest.LogCaptureFixture,
) -> None:
    served = f"chat-{namespace}"  # unique: the watch sees every namespace
    apply(cluster, namespace, model_deployment("llm", served))
    route = wait_until(lambda: loop_table.route(served), timeout_s=30, what="the route")
    assert route.scale_target == ScaleTarget(namespace, "llm") and route.backends == ()

    for pod, ip in (("llm-0", "127.90.0.1"), ("llm-1", "127.90.0.2")):
        runtime_pod(cluster, namespace, bare_node, pod, "llm")
        set_status(cluster, namespace, pod, ip, ready=True)
    want = (
        Backend(f"{namespace}/llm-0", "http://127.90.0.1:8000"),
        Backend(f"{namespace}/llm-1", "http://127.90.0.2:8000"),
    )
    wait_until(lambda: backends_of(loop_table, served) == want, 30, "two backends")

    set_status(cluster, namespace, "llm-1", "127.90.0.2", ready=False)
    wait_until(lambda: backends_of(loop_table, served) == want[:1], 30, "not-Ready llm-1 left")

    # Deleted: terminating (no kubelet confirms it) while still Ready; it takes nothing new.
    cluster.kubectl("delete", "pod", "llm-0", "-n", namespace, "--wait=false")
    wait_until(lambda: backends_of(loop_table, served) == (), 30, "terminating llm-0 left")

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
    bare_node: str,
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
    runtime_pod(cluster, namespace, bare_node, "llm-0", "llm")
    set_status(cluster, namespace, "llm-0", "127.90.1.1", ready=True)
    client = api_client(str(gateway_identity))
    source = KubernetesDiscovery(loop_table.table, loop_table.loop, client)
    source.start()
    try:
        assert source.synced.wait(timeout=30), "the first lists never arrived"
        want = (Backend(f"{namespace}/llm-0", "http://127.90.1.1:8000"),)
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


def test_routes_follow_the_operators_replicas(
    cluster: Any,
    namespace: str,
    operator: Operator,
    discovery: KubernetesDiscovery,
    loop_table: LoopTable,
) -> None:
    """The real operator's pods (kwok pods on the l4 pool: Ready, with pod IPs): the route holds
    exactly the ready pods as they scale."""
    served = f"qwen-{namespace}"
    md = model_deployment("qwen", served)
    md["spec"]["model"]["uri"] = "hf://Qwen/Qwen2.5-0.5B-Instruct"
    md["spec"]["placement"] = {"nodeTypes": ["l4-24gb"]}
    md["spec"]["autoscaling"] = {"mode": "off", "replicas": 2}
    apply(cluster, namespace, md)

    def pods_as_backends() -> tuple[Backend, ...]:
        found = get_json(cluster, "pods", "-n", namespace, "-l", "kvpilot.dev/model=qwen")
        ready = [p for p in found["items"] if is_ready_pod(p)]
        return tuple(sorted((backend_of(p) for p in ready), key=lambda b: b.name))

    def routed(count: int) -> bool:
        want = pods_as_backends()
        return len(want) == count and backends_of(loop_table, served) == want

    wait_for(lambda: routed(2), "the route holds both ready pods", operator, timeout=120)
    cluster.kubectl("scale", "modeldeployment/qwen", "--replicas=1", "-n", namespace)
    wait_for(lambda: routed(1), "the route down to one pod", operator, timeout=120)


def is_ready_pod(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp") or not pod["status"].get("podIP"):
        return False
    conditions = pod["status"].get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def backend_of(pod: dict[str, Any]) -> Backend:
    """What discovery must make of a ready runtime pod: its IP and its container port `http`."""
    ports = pod["spec"]["containers"][0]["ports"]
    port = next(p["containerPort"] for p in ports if p["name"] == "http")
    meta = pod["metadata"]
    return Backend(f"{meta['namespace']}/{meta['name']}", f"http://{pod['status']['podIP']}:{port}")


def test_fallbacks_from_spec_routing_with_the_providers_key(
    cluster: Any, namespace: str, discovery: KubernetesDiscovery, loop_table: LoopTable
) -> None:
    cluster.kubectl(
        "create", "secret", "generic", "example-key", "-n", namespace, "--from-literal=api-key=sk-9"
    )
    big = model_deployment("big", f"big-{namespace}")
    big["spec"]["routing"] = {
        "fallbacks": [
            {"modelDeployment": "small"},
            {
                "provider": {
                    "baseURL": "https://api.example.com/v1",
                    "model": "gpt-4o-mini",
                    "apiKeySecretRef": {"name": "example-key", "key": "api-key"},
                }
            },
        ],
        "fallbackAfterSeconds": 12,
    }
    apply(cluster, namespace, model_deployment("small", f"small-{namespace}"))
    apply(cluster, namespace, big)
    provider = Provider("big/1", "https://api.example.com/v1", "gpt-4o-mini", "sk-9")
    want = (f"small-{namespace}", provider)

    def resolved() -> Route | None:
        route = loop_table.route(f"big-{namespace}")
        return route if route is not None and route.fallbacks == want else None

    route = wait_until(resolved, 30, "the fallbacks, the provider with its key")
    assert route.fallback_after_s == 12


def test_an_expired_resource_version_is_gone_so_the_watch_lists_again(
    cluster: Any, crds: None, loop_table: LoopTable
) -> None:
    """The API answers a watch from a version older than its watch cache with 410 Gone (an
    ERROR event): watch_from raises GoneError, on which the watch thread lists again, instead of
    backing off. (ModelDeployments: their cache starts when the CRD is established, well after
    version 1; the pods' cache starts with the apiserver, so a young cluster may still hold 1.)"""
    source = KubernetesDiscovery(
        loop_table.table, loop_table.loop, api_client(str(cluster.kubeconfig))
    )
    outcome: list[BaseException | None] = []

    def watch() -> None:
        try:
            source.watch_from(MODEL_DEPLOYMENTS, None, "1")
            outcome.append(None)
        except BaseException as error:  # handed to the test's thread
            outcome.append(error)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert outcome and isinstance(outcome[0], GoneError), outcome
