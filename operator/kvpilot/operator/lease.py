"""Leader election: a coordination.k8s.io Lease, as client-go's leaderelection, is the one decision
of which operator instance acts.

An instance first waits for the Lease (`wait_until_held`), answering its probes as a standby; only
then does it start kopf (with no kopf peering) and the loops kopf's startup handler starts. While
it runs, `keep` renews the Lease; an instance that loses it (another holds it, or no renewal got
through for `renew_deadline_s`) stops kopf and exits, and its pod restarts as a standby. So kopf's
handlers, the autoscaler and the re-planner always run in the same single instance. Another
instance takes the Lease over when the record has not changed for `leaseDurationSeconds` by that
instance's own clock (as client-go does, so the instances' clocks need not agree), or at once when
the holder lets it go on a clean stop. The holder gives up at two thirds of the duration, so it has
stopped acting before a standby may take over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s_client

from kvpilot.contract import k8s, timestamps

LEASE_NAME = "kvpilot-operator"
LEASE_API_VERSION = "coordination.k8s.io/v1"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
log = logging.getLogger(__name__)


def may_take(spec: Mapping[str, Any], identity: str, unchanged_for_s: float) -> bool:
    """Whether `identity` may hold a Lease whose spec is `spec` (pure).

    `unchanged_for_s`: how long this instance has seen the record unchanged; a holder that
    renews changes it, so a record unchanged for longer than its duration has a dead holder.
    """
    holder = spec.get("holderIdentity")
    if not holder or holder == identity:
        return True
    return unchanged_for_s > float(spec.get("leaseDurationSeconds") or 0)


def taken(spec: Mapping[str, Any], identity: str, duration_s: int, now: str) -> dict[str, Any]:
    """The spec after `identity` takes or renews the Lease (pure)."""
    new = dict(spec)
    if spec.get("holderIdentity") != identity:
        new["acquireTime"] = now
        new["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (
            1 if spec.get("holderIdentity") else 0
        )
    new.update(holderIdentity=identity, leaseDurationSeconds=duration_s, renewTime=now)
    return new


def has_lost(held: bool, holder_known: bool, since_renewal_s: float, deadline_s: float) -> bool:
    """Whether the holder must stop acting (pure): another instance holds the Lease now, or no
    renewal has got through for `deadline_s` (the API unreachable), after which a standby may
    soon take it over."""
    return not held and (holder_known or since_renewal_s > deadline_s)


def released(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec after its holder lets it go: no holder, so the next instance takes it at once."""
    return {k: v for k, v in spec.items() if k != "holderIdentity"}


