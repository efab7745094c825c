"""The dev cluster is a real control plane: real kubectl, scheduler and garbage collection."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.devcluster import DevCluster, procs
from hack.devcluster.cluster import PROCESSES
from hack.devcluster.nodepools import parse_pools
from hack.devcluster.versions import NODEPOOLS, REPO_ROOT
from tests.support.kube import get_json, wait_until

pytestmark = pytest.mark.cluster


REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
NOT_LOCAL = {
    "matchExpressions": [{"key": "kvpilot.dev/local-execution", "operator": "DoesNotExist"}]
}


def gpu_deployment(name: str, gpus: int, node_selector: dict[str, str]) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": node_selector,
                    # kwok nodes only: the pod runner's L4 nodes would try to run this image
                    "affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [NOT_LOCAL]}}},
                    "containers": [
                        {
                            "name": "main",
                            "image": "example.invalid/runtime:test",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                        }
                    ],
                },
            },
        },
    }


def test_kubectl_version_is_the_pinned_build(cluster: Any) -> None:
    versions = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert versions["serverVersion"]["gitVersion"] == "v1.37.2"
    assert versions["clientVersion"]["gitVersion"] == "v1.37.2"


def test_every_pool_is_listed_with_gpu_capacity_and_gfd_labels(cluster: Any) -> None:
    pools = parse_pools(yaml.safe_load(NODEPOOLS.read_text()))
    nodes = {n["metadata"]["name"]: n for n in get_json(cluster, "nodes")["items"]}
    for pool in pools:
        members = [
            n
            for n in nodes.values()
            if n["metadata"]["labels"].get("kvpilot.dev/node-type") == pool.name
        ]
        assert len(members) == pool.nodes, pool.name
        for node in members:
            labels, allocatable = node["metadata"]["labels"], node["status"]["allocatable"]
            if pool.gpu is None:
                assert "nvidia.com/gpu" not in allocatable
                continue
            assert allocatable["nvidia.com/gpu"] == str(pool.gpu.count)
            assert node["status"]["capacity"]["nvidia.com/gpu"] == str(pool.gpu.count)
            assert labels["nvidia.com/gpu.product"] == pool.gpu.product
            assert labels["nvidia.com/gpu.memory"] == str(pool.gpu.memory_mib)
            assert labels["nvidia.com/gpu.count"] == str(pool.gpu.count)


def test_gpu_pod_lands_on_l4_and_runs_oversized_stays_pending_and_gc_cleans(cluster: Any) -> None:
    fits = gpu_deployment("l4-fits", 1, {"nvidia.com/gpu.product": "NVIDIA-L4"})
    too_big = gpu_deployment("nine-gpus", 9, {})
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"kind": "List", "apiVersion": "v1", "items": [fits, too_big]}),
    )

    def running_pod(app: str) -> dict[str, Any] | None:
        pods = get_json(cluster, "pods", "-l", f"app={app}")["items"]
        return next((p for p in pods if p["status"].get("phase") == "Running"), None)

    pod = wait_until(lambda: running_pod("l4-fits"), what="the L4 pod to run")
    node = get_json(cluster, "node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-L4"

    def unschedulable() -> bool:
        pods = get_json(cluster, "pods", "-l", "app=nine-gpus")["items"]
        return any(
            c.get("reason") == "Unschedulable"
            for p in pods
            for c in p["status"].get("conditions", [])
            if c["type"] == "PodScheduled" and c["status"] == "False"
        )

    wait_until(unschedulable, what="the 9-GPU pod to be Unschedulable")
    assert all(
        p["status"]["phase"] == "Pending"
        for p in get_json(cluster, "pods", "-l", "app=nine-gpus")["items"]
    )

    cluster.kubectl("delete", "deployment", "l4-fits", "nine-gpus", "--wait=false")

    def collected(app: str) -> bool:
        return (
            not get_json(cluster, "replicasets", "-l", f"app={app}")["items"]
            and not (get_json(cluster, "pods", "-l", f"app={app}")["items"])
        )

    for app in ("l4-fits", "nine-gpus"):
        wait_until(functools.partial(collected, app), what=f"garbage collection of {app}")


def devcluster_cli(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hack.devcluster", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_up_is_idempotent_and_down_leaves_no_process(tmp_path: Path) -> None:
    state = tmp_path / "cluster"
    assert devcluster_cli("up", "--state-dir", str(state)).returncode == 0
    dev = DevCluster(state)
    pids = [procs.recorded(dev.run_dir, name) for name in PROCESSES]
    again = devcluster_cli("up", "--state-dir", str(state))
    assert again.returncode == 0 and "starting" not in again.stdout
    assert devcluster_cli("status", "--state-dir", str(state)).returncode == 0

    assert devcluster_cli("down", "--state-dir", str(state)).returncode == 0
    assert all(entry is not None for entry in pids)
    assert not [e for e in pids if e is not None and procs.pid_runs(*e)]
    assert devcluster_cli("status", "--state-dir", str(state)).returncode == 1


def test_port_in_use_is_one_clear_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = devcluster_cli("up", "--state-dir", str(tmp_path), "--apiserver-port", str(port))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "in use" in lines[0]


def test_missing_go_toolchain_is_one_clear_line(tmp_path: Path) -> None:
    # An empty cache forces a build; a PATH without `go` must fail fast with one line.
    env = {**os.environ, "KVPILOT_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/nonexistent"}
    done = devcluster_cli("build", env=env)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Go toolchain is missing" in lines[0]


def test_images_mode_without_the_images_is_one_clear_line(tmp_path: Path) -> None:
    """`up --images` (make cluster-up IMAGES=1) says to build the images before it starts
    anything, rather than leaving the local pool's pods in ErrImagePull."""
    env = {**os.environ, "KVPILOT_CACHE_DIR": str(tmp_path / "cache")}
    done = devcluster_cli("up", "--images", "--state-dir", str(tmp_path), env=env)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "not cached" in line and "run `make images`" in line
    assert str(tmp_path / "cache" / "images") in line
    assert not (tmp_path / "run").exists()  # nothing was started


READ_BOTH_SERVERS = """
import hashlib, boto3, huggingface_hub
path = huggingface_hub.hf_hub_download("kvpilot/tiny-llama", "config.json", cache_dir="{cache}")
print(hashlib.sha256(open(path, "rb").read()).hexdigest())
body = boto3.client("s3").get_object(Bucket="models", Key="tiny-llama/config.json")["Body"]
print(hashlib.sha256(body.read()).hexdigest())
"""


def test_env_exports_alone_reach_the_model_servers(cluster: Any, tmp_path: Path) -> None:
    if not isinstance(cluster, DevCluster):
        pytest.skip("needs the dev cluster's state dir")
    done = devcluster_cli("env", "--state-dir", str(cluster.state_dir))
    assert done.returncode == 0, done.stderr
    names = {line.split("=", 1)[0].removeprefix("export ") for line in done.stdout.splitlines()}
    assert names >= {
        "HF_ENDPOINT",
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    }
    # The clients get no endpoint or key from the code: only from the exported variables.
    code = READ_BOTH_SERVERS.format(cache=tmp_path / "hf")
    script = f"{done.stdout}\nexec {sys.executable} -c {shlex.quote(code)}\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "AWS_"))}
    read = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert read.returncode == 0, read.stderr
    expected = hashlib.sha256((REPO_ROOT / "models/tiny-llama/config.json").read_bytes())
    assert read.stdout.split() == [expected.hexdigest()] * 2
