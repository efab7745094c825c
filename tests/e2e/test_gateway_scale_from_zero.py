"""Scale from zero through the chart's gateway, on the dev cluster: real operator, real chart,
real runtime pods.

A ModelDeployment with minReplicas 0 idles down to no pod. A request to the gateway Service that
`helm install` created (two kvpilot-gateway pods on the `local` pool, each watching the cluster as
the gateway's ServiceAccount) is held, the gateway writes the wake annotation, the operator decides
one replica at once, the pod runner starts the runtime, discovery sees the pod Ready and the held
request is served by it: one request, no error, no retry by the client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from hack import closedloop
from tests.support.kube import get_json, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
NAME = "tiny-zero"
WAKE_ANNOTATION = "kvpilot.dev/wake-requested-at"


@pytest.fixture
def gateway(cluster: Any) -> Iterator[str]:
    """CRD + operator + the chart's gateway + a tiny-llama ModelDeployment that may go to zero."""
    if not hasattr(cluster, "start_process"):
        pytest.skip("needs the dev cluster (pod runner and Prometheus)")
    # A cold start on a busy 2-core machine takes a while: the fallback deadline is generous.
    url = closedloop.start_zero_gateway(cluster, NAME, idle_s=10, fallback_after_s=280)
    try:
        yield url
    finally:
        closedloop.stop_zero_gateway(cluster, NAME)


def pods(cluster: Any) -> list[dict[str, Any]]:
    return list(get_json(cluster, "pods", "-l", f"kvpilot.dev/model={NAME}")["items"])


def status(cluster: Any) -> dict[str, Any]:
    return dict(get_json(cluster, "modeldeployment", NAME).get("status", {}))


def test_a_request_wakes_a_model_at_zero_and_is_served(cluster: Any, gateway: str) -> None:
    wait_until(
        lambda: status(cluster).get("replicas") == 0 and not pods(cluster), 300, "zero replicas"
    )
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=300)
    started = time.monotonic()
    raw = client.completions.with_raw_response.create(model=NAME, prompt="Once", max_tokens=8)
    waited = time.monotonic() - started
    completion = raw.parse()
    assert completion.choices[0].text and completion.usage is not None
    assert completion.usage.completion_tokens == 8
    served_by = raw.headers["x-kvpilot-backend"]
    assert served_by.startswith(f"default/{NAME}-"), served_by
    assert raw.headers["x-kvpilot-target"] == NAME
    annotations = get_json(cluster, "modeldeployment", NAME)["metadata"].get("annotations", {})
    assert WAKE_ANNOTATION in annotations
    assert status(cluster)["replicas"] == 1
    assert [p["metadata"]["name"] for p in pods(cluster)] == [served_by.split("/")[1]]
    print(f"first request from zero replicas answered in {waited:.1f} s")
