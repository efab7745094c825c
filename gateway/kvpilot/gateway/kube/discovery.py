"""Kubernetes discovery: WATCHES ModelDeployments and their pods and keeps a RouteTable current.

One thread per (resource, namespace) lists, then watches from the list's resourceVersion (with
bookmarks, so a quiet resource's version stays fresh); a 410 Gone or an expired version re-lists,
any other error backs off (exponential, jittered) and re-lists. After every change the routes are
rebuilt from the objects held (kube_routes.build_routes, pure) and handed to the event loop with
`loop.call_soon_threadsafe`, where `apply_routes` puts only the routes that changed.

Provider API keys are read (`get`, by name) from their Secrets when a ModelDeployment is added or
its spec changes (a new generation) and at every re-list; Secrets are not watched, so a rotated
key reaches the gateway at the next spec change of its ModelDeployment or the next re-list.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from kvpilot.contract import k8s
from kvpilot.contract.resource import API_VERSION, KIND, LABEL_MODEL
from kvpilot.gateway.kube import routes as kube_routes
from kvpilot.gateway.kube.wake import KubernetesWaker
from kvpilot.gateway.routing.routes import Route, RouteTable

log = logging.getLogger("kvpilot.gateway.discovery")

WATCH_TIMEOUT_S = 300  # the server ends a watch after this; the thread watches on from there
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class Resource:
    """One watched list: its apiVersion and kind, and which of its objects we keep."""

    api_version: str
    kind: str
    selector: str = ""
    keep: Callable[[dict[str, Any]], dict[str, Any]] = dict  # the part of an object we hold


MODEL_DEPLOYMENTS = Resource(API_VERSION, KIND)
# Only the operator's runtime pods (label kvpilot.dev/model), and only what routing reads of them.
PODS = Resource("v1", "Pod", LABEL_MODEL, kube_routes.slim_pod)


class GoneError(Exception):
    """The watch's resourceVersion expired (410): list again."""


@dataclass
class ClusterObjects:
    """What the watches have seen, keyed by namespace/name; guarded by the lock."""

    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    secrets: dict[kube_routes.SecretKey, str | None] = field(default_factory=dict)

    def store(self, kind: str) -> dict[str, dict[str, Any]]:
        return self.deployments if kind == MODEL_DEPLOYMENTS.kind else self.pods


def apply_routes(table: RouteTable, routes: Iterable[Route]) -> None:
    """Make the table hold exactly `routes`, touching only the models whose route changed (each
    put or remove wakes the requests held on the table, so unchanged models stay quiet)."""
    wanted = {route.model: route for route in routes}
    for model in table.models():
        if model not in wanted:
            table.remove(model)
    for model, route in wanted.items():
        if table.get(model) != route:
            table.put(route)


