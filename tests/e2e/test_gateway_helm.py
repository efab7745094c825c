"""`helm install` puts the gateway in front, on the dev cluster.

The real chart, installed with the values a dev-cluster user sets (the gateway on the `local`
pool: hack/devcluster/chart-values.yaml), runs its two gateway pods as real processes acting as the
gateway's ServiceAccount; the real operator starts a tiny-llama runtime pod; the official openai
client, pointed at the gateway's Service, gets answers served by that runtime pod, and the gateway
pods' own metrics count every pick. Under steady load through the same gateway, a rollout of the
runtime pods and a scale-down lose no request.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hack import closedloop
from hack.devcluster import chart
from tests.support.gateway_install import Install, gateway_in_front
from tests.support.kube import get_json, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
NAME = "tiny-helm"


@pytest.fixture(scope="module")
def install(cluster: Any) -> Iterator[Install]:
    md = closedloop.tiny_llama(NAME, 4, closedloop.builtin_autoscaling(1, 30))
    with gateway_in_front(cluster, "gw-helm", md) as installed:
        yield installed


def runtime_pods(cluster: Any, namespace: str) -> list[str]:
    found = get_json(cluster, "pods", "-n", namespace, "-l", f"kvpilot.dev/model={NAME}")
    return [p["metadata"]["name"] for p in found["items"]]


def ready_replicas(cluster: Any, namespace: str) -> int:
    status = get_json(cluster, "modeldeployment", NAME, "-n", namespace).get("status", {})
    return int(status.get("readyReplicas", 0))


def picks_by_backend(url: str) -> dict[str, float]:
    """kvpilot_gateway_picks_total of one gateway pod, by backend."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    picks: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvpilot_gateway_picks_total" and sample.labels["model"] == NAME:
                backend = sample.labels["backend"]
                picks[backend] = picks.get(backend, 0.0) + sample.value
    return picks


def test_the_openai_client_reaches_a_runtime_pod_through_the_charts_gateway(
    cluster: Any, install: Install
) -> None:
    gateways = chart.gateway_pod_urls(cluster, install.release, install.namespace)
    assert len(gateways) == 2  # the chart's default replicas, both Ready (helm --wait)
    for pod in get_json(cluster, "pods", "-n", install.namespace, "-l", chart.GATEWAY)["items"]:
        node = get_json(cluster, "node", pod["spec"]["nodeName"])["metadata"]["labels"]
        assert node["kvpilot.dev/node-type"] == "local"  # as chart-values.yaml asks
    wait_until(lambda: ready_replicas(cluster, install.namespace) >= 1, 600, "tiny-llama Ready")

    client = openai.OpenAI(base_url=f"{install.url}/v1", api_key="unused", max_retries=0)
    assert NAME in [model.id for model in client.models.list()]
    picks_before = sum(sum(p.values()) for p in (picks_by_backend(u) for u in gateways.values()))
    served_by = set()
    prompts = [f"Request {i}: once upon a time" for i in range(4)]
    for prompt in prompts:
        raw = client.completions.with_raw_response.create(model=NAME, prompt=prompt, max_tokens=8)
        completion = raw.parse()
        assert completion.usage is not None and completion.usage.completion_tokens == 8
        assert raw.headers["x-kvpilot-target"] == NAME
        served_by.add(raw.headers["x-kvpilot-backend"])
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=8,
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    pods = runtime_pods(cluster, install.namespace)
    assert served_by <= {f"{install.namespace}/{pod}" for pod in pods}, (served_by, pods)
    # Every request went through the chart's gateway pods, and each pick is counted by the pod
    # that made it: the picks of both pods add up to the requests sent.
    picks = [picks_by_backend(url) for url in gateways.values()]
    assert sum(sum(p.values()) for p in picks) - picks_before == len(prompts) + 1, picks
    assert {backend for p in picks for backend in p} == served_by


