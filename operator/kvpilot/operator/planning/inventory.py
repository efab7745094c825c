"""GPU node types from Nodes and Pods (DESIGN.md §3.2). Pure: objects in, frozen dataclasses out.

A node type is a set of identical GPU nodes. It is named by the node's `kvpilot.dev/node-type` label
when there is one, else after its GFD labels (product, memory, GPUs per node), so a cluster with
only NVIDIA GPU Feature Discovery gets deterministic names too. Node types declared in the operator
config claim the nodes their selector matches, for clusters without GFD.

Nodes and pods are plain dicts shaped like the API's JSON (camelCase), as kopf hands them over.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from kubernetes.utils import parse_quantity

from kvpilot.contract.resource import LABEL_NODE_TYPE
from kvpilot.operator.config import DeclaredNodeType
from kvpilot.operator.reconcile.conditions import pod_problem

GPU_RESOURCE = "nvidia.com/gpu"
LABEL_PRODUCT = "nvidia.com/gpu.product"
LABEL_MEMORY = "nvidia.com/gpu.memory"
LABEL_COUNT = "nvidia.com/gpu.count"
ANNOTATION_PRICE = "kvpilot.dev/price-per-hour"
_TERMINAL_PHASES = ("Succeeded", "Failed")

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class NodeType:
    name: str
    product: str
    gpu_memory_mib: int
    gpus_per_node: int
    price_per_hour: float  # per node; 0 when unknown
    node_selector: Mapping[str, str]
    nodes: tuple[str, ...] = ()
    free_gpus_per_node: tuple[int, ...] = ()
    # The smallest node's allocatable memory in bytes; 0: not known (a declared type, no nodes)
    memory_bytes: int = 0

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def free_gpus(self) -> int:
        return sum(self.free_gpus_per_node)

    @property
    def gpu_memory_bytes(self) -> int:
        return self.gpu_memory_mib * 1024 * 1024

    def num_free_slots(self, gpus_per_replica: int, memory_per_replica: int = 0) -> int:
        """Replicas of `gpus_per_replica` GPUs that still fit; a replica never spans two nodes.
        With `memory_per_replica` (bytes requested) no more per node than its memory holds (an
        upper bound: other pods' memory is not counted)."""
        if gpus_per_replica < 1:
            raise ValueError(f"gpus_per_replica must be >= 1, got {gpus_per_replica}")
        per_node = [free // gpus_per_replica for free in self.free_gpus_per_node]
        if memory_per_replica > 0 and self.memory_bytes > 0:
            most = self.memory_bytes // memory_per_replica
            per_node = [min(slots, most) for slots in per_node]
        return sum(per_node)

    def price_per_gpu_hour(self) -> float:
        return self.price_per_hour / self.gpus_per_node if self.gpus_per_node else 0.0


class _GpuNode(NamedTuple):  # a NamedTuple: built once per node, 10,000 times per pass
    name: str
    type_name: str
    product: str
    memory_mib: int
    num_gpus: int
    price: float
    selector: Mapping[str, str]
    free: int
    memory_bytes: int


def discover(
    nodes: Iterable[Obj], pods: Iterable[Obj], declared: Iterable[DeclaredNodeType] = ()
) -> list[NodeType]:
    """Node types sorted by name, each with its nodes and the free GPUs on each of them."""
    used = used_gpus_by_node(pods)
    declared = tuple(declared)
    gpu_nodes = [n for n in (_gpu_node(node, used, declared) for node in nodes) if n is not None]
    by_type: dict[str, list[_GpuNode]] = {}
    for gpu_node in gpu_nodes:
        by_type.setdefault(gpu_node.type_name, []).append(gpu_node)
    types = {name: _node_type(name, members) for name, members in by_type.items()}
    for decl in declared:  # declared types exist even before any node has joined
        types.setdefault(decl.name, _declared_type(decl))
    return [types[name] for name in sorted(types)]


def _node_type(name: str, members: list[_GpuNode]) -> NodeType:
    members.sort(key=lambda n: n.name)
    first = members[0]
    return NodeType(
        name=name,
        product=first.product,
        gpu_memory_mib=first.memory_mib,
        gpus_per_node=first.num_gpus,
        price_per_hour=max(n.price for n in members),
        node_selector=first.selector,
        nodes=tuple(n.name for n in members),
        free_gpus_per_node=tuple(n.free for n in members),
        memory_bytes=min(n.memory_bytes for n in members),
    )


def _declared_type(decl: DeclaredNodeType) -> NodeType:
    """A declared type has a discovered one's fields, by the same names, and no nodes yet."""
    return NodeType(**{f.name: getattr(decl, f.name) for f in fields(decl)})


def _gpu_node(
    node: Obj, used: Mapping[str, int], declared: tuple[DeclaredNodeType, ...]
) -> _GpuNode | None:
    meta = node.get("metadata", {})
    name, labels = meta.get("name", ""), meta.get("labels") or {}
    resources = (node.get("status") or {}).get("allocatable") or {}
    allocatable, memory_bytes = _quantity(resources.get(GPU_RESOURCE)), _bytes(resources)
    schedulable = not (node.get("spec") or {}).get("unschedulable", False)
    free = max(0, allocatable - used.get(name, 0)) if schedulable else 0
    price = _price((meta.get("annotations") or {}).get(ANNOTATION_PRICE))
    for decl in declared:
        if all(labels.get(k) == v for k, v in decl.node_selector.items()):
            count = allocatable or decl.gpus_per_node
            price = decl.price_per_hour or price
            return _GpuNode(
                name,
                decl.name,
                decl.product,
                decl.gpu_memory_mib,
                count,
                price,
                decl.node_selector,
                free,
                memory_bytes,
            )
    product, memory = labels.get(LABEL_PRODUCT), _quantity(labels.get(LABEL_MEMORY))
    if not product or memory <= 0 or allocatable <= 0:
        return None  # not a GPU node, or GFD has not labelled it yet
    count = _quantity(labels.get(LABEL_COUNT)) or allocatable
    type_name = labels.get(LABEL_NODE_TYPE) or gfd_type_name(product, memory, count)
    selector = (
        {LABEL_NODE_TYPE: type_name}
        if LABEL_NODE_TYPE in labels
        else {LABEL_PRODUCT: product, LABEL_MEMORY: str(memory), LABEL_COUNT: str(count)}
    )
    return _GpuNode(name, type_name, product, memory, count, price, selector, free, memory_bytes)


@functools.lru_cache(maxsize=1024)
def gfd_type_name(product: str, memory_mib: int, count: int) -> str:
    """`NVIDIA-L4`, 23034 MiB, 4 GPUs -> `nvidia-l4-22gb-x4`: one name per product+memory+count."""
    slug = re.sub(r"[^a-z0-9]+", "-", product.lower()).strip("-")
    name = f"{slug}-{round(memory_mib / 1024)}gb"
    return f"{name}-x{count}" if count != 1 else name


def used_gpus_by_node(pods: Iterable[Obj]) -> dict[str, int]:
    """GPUs requested by scheduled, non-terminated pods, per node."""
    used: dict[str, int] = {}
    for pod in pods:
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name or (pod.get("status") or {}).get("phase") in _TERMINAL_PHASES:
            continue
        used[node_name] = used.get(node_name, 0) + pod_gpus(pod)
    return used


def pod_gpus(pod: Obj) -> int:
    """GPUs a pod holds: extended resources have requests == limits, so either one counts."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or ():
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        total += _quantity(requests.get(GPU_RESOURCE, limits.get(GPU_RESOURCE)))
    return total


def fingerprint(nodes: Iterable[Obj]) -> tuple[tuple[str, ...], ...]:
    """What about the nodes a plan depends on; node heartbeats leave it unchanged."""
    rows = []
    for node in nodes:
        meta = node.get("metadata", {})
        labels = meta.get("labels") or {}
        resources = (node.get("status") or {}).get("allocatable") or {}
        allocatable, memory = resources.get(GPU_RESOURCE), resources.get("memory")
        unschedulable = (node.get("spec") or {}).get("unschedulable", False)
        facts = (
            labels.get(k, "") for k in (LABEL_NODE_TYPE, LABEL_PRODUCT, LABEL_MEMORY, LABEL_COUNT)
        )
        rows.append(
            (meta.get("name", ""), *facts, str(allocatable), str(memory), str(unschedulable))
        )
    return tuple(sorted(rows))


def _quantity(value: Any) -> int:
    if value is None or value == "":
        return 0
    try:
        return int(str(value))
    except ValueError:
        return 0  # a label we cannot read makes the node invisible, not the whole inventory fail


def _bytes(allocatable: Mapping[str, Any]) -> int:
    """A node's allocatable memory in bytes (a quantity: 32Gi, 131811964Ki); 0 if unreadable."""
    try:
        return int(parse_quantity(allocatable.get("memory") or 0))
    except ValueError:
        return 0  # unknown memory: the planner does not count a host KV tier against it


def _price(value: Any) -> float:
    try:
        return float(value) if value not in (None, "") else 0.0
    except ValueError:
        return 0.0  # a malformed price annotation only loses cost ordering, not the node


def trim_node(node: Obj) -> dict[str, Any]:
    """Only what `discover` and `fingerprint` read, so an in-memory index of nodes stays small."""
    meta = node.get("metadata") or {}
    price = (meta.get("annotations") or {}).get(ANNOTATION_PRICE)
    resources = (node.get("status") or {}).get("allocatable") or {}
    kept = {k: resources[k] for k in (GPU_RESOURCE, "memory") if resources.get(k) is not None}
    return {
        "metadata": {
            "name": meta.get("name", ""),
            "labels": dict(meta.get("labels") or {}),
            "annotations": {ANNOTATION_PRICE: price} if price is not None else {},
        },
        "spec": {"unschedulable": bool((node.get("spec") or {}).get("unschedulable", False))},
        "status": {"allocatable": kept},
    }


def trim_pod(pod: Obj) -> dict[str, Any] | None:
    """A GPU pod reduced to its node, GPU count, phase and owner labels; None for other pods."""
    gpus = pod_gpus(pod)
    if not gpus:
        return None
    meta = pod.get("metadata") or {}
    return {
        "metadata": {
            "name": meta.get("name", ""),
            "namespace": meta.get("namespace", ""),
            "labels": dict(meta.get("labels") or {}),
        },
        "spec": {
            "nodeName": (pod.get("spec") or {}).get("nodeName", ""),
            "containers": [{"resources": {"requests": {GPU_RESOURCE: str(gpus)}}}],
        },
        "status": {
            "phase": (pod.get("status") or {}).get("phase", ""),
            "problem": pod_problem(pod),  # shown in the owner's conditions
        },
    }
