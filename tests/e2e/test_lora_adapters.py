"""Multi-LoRA end to end on the dev cluster (issue 34): a ModelDeployment of three adapters on the
`local` pool, served through the chart's gateway with the official openai client; then a fourth
added to the spec, loaded into the running pod by the operator's adapter sync and served through
the gateway, without a pod restart (the same pod, no container restart, the Deployment's template
unchanged)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from bench.reference.lora import MIXED_ADAPTERS
from hack import closedloop
from hack.devcluster import chart
from tests.support.adapters import local_pool_adapters
from tests.support.kube import get_json, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.e2e]
NAME = "tiny-lora"
RELEASE = "lora-gw"


@pytest.fixture(scope="module")
def adapter_uris() -> Iterator[dict[str, str]]:
    """Four PEFT adapters of tiny-llama, as file:// URIs the `local` pool's pods can read."""
    with local_pool_adapters(MIXED_ADAPTERS, "lora-e2e") as uris:
        yield uris


def manifest(adapters: dict[str, str]) -> dict[str, Any]:
    md = closedloop.tiny_llama(NAME, 4, {"mode": "off", "replicas": 1})
    md["spec"]["lora"] = {"maxLoras": 2, "maxLoraRank": 16}
    md["spec"]["adapters"] = [{"name": n, "uri": u} for n, u in adapters.items()]
    return md


@pytest.fixture
def gateway(cluster: Any, adapter_uris: dict[str, str]) -> Iterator[str]:
    """CRDs, the operator, the chart's gateway and the ModelDeployment with three adapters; the
    gateway's URL (a proxy in front of its Service)."""
    if not hasattr(cluster, "start_process"):
        pytest.skip("needs the dev cluster (pod runner)")
    first_three = dict(list(adapter_uris.items())[:3])
    closedloop.apply_crds(cluster)
    closedloop.start_operator(cluster, f"{NAME}-operator", 5)
    try:
        chart.helm_install(cluster, RELEASE, "default")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(first_three)))
        service = chart.gateway_service(cluster, RELEASE, "default")
        yield closedloop.start_proxy(cluster, f"{NAME}-gateway-proxy", service)
    finally:
        cluster.kubectl("delete", "modeldeployment", NAME, "--wait=false", check=False)
        cluster.stop_process(f"{NAME}-gateway-proxy")
        cluster.stop_process(f"{NAME}-operator")
        uninstall = ["uninstall", RELEASE, "--wait", "--timeout", "60s", "--namespace", "default"]
        chart.helm(cluster, *uninstall, check=False)


def status(cluster: Any) -> dict[str, Any]:
    return dict(get_json(cluster, "modeldeployment", NAME).get("status", {}))


def loaded_everywhere(cluster: Any, names: list[str]) -> list[str] | None:
    """The pods serving every adapter in `names` when AdaptersLoaded is True (None: not yet)."""
    found = status(cluster)
    loaded = next((c for c in found.get("conditions", []) if c["type"] == "AdaptersLoaded"), None)
    adapters = {a["name"]: a.get("pods", []) for a in found.get("adapters", [])}
    if loaded is None or loaded["status"] != "True" or sorted(adapters) != sorted(names):
        return None
    pods = {tuple(p) for p in adapters.values()}
    return list(pods.pop()) if len(pods) == 1 and all(pods) else None


def pod_facts(cluster: Any) -> list[tuple[str, str, int]]:
    pods = get_json(cluster, "pods", "-l", f"kvpilot.dev/model={NAME}")["items"]
    return [
        (p["metadata"]["name"], p["metadata"]["uid"],
         sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses", [])))
        for p in pods
    ]  # fmt: skip


def template_generation(cluster: Any) -> list[int]:
    found = get_json(cluster, "deployments", "-l", f"kvpilot.dev/model={NAME}")["items"]
    return [d["metadata"]["generation"] for d in found]


def served_by_gateway(url: str, model: str) -> bool:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        raw = client.completions.with_raw_response.create(model=model, prompt="Once", max_tokens=4)
    except (openai.NotFoundError, openai.APIConnectionError, openai.InternalServerError):
        return False
    return bool(raw.parse().choices[0].text) and raw.headers["x-kvpilot-target"] == model


def serves(url: str, model: str) -> Callable[[], bool]:
    return lambda: served_by_gateway(url, model)


def test_adapters_are_served_and_a_fourth_is_added_without_a_restart(
    cluster: Any, gateway: str, adapter_uris: dict[str, str]
) -> None:
    names = list(adapter_uris)
    pods = wait_until(lambda: loaded_everywhere(cluster, names[:3]), 600, "3 adapters loaded")
    assert len(pods) == 1
    for model in [NAME, *names[:3]]:
        wait_until(serves(gateway, model), 120, f"{model} via the gateway")
    before, generation = pod_facts(cluster), template_generation(cluster)

    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(adapter_uris)))
    assert wait_until(lambda: loaded_everywhere(cluster, names), 120, "4 adapters") == pods
    wait_until(serves(gateway, names[3]), 120, f"{names[3]} via the gateway")
    assert pod_facts(cluster) == before  # the same pod, never restarted
    assert before[0][2] == 0
    assert template_generation(cluster) == generation  # the template did not change
