"""`helm install` puts the gateway in front, on the dev cluster.

The real chart, installed with the values a dev-cluster user sets (the gateway on the `local`
pool: hack/devcluster/chart-values.yaml), runs its two gateway pods as real processes acting as the
gateway's ServiceAccount; the real operator starts a tiny-llama runtime pod; the official openai
client, pointed at the gateway's Service, gets answers served by that runtime pod, and the gateway
pods' own metrics count every pick.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hack import closedloop
from hack.devcluster import chart, procs
from tests.support.kube import fresh_namespace, get_json, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
NAME = "tiny-helm"


@dataclass(frozen=True)
class Install:
    url: str  # the gateway Service's base URL, reached through the dev cluster's service proxy
    namespace: str
    release: str


@pytest.fixture
def install(cluster: Any) -> Iterator[Install]:
    if not hasattr(cluster, "start_process"):
        pytest.skip("needs the dev cluster (pod runner, Prometheus, local processes)")
    closedloop.apply_crds(cluster)
    release = f"gw{uuid.uuid4().hex[:6]}"
    with fresh_namespace(cluster, "gw-helm") as namespace:
        closedloop.start_operator(cluster, "helm-operator", 2)
        try:
            chart.helm_install(cluster, release, namespace)
            md = closedloop.tiny_llama(NAME, 4, closedloop.builtin_autoscaling(1, 30))
            md["metadata"]["namespace"] = namespace
            cluster.kubectl("apply", "-f", "-", input=json.dumps(md))
            service = chart.gateway_service(cluster, release, namespace)
            url = closedloop.start_proxy(cluster, "helm-gateway-proxy", service, namespace)
            wait_until(lambda: procs.http_ok(f"{url}/health"), 120, "the gateway Service")
            yield Install(url, namespace, release)
        finally:
            cluster.kubectl("delete", "modeldeployment", NAME, "-n", namespace, check=False)
            cluster.stop_process("helm-gateway-proxy")
            cluster.stop_process("helm-operator")
            uninstall = ["uninstall", release, "-n", namespace, "--wait", "--timeout", "60s"]
            chart.helm(cluster, *uninstall, check=False)


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
    assert sum(sum(p.values()) for p in picks) == len(prompts) + 1, picks
    assert {backend for p in picks for backend in p} == served_by
