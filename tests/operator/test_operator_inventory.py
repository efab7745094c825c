"""Inventory: node types from Node/Pod JSON as the API serves it."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.config import DeclaredNodeType
from kvpilot.operator.planning import inventory


def node(
    name: str,
    product: str | None = "NVIDIA-L4",
    memory: int = 23034,
    count: int = 1,
    node_type: str | None = None,
    price: str | None = None,
    unschedulable: bool = False,
    allocatable: int | None = None,
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    labels = dict(extra_labels or {})
    if product:
        labels |= {
            "nvidia.com/gpu.product": product,
            "nvidia.com/gpu.memory": str(memory),
            "nvidia.com/gpu.count": str(count),
        }
    if node_type:
        labels["kvpilot.dev/node-type"] = node_type
    gpus = count if allocatable is None else allocatable
    return {
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {"kvpilot.dev/price-per-hour": price} if price else {},
        },
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {
            "allocatable": {"cpu": "8", "nvidia.com/gpu": str(gpus)} if gpus else {"cpu": "8"}
        },
    }


def pod(
    node_name: str, gpus: int, phase: str = "Running", in_limits: bool = False
) -> dict[str, Any]:
    key = "limits" if in_limits else "requests"
    return {
        "metadata": {"name": f"p-{node_name}", "namespace": "default", "labels": {}},
        "spec": {
            "nodeName": node_name,
            "containers": [{"resources": {key: {"nvidia.com/gpu": str(gpus), "cpu": "1"}}}],
        },
        "status": {"phase": phase},
    }


def test_gfd_labels_alone_group_identical_nodes() -> None:
    nodes = [
        node("a", count=1),
        node("b", count=1),
        node("c", count=4),
        node("d", "Tesla-T4", 15360),
        node("cpu-0", product=None),
    ]
    types = inventory.discover(nodes, [])
    assert [(t.name, t.num_nodes, t.gpus_per_node, t.gpu_memory_mib) for t in types] == [
        ("nvidia-l4-22gb", 2, 1, 23034),
        ("nvidia-l4-22gb-x4", 1, 4, 23034),
        ("tesla-t4-15gb", 1, 1, 15360),
    ]
    assert types[0].node_selector == {
        "nvidia.com/gpu.product": "NVIDIA-L4",
        "nvidia.com/gpu.memory": "23034",
        "nvidia.com/gpu.count": "1",
    }


def test_node_type_label_names_the_type_and_is_its_selector() -> None:
    types = inventory.discover([node("x-0", node_type="l4-24gb", price="0.98")], [])
    assert types[0].name == "l4-24gb"
    assert types[0].node_selector == {"kvpilot.dev/node-type": "l4-24gb"}
    assert types[0].price_per_hour == 0.98


@pytest.mark.parametrize(
    ("pods", "free"),
    [
        ([], (4, 4)),
        ([pod("n0", 3)], (1, 4)),
        ([pod("n0", 3, in_limits=True), pod("n1", 4)], (1, 0)),
        ([pod("n0", 3, phase="Succeeded"), pod("n1", 1, phase="Failed")], (4, 4)),
        ([pod("elsewhere", 2)], (4, 4)),
    ],
)
def test_free_gpus_are_allocatable_minus_requests_of_live_pods(
    pods: list[dict[str, Any]], free: tuple[int, ...]
) -> None:
    nodes = [node("n0", count=4, node_type="l4x4"), node("n1", count=4, node_type="l4x4")]
    (l4x4,) = inventory.discover(nodes, pods)
    assert l4x4.free_gpus_per_node == free
    assert l4x4.num_free_slots(4) == sum(f // 4 for f in free)


def test_unschedulable_nodes_offer_no_free_gpus() -> None:
    (t,) = inventory.discover([node("n0", node_type="l4", unschedulable=True)], [])
    assert t.num_nodes == 1 and t.free_gpus == 0


def test_declared_node_types_claim_matching_nodes_without_gfd() -> None:
    declared = DeclaredNodeType(
        name="a10g-24gb",
        node_selector={"node.kubernetes.io/instance-type": "g5.xlarge"},
        gpu_memory_mib=23028,
        gpus_per_node=1,
        price_per_hour=1.006,
    )
    bare = node(
        "g5-0",
        product=None,
        allocatable=1,
        extra_labels={"node.kubernetes.io/instance-type": "g5.xlarge"},
    )
    empty = DeclaredNodeType(
        name="h200", node_selector={"pool": "h200"}, gpu_memory_mib=143771, gpus_per_node=8
    )
    types = {
        t.name: t
        for t in inventory.discover([bare, node("l4-0")], [pod("g5-0", 1)], [declared, empty])
    }
    assert types["a10g-24gb"].nodes == ("g5-0",)
    assert types["a10g-24gb"].free_gpus == 0
    assert types["a10g-24gb"].price_per_hour == 1.006
    assert types["h200"].num_nodes == 0  # declared but not yet joined: planned, no capacity
    assert "nvidia-l4-22gb" in types


def test_fingerprint_ignores_what_plans_do_not_depend_on() -> None:
    a = node("n0", node_type="l4")
    b = node("n0", node_type="l4")
    b["metadata"]["annotations"]["heartbeat"] = "now"
    assert inventory.fingerprint([a]) == inventory.fingerprint([b])
    assert inventory.fingerprint([a]) != inventory.fingerprint([a, node("n1", node_type="l4")])
    assert inventory.fingerprint([a]) == inventory.fingerprint([inventory.trim_node(a)])


def test_trim_pod_keeps_gpu_pods_only() -> None:
    assert inventory.trim_pod(pod("n0", 0)) is None
    trimmed = inventory.trim_pod(pod("n0", 2))
    assert trimmed is not None
    assert inventory.used_gpus_by_node([trimmed]) == {"n0": 2}


def test_unreadable_labels_hide_the_node_not_the_inventory() -> None:
    weird = node("w", memory=0)
    weird["metadata"]["labels"]["nvidia.com/gpu.memory"] = "lots"
    assert [t.name for t in inventory.discover([weird, node("ok")], [])] == ["nvidia-l4-22gb"]


@pytest.mark.parametrize(
    ("memories", "expected"),
    [
        (["32Gi", "32Gi"], 32 * 2**30),
        (["131811964Ki", "64Gi"], 64 * 2**30),  # the smallest node bounds the type
        (["32Gi", None], 0),  # a node without the figure: unknown, never counted against
        (["32Gi", "a lot"], 0),
    ],
)
def test_node_memory_is_the_smallest_nodes_allocatable(
    memories: list[str | None], expected: int
) -> None:
    nodes = [node(f"n{i}", node_type="l4") for i in range(len(memories))]
    for n, memory in zip(nodes, memories, strict=True):
        if memory is not None:
            n["status"]["allocatable"]["memory"] = memory
    (t,) = inventory.discover(nodes, [])
    assert t.memory_bytes == expected
    trimmed = [inventory.trim_node(n) for n in nodes]
    assert inventory.discover(trimmed, []) == [t]
    assert inventory.fingerprint(trimmed) == inventory.fingerprint(nodes)


def test_a_nodes_memory_is_part_of_the_fingerprint() -> None:
    a, b = node("n0", node_type="l4"), node("n0", node_type="l4")
    b["status"]["allocatable"]["memory"] = "64Gi"
    assert inventory.fingerprint([a]) != inventory.fingerprint([b])


@pytest.mark.parametrize(
    ("memory_per_replica", "slots"),
    [(0, 8), (16 * 2**30, 4), (40 * 2**30, 1), (65 * 2**30, 0)],
)
def test_free_slots_are_bounded_by_the_memory_each_replica_requests(
    memory_per_replica: int, slots: int
) -> None:
    n = node("n0", count=8, node_type="h100")
    n["status"]["allocatable"]["memory"] = "64Gi"
    (t,) = inventory.discover([n], [])
    assert t.num_free_slots(1, memory_per_replica) == slots
