"""Planner time for 10,000 nodes of 20 node types (issue 5 target: <= 100 ms).

Times what one reconcile pass does with the inventory: `inventory.discover` over every Node and
GPU Pod, then `planner.plan` for one ModelDeployment, plus `assign_replicas`. Median and worst of
several runs, on plain dicts shaped like the API's JSON.

    .venv/bin/python -m bench.operator_planner [--nodes 10000] [--types 20] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench.report import markdown_table, write_section
from kvpilot.contract import catalog
from kvpilot.operator.planning import inventory, planner

TARGET_MS = 100.0
PRODUCTS = [
    ("NVIDIA-H100-80GB-HBM3", 81559),
    ("NVIDIA-A100-SXM4-40GB", 40960),
    ("NVIDIA-L4", 23034),
    ("Tesla-T4", 15360),
    ("NVIDIA-A10G", 23028),
]


def build_cluster(
    num_nodes: int, num_types: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    nodes, pods = [], []
    for i in range(num_nodes):
        product, memory = PRODUCTS[i % num_types % len(PRODUCTS)]
        count = (1, 2, 4, 8)[(i % num_types) // len(PRODUCTS) % 4]
        name = f"node-{i}"
        nodes.append(
            {
                "metadata": {
                    "name": name,
                    "labels": {
                        "nvidia.com/gpu.product": product,
                        "nvidia.com/gpu.memory": str(memory),
                        "nvidia.com/gpu.count": str(count),
                    },
                    "annotations": {"kvpilot.dev/price-per-hour": f"{count * 1.5:.2f}"},
                },
                "status": {"allocatable": {"nvidia.com/gpu": str(count)}},
            }
        )
        if i % 2:  # half the nodes run one GPU pod
            pods.append(
                {
                    "metadata": {"name": f"p{i}", "namespace": "x", "labels": {}},
                    "spec": {
                        "nodeName": name,
                        "containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}],
                    },
                    "status": {"phase": "Running"},
                }
            )
    return nodes, pods


def one_pass(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> tuple[float, int]:
    facts = catalog.lookup("hf://meta-llama/Llama-3.1-70B-Instruct")
    if facts is None:
        raise ValueError("catalog lacks Llama-3.1-70B")
    start = time.perf_counter()
    node_types = inventory.discover(nodes, pods)
    request = planner.PlanRequest(facts, ("bf16", "int8", "int4"), 8192, 8)
    plans = planner.plan(request, node_types)
    planner.assign_replicas(10, plans)
    return (time.perf_counter() - start) * 1000, len(node_types)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--types", type=int, default=20)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    nodes, pods = build_cluster(args.nodes, args.types)
    results = [one_pass(nodes, pods) for _ in range(args.runs)]
    times = [ms for ms, _ in results]
    num_types = results[0][1]
    median, worst = statistics.median(times), max(times)
    rows: list[list[object]] = [
        [
            f"{args.nodes:,} nodes, {num_types} node types, {len(pods):,} GPU pods",
            f"{median:.1f} ms",
            f"{worst:.1f} ms",
            f"<= {TARGET_MS:.0f} ms",
            "yes" if median <= TARGET_MS else "no",
        ]
    ]
    body = markdown_table(["inventory + plan + spread", "median", "worst", "target", "met"], rows)
    print(body)
    if not args.no_write:
        write_section(
            "operator-planner",
            "Operator: planner time for a large cluster",
            "python -m bench.operator_planner",
            body,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
