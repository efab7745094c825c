"""200 ModelDeployments applied at once on ~100 kwok GPU nodes (issue 5 targets).

- time until all are Ready (target <= 60 s),
- reconcile latency p95, create returned -> Deployment seen by a watch (target <= 1 s),
- operator RSS, current and peak (target <= 250 MB).

Runs the real operator (`kvpilot-operator run`) against a dev cluster it starts (or $KUBECONFIG),
adds kwok GPU nodes until there are ~100, creates the ModelDeployments from 8 client threads.

    .venv/bin/python -m bench.operator_scale [--count 200] [--nodes 100] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.report import markdown_table, write_section
from hack.closedloop import apply_crds
from hack.devcluster import DevCluster, nodepools
from kvpilot.operator import k8s

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "bench-operator"
POOL = "bench-l4x4"
TARGETS = {"ready_s": 60.0, "p95_s": 1.0, "rss_mb": 250.0}


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def add_nodes(cluster: Any, total: int) -> int:
    existing = len(json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"])
    extra = max(0, total - existing)
    if not extra:
        return existing
    pool = nodepools.NodePool(
        POOL, extra, "48", "192Gi", 4.89, nodepools.Gpu("NVIDIA-L4", 23034, 4)
    )
    nodes = [nodepools.build_node(pool, i, 100) for i in range(extra)]
    doc = {"apiVersion": "v1", "kind": "List", "items": nodes}
    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(doc), timeout=120)
    return existing + extra


def watch_deployments(client: Any, seen: dict[str, float], stop: threading.Event) -> None:
    """First time each Deployment appears, by the clock of this process."""
    from kubernetes import client as k8s_client
    from kubernetes import watch

    apps = k8s_client.AppsV1Api(client)
    while not stop.is_set():
        stream = watch.Watch()
        for event in stream.stream(apps.list_namespaced_deployment, NAMESPACE, timeout_seconds=5):
            seen.setdefault(event["object"].metadata.name, time.monotonic())
            if stop.is_set():
                stream.stop()


def model_deployment(name: str) -> dict[str, Any]:
    return {
        "apiVersion": k8s.MD_API_VERSION,
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
            "serving": {"maxContextLength": 4096, "targetConcurrency": 8},
            "placement": {"nodeTypes": [POOL]},
            "autoscaling": {"mode": "off", "replicas": 1},
        },
    }


def create_model_deployment(client: Any, name: str) -> None:
    # A leftover of that name would make its latency meaningless: fail rather than time it.
    if k8s.create(client, model_deployment(name)) is None:
        raise RuntimeError(f"ModelDeployment {NAMESPACE}/{name} exists already")


def count_ready(client: Any) -> int:
    items = k8s.list_objects(client, k8s.MD_API_VERSION, "ModelDeployment", NAMESPACE)
    return sum(
        any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (i.get("status") or {}).get("conditions", [])
        )
        for i in items
    )


def rss_mb(pid: int) -> tuple[float, float]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def run(cluster: Any, count: int, total_nodes: int, log: Path) -> dict[str, float]:
    apply_crds(cluster)
    num_nodes = add_nodes(cluster, total_nodes)
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    client = cluster.api_client()
    with log.open("wb") as out:
        operator = subprocess.Popen(
            [str(ROOT / ".venv/bin/kvpilot-operator"), "run"],
            env=cluster.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    seen: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_deployments, args=(client, seen, stop), daemon=True)
    watcher.start()
    try:
        create_model_deployment(client, "warmup")
        wait_until(lambda: f"warmup-{POOL}" in seen, 120, "the operator to start acting")
        created: dict[str, float] = {}

        def create(name: str) -> None:
            create_model_deployment(client, name)
            created[name] = time.monotonic()

        start = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(create, [f"md-{i:03d}" for i in range(count)]))
        wait_until(lambda: count_ready(client) >= count + 1, 600, f"{count} ModelDeployments Ready")
        ready_s = time.monotonic() - start
        wait_until(lambda: all(f"{n}-{POOL}" in seen for n in created), 60, "all Deployments seen")
        latencies = sorted(seen[f"{n}-{POOL}"] - t for n, t in created.items())
        idle = sorted(idle_latency(client, seen, f"one-{i:02d}") for i in range(20))
        rss, peak = rss_mb(operator.pid)
    finally:
        stop.set()
        operator.terminate()
        operator.wait(timeout=30)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
    return {
        "nodes": num_nodes,
        "ready_s": ready_s,
        "p50_s": latencies[len(latencies) // 2],
        "p95_s": latencies[int(len(latencies) * 0.95) - 1],
        "max_s": latencies[-1],
        "rss_mb": rss,
        "peak_mb": peak,
        "idle_p50_s": idle[len(idle) // 2],
        "idle_p95_s": idle[int(len(idle) * 0.95) - 1],
    }


def idle_latency(client: Any, seen: dict[str, float], name: str) -> float:
    """Create one ModelDeployment into a settled operator and wait for its Deployment."""
    create_model_deployment(client, name)
    created = time.monotonic()
    wait_until(lambda: f"{name}-{POOL}" in seen, 60, f"{name}'s Deployment")
    return seen[f"{name}-{POOL}"] - created


def report(count: int, r: dict[str, float]) -> str:
    def met(value: float, key: str) -> str:
        return "yes" if value <= TARGETS[key] else "no"

    rows: list[list[object]] = [
        [f"all {count} Ready", f"{r['ready_s']:.1f} s", "<= 60 s", met(r["ready_s"], "ready_s")],
        [
            "reconcile latency p95 (create -> Deployment)",
            f"{r['p95_s'] * 1000:.0f} ms "
            f"(p50 {r['p50_s'] * 1000:.0f}, max {r['max_s'] * 1000:.0f})",
            "<= 1000 ms",
            met(r["p95_s"], "p95_s"),
        ],
        [
            "reconcile latency p95, one at a time into a settled operator",
            f"{r['idle_p95_s'] * 1000:.0f} ms (p50 {r['idle_p50_s'] * 1000:.0f})",
            "<= 1000 ms",
            met(r["idle_p95_s"], "p95_s"),
        ],
        [
            "operator RSS at the end (peak)",
            f"{r['rss_mb']:.0f} MB ({r['peak_mb']:.0f} MB)",
            "<= 250 MB",
            met(r["peak_mb"], "rss_mb"),
        ],
    ]
    header = (
        f"{count} ModelDeployments created at once by 8 client threads on {r['nodes']:.0f}"
        " kwok nodes; control plane, kwok and operator share the machine's cores.\n\n"
    )
    return header + markdown_table(["figure", "measured", "target", "met"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-") as tmp:
        log = Path(tmp) / "operator.log"
        if os.environ.get("KUBECONFIG"):
            from tests.conftest import ExistingCluster

            results = run(
                ExistingCluster(Path(os.environ["KUBECONFIG"])), args.count, args.nodes, log
            )
        else:
            cluster = DevCluster(Path(tmp) / "cluster")
            try:
                cluster.up()
                results = run(cluster, args.count, args.nodes, log)
            finally:
                cluster.down()
    body = report(args.count, results)
    print(body)
    if not args.no_write:
        write_section(
            "operator-scale",
            "Operator: 200 ModelDeployments on ~100 GPU nodes",
            "python -m bench.operator_scale",
            body,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