class KubernetesDiscovery:
    """The watch threads and the objects they keep; `stop()` ends them."""

    def __init__(
        self,
        table: RouteTable,
        loop: asyncio.AbstractEventLoop,
        client: k8s_client.ApiClient,
        namespaces: Sequence[str] = (),
    ) -> None:
        self._table, self._loop, self._client = table, loop, client
        self._scopes: list[str | None] = list(namespaces) or [None]
        self._objects = ClusterObjects()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listed: set[tuple[str, str | None]] = set()
        self.synced = threading.Event()  # every list has been read once
        self._problems: tuple[str, ...] = ()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for resource in (MODEL_DEPLOYMENTS, PODS):
            for scope in self._scopes:
                name = f"discovery-{resource.kind}-{scope or 'all'}"
                thread = threading.Thread(
                    target=self._run, args=(resource, scope), name=name, daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the threads; one blocked reading a quiet watch ends at its server timeout."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=timeout_s / max(1, len(self._threads)))

    def _run(self, resource: Resource, scope: str | None) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                version = self._relist(resource, scope)
                failures = 0
                self.watch_from(resource, scope, version)
            except GoneError:
                log.info("%s watch (%s) expired; listing again", resource.kind, scope or "all")
            except Exception as error:  # the API or the network: back off, then list again
                failures += 1
                delay = min(MAX_BACKOFF_S, 0.5 * 2**failures) * random.uniform(0.5, 1.0)
                log.warning(
                    "%s watch (%s) failed: %s; listing again in %.1fs",
                    resource.kind,
                    scope or "all",
                    _one_line(error),
                    delay,
                )
                self._stopping.wait(delay)

    def _relist(self, resource: Resource, scope: str | None) -> str:
        listed = k8s.list_objects(
            self._client, resource.api_version, resource.kind, scope, resource.selector
        )
        version = listed.resource_version
        items = {kube_routes.key_of(i): resource.keep(i) for i in listed}
        with self._lock:
            store = self._objects.store(resource.kind)
            for key in [k for k in store if _in_scope(k, scope)]:
                del store[key]
            store.update(items)
            if resource is MODEL_DEPLOYMENTS:
                self._read_secrets(list(items.values()), force=True)
            self._listed.add((resource.kind, scope))
            self._publish()
        if len(self._listed) == 2 * len(self._scopes):
            self.synced.set()
        return version

    def watch_from(self, resource: Resource, scope: str | None, version: str) -> None:
        """Apply the events after `version` until stopped; GoneError when it has expired."""
        watcher = k8s_watch.Watch()
        while not self._stopping.is_set():
            events = k8s.watch(
                self._client,
                watcher,
                resource.api_version,
                resource.kind,
                scope,
                resource.selector,
                version,
                WATCH_TIMEOUT_S,
            )
            try:
                for event in events:
                    version = self._handle(resource, event)
                    if self._stopping.is_set():
                        watcher.stop()
            except ApiException as error:
                if error.status == 410:
                    raise GoneError() from error
                raise

    def _handle(self, resource: Resource, event: dict[str, Any]) -> str:
        """Apply one watch event; the resourceVersion to resume from."""
        obj = event["raw_object"]  # the JSON as the API sent it (event["object"]: typed)
        version = str(obj["metadata"]["resourceVersion"])
        if event["type"] == "BOOKMARK":
            return version
        key = kube_routes.key_of(obj)
        with self._lock:
            store = self._objects.store(resource.kind)
            if event["type"] == "DELETED":
                store.pop(key, None)
            else:
                before = store.get(key)
                store[key] = resource.keep(obj)
                if resource is MODEL_DEPLOYMENTS:
                    # the spec changed (not only status, which the operator writes every few
                    # seconds): read its providers' keys again
                    self._read_secrets([obj], force=_generation(before) != _generation(obj))
            self._publish()
        return version

    def _read_secrets(self, deployments: list[dict[str, Any]], force: bool) -> None:
        for needed in kube_routes.secrets_needed(deployments):
            if force or needed not in self._objects.secrets:
                self._objects.secrets[needed] = self.secret_value(needed)

    def secret_value(self, needed: kube_routes.SecretKey) -> str | None:
        try:
            secret = k8s_client.CoreV1Api(self._client).read_namespaced_secret(
                needed.name, needed.namespace, _request_timeout=k8s.TIMEOUT_SECONDS
            )
        except ApiException as error:
            log.warning("cannot read Secret %s/%s: %s", needed.namespace, needed.name, error.reason)
            return None
        encoded = (secret.data or {}).get(needed.key)
        return base64.b64decode(encoded).decode() if encoded is not None else None

    def _publish(self) -> None:
        """Rebuild the routes and hand them to the loop (under the lock: handed over in order)."""
        objects = self._objects
        resolution = kube_routes.build_routes(
            objects.deployments.values(),
            objects.pods.values(),
            lambda ns, name, key: objects.secrets.get(kube_routes.SecretKey(ns, name, key)),
        )
        for problem in sorted(set(resolution.problems) - set(self._problems)):
            log.warning("%s", problem)
        self._problems = resolution.problems
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(apply_routes, self._table, resolution.routes)


def _generation(obj: dict[str, Any] | None) -> int | None:
    return None if obj is None else obj["metadata"].get("generation")


def _in_scope(key: str, scope: str | None) -> bool:
    return scope is None or key.startswith(f"{scope}/")


def _one_line(error: BaseException) -> str:
    if isinstance(error, ApiException):
        return f"{error.status} {error.reason}"
    return (str(error).splitlines() or [type(error).__name__])[0]


def api_client(kubeconfig: str | None = None) -> k8s_client.ApiClient:
    """The kubeconfig's context (KUBECONFIG, ~/.kube/config or `kubeconfig`), else the pod's
    in-cluster service account."""
    return k8s.api_client(kubeconfig)


def start_kubernetes_discovery(
    table: RouteTable,
    loop: asyncio.AbstractEventLoop,
    namespaces: Sequence[str] = (),
    kubeconfig: str | None = None,
) -> tuple[Callable[[], None], KubernetesWaker]:
    """Watch the cluster into `table` (every namespace, or only `namespaces`); returns the
    function that stops the watches and the waker that asks a ModelDeployment for a replica."""
    client = api_client(kubeconfig)
    discovery = KubernetesDiscovery(table, loop, client, namespaces)
    discovery.start()
    return discovery.stop, KubernetesWaker(client)