def default_identity() -> str:
    """The pod's name (the chart passes it as POD_NAME) and this process's id."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{os.getpid()}"


def operator_namespace(watch_namespace: str = "") -> str:
    """Where the operator runs: POD_NAMESPACE (the chart's downward API), else the service
    account's namespace inside a pod, else the namespace it watches, else `default`."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return watch_namespace or "default"


class LeaderLease:
    """`hold()` answers "may I act now?", renewing or taking the Lease when it is time to."""

    def __init__(
        self,
        client: k8s_client.ApiClient,
        namespace: str,
        identity: str,
        duration_s: int,
        name: str = LEASE_NAME,
    ) -> None:
        self.client, self.namespace, self.name = client, namespace, name
        self.identity, self.duration_s = identity, duration_s
        self.renew_every_s = duration_s / 3  # two renewals may fail before another takes over
        self.renew_deadline_s = duration_s * 2 / 3  # stop acting before a standby may take over
        self.retry_s = min(2.0, duration_s / 6)  # how often a standby, or a failed renewal, tries
        self._renewed_at: float | None = None  # monotonic time of our last successful write
        self.last_renewal = time.monotonic()  # of the last successful write, kept across failures
        self.holder = ""  # who holds it, as last read ("" unknown or nobody)
        self._seen: tuple[str, float] | None = None  # (resourceVersion, first seen, monotonic)
        self._problem = ""
        # Whether the last check learned who holds the Lease (an API error leaves it unknown).
        self.state_known = False

    def hold(self) -> bool:
        now = time.monotonic()
        if self._renewed_at is not None and now - self._renewed_at < self.renew_every_s:
            return True
        try:
            holds = self._take_or_renew(now)
            self.state_known = True
        except k8s.ApiException as error:
            holds = False
            # 409: another instance wrote first. Anything else: we cannot know we still hold it.
            self.state_known = error.status == 409
            if error.status != 409:
                self._report(f"cannot take or renew Lease {self.namespace}/{self.name}: {error}")
        except (urllib3.exceptions.HTTPError, OSError) as error:  # the API is unreachable
            holds, self.state_known = False, False
            self._report(f"cannot reach the API for Lease {self.namespace}/{self.name}: {error}")
        self._renewed_at = now if holds else None
        return holds

    def wait_until_held(
        self, on_check: Callable[[], None] = lambda: None, stop: threading.Event | None = None
    ) -> bool:
        """Block until this instance holds the Lease (True; a standby waits here) or `stop` is set
        (False), calling `on_check` after each try so readiness can follow `state_known`."""
        stop = stop or threading.Event()
        waiting_for = None  # log each new holder once, not on every try
        while not stop.is_set():
            if self.hold():
                on_check()
                return True
            on_check()
            if self.holder and self.holder != waiting_for:
                waiting_for = self.holder
                log.info(
                    "standby: Lease %s/%s is held by %s", self.namespace, self.name, self.holder
                )
            stop.wait(self.retry_s)  # a signal handler setting it wakes this at once
        return False

    async def keep(self, on_lost: Callable[[], None]) -> None:
        """Renew the Lease until cancelled; call `on_lost` once and return when it is lost."""
        while True:
            await asyncio.sleep(self.retry_s)
            held = await asyncio.to_thread(self.hold)
            since = time.monotonic() - self.last_renewal
            if has_lost(held, self.state_known, since, self.renew_deadline_s):
                log.error(
                    "lost Lease %s/%s (holder now: %s); stopping so another instance acts alone",
                    self.namespace,
                    self.name,
                    self.holder or "unknown",
                )
                on_lost()
                return

    def release(self) -> None:
        """Let the Lease go on a clean stop, so a standby takes over without waiting."""
        if self._renewed_at is None:
            return
        self._renewed_at = None
        try:
            lease = k8s.get(self.client, LEASE_API_VERSION, "Lease", self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                self._put({**lease, "spec": released(lease["spec"])})
        except k8s.ApiException as error:  # it expires on its own
            log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, error)

    def _take_or_renew(self, now: float) -> bool:
        lease = k8s.get(self.client, LEASE_API_VERSION, "Lease", self.namespace, self.name)
        self.holder = str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")
        stamp = timestamps.micro_time(datetime.now(UTC))
        if lease is None:
            body = {
                "apiVersion": LEASE_API_VERSION,
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": taken({}, self.identity, self.duration_s, stamp),
            }
            if k8s.create(self.client, body) is None:  # another instance created it first
                return False
            return self._took()
        spec = lease.get("spec") or {}
        if not may_take(spec, self.identity, self._unchanged_for(lease, now)):
            return False
        self._put({**lease, "spec": taken(spec, self.identity, self.duration_s, stamp)})
        return self._took()

    def _unchanged_for(self, lease: Mapping[str, Any], now: float) -> float:
        version = str(lease["metadata"].get("resourceVersion", ""))
        if self._seen is None or self._seen[0] != version:
            self._seen = (version, now)
        return now - self._seen[1]

    def _put(self, lease: Mapping[str, Any]) -> None:
        # The body carries the resourceVersion read: a concurrent writer makes this a 409.
        k8s.replace(self.client, lease)

    def _took(self) -> bool:
        if self._problem or self._renewed_at is None:
            log.info("holding Lease %s/%s as %s", self.namespace, self.name, self.identity)
        self._problem, self.holder = "", self.identity
        self.last_renewal = time.monotonic()
        return True

    def _report(self, problem: str) -> None:
        if problem != self._problem:  # once per new problem, not on every tick
            log.warning("%s; trying again", problem)
        self._problem = problem
