"""A local pod reaches the API server as its own ServiceAccount, as a pod on a kubelet does.

The pod lists pods in its namespace (its Role grants that), is refused Secrets and other
namespaces (its Role grants neither), and the API server names it as the ServiceAccount with a
token bound to this very pod: the credentials are the pod's own, not the runner's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.kube import fresh_namespace, get_json, wait_until

pytestmark = pytest.mark.cluster

ACCOUNT = "lister"
# What the pod runs: the kvpilot client setup the gateway and the operator use (k8s.api_client),
# then each API call's outcome, written to the termination log (argv[1]) for the test to read.
SCRIPT = """
import json, sys
from kubernetes import client
from kubernetes.client.rest import ApiException
from kvpilot.contract import k8s

api = k8s.api_client()
core = client.CoreV1Api(api)
namespace = open(sys.argv[2]).read()

def outcome(call):
    try:
        return sorted(item.metadata.name for item in call().items)
    except ApiException as err:
        return err.status

review = client.AuthenticationV1Api(api).create_self_subject_review(
    client.V1SelfSubjectReview(metadata=client.V1ObjectMeta())
)
user = review.status.user_info
found = {
    "user": user.username,
    "bound_pod": (user.extra or {}).get("authentication.kubernetes.io/pod-name"),
    "namespace_file": namespace,
    "pods": outcome(lambda: core.list_namespaced_pod(namespace)),
    "secrets": outcome(lambda: core.list_namespaced_secret(namespace)),
    "default_pods": outcome(lambda: core.list_namespaced_pod("default")),
}
open(sys.argv[1], "w").write(json.dumps(found))
"""
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture
def namespace(cluster: Any) -> Iterator[str]:
    if not get_json(cluster, "nodes", "-l", "kvpilot.dev/local-execution=true")["items"]:
        pytest.skip("this cluster has no local-execution nodes (no hack/podrunner)")
    with fresh_namespace(cluster, "api-access") as name:
        yield name


def rbac(namespace: str) -> list[dict[str, Any]]:
    """A ServiceAccount whose Role lets it read pods in its namespace, and nothing else."""
    meta = {"name": ACCOUNT, "namespace": namespace}
    subject = {"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ACCOUNT},
            "subjects": [subject],
        },
    ]


def pod(namespace: str) -> dict[str, Any]:
    container = {
        "name": "client",
        "image": "example.invalid/api-client:test",
        "command": [sys.executable, "-c", SCRIPT],
        "args": ["/dev/termination-log", f"{SERVICE_ACCOUNT_DIR}/namespace"],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "api-client", "namespace": namespace},
        "spec": {
            "serviceAccountName": ACCOUNT,
            "restartPolicy": "Never",
            "nodeSelector": {"kvpilot.dev/local-execution": "true"},
            "containers": [container],
        },
    }


def finished(cluster: Any, namespace: str) -> dict[str, Any] | None:
    found = get_json(cluster, "pod", "api-client", "-n", namespace)
    if found["status"].get("phase") not in ("Succeeded", "Failed"):
        return None
    return dict(found)


def test_a_local_pod_acts_as_its_own_service_account(cluster: Any, namespace: str) -> None:
    items = [*rbac(namespace), pod(namespace)]
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    )
    done = wait_until(lambda: finished(cluster, namespace), 90, "the API client pod to finish")
    state = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert done["status"]["phase"] == "Succeeded", state
    found = json.loads(state["message"])
    assert found["user"] == f"system:serviceaccount:{namespace}:{ACCOUNT}"
    assert found["bound_pod"] == ["api-client"]  # a TokenRequest bound to this pod
    assert found["namespace_file"] == namespace
    assert found["pods"] == ["api-client"]  # granted by its Role
    assert found["secrets"] == 403  # not granted
    assert found["default_pods"] == 403  # the Role is only in its namespace
