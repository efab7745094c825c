"""The builtin autoscaler on the local control plane, fed by a real metrics endpoint we control.

kwok runs the runtime pods (no process), but their pod IPs are loopback addresses, so the test
serves each pod's /metrics itself on that IP and port: the operator scrapes it exactly as it
would scrape a runtime pod, decides, records status and Events, and the Deployments follow.
"""

from __future__ import annotations

import json
import signal
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hack.closedloop import apply_crds
from hack.devcluster import nodepools
from kvpilot.contract import timestamps
from kvpilot.operator.autoscaling import recording
from kvpilot.operator.reconcile import manifests
from tests.support.operator_cluster import (
    Operator,
    apply_doc,
    condition,
    events,
    get,
    model_deployment,
    pods,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
RUNTIME_PORT = 8000
SPILL_AFTER_S = 3


class Exporter:
    """Serves kvpilot_requests_waiting = `waiting` on one pod IP (what a runtime pod would)."""

    def __init__(self, ip: str) -> None:
        self.waiting = 0.0
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = (
                    "# TYPE kvpilot_requests_waiting gauge\n"
                    f'kvpilot_requests_waiting{{model_name="m"}} {exporter.waiting}\n'
                    "# TYPE kvpilot_kv_cache_usage_ratio gauge\n"
                    'kvpilot_kv_cache_usage_ratio{model_name="m"} 0.1\n'
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((ip, RUNTIME_PORT), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def crds(cluster: Any) -> None:
    apply_crds(cluster)


@pytest.fixture
def autoscaling_operator(cluster: Any, crds: None, tmp_path: Path) -> Iterator[Operator]:
    env = {
        "KVPILOT_AUTOSCALER_INTERVAL": "1",
        "KVPILOT_SPILL_AFTER": str(SPILL_AFTER_S),
        "KVPILOT_PROMETHEUS_URL": "",
    }
    op = Operator(cluster, tmp_path / "operator.log", "--standalone", env=env)
    op.start()
    yield op
    op.stop()


def test_queue_scales_up_then_down_and_state_survives_a_restart(
    cluster: Any, autoscaling_operator: Operator, tmp_path: Path
) -> None:
    namespace = "default"
    name = "autoscaled"
    op = autoscaling_operator
    autoscaling = {
        "mode": "builtin",
        "minReplicas": 1,
        "maxReplicas": 3,
        "targetQueueLength": 2,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 8,
    }
    doc = model_deployment(
        name,
        "hf://Qwen/Qwen2.5-0.5B-Instruct",
        serving={"maxContextLength": 2048, "targetConcurrency": 4},
        placement={"nodeTypes": ["l4-24gb"]},
        autoscaling=autoscaling,
    )
    apply_doc(cluster, namespace, doc)
    first = wait_for(
        lambda: [p for p in pods(cluster, namespace, name) if p["status"].get("podIP")],
        "the first pod",
        op,
    )[0]
    exporter = Exporter(first["status"]["podIP"])
    try:
        exporter.waiting = 10  # 10 waiting on 1 replica, target 2 per replica -> scale up
        md = wait_for(
            lambda: (
                (m := get(cluster, "md", name, "-n", namespace))["status"].get("replicas", 0) > 1
                and m
            ),
            "a scale-up",
            op,
            timeout=60,
        )
        assert condition(md, "MetricsAvailable")["status"] == "True"
        assert md["status"]["autoscaling"]["desiredReplicas"] > 1
        assert md["status"]["autoscaling"]["lastDecision"]
        assert wait_for(
            lambda: events(cluster, namespace, name, "ScaledUp"), "a ScaledUp event", op
        )
        wait_for(lambda: len(pods(cluster, namespace, name)) > 1, "more pods", op)

        # Restart the operator between decisions: the policy state lives in status.
        state_before = md["status"]["autoscaling"].get("state")
        op.stop(signal.SIGKILL)
        assert state_before
        exporter.waiting = 0
        op.start()
        md = wait_for(
            lambda: (
                (m := get(cluster, "md", name, "-n", namespace))["status"].get("replicas") == 1
                and m
            ),
            "the scale-down after the window",
            op,
            timeout=90,
        )
        assert events(cluster, namespace, name, "ScaledDown")
    finally:
        exporter.close()
        cluster.kubectl("delete", "md", name, "-n", namespace, "--wait=false", check=False)


def test_missing_metrics_hold_replicas(cluster: Any, autoscaling_operator: Operator) -> None:
    namespace, name = "default", "no-metrics"
    autoscaling = {"mode": "builtin", "minReplicas": 2, "maxReplicas": 4}
    doc = model_deployment(
        name,
        "hf://Qwen/Qwen2.5-0.5B-Instruct",
        placement={"nodeTypes": ["l4-24gb"]},
        autoscaling=autoscaling,
    )
    apply_doc(cluster, namespace, doc)
    try:
        # Pods are Ready (kwok) but nothing answers on their metrics port.
        md = wait_for(
            lambda: (
                condition(m := get(cluster, "md", name, "-n", namespace), "MetricsAvailable").get(
                    "status"
                )
                == "False"
                and m
            ),
            "MetricsAvailable=False",
            autoscaling_operator,
            timeout=60,
        )
        assert md and md["status"]["replicas"] == 2
        assert not events(cluster, namespace, name, "ScaledDown")
    finally:
        cluster.kubectl("delete", "md", name, "-n", namespace, "--wait=false", check=False)


def test_pods_stuck_unschedulable_spill_over_to_the_next_node_type(
    cluster: Any, autoscaling_operator: Operator
) -> None:
    # Two fresh one-node pools. The cheaper one is first in the plan and has free GPUs, but a
    # taint keeps every pod off it, as CPU, memory or a taint can in a real cluster.
    suffix = uuid.uuid4().hex[:6]
    l4 = nodepools.Gpu("NVIDIA-L4", 23034, 2)
    stuck = nodepools.NodePool(f"stuck-{suffix}", 1, "16", "64Gi", 0.5, l4)
    spare = nodepools.NodePool(f"spare-{suffix}", 1, "16", "64Gi", 0.9, l4)
    nodes = [nodepools.build_node(stuck, 0, 91), nodepools.build_node(spare, 0, 92)]
    nodes[0]["spec"]["taints"] = [{"key": "kvpilot.dev/test-no-room", "effect": "NoSchedule"}]
    namespace, name, op = "default", f"spill-{suffix}", autoscaling_operator
    doc = model_deployment(
        name,
        "hf://Qwen/Qwen2.5-0.5B-Instruct",
        serving={"maxContextLength": 2048, "targetConcurrency": 4},
        placement={"nodeTypes": [stuck.name, spare.name], "prefer": "cost"},
        autoscaling={"mode": "builtin", "minReplicas": 2, "maxReplicas": 2},
    )
    try:
        for node in nodes:
            cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(node))
        apply_doc(cluster, namespace, doc)

        def all_stuck() -> list[dict[str, Any]]:
            found = pods(cluster, namespace, name)
            stuck_there = [
                p
                for p in found
                if p["metadata"]["labels"][manifests.LABEL_NODE_TYPE] == stuck.name
                and recording.unschedulable_since(p) is not None
            ]
            return stuck_there if len(found) == len(stuck_there) == 2 else []

        def all_running_on_spare() -> list[dict[str, Any]]:
            found = pods(cluster, namespace, name)
            moved = [
                p
                for p in found
                if p["spec"].get("nodeName") == nodes[1]["metadata"]["name"]
                and p["status"].get("phase") == "Running"
            ]
            return moved if len(found) == len(moved) == 2 else []

        stuck_pods = wait_for(all_stuck, "two pods Unschedulable on the tainted pool", op)
        stuck_at = min(recording.unschedulable_since(p) or 0 for p in stuck_pods)
        wait_for(all_running_on_spare, "both replicas running on the next node type", op, 60)
        md = get(cluster, "md", name, "-n", namespace)
        assert md["status"]["autoscaling"]["replicasPerNodeType"] == {stuck.name: 0, spare.name: 2}
        (message,) = events(cluster, namespace, name, "SpilledOver")
        assert f"Unschedulable on {stuck.name}" in message
        assert f"{stuck.name} 2->0, {spare.name} 0->2" in message
        # The spill waited for the threshold (stuck_at has whole seconds). The operator's Events
        # are events.k8s.io Events: the core/v1 view has their eventTime, no firstTimestamp.
        # Some Events name no object (the apiserver's KubernetesDefaultServiceCIDRInconsistent,
        # about the ServiceCIDR, in `default` on a cluster started by `make cluster-up`).
        (event,) = [
            e
            for e in get(cluster, "events", "-n", namespace)["items"]
            if e["involvedObject"].get("name") == name and e.get("reason") == "SpilledOver"
        ]
        spilled_at = timestamps.unix(event["eventTime"])
        assert spilled_at - stuck_at >= SPILL_AFTER_S - 1
        assert not events(cluster, namespace, name, "ScaledUp")  # the count never changed
    finally:
        cluster.kubectl("delete", "md", name, "-n", namespace, "--wait=false", check=False)
        for node in nodes:
            cluster.kubectl("delete", "node", node["metadata"]["name"], "--wait=false", check=False)
