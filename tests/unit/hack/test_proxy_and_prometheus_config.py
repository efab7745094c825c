"""Pure parts of the service proxy (ready endpoints) and the dev cluster's Prometheus config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hack.devcluster.prometheus import build_config
from hack.serviceproxy import ready_endpoints


def endpoint(ip: str, ready: bool, terminating: bool = False) -> dict[str, Any]:
    return {"addresses": [ip], "conditions": {"ready": ready, "terminating": terminating}}


SLICES: list[dict[str, Any]] = [
    {
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [
            endpoint("127.70.0.3", True),
            endpoint("127.70.0.2", True),
            endpoint("127.70.0.4", False),
            endpoint("127.70.0.5", False, True),
        ],
    },
    {"ports": [{"name": "metrics", "port": 9000}], "endpoints": [endpoint("127.70.1.2", True)]},
    {"ports": None, "endpoints": None},
]


@pytest.mark.parametrize(
    ("port_name", "expected"),
    [
        ("http", ["127.70.0.2:8000", "127.70.0.3:8000"]),
        ("metrics", ["127.70.1.2:9000"]),
        (None, ["127.70.0.2:8000", "127.70.0.3:8000", "127.70.1.2:9000"]),
        ("grpc", []),
    ],
)
def test_only_ready_non_terminating_endpoints_get_traffic(
    port_name: str | None, expected: list[str]
) -> None:
    assert ready_endpoints(SLICES, port_name) == expected


def test_prometheus_discovers_pods_and_keeps_only_loopback_targets() -> None:
    config = build_config("https://127.0.0.1:6443", Path("ca"), Path("crt"), Path("key"))
    job = config["scrape_configs"][0]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    assert job["kubernetes_sd_configs"][0]["api_server"] == "https://127.0.0.1:6443"
    rules = job["relabel_configs"]
    keeps = [r for r in rules if r["action"] == "keep"]
    assert keeps[0]["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    assert {"source_labels": ["__address__"], "regex": "127\\..*", "action": "keep"} in keeps
    targets = {r["target_label"] for r in rules if r["action"] == "replace"}
    assert {"namespace", "pod", "kvpilot_model", "kvpilot_node_type", "__address__"} <= targets
