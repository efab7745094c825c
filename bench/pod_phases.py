"""A new pod's start-up (a replacement, or a scale-up's), phase by phase: when a watch on the
model's pods first saw each step of the new pod (created, bound to a node, container running,
Ready) and, in between, when its runtime process was created and when its engine was ready (the
runtime's /version: the kernel's creation time of the process and its start-up phases, which
add up to its /ready).

All of it is wall-clock time on the one machine that runs the dev cluster, so the bench, the
pod runner and the runtime share a clock. A watch, not a poll: each step is seen within the
API server's fan-out of the update, and the bench burns no CPU the starting pod needs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from urllib3.exceptions import ProtocolError

# The replacement's path, in order; each figure is the seconds from the previous step's end.
PHASES = (
    "delete -> replacement created",  # the ReplicaSet controller
    "created -> scheduled",  # kube-scheduler's binding
    # the node's agent (kubelet, or the pod runner) runs the init containers, then starts it
    "scheduled -> process created",
    "process created -> engine ready",  # the runtime's own start-up (/version's phases)
    "engine ready -> pod Ready",  # the probe that sees it, the status update, the watch
)
# A scale-up onto a free GPU: the same path from the write of the ModelDeployment's replicas.
SCALE_UP_PHASES = (
    # the operator's reconcile, its write of the Deployment, the Deployment and ReplicaSet
    # controllers
    "written -> created",
    "created -> scheduled",  # kube-scheduler's binding, with no wait for a GPU
    *PHASES[2:],
)
# The phases that make up the new pod's own start, whatever created it.
OWN_START_PHASES = PHASES[2:]


@dataclass
class PodSeen:
    """When the watch first saw each step of one pod (unix seconds), and the pod as last seen."""

    created: float | None = None
    scheduled: float | None = None
    running: float | None = None
    ready: float | None = None
    pod: dict[str, Any] = field(default_factory=dict)


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def is_running(pod: dict[str, Any]) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return any("running" in (s.get("state") or {}) for s in statuses)


def observe(seen: PodSeen, pod: dict[str, Any], at: float) -> None:
    """Mark the steps this version of the pod shows for the first time."""
    seen.pod = pod
    steps = {
        "created": True,
        "scheduled": bool((pod.get("spec") or {}).get("nodeName")),
        "running": is_running(pod),
        "ready": is_ready(pod),
    }
    for step, shows in steps.items():
        if shows and getattr(seen, step) is None:
            setattr(seen, step, at)


def is_settled(pods: Iterable[dict[str, Any]], count: int) -> bool:
    """Exactly `count` pods, each Ready and none being deleted: a replica count reached, and a
    GPU given up by a scale-down free again (the pod's object gone, not only its process)."""
    pods = list(pods)
    deleting = any((p.get("metadata") or {}).get("deletionTimestamp") for p in pods)
    return len(pods) == count and not deleting and all(is_ready(p) for p in pods)


def phases(
    started_at: float,
    seen: PodSeen,
    process_created_at: float,
    engine_ready_at: float,
    names: tuple[str, ...] = PHASES,
) -> dict[str, float]:
    """Seconds of each phase in `names` for one new pod: the steps in order, from `started_at`
    (the old pod's deletion for PHASES, the replicas' write for SCALE_UP_PHASES)."""
    steps = [seen.created, seen.scheduled, process_created_at, engine_ready_at, seen.ready]
    if any(step is None for step in steps):
        raise ValueError(f"the new pod was not seen at every step: {steps}")
    ends = [started_at, *(float(step) for step in steps if step is not None)]
    return {name: ends[i + 1] - ends[i] for i, name in enumerate(names)}


class PodWatch:
    """A thread watching the pods of `selector` in `namespace`, keeping PodSeen by pod name."""

    def __init__(self, api: client.ApiClient, namespace: str, selector: str) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace, self.selector = namespace, selector
        self.seen: dict[str, PodSeen] = {}
        self.changed = threading.Condition()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self) -> PodWatch:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()

    def run(self) -> None:
        while not self.stop.is_set():  # the API server ends a watch now and then: watch again
            try:
                self.follow()
            except (ApiException, ProtocolError, OSError):
                self.stop.wait(0.5)  # the cluster going down, or a restart: try again or stop

    def follow(self) -> None:
        stream = watch.Watch().stream(
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=self.selector,
            timeout_seconds=60,
        )
        for event in stream:
            pod = self.core.api_client.sanitize_for_serialization(event["object"])
            with self.changed:
                observe(self.seen.setdefault(pod["metadata"]["name"], PodSeen()), pod, time.time())
                self.changed.notify_all()
            if self.stop.is_set():
                return

    def is_deleted(self, name: str) -> bool:
        """Whether the watch has seen pod `name` marked for deletion (or never seen it)."""
        with self.changed:
            seen = self.seen.get(name)
            return seen is None or bool(seen.pod.get("metadata", {}).get("deletionTimestamp"))

    def wait_ready(self, created_after: float, timeout_s: float) -> PodSeen:
        """The first pod created after `created_after` (unix s) to be seen Ready."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                found = first_ready(self.seen.values(), created_after)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.selector}: no new pod Ready within {timeout_s} s")
                self.changed.wait(left)


def first_ready(seen: Iterable[PodSeen], created_after: float) -> PodSeen | None:
    """A replacement or a scale-up's pod: one first seen after the delete or the write (an older
    one, Ready or not, is not)."""
    new = [s for s in seen if s.created is not None and s.created >= created_after and s.ready]
    return min(new, key=lambda s: s.ready or 0.0, default=None)


def runtime_startup(pod: dict[str, Any]) -> tuple[float, float]:
    """The pod's runtime: when its process was created and when its engine was ready (unix s)."""
    container = pod["spec"]["containers"][0]
    port = container["ports"][0]["containerPort"]
    url = f"http://{pod['status']['podIP']}:{port}/version"
    startup = httpx.get(url, timeout=10).json()["startup"]
    return startup["started_at"], startup["started_at"] + sum(startup["phases"].values())
