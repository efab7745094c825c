"""Thin adapter to the Kubernetes API: server-side apply, list, delete, status, events.

Objects travel as plain JSON dicts (the wire form), the same shape the pure modules and kopf use, so
nothing converts between the client's model classes and dicts. Errors surface as the client's
`ApiException`; the handlers decide what is temporary. Events are `events.k8s.io/v1` Events
through the typed events API.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from kvpilot.operator import api, timestamps

Obj = Mapping[str, Any]
_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodMonitor": "podmonitors",
    "InferencePool": "inferencepools",
    "Node": "nodes",
    "Pod": "pods",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Job": "jobs",
    "ConfigMap": "configmaps",
    "CustomResourceDefinition": "customresourcedefinitions",
    "ClusterKopfPeering": "clusterkopfpeerings",
    "KopfPeering": "kopfpeerings",
    "Lease": "leases",
    api.KIND: api.PLURAL,
}
MD_API_VERSION = f"{api.GROUP}/{api.VERSION}"
TIMEOUT_SECONDS = 30
CONNECTION_POOL_SIZE = 64
NOTE_LIMIT = 1024  # bytes: events.k8s.io rejects a longer note


def api_client(kubeconfig: str | None = None) -> k8s_client.ApiClient:
    """A client for the current kubeconfig context, or the in-cluster service account."""
    try:
        k8s_config.load_kube_config(config_file=kubeconfig)
    except k8s_config.ConfigException:
        k8s_config.load_incluster_config()
    configuration = k8s_client.Configuration.get_default_copy()
    # kopf runs up to 48 sync handlers at once; urllib3's default pool of 4 would open and drop
    # a TLS connection for every request beyond that, which costs more CPU than the request.
    configuration.connection_pool_maxsize = CONNECTION_POOL_SIZE
    return k8s_client.ApiClient(configuration)


def path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    scope = f"/namespaces/{namespace}" if namespace else ""
    suffix = f"/{name}" if name else ""
    return f"{prefix}{scope}/{_PLURALS[kind]}{suffix}"


def request(
    client: k8s_client.ApiClient,
    method: str,
    resource_path: str,
    body: Any = None,
    query: Mapping[str, str] | None = None,
    content_type: str = "application/json",
) -> dict[str, Any]:
    """One API call; JSON in, JSON out; ApiException for any status >= 400."""
    if query:
        resource_path = f"{resource_path}?{urlencode(query)}"
    headers = {"Accept": "application/json", "Content-Type": content_type}
    method, url, headers, _, _ = client.param_serialize(
        method, resource_path, header_params=headers, auth_settings=["BearerToken"]
    )
    # The client JSON-encodes bodies itself for JSON content types but sends strings as they are
    # for the apply-patch YAML type (JSON is valid YAML), so only the latter is encoded here.
    data = json.dumps(body) if body is not None and "json" not in content_type else body
    response = client.call_api(method, url, headers, data, _request_timeout=TIMEOUT_SECONDS)
    response.read()
    if response.status >= 400:
        text = response.data.decode(errors="replace") if response.data else ""
        raise ApiException(status=response.status, reason=response.reason, body=text)
    return json.loads(response.data) if response.data else {}


def apply(client: k8s_client.ApiClient, manifest: Obj, field_manager: str) -> dict[str, Any]:
    """Server-side apply; `force` takes back fields someone else changed (drift is reverted)."""
    meta = manifest["metadata"]
    target = path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
    return request(
        client,
        "PATCH",
        target,
        body=manifest,
        query={"fieldManager": field_manager, "force": "true"},
        content_type="application/apply-patch+yaml",
    )


def create(client: k8s_client.ApiClient, manifest: Obj) -> dict[str, Any] | None:
    """Create the object; None when one of that name exists already (it is left as it is)."""
    meta = manifest["metadata"]
    target = path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"))
    try:
        return request(client, "POST", target, body=manifest)
    except ApiException as error:
        if error.status == 409:
            return None
        raise


def add_owner_reference(client: k8s_client.ApiClient, obj: Obj, owner: Obj) -> None:
    """Add `owner` to the object's owners, keeping the others (a strategic merge keyed by uid)."""
    meta = obj["metadata"]
    target = path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
    request(
        client,
        "PATCH",
        target,
        body={"metadata": {"ownerReferences": [dict(owner)]}},
        content_type="application/strategic-merge-patch+json",
    )


def delete(client: k8s_client.ApiClient, obj: Obj) -> None:
    meta = obj["metadata"]
    target = path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
    try:
        request(client, "DELETE", target, body={"propagationPolicy": "Background"})
    except ApiException as error:
        if error.status != 404:
            raise


def get(
    client: k8s_client.ApiClient, api_version: str, kind: str, namespace: str, name: str
) -> dict[str, Any] | None:
    try:
        return request(client, "GET", path(api_version, kind, namespace, name))
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def list_objects(
    client: k8s_client.ApiClient,
    api_version: str,
    kind: str,
    namespace: str | None = None,
    selector: str = "",
) -> list[dict[str, Any]]:
    query = {"labelSelector": selector} if selector else None
    items = request(client, "GET", path(api_version, kind, namespace), query=query).get("items", [])
    for item in items:  # list items lack apiVersion/kind; the pure code keys on them
        item.setdefault("apiVersion", api_version)
        item.setdefault("kind", kind)
    return items


def patch_status(
    client: k8s_client.ApiClient,
    namespace: str,
    name: str,
    status: Obj,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """Merge-patch the status subresource: keys we leave out (autoscaling) stay as they are.
    With `resource_version`, only if the object is still that version (else 409 Conflict)."""
    target = path(MD_API_VERSION, api.KIND, namespace, name) + "/status"
    body: dict[str, Any] = {"status": status}
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    return request(client, "PATCH", target, body=body, content_type="application/merge-patch+json")


def has_crd(client: k8s_client.ApiClient, name: str) -> bool:
    crd = get(client, "apiextensions.k8s.io/v1", "CustomResourceDefinition", "", name)
    return crd is not None


def reporting_instance() -> str:
    """Which operator process reported: the pod's name (the chart's POD_NAME), else the host."""
    return (os.environ.get("POD_NAME") or socket.gethostname())[:128]


def emit_event(
    client: k8s_client.ApiClient,
    involved: Obj,
    kind: str,
    reason: str,
    message: str,
    component: str,
) -> None:
    """An events.k8s.io Event regarding the ModelDeployment, as `kubectl describe` shows them.
    `kind`: Normal or Warning; `component`: the reporting controller. The reason names what was
    done, so it is the action as well."""
    meta = involved["metadata"]
    event = k8s_client.EventsV1Event(
        metadata=k8s_client.V1ObjectMeta(
            name=f"{meta['name']}.{uuid.uuid4().hex[:16]}", namespace=meta["namespace"]
        ),
        regarding=k8s_client.V1ObjectReference(
            api_version=involved.get("apiVersion", MD_API_VERSION),
            kind=involved.get("kind", api.KIND),
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta.get("uid") or None,
        ),
        event_time=timestamps.client_micro_time(datetime.now(UTC)),
        reporting_controller=component,
        reporting_instance=reporting_instance(),
        action=reason,
        reason=reason,
        note=message.encode()[:NOTE_LIMIT].decode(errors="ignore"),
        type=kind,
    )
    k8s_client.EventsV1Api(client).create_namespaced_event(
        meta["namespace"], event, _request_timeout=TIMEOUT_SECONDS
    )
