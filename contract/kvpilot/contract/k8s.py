"""Thin adapter to the Kubernetes API: server-side apply, list, watch, delete, status, events.

Requests go through the client's `DynamicClient`: it finds each resource (its URL, whether it is
namespaced) by apiVersion and kind from the API's discovery documents, looked up once per client
and kept. Objects travel as plain JSON dicts (the wire form), the same shape the pure modules and
kopf use: responses are read as JSON (`serialize=False`), not wrapped in the dynamic client's
ResourceInstance objects, which double the client CPU of a GET and would be converted straight
back. Events are `events.k8s.io/v1` Events through the typed events API. Errors surface as the
client's `ApiException`; the handlers decide what is temporary.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.discovery import LazyDiscoverer
from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError
from kubernetes.dynamic.resource import Resource

from kvpilot.contract import resource, timestamps

Obj = Mapping[str, Any]
MD_API_VERSION = resource.API_VERSION
TIMEOUT_SECONDS = 30
CONNECTION_POOL_SIZE = 256
MERGE_PATCH = "application/merge-patch+json"
NOTE_LIMIT = 1024  # bytes: events.k8s.io rejects a longer note


def api_client(kubeconfig: str | None = None) -> k8s_client.ApiClient:
    """A client for the current kubeconfig context, or the in-cluster service account."""
    try:
        k8s_config.load_kube_config(config_file=kubeconfig)
    except k8s_config.ConfigException:
        k8s_config.load_incluster_config()
    configuration = k8s_client.Configuration.get_default_copy()
    # One connection per pass in flight (passes.WORKERS); beyond its pool urllib3 opens and
    # drops a TLS connection for every request, which costs more CPU than the request.
    configuration.connection_pool_maxsize = CONNECTION_POOL_SIZE
    return k8s_client.ApiClient(configuration)


class _MemoryDiscoverer(LazyDiscoverer):
    """Discovery kept in memory only. The library's default shares one file per API URL in the
    temp directory between every process (operator replicas, the gateway, each test) and
    rewrites it as it learns; concurrent writers leave a torn file that the next reader logs as
    an error. One process discovers its few kinds in a handful of requests."""

    def _write_cache(self) -> None:
        pass


# A path never written (see above), so the discoverer starts empty rather than reading a file.
_NO_CACHE_FILE = os.path.join(tempfile.gettempdir(), f"kvpilot-no-discovery-{uuid.uuid4().hex}")


class _TimedClient(DynamicClient):
    """A DynamicClient whose requests, discovery's included, time out after TIMEOUT_SECONDS
    unless told otherwise (a watch says None: it ends at its own server-side timeout)."""

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        params.setdefault("_request_timeout", TIMEOUT_SECONDS)
        return super().request(method, path, body, **params)


@contextmanager
def _plain_errors() -> Iterator[None]:
    """The dynamic client's DynamicApiError as the plain ApiException the typed APIs raise: the
    subclass puts a traceback in its message, and callers log `error`."""
    try:
        yield
    except DynamicApiError as error:
        raise ApiException(status=error.status, reason=error.reason) from error


class _Dynamic:
    """One DynamicClient per ApiClient and the resources it found, by (apiVersion, kind)."""

    def __init__(self, client: k8s_client.ApiClient) -> None:
        with _plain_errors():  # it reads /version and /apis at once
            self.client = _TimedClient(
                client, cache_file=_NO_CACHE_FILE, discoverer=_MemoryDiscoverer
            )
        self.resources: dict[tuple[str, str], Resource] = {}
        self.lock = threading.Lock()  # the discoverer's cache is not safe across threads

    def resource(self, api_version: str, kind: str) -> Resource:
        found = self.resources.get((api_version, kind))
        if found is not None:
            return found
        group, _, version = api_version.rpartition("/")
        # The prefix and group narrow the search to one group's document; with the group left
        # out, a core kind ("v1") would fetch every group that has a v1.
        where = {"prefix": "apis", "group": group} if group else {"prefix": "api"}
        with self.lock, _plain_errors():
            try:
                found = self.client.resources.get(api_version=version, kind=kind, **where)
            except ResourceNotFoundError as error:
                # Not served (its CRD is not installed): the 404 a request to its URL would get.
                raise ApiException(status=404, reason=f"{kind} {api_version} not served") from error
        self.resources[(api_version, kind)] = found
        return found


_DYNAMIC_ATTRIBUTE = "_kvpilot_dynamic"
_dynamic_lock = threading.Lock()


def _dynamic(client: k8s_client.ApiClient) -> _Dynamic:
    # Kept on the ApiClient itself, so it lives and dies with it (callers pass the ApiClient).
    found: _Dynamic | None = getattr(client, _DYNAMIC_ATTRIBUTE, None)
    if found is None:
        with _dynamic_lock:
            found = getattr(client, _DYNAMIC_ATTRIBUTE, None)
            if found is None:
                found = _Dynamic(client)
                setattr(client, _DYNAMIC_ATTRIBUTE, found)
    return found


def _call(
    client: k8s_client.ApiClient, verb: str, api_version: str, kind: str, **kwargs: Any
) -> dict[str, Any]:
    """One DynamicClient request (`verb`: get, create, replace, patch, server_side_apply, delete)
    on the kind's resource; the response's JSON as a dict; ApiException for any status >= 400."""
    dynamic = _dynamic(client)
    resource = dynamic.resource(api_version, kind)
    if kwargs.pop("subresource", None) == "status":
        resource = resource.subresources["status"]
    with _plain_errors():
        response = getattr(dynamic.client, verb)(resource, serialize=False, **kwargs)
    data = response.data
    return json.loads(data) if data else {}


def _on(client: k8s_client.ApiClient, verb: str, obj: Obj, **kwargs: Any) -> dict[str, Any]:
    """`_call` on the object `obj` names (its apiVersion, kind, namespace and name)."""
    meta = obj["metadata"]
    where = {"name": meta["name"], "namespace": meta.get("namespace")}
    return _call(client, verb, obj["apiVersion"], obj["kind"], **where, **kwargs)


def apply(client: k8s_client.ApiClient, manifest: Obj, field_manager: str) -> dict[str, Any]:
    """Server-side apply; `force` takes back fields someone else changed (drift is reverted)."""
    return _on(
        client,
        "server_side_apply",
        manifest,
        body=manifest,
        field_manager=field_manager,
        force_conflicts=True,
    )


def create(client: k8s_client.ApiClient, manifest: Obj) -> dict[str, Any] | None:
    """Create the object; None when one of that name exists already (it is left as it is)."""
    namespace = manifest["metadata"].get("namespace")
    try:
        api_version, kind = manifest["apiVersion"], manifest["kind"]
        return _call(client, "create", api_version, kind, body=manifest, namespace=namespace)
    except ApiException as error:
        if error.status == 409:
            return None
        raise


def replace(client: k8s_client.ApiClient, obj: Obj) -> dict[str, Any]:
    """PUT the whole object. Its metadata.resourceVersion, when set, makes this a 409 Conflict
    if someone else wrote the object since it was read."""
    return _on(client, "replace", obj, body=obj)


def merge_patch(client: k8s_client.ApiClient, obj: Obj, patch: Obj) -> dict[str, Any]:
    """JSON merge patch (RFC 7386) of the object `obj` names: keys `patch` leaves out stay."""
    return _on(client, "patch", obj, body=patch, content_type=MERGE_PATCH)


def add_owner_reference(client: k8s_client.ApiClient, obj: Obj, owner: Obj) -> None:
    """Add `owner` to the object's owners, keeping the others (a strategic merge keyed by uid)."""
    body = {"metadata": {"ownerReferences": [dict(owner)]}}
    _on(client, "patch", obj, body=body, content_type="application/strategic-merge-patch+json")


