"""Pure parts of the service proxy (ready endpoints) and the dev cluster's Prometheus config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hack.devcluster.prometheus import build_config
from hack.serviceproxy import ready_endpoints, target_port


def pod(ip: str | None, ready: bool, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"p-{ip}"}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


PODS = [
    pod("127.70.0.3", True),
    pod("127.70.0.2", True),
    pod("127.70.0.4", False),
    pod("127.70.0.5", True, terminating=True),
    pod(None, True),
]
SERVICE = {
    "spec": {
        "ports": [
            {"name": "http", "port": 80, "targetPort": "http"},
            {"name": "metrics", "port": 9000},
        ]
    }
}


@pytest.mark.parametrize(
    ("port_name", "expected"),
    [
        ("http", ["127.70.0.2:8000", "127.70.0.3:8000"]),
        ("metrics", ["127.70.0.2:9000", "127.70.0.3:9000"]),
        (None, ["127.70.0.2:8000", "127.70.0.3:8000"]),
    ],
)
def test_only_ready_non_terminating_pods_get_traffic(
    port_name: str | None, expected: list[str]
) -> None:
    assert ready_endpoints(PODS, target_port(SERVICE, port_name)) == expected


def test_unknown_port_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no port named 'grpc'"):
        target_port(SERVICE, "grpc")


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
