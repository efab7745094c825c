"""`helm install / upgrade / uninstall` of the chart into the dev cluster with the real helm, and
what the chart's ServiceAccount may and may not do (`kubectl auth can-i --as=...`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.helm_chart import render, require
from tests.support.helm_release import Release
from tests.support.kube import get_json, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CRDS = ("modeldeployments.kvpilot.dev",)


@pytest.fixture(scope="module")
def release(cluster: Any, helm_binary: Path) -> Iterator[tuple[Release, str]]:
    rel = Release.new(cluster, require(helm_binary), "kvp")
    output = rel.install()
    yield rel, output
    rel.uninstall()
    cluster.kubectl("delete", "namespace", rel.namespace, "--wait=false", check=False)


def exists(cluster: Any, kind: str, name: str, namespace: str = "") -> bool:
    args = ["get", kind, name, "--ignore-not-found", "-o", "name"]
    args += ["-n", namespace] if namespace else []
    return bool(cluster.kubectl(*args).stdout.strip())


def test_install_creates_every_rendered_object(
    cluster: Any, release: tuple[Release, str], helm_binary: Path
) -> None:
    rel, _ = release
    objects = render(helm_binary, namespace=rel.namespace, release=rel.name)
    assert {o["kind"] for o in objects} == {
        "ServiceAccount",
        "ConfigMap",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",  # the autoscaler's Lease, in the release namespace
        "RoleBinding",
        "Service",
        "Deployment",
        "PodDisruptionBudget",  # the gateway's (2 replicas)
    }
    for obj in objects:
        meta = obj["metadata"]
        assert exists(cluster, obj["kind"], meta["name"], meta.get("namespace", "")), meta["name"]
    for crd in CRDS:
        wait_until(lambda: exists(cluster, "crd", crd), timeout_s=60, what=f"CRD {crd}")  # noqa: B023
    deployment = get_json(cluster, "deployment", rel.fullname, "-n", rel.namespace)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == rel.fullname


def test_notes_tell_what_to_apply_next(release: tuple[Release, str]) -> None:
    rel, output = release
    notes = output.split("NOTES:", 1)[1]
    assert f"kubectl -n {rel.namespace} rollout status deployment/{rel.fullname}" in notes
    assert "kubectl apply -n default -f examples/qwen2.5-7b-instruct.yaml" in notes
    assert "kubectl apply --server-side -f charts/kvpilot/crds/" in notes
    gateway = f"port-forward service/{rel.gateway().fullname} 8080:80"
    assert f"kubectl -n {rel.namespace} {gateway}" in notes


# What the operator does (derived from handlers.py, reconcile/controller.py, contract/k8s.py, cli.py
# and kopf): (verb, plural[.group], namespace, subresource)
ALLOWED = [
    ("list", "nodes", "", ""),
    ("watch", "nodes", "", ""),
    ("list", "pods", "", ""),
    ("watch", "pods", "", ""),
    ("create", "deployments.apps", "anywhere", ""),
    ("patch", "deployments.apps", "anywhere", ""),
    ("delete", "deployments.apps", "anywhere", ""),
    ("create", "services", "anywhere", ""),
    ("delete", "services", "anywhere", ""),
    ("create", "events.events.k8s.io", "anywhere", ""),  # k8s.emit_event
    ("create", "events", "anywhere", ""),  # kopf posts core/v1 Events
    # quality/io.py: the eval set's ConfigMap read by name, the measurement cache merged into
    ("get", "configmaps", "anywhere", ""),
    ("create", "configmaps", "anywhere", ""),
    ("patch", "configmaps", "anywhere", ""),
    ("watch", "modeldeployments.kvpilot.dev", "", ""),
    ("patch", "modeldeployments.kvpilot.dev", "anywhere", "status"),
    ("get", "customresourcedefinitions.apiextensions.k8s.io", "", ""),
]
# Outside its list: secrets, listing or deleting ConfigMaps, other workloads, RBAC, spec writes
# by update/create, cluster admin.
DENIED = [
    ("get", "secrets", "anywhere", ""),
    ("patch", "events.events.k8s.io", "anywhere", ""),
    ("delete", "events.events.k8s.io", "anywhere", ""),
    ("list", "secrets", "", ""),
    ("list", "configmaps", "", ""),
    ("delete", "configmaps", "anywhere", ""),
    ("create", "pods", "anywhere", ""),
    ("delete", "pods", "anywhere", ""),
    ("create", "pods", "anywhere", "exec"),
    ("patch", "nodes", "", ""),
    ("delete", "nodes", "", ""),
    ("update", "modeldeployments.kvpilot.dev", "anywhere", ""),
    ("patch", "modeldeployments.kvpilot.dev", "anywhere", ""),  # status only: no kopf annotations
    ("create", "modeldeployments.kvpilot.dev", "anywhere", ""),
    ("delete", "modeldeployments.kvpilot.dev", "anywhere", ""),
    ("update", "modeldeployments.kvpilot.dev", "anywhere", "scale"),
    ("create", "statefulsets.apps", "anywhere", ""),
    ("update", "deployments.apps", "anywhere", "scale"),
    ("create", "podmonitors.monitoring.coreos.com", "anywhere", ""),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", "", ""),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", "", ""),
    ("create", "serviceaccounts", "anywhere", "token"),
    ("impersonate", "serviceaccounts", "", ""),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", "", ""),
    ("delete", "namespaces", "", ""),
    ("create", "kopfpeerings.kopf.dev", "anywhere", ""),
    ("patch", "clusterkopfpeerings.kopf.dev", "", ""),  # the Lease decides, not kopf's peering
]


def test_service_account_can_do_what_the_operator_needs(release: tuple[Release, str]) -> None:
    rel, _ = release
    refused = [args for args in ALLOWED if not rel.can(*args)]
    assert not refused


def test_service_account_cannot_leave_its_list(release: tuple[Release, str]) -> None:
    rel, _ = release
    granted = [args for args in DENIED if rel.can(*args)]
    assert not granted


# What the gateway does (kube/discovery.py: list + watch ModelDeployments and pods; kube/wake.py:
# merge-patch the annotation; provider API keys: get a Secret by name).
GATEWAY_ALLOWED = [
    ("list", "modeldeployments.kvpilot.dev", "", ""),
    ("watch", "modeldeployments.kvpilot.dev", "", ""),
    ("patch", "modeldeployments.kvpilot.dev", "anywhere", ""),
    ("list", "pods", "", ""),
    ("watch", "pods", "", ""),
    ("get", "secrets", "anywhere", ""),
]
GATEWAY_DENIED = [
    ("list", "secrets", "", ""),
    ("watch", "secrets", "anywhere", ""),
    ("patch", "modeldeployments.kvpilot.dev", "anywhere", "status"),
    ("update", "modeldeployments.kvpilot.dev", "anywhere", ""),
    ("create", "modeldeployments.kvpilot.dev", "anywhere", ""),
    ("delete", "modeldeployments.kvpilot.dev", "anywhere", ""),
    ("patch", "modeldeployments.kvpilot.dev", "anywhere", "scale"),
    ("patch", "pods", "anywhere", ""),
    ("get", "pods", "anywhere", "log"),
    ("create", "pods", "anywhere", "exec"),
    ("patch", "deployments.apps", "anywhere", ""),
    ("list", "nodes", "", ""),
    ("create", "serviceaccounts", "anywhere", "token"),
]


def test_gateway_service_account_can_do_what_the_gateway_needs_and_no_more(
    release: tuple[Release, str],
) -> None:
    gateway = release[0].gateway()
    assert not [args for args in GATEWAY_ALLOWED if not gateway.can(*args)]
    assert not [args for args in GATEWAY_DENIED if gateway.can(*args)]


def test_service_account_may_hold_only_the_autoscaler_lease(release: tuple[Release, str]) -> None:
    rel, _ = release
    leases = "leases.coordination.k8s.io"
    assert rel.can("create", leases, rel.namespace)
    for verb in ("get", "update"):
        assert rel.can(verb, leases, rel.namespace, name="kvpilot-operator")
        assert not rel.can(verb, leases, rel.namespace, name="kube-controller-manager")
        assert not rel.can(verb, leases, "kube-system", name="kvpilot-operator")
    assert not rel.can("create", leases, "kube-system")
    assert not rel.can("delete", leases, rel.namespace, name="kvpilot-operator")


def test_kubectl_auth_can_i_agrees(release: tuple[Release, str]) -> None:
    """The same answers through `kubectl auth can-i --as=system:serviceaccount:...`."""
    rel, _ = release
    assert not rel.can_i("get", "secrets", "-n", "anywhere")
    assert not rel.can_i("list", "secrets", "--all-namespaces")
    assert not rel.can_i("create", "pods", "-n", "anywhere")
    assert not rel.can_i("update", "modeldeployments.kvpilot.dev", "-n", "anywhere")
    assert rel.can_i("patch", "deployments.apps", "-n", "anywhere")
    assert rel.can_i("patch", "modeldeployments.kvpilot.dev", "--subresource=status", "-n", "x")
    assert rel.can_i("watch", "nodes")


def test_a_user_who_may_do_everything_sees_yes(cluster: Any) -> None:
    """The probe itself works: the admin kubeconfig is allowed what the SA is refused."""
    done = cluster.kubectl("auth", "can-i", "get", "secrets", "-n", "anywhere", check=False)
    assert done.stdout.strip() == "yes"


def test_upgrade_then_uninstall_keeps_the_crds(cluster: Any, helm_binary: Path) -> None:
    rel = Release.new(cluster, require(helm_binary), "kvu")
    try:
        rel.install({"replicaCount": "1"})
        assert not rel.can("create", "podmonitors.monitoring.coreos.com", "x")
        rel.upgrade({"config.autoscalerIntervalSeconds": "45", "podMonitors.enabled": "true"})
        assert "autoscalerIntervalSeconds: 45" in rel.config_yaml()
        # the RBAC authorizer sees the new rule once its informer has it: poll
        wait_until(
            lambda: rel.can("create", "podmonitors.monitoring.coreos.com", "x"),
            timeout_s=30,
            what="podmonitors granted after upgrade",
        )
        history = json.loads(rel.helm("history", rel.name, "-o", "json"))
        assert [h["revision"] for h in history] == [1, 2] and history[-1]["status"] == "deployed"
        deployment = get_json(cluster, "deployment", rel.fullname, "-n", rel.namespace)
        assert deployment["spec"]["replicas"] == 1
    finally:
        out = rel.uninstall()
    assert "uninstalled" in out
    assert not exists(cluster, "deployment", rel.fullname, rel.namespace)
    assert not exists(cluster, "clusterrole", rel.fullname)
    assert not exists(cluster, "clusterrolebinding", rel.fullname)
    for crd in CRDS:  # Helm never deletes what it installed from crds/
        assert exists(cluster, "crd", crd)
    cluster.kubectl("delete", "namespace", rel.namespace, "--wait=false", check=False)


def test_namespaced_install_grants_rights_in_one_namespace(cluster: Any, helm_binary: Path) -> None:
    rel = Release.new(cluster, require(helm_binary), "kvn")
    watched = f"{rel.namespace}-models"
    cluster.kubectl("create", "namespace", watched)
    try:
        rel.install({"watchNamespace": watched, "replicaCount": "1"})
        assert rel.can("create", "deployments.apps", watched)
        assert rel.can("patch", "modeldeployments.kvpilot.dev", watched, "status")
        assert not rel.can("create", "deployments.apps", "elsewhere")
        assert not rel.can("list", "pods")  # all namespaces
        assert not rel.can("create", "clusterkopfpeerings.kopf.dev")
        assert rel.can("list", "nodes")
    finally:
        rel.uninstall()
        for ns in (rel.namespace, watched):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
