"""Pure: the fake GPU node pools in hack/nodepools.yaml as Kubernetes Node objects.

Each node gets the NVIDIA GPU Feature Discovery labels a real GPU node has, capacity and
allocatable including `nvidia.com/gpu`, and a price annotation, so the operator cannot tell it
from a real node. kwok manages nodes that carry its annotation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
NODE_TYPE_LABEL = "kvpilot.dev/node-type"
LOCAL_EXECUTION_LABEL = "kvpilot.dev/local-execution"
PRICE_ANNOTATION = "kvpilot.dev/price-per-hour"
GPU_RESOURCE = "nvidia.com/gpu"
# Every node has a disk for logs and emptyDirs; pods that request ephemeral-storage (the chart's
# operator and gateway do) fit only on a node that advertises it.
EPHEMERAL_STORAGE = "100Gi"


@dataclass(frozen=True)
class Gpu:
    product: str
    memory_mib: int
    count: int


@dataclass(frozen=True)
class NodePool:
    name: str
    nodes: int
    cpu: str
    memory: str
    price_per_hour: float
    gpu: Gpu | None = None
    local_execution: bool = False


def parse_pools(doc: dict[str, Any]) -> list[NodePool]:
    """Validate and convert the YAML document; errors name the pool and the field."""
    pools = []
    for index, raw in enumerate(doc.get("pools") or []):
        where = f"nodepools.yaml pools[{index}] ({raw.get('name', '?')})"
        try:
            gpu = raw.get("gpu")
            pools.append(
                NodePool(
                    name=str(raw["name"]),
                    nodes=int(raw["nodes"]),
                    cpu=str(raw["cpu"]),
                    memory=str(raw["memory"]),
                    price_per_hour=float(raw.get("pricePerHour", 0.0)),
                    gpu=Gpu(str(gpu["product"]), int(gpu["memoryMiB"]), int(gpu["count"]))
                    if gpu
                    else None,
                    local_execution=bool(raw.get("localExecution", False)),
                )
            )
        except KeyError as err:
            raise ValueError(f"{where}: missing field {err.args[0]!r}") from err
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from err
    if not pools:
        raise ValueError("nodepools.yaml defines no pools: add at least one under 'pools:'")
    return pools


def node_name(pool: NodePool, index: int) -> str:
    return f"{pool.name}-{index}"


def build_node(
    pool: NodePool, index: int, pool_index: int, cluster_slot: int = 0
) -> dict[str, Any]:
    """One Node object; pod CIDRs are disjoint per node so pods get distinct IPs.

    Local-execution nodes are left to hack/podrunner (no kwok annotation); their pods'
    processes bind to their loopback pod IPs on this machine.
    """
    name = node_name(pool, index)
    resources = {"cpu": pool.cpu, "memory": pool.memory, "pods": "110"}
    resources["ephemeral-storage"] = EPHEMERAL_STORAGE
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        NODE_TYPE_LABEL: pool.name,
    }
    if pool.gpu is not None:
        resources[GPU_RESOURCE] = str(pool.gpu.count)
        labels |= gfd_labels(pool.gpu)
    annotations = {
        "node.alpha.kubernetes.io/ttl": "0",
        PRICE_ANNOTATION: f"{pool.price_per_hour:.2f}",
    }
    if pool.local_execution:
        labels[LOCAL_EXECUTION_LABEL] = "true"
    else:
        annotations[KWOK_ANNOTATION] = "fake"
    # Every pod IP is a loopback address, kwok's fake pods included: anything that connects to a
    # pod (Prometheus, the operator's direct scrape) stays on this machine. Two dev clusters on
    # one machine (another checkout's tests) take different slots, else their pods share IPs and
    # one cluster's requests reach the other's pods.
    if not 0 <= index < NODES_PER_SLOT or not 0 <= cluster_slot < CLUSTER_SLOTS:
        raise ValueError(f"node {index} of {pool.name}, cluster slot {cluster_slot}: out of range")
    pod_cidr = f"127.{64 + pool_index}.{cluster_slot * NODES_PER_SLOT + index}.0/24"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {"podCIDR": pod_cidr},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


def gfd_labels(gpu: Gpu) -> dict[str, str]:
    """The labels NVIDIA GPU Feature Discovery sets (memory in MiB per GPU)."""
    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": gpu.product,
        "nvidia.com/gpu.memory": str(gpu.memory_mib),
        "nvidia.com/gpu.count": str(gpu.count),
    }


NODES_PER_SLOT = 16  # a pool's nodes, each with its own /24 of the pool's 127.x.0.0/16
CLUSTER_SLOTS = 256 // NODES_PER_SLOT


def cluster_slot(apiserver_port: int) -> int:
    """Clusters running at once have distinct apiserver ports: most get distinct slots."""
    return apiserver_port % CLUSTER_SLOTS


def keep_pod_cidrs(nodes: list[dict[str, Any]], existing: list[dict[str, Any]]) -> None:
    """A Node's podCIDR cannot change once set: a node the cluster has keeps its own (one made
    before the slots existed, or in another slot) when `up` runs again."""
    cidrs = {n["metadata"]["name"]: n.get("spec", {}).get("podCIDR") for n in existing}
    for node in nodes:
        node["spec"]["podCIDR"] = cidrs.get(node["metadata"]["name"]) or node["spec"]["podCIDR"]


def build_nodes(pools: list[NodePool], cluster_slot: int = 0) -> list[dict[str, Any]]:
    return [
        build_node(pool, index, pool_index, cluster_slot)
        for pool_index, pool in enumerate(pools)
        for index in range(pool.nodes)
    ]
