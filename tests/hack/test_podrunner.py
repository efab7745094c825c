"""The local pod runner: pods on local-execution nodes are real processes on their pod IPs."""

from __future__ import annotations

import json
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import get_json, wait_until

pytestmark = pytest.mark.cluster

APP = Path(__file__).parent / "apps" / "probe_app.py"


def local_deployment(name: str, marker: Path) -> dict[str, Any]:
    labels = {"app": name, "kvpilot.dev/model": name, "kvpilot.dev/node-type": "local"}
    container = {
        "name": "app",
        "image": "example.invalid/probe-app:test",
        "command": [sys.executable, str(APP)],
        "args": ["--port", "8080"],
        "ports": [{"name": "http", "containerPort": 8080}],
        "env": [
            {"name": "TERM_MARKER", "value": str(marker)},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": "8080",
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "nodeSelector": {"kvpilot.dev/local-execution": "true"},
                    "terminationGracePeriodSeconds": 5,
                    "containers": [container],
                },
            },
        },
    }


def ready_pod(cluster: Any, app: str, min_restarts: int = 0) -> dict[str, Any] | None:
    for pod in get_json(cluster, "pods", "-l", f"app={app}")["items"]:
        statuses = pod["status"].get("containerStatuses") or [{}]
        if statuses[0].get("ready") and statuses[0].get("restartCount", 0) >= min_restarts:
            return dict(pod)
    return None


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def test_local_pod_runs_restarts_and_drains(cluster: Any, tmp_path: Path) -> None:
    if not get_json(cluster, "nodes", "-l", "kvpilot.dev/local-execution=true")["items"]:
        pytest.skip("this cluster has no local-execution nodes (no hack/podrunner)")
    marker = tmp_path / "sigterm"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(local_deployment("probe", marker)))

    pod = wait_until(lambda: ready_pod(cluster, "probe"), 60, "the local pod to be Ready")
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.")
    name, pid = get(f"http://{ip}:8080/").split()
    assert name == pod["metadata"]["name"]

    # A crash restarts the container (restartPolicy Always) and the pod turns Ready again.
    with pytest.raises(OSError):
        get(f"http://{ip}:8080/crash")
    restarted = wait_until(lambda: ready_pod(cluster, "probe", 1), 60, "a restart")
    assert restarted["status"]["podIP"] == ip
    assert get(f"http://{ip}:8080/").split()[1] != pid

    # Deleting the pod delivers SIGTERM; the process exits and the pod object goes away.
    cluster.kubectl("delete", "deployment", "probe", "--wait=false")
    wait_until(lambda: not get_json(cluster, "pods", "-l", "app=probe")["items"], 60, "deletion")
    assert marker.read_text().strip()
    with pytest.raises(OSError):
        get(f"http://{ip}:8080/")


def test_prometheus_scrapes_local_pods_by_annotation(cluster: Any, tmp_path: Path) -> None:
    if not hasattr(cluster, "prometheus_url"):
        pytest.skip("no Prometheus URL for this cluster")
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps(local_deployment("scraped", tmp_path / "t"))
    )
    pod = wait_until(lambda: ready_pod(cluster, "scraped"), 60, "the local pod to be Ready")
    query = urllib.parse.quote('probe_app_info{kvpilot_model="scraped"}')

    def series() -> list[dict[str, Any]]:
        result = json.loads(get(f"{cluster.prometheus_url}/api/v1/query?query={query}"))
        return list(result["data"]["result"])

    found = wait_until(series, 60, "Prometheus to scrape the pod")
    labels = found[0]["metric"]
    assert labels["pod"] == pod["metadata"]["name"]
    assert labels["namespace"] == "default"
    assert labels["kvpilot_node_type"] == "local"
    assert labels["instance"] == f"{pod['status']['podIP']}:8080"
    cluster.kubectl("delete", "deployment", "scraped", "--wait=false")
