"""Pure node-pool conversion: GFD labels, GPU capacity, clear errors for a bad nodepools.yaml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from hack.devcluster import build
from hack.devcluster.nodepools import (
    build_node,
    build_nodes,
    cluster_slot,
    keep_pod_cidrs,
    parse_pools,
)
from hack.devcluster.versions import INFERENCE_POOL_CRD, KUBERNETES, NODEPOOLS, ModuleFile

L4 = {
    "name": "l4",
    "nodes": 2,
    "cpu": "8",
    "memory": "32Gi",
    "pricePerHour": 0.98,
    "gpu": {"product": "NVIDIA-L4", "memoryMiB": 23034, "count": 1},
}
CPU = {"name": "cpu", "nodes": 1, "cpu": "32", "memory": "128Gi"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"pools": []}, "defines no pools"),
        (
            {"pools": [{"name": "x", "cpu": "1", "memory": "1Gi"}]},
            "pools[0] (x): missing field 'nodes'",
        ),
        ({"pools": [{**L4, "nodes": "two"}]}, "pools[0] (l4)"),
        ({"pools": [{**L4, "gpu": {"product": "p", "count": 1}}]}, "missing field 'memoryMiB'"),
    ],
)
def test_bad_pools_name_the_pool_and_field(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_pools(raw)


@pytest.mark.parametrize(
    ("raw", "gpus", "product"),
    [(L4, "1", "NVIDIA-L4"), (CPU, None, None)],
)
def test_node_carries_gfd_labels_and_gpu_capacity(
    raw: dict, gpus: str | None, product: str | None
) -> None:
    pool = parse_pools({"pools": [raw]})[0]
    node = build_node(pool, 1, 0)
    labels, status = node["metadata"]["labels"], node["status"]
    assert node["metadata"]["name"] == f"{raw['name']}-1"
    assert labels["kvpilot.dev/node-type"] == raw["name"]
    assert status["allocatable"].get("nvidia.com/gpu") == gpus
    assert status["capacity"].get("nvidia.com/gpu") == gpus
    assert status["allocatable"]["ephemeral-storage"] == "100Gi"  # the chart's pods request it
    assert labels.get("nvidia.com/gpu.product") == product
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"


def test_pod_cidrs_are_distinct_and_the_shipped_pools_parse() -> None:
    pools = parse_pools(yaml.safe_load(NODEPOOLS.read_text()))
    nodes = build_nodes(pools)
    cidrs = [n["spec"]["podCIDR"] for n in nodes]
    assert len(set(cidrs)) == len(cidrs) == sum(p.nodes for p in pools)
    products = {p.gpu.product for p in pools if p.gpu}
    assert {"NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-40GB", "NVIDIA-L4", "Tesla-T4"} <= products


def test_kubernetes_ldflags_stamp_the_version() -> None:
    flags = build.kubernetes_ldflags("v1.37.2")
    assert "-X k8s.io/component-base/version.gitVersion=v1.37.2" in flags
    assert "gitMajor=1" in flags and "gitMinor=37" in flags
    argv, cwd = build.build_commands(KUBERNETES, KUBERNETES.bin_dir)[0]
    assert argv[:2] == ["go", "build"] and cwd is not None and cwd.name == "kubernetes"


def test_module_files_are_cached_by_version_and_not_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    cached = INFERENCE_POOL_CRD.cached
    assert cached.parent.name == "gateway-api-inference-extension-v1.2.0"
    assert cached.name == "inference.networking.k8s.io_inferencepools.yaml"
    other = ModuleFile(INFERENCE_POOL_CRD.module, "v9.9.9", INFERENCE_POOL_CRD.path)
    assert other.cached != cached  # a new pin is fetched anew
    cached.parent.mkdir(parents=True)
    cached.write_text("kind: CustomResourceDefinition\n")
    monkeypatch.setenv("PATH", "")  # no Go: the cached copy must do
    assert build.ensure_module_file(INFERENCE_POOL_CRD) == cached


def test_clusters_in_other_slots_give_their_pods_other_addresses() -> None:
    pools = parse_pools(yaml.safe_load(NODEPOOLS.read_text()))
    ours = {n["spec"]["podCIDR"] for n in build_nodes(pools, cluster_slot(6443))}
    theirs = {n["spec"]["podCIDR"] for n in build_nodes(pools, cluster_slot(6444))}
    assert ours and theirs and not ours & theirs
    with pytest.raises(ValueError, match="out of range"):
        build_node(pools[0], 16, 0)


def test_a_node_the_cluster_has_keeps_its_pod_cidr() -> None:
    pools = parse_pools(yaml.safe_load(NODEPOOLS.read_text()))
    nodes = build_nodes(pools, 3)
    first, second = nodes[0]["metadata"]["name"], nodes[1]["spec"]["podCIDR"]
    existing = [{"metadata": {"name": first}, "spec": {"podCIDR": "127.64.0.0/24"}}]
    keep_pod_cidrs(nodes, existing)
    assert nodes[0]["spec"]["podCIDR"] == "127.64.0.0/24"
    assert nodes[1]["spec"]["podCIDR"] == second
