"""The adapter placement's demand from the dev cluster's Prometheus scraping real runtime pods
(the `local` pool): five adapters on two replicas, one made hot by requests; then both pods are
replaced. The new pods' own counters are zero (every adapter equally cold: one copy each), so
only the demand the operator reads from Prometheus (the old pods' series, within its ten-minute
window) can put the hot adapter on both new pods, and it does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.reference.lora import AdapterSpec
from hack import closedloop
from kvpilot.contract import metric_names
from tests.support.adapters import local_pool_adapters
from tests.support.operator_cluster import (
    ROOT,
    TINY_FACTS,
    Operator,
    apply_doc,
    get,
    model_deployment,
    pod_url,
    pods,
    ready_check,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
ADAPTERS = [AdapterSpec(f"a{i}", 4, ("q_proj", "v_proj"), seed=20 + i) for i in range(5)]
HOT = "a0"
NUM_HOT_REQUESTS = 24


@pytest.fixture
def prometheus_operator(cluster: Any, crds: None, tmp_path: Path) -> Iterator[Operator]:
    """The operator reading the dev cluster's Prometheus (its adapter demand among the rest)."""
    env = {"KVPILOT_PROMETHEUS_URL": cluster.prometheus_url}
    op = Operator(cluster, tmp_path / "operator.log", "--standalone", env=env)
    op.start()
    yield op
    op.stop()


@pytest.fixture
def adapter_uris(namespace: str) -> Iterator[dict[str, str]]:
    """The adapters as file:// URIs the `local` pool's pods read."""
    with local_pool_adapters(ADAPTERS, f"lora-demand-{namespace}") as uris:
        yield uris


def tiny_with_adapters(uris: dict[str, str]) -> dict[str, Any]:
    md = model_deployment(
        "tiny",
        closedloop.local_model_uri(ROOT / "models" / "tiny-llama"),
        serving={"maxContextLength": 256, "targetConcurrency": 2},
        placement={"nodeTypes": ["local"]},
        autoscaling={"mode": "off", "replicas": 2},
    )
    md["spec"]["model"].update(servedName="tiny", **TINY_FACTS)
    md["spec"]["lora"] = {"maxLoras": 2, "maxLoraRank": 16, "maxCpuLoras": 4}
    md["spec"]["adapters"] = [{"name": n, "uri": u} for n, u in uris.items()]
    return md


def placed(cluster: Any, namespace: str, num_pods: int) -> dict[str, list[str]]:
    """adapter -> pods once AdaptersLoaded is True over `num_pods` ready pods."""
    status = get(cluster, "modeldeployment", "tiny", "-n", namespace).get("status") or {}
    found = [c for c in status.get("conditions", []) if c["type"] == "AdaptersLoaded"]
    ok = (
        found and found[0]["status"] == "True" and f"of {num_pods} ready pod" in found[0]["message"]
    )
    if not ok:
        raise AssertionError(f"AdaptersLoaded {found}; adapters {status.get('adapters')}")
    return {a["name"]: a["pods"] for a in status["adapters"]}


def scraped_requests(cluster: Any, namespace: str) -> float:
    """The hot adapter's requests as Prometheus scraped them from the pods."""
    name, label = metric_names.LORA_REQUESTS_RECEIVED, metric_names.LORA_NAME_LABEL
    query = f'sum({name}{{namespace="{namespace}", {label}="{HOT}"}})'
    found = httpx.get(f"{cluster.prometheus_url}/api/v1/query", params={"query": query}, timeout=10)
    result = found.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def test_adapter_demand_read_from_prometheus_outlives_the_pods(
    cluster: Any, prometheus_operator: Operator, namespace: str, adapter_uris: dict[str, str]
) -> None:
    op = prometheus_operator
    apply_doc(cluster, namespace, tiny_with_adapters(adapter_uris))
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", op, timeout=240)

    def one_copy_each() -> dict[str, list[str]]:  # no demand yet; settled (see below)
        where = placed(cluster, namespace, 2)
        assert all(len(holders) == 1 for holders in where.values()), where
        return where

    first = wait_for(one_copy_each, "adapters placed", op, timeout=120)

    by_name = {p["metadata"]["name"]: p for p in pods(cluster, namespace, "tiny")}
    holder = by_name[first[HOT][0]]
    for _ in range(NUM_HOT_REQUESTS):
        body = {"model": HOT, "prompt": "Once", "max_tokens": 1}
        httpx.post(f"{pod_url(holder)}/v1/completions", json=body, timeout=60).raise_for_status()
    wait_for(
        lambda: scraped_requests(cluster, namespace) >= NUM_HOT_REQUESTS,
        "Prometheus has scraped the hot adapter's requests",
        op,
        timeout=60,
    )
    wait_for(lambda: len(placed(cluster, namespace, 2)[HOT]) == 2, "hot on both pods", op, 60)

    old = set(by_name)
    cluster.kubectl("delete", "pods", "-n", namespace, "-l", "kvpilot.dev/model=tiny")

    def settled_on_new_pods() -> dict[str, list[str]]:
        """Placement moves make-before-break: an adapter leaving a pod stays there until its
        new holder has it, so AdaptersLoaded may turn True while a cold one is on both pods
        for a sync or two; wait for the plan's own layout."""
        where = placed(cluster, namespace, 2)
        assert not old & {p for holders in where.values() for p in holders}, where
        cold_copies = [len(where[name]) for name in adapter_uris if name != HOT]
        assert len(where[HOT]) == 2 and cold_copies == [1] * len(cold_copies), where
        return where

    after = wait_for(settled_on_new_pods, "adapters placed on the new pods", op, timeout=240)
    new_pods = {p["metadata"]["name"] for p in pods(cluster, namespace, "tiny")} - old
    assert sorted(after[HOT]) == sorted(new_pods)  # the old pods' demand, from Prometheus
