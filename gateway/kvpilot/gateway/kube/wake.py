"""Wake from zero on Kubernetes: ask the operator for a replica of a ModelDeployment.

The gateway merge-patches the annotation `kvpilot.dev/wake-requested-at: <RFC 3339 UTC now>` on
the ModelDeployment; the operator treats a wake newer than the autoscaler's last decision as
demand (a model at zero replicas goes to one at once). Requests held for one model would each ask
again, so a model is patched at most once per `min_interval_s`. The API call runs in a thread:
the event loop never waits on the API server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException

from kvpilot.contract import k8s, resource, timestamps
from kvpilot.gateway.routing.routes import ScaleTarget

log = logging.getLogger("kvpilot.gateway.wake")

MIN_INTERVAL_S = 5.0


class KubernetesWaker:
    """`Waker` (routing/wake.py) that annotates the ModelDeployment, at most once per model per
    interval."""

    def __init__(
        self,
        client: k8s_client.ApiClient,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._objects = k8s_client.CustomObjectsApi(client)
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._last_wake: dict[ScaleTarget, float] = {}

    def is_due(self, target: ScaleTarget) -> bool:
        """Whether a wake for `target` goes to the API now (and remember that it did)."""
        now = self._clock()
        last = self._last_wake.get(target)
        if last is not None and now - last < self._min_interval_s:
            return False
        self._last_wake[target] = now
        return True

    async def wake(self, target: ScaleTarget) -> None:
        """Annotate the ModelDeployment; a refusal is logged, never raised: the request stays
        held (and its deadline, then its fallbacks, still apply)."""
        if not self.is_due(target):
            return
        try:
            await asyncio.to_thread(self._annotate, target, timestamps.rfc3339())
        except ApiException as error:
            log.warning(
                "cannot wake ModelDeployment %s/%s: %s %s",
                target.namespace,
                target.name,
                error.status,
                error.reason,
            )
        except Exception as error:  # the network: the next request after the interval retries
            log.warning("cannot wake %s/%s: %s", target.namespace, target.name, error)

    def _annotate(self, target: ScaleTarget, now: str) -> None:
        self._objects.patch_namespaced_custom_object(
            resource.GROUP,
            resource.VERSION,
            target.namespace,
            resource.PLURAL,
            target.name,
            {"metadata": {"annotations": {resource.WAKE_ANNOTATION: now}}},
            _content_type="application/merge-patch+json",
            _request_timeout=k8s.TIMEOUT_SECONDS,
        )
        log.info("asked %s/%s for a replica at %s", target.namespace, target.name, now)