@dataclass
class SteadyLoad:
    """Clients sending streamed chat requests through the gateway, one after another each, until
    stopped: what they got, per replica, and every failure."""

    url: str
    served_by: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, number: int) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)
        sent = 0
        while not self.stop.is_set():
            sent += 1
            messages = [{"role": "user", "content": f"Client {number}, request {sent}: hello"}]
            try:
                finish_reason, backend = stream_chat(client, messages)
            except openai.OpenAIError as error:
                with self.lock:
                    self.failures.append(f"client {number}, request {sent}: {error!r}")
                continue
            with self.lock:
                # A stream that broke off gets the gateway's error event (the client raises) or
                # no finish_reason; an empty answer is fine (the sampled first token may be EOS).
                if finish_reason not in ("stop", "length"):
                    self.failures.append(f"client {number}, request {sent}: ended {finish_reason}")
                self.served_by[backend] = self.served_by.get(backend, 0) + 1

    def served(self) -> int:
        with self.lock:
            return sum(self.served_by.values())

    def pods(self) -> set[str]:
        """The pods that served a request (the gateway names them namespace/pod)."""
        with self.lock:
            return {backend.split("/")[1] for backend in self.served_by}


def stream_chat(client: openai.OpenAI, messages: list[Any]) -> tuple[str | None, str]:
    """A streamed chat request: how it finished and the replica that served it."""
    raw: Any = client.chat.completions.with_raw_response.create(
        model=NAME,
        messages=messages,
        max_tokens=8,
        stream=True,
    )
    reasons = [c.choices[0].finish_reason for c in raw.parse() if c.choices]
    return next((r for r in reasons if r is not None), None), str(raw.headers["x-kvpilot-backend"])


def replaced_pods(cluster: Any, namespace: str, old: set[str]) -> set[str] | None:
    """Two settled pods, none of them in `old`."""
    pods = settled_pods(cluster, namespace, 2)
    return pods if pods and not pods & old else None


def set_replicas(cluster: Any, namespace: str, replicas: int) -> None:
    patch = {"spec": {"autoscaling": {"minReplicas": replicas, "maxReplicas": replicas}}}
    cluster.kubectl("patch", "modeldeployment", NAME, "-n", namespace, "--type=merge",
                    "-p", json.dumps(patch))  # fmt: skip


def settled_pods(cluster: Any, namespace: str, count: int) -> set[str] | None:
    """The model's pod names once exactly `count` are Ready and none is terminating."""
    found = get_json(cluster, "pods", "-n", namespace, "-l", f"kvpilot.dev/model={NAME}")["items"]
    ready = {
        pod["metadata"]["name"]
        for pod in found
        if not pod["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True"
                for c in pod["status"].get("conditions", []))
    }  # fmt: skip
    return ready if len(found) == len(ready) == count else None


def test_a_rollout_and_a_scale_down_behind_the_gateway_lose_no_request(
    cluster: Any, install: Install
) -> None:
    namespace = install.namespace
    set_replicas(cluster, namespace, 2)
    before = wait_until(lambda: settled_pods(cluster, namespace, 2), 600, "two Ready replicas")
    load = SteadyLoad(install.url)
    clients = [threading.Thread(target=load.client, args=(n,), daemon=True) for n in range(4)]
    for thread in clients:
        thread.start()
    try:
        wait_until(lambda: load.served() >= 8, 120, "requests served before the rollout")
        # A new pod template (the runtime's batch cap is one of its flags): the Deployment
        # replaces its pods one at a time (maxSurge 0 on the 2 one-GPU local nodes).
        patch = {"spec": {"serving": {"maxNumSeqs": 5}}}
        cluster.kubectl("patch", "modeldeployment", NAME, "-n", namespace, "--type=merge",
                        "-p", json.dumps(patch))  # fmt: skip
        after = wait_until(
            lambda: replaced_pods(cluster, namespace, before), 900, "the rollout to replace both"
        )
        # The gateway routes to each new pod once it has seen it Ready (it watches the
        # endpoints): before the scale-down removes one of them.
        wait_until(lambda: after <= load.pods(), 120, "each new pod to serve a request")
        served_at_rollout = load.served()
        set_replicas(cluster, namespace, 1)
        wait_until(lambda: settled_pods(cluster, namespace, 1), 300, "the scale-down to one pod")
        wait_until(lambda: load.served() >= served_at_rollout + 8, 120, "requests after it")
    finally:
        load.stop.set()
        for thread in clients:
            thread.join(timeout=120)
    assert not load.failures, load.failures[:5]
    assert before <= load.pods(), (before, load.served_by)
