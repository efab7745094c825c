"""The gateway's fair queue reaches the autoscaler, on the dev cluster (issue 33).

The real chart's two gateway pods run with flow control (`--max-in-flight-per-replica=1`), in
front of one tiny-llama replica that could batch 8: a flood of clients through the gateway's
Service keeps the replica at two running requests (one per gateway pod) and nothing waiting on
it, while the rest wait in the gateways' fair queues. The replica's own metrics describe a fleet
at ease; Prometheus scrapes the gateway pods' `kvpilot_gateway_requests_queued` (by the pods'
annotations, as it scrapes the runtime's), the operator reads it as waiting demand
(`status.autoscaling.metrics.requestsQueued`) and scales the model out to its second replica.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from hack import closedloop
from tests.support.gateway_install import Install, gateway_in_front
from tests.support.kube import get_json, wait_until
from tests.support.operator_cluster import events

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
NAME = "tiny-flow"
MAX_NUM_SEQS = 8  # the replica could batch 8; the gateways let 2 through (1 per pod)
CLIENTS = 10


@pytest.fixture(scope="module")
def install(cluster: Any) -> Iterator[Install]:
    # A 300 s down window: the fleet stays out while the test reads it.
    md = closedloop.tiny_llama(NAME, MAX_NUM_SEQS, closedloop.builtin_autoscaling(2, 300))
    flow_control = ["--set-json", 'gateway.extraArgs=["--max-in-flight-per-replica=1"]']
    with gateway_in_front(cluster, "gw-flow", md, settings=flow_control) as installed:
        yield installed


@dataclass
class Flood:
    """Clients sending completions through the gateway, one after another each, until stopped."""

    url: str
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, number: int) -> None:
        with httpx.Client(base_url=self.url, timeout=300) as http:
            while not self.stop.is_set():
                body = {"model": NAME, "prompt": f"Client {number}: once", "max_tokens": 24}
                reply = http.post("/v1/completions", json=body)
                with self.lock:
                    if reply.status_code == 200:
                        self.answered += 1
                    else:
                        self.failures.append(f"{reply.status_code}: {reply.text[:200]}")


def status(cluster: Any, namespace: str) -> dict[str, Any]:
    found = get_json(cluster, "modeldeployment", NAME, "-n", namespace)
    return dict(found.get("status") or {})


def queued_at_the_gateways(cluster: Any, namespace: str) -> dict[str, Any] | None:
    """status.autoscaling.metrics once it shows the flood in the gateways' fair queues (10
    clients, 2 of them running)."""
    metrics = (status(cluster, namespace).get("autoscaling") or {}).get("metrics") or {}
    return metrics if metrics.get("requestsQueued", 0) >= 4 else None


def test_the_gateways_fair_queue_scales_the_model_out(cluster: Any, install: Install) -> None:
    namespace = install.namespace
    wait_until(
        lambda: status(cluster, namespace).get("readyReplicas", 0) >= 1, 600, "a replica Ready"
    )
    flood = Flood(install.url)
    clients = [threading.Thread(target=flood.client, args=(n,)) for n in range(CLIENTS)]
    for thread in clients:
        thread.start()
    try:
        shown = wait_until(lambda: queued_at_the_gateways(cluster, namespace), 180, "the queue")
        # The waiting demand is the gateways': the replica's own queue holds at most a request
        # on its way into the next step (a scrape may catch it between arrival and admission).
        on_the_replica = shown["requestsWaiting"] - shown["requestsQueued"] - shown["requestsHeld"]
        assert on_the_replica <= 1, shown
        assert shown["requestsRunning"] <= 2, shown  # one per gateway pod
        scaled = wait_until(
            lambda: events(cluster, namespace, NAME, "ScaledUp"), 120, "the scale-out event"
        )
        wait_until(lambda: status(cluster, namespace).get("readyReplicas", 0) == 2, 600, "2 Ready")
    finally:
        flood.stop.set()
        for thread in clients:
            thread.join(timeout=300)
    # e.g. "Scaled from 1 to 2 replicas: queue 7.00/replica vs target 2 (2 running, 7 waiting,
    # 1 ready)": the waiting ones are the gateways' (the replica's own queue was empty)
    assert scaled[0].startswith("Scaled from 1 to 2 replicas") and "waiting" in scaled[0], scaled
    assert flood.answered > 0 and not flood.failures, flood.failures[:5]
