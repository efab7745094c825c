"""status.cost is a fact of the traffic, not of who scales (issue 40 item 17): a ModelDeployment
with `autoscaling.mode: off` (fixed replicas) and one with `mode: external` (an HPA or KEDA owns
the scale subresource) serve real traffic; both get status.cost and a value in the `$/1k req`
column, and the operator writes neither's replicas.

Real tiny-llama runtime pods on the `local` pool (the pod runner), the dev cluster's Prometheus
scraping them, the real operator reading that Prometheus.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.reconcile import manifests
from tests.support.operator_cluster import (
    ROOT,
    TINY_FACTS,
    Operator,
    apply_doc,
    complete,
    events,
    get,
    model_deployment,
    pods,
    ready_check,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
COST_WINDOW_S = 30  # the operator's shortest: five refreshes of status.cost per 30 s
MODES = {"fixed": "off", "hpa-driven": "external"}
COLUMN = "$/1K REQ"  # kubectl upper-cases the printer column `$/1k req`


@pytest.fixture
def costing_operator(cluster: Any, crds: None, tmp_path: Path) -> Iterator[Operator]:
    """The operator reading the dev cluster's Prometheus, deciding every second."""
    env = {
        "KVPILOT_PROMETHEUS_URL": cluster.prometheus_url,
        "KVPILOT_AUTOSCALER_INTERVAL": "1",
        "KVPILOT_COST_WINDOW": str(COST_WINDOW_S),
    }
    op = Operator(cluster, tmp_path / "operator.log", "--standalone", env=env)
    op.start()
    yield op
    op.stop()


def tiny_llama(name: str, mode: str) -> dict[str, Any]:
    """One replica of tiny-llama on the `local` pool (one GPU per node: one pod per node)."""
    md = model_deployment(
        name,
        f"file://{ROOT / 'models' / 'tiny-llama'}",
        serving={"maxContextLength": 256, "targetConcurrency": 2},
        placement={"nodeTypes": ["local"]},
        autoscaling={"mode": mode, "replicas": 1},
    )
    md["spec"]["model"].update(servedName="tiny", **TINY_FACTS)
    return md


def column_value(listing: str, name: str, column: str) -> str:
    """The cell of `column` in the row of `name` in `kubectl get` output (aligned columns)."""
    header, *rows = listing.splitlines()
    start = header.index(column)
    row = next(r for r in rows if r.split()[0] == name)
    return row[start:].split()[0]


def test_off_and_external_modes_get_status_cost_and_keep_their_replicas(
    cluster: Any, costing_operator: Operator, namespace: str
) -> None:
    op = costing_operator
    for name, mode in MODES.items():
        apply_doc(cluster, namespace, tiny_llama(name, mode))
    for name in MODES:
        wait_for(ready_check(cluster, namespace, name), f"{name} Ready", op, timeout=240)
    serving = [pod for name in MODES for pod in pods(cluster, namespace, name)]
    assert len(serving) == 2

    def costed() -> dict[str, dict[str, Any]]:
        for pod in serving:  # traffic until Prometheus' rate over the window shows it
            assert complete(pod)["usage"]["completion_tokens"] == 4
        found = {
            name: get(cluster, "md", name, "-n", namespace)["status"].get("cost") or {}
            for name in MODES
        }
        if not all(c.get("perThousandRequests") for c in found.values()):
            raise AssertionError(f"status.cost so far: {found}")  # wait_for shows the last
        return found

    figures = wait_for(costed, "status.cost under traffic for both modes", op, timeout=180)
    listing = cluster.kubectl("get", "md", "-n", namespace).stdout
    for name, cost in figures.items():
        seen = json.dumps({name: cost})
        assert cost["window"] == "30s" and cost["currency"] == "USD", seen
        assert cost["requestsPerSecond"] > 0 and cost["nodeTypes"]["local"]["replicas"] == 1, seen
        shown = column_value(listing, name, COLUMN)
        assert float(shown) == pytest.approx(cost["perThousandRequests"], rel=0.01), listing

    # Nobody but their owners wrote the replicas: spec for `off`, the scale subresource for
    # `external`; the autoscaler decided nothing for either.
    for name in MODES:
        md = get(cluster, "md", name, "-n", namespace)
        assert md["spec"]["autoscaling"]["replicas"] == 1
        assert "desiredReplicas" not in (md["status"].get("autoscaling") or {}), md["status"]
        selector = f"{manifests.LABEL_MODEL}={name}"
        (deployment,) = get(cluster, "deployments", "-n", namespace, "-l", selector)["items"]
        assert deployment["spec"]["replicas"] == 1
        assert not events(cluster, namespace, name, "ScaledUp")
        assert not events(cluster, namespace, name, "ScaledDown")