def delete(client: k8s_client.ApiClient, obj: Obj) -> None:
    try:
        _on(client, "delete", obj, propagation_policy="Background")
    except ApiException as error:
        if error.status != 404:
            raise


def get(
    client: k8s_client.ApiClient, api_version: str, kind: str, namespace: str, name: str
) -> dict[str, Any] | None:
    try:
        return _call(client, "get", api_version, kind, name=name, namespace=namespace or None)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


class Listing(list[dict[str, Any]]):
    """A LIST's objects, and its resourceVersion, which a watch starts from."""

    def __init__(self, items: list[dict[str, Any]], resource_version: str) -> None:
        super().__init__(items)
        self.resource_version = resource_version


def list_objects(
    client: k8s_client.ApiClient,
    api_version: str,
    kind: str,
    namespace: str | None = None,
    selector: str = "",
) -> Listing:
    """The objects, each with apiVersion and kind (a LIST's items lack them; the pure code keys
    on them)."""
    listing = _call(
        client,
        "get",
        api_version,
        kind,
        namespace=namespace or None,
        label_selector=selector or None,
    )
    items = listing.get("items") or []
    for item in items:
        item.setdefault("apiVersion", api_version)
        item.setdefault("kind", kind)
    return Listing(items, str(listing["metadata"]["resourceVersion"]))


def watch(
    client: k8s_client.ApiClient,
    watcher: k8s_watch.Watch,
    api_version: str,
    kind: str,
    namespace: str | None,
    selector: str,
    resource_version: str,
    timeout_s: int,
) -> Iterator[dict[str, Any]]:
    """The watch events after `resource_version`, bookmarks included, until the server ends the
    watch (`timeout_s`) or `watcher.stop()`; each has `type` and `raw_object`, the object's JSON.
    An expired version raises ApiException 410, whether the API answers the request with 410 or
    sends it as an ERROR event (the library retries a 410 once only without a timeout).

    This is DynamicClient.watch without its last step, which wraps every event's object in a
    ResourceInstance that nothing here reads (it doubles the CPU of reading an object)."""
    dynamic = _dynamic(client)
    resource = dynamic.resource(api_version, kind)
    with _plain_errors():
        yield from watcher.stream(
            resource.get,
            namespace=namespace or None,
            label_selector=selector or None,
            resource_version=resource_version,
            timeout_seconds=timeout_s,
            allow_watch_bookmarks=True,
            serialize=False,
            _request_timeout=None,  # as the typed watch had: the server ends it at timeout_s
        )


def patch_status(
    client: k8s_client.ApiClient,
    namespace: str,
    name: str,
    status: Obj,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """Merge-patch the status subresource: keys we leave out (autoscaling) stay as they are.
    With `resource_version`, only if the object is still that version (else 409 Conflict)."""
    body: dict[str, Any] = {"status": dict(status)}
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    return _call(
        client,
        "patch",
        MD_API_VERSION,
        resource.KIND,
        subresource="status",
        body=body,
        name=name,
        namespace=namespace,
        content_type=MERGE_PATCH,
    )


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
            kind=involved.get("kind", resource.KIND),
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
