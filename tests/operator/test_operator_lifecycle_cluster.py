"""The real operator (`kvpilot-operator run`) through a ModelDeployment's life on the local control
plane: scale, edit, drift, delete, a restart mid-reconcile, a new node pool, leader election.
Observed with real `kubectl`: what the apiserver stored, what the scheduler placed on which kwok
GPU node, what the garbage collector removed. Each test gets its own namespace and operator process.
"""

from __future__ import annotations

import json
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from hack.devcluster import nodepools
from kvpilot.operator.lease import LEASE_NAME
from tests.support.operator_cluster import (
    Operator,
    apply_doc,
    condition,
    get,
    is_ready,
    model_deployment,
    pods,
    ready_check,
    reconciles,
    wait_for,
)
from tests.support.server_process import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _args(cluster: Any, namespace: str, name: str) -> list[str]:
    deployment = get(cluster, "deployment", name, "-n", namespace)
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_scale_edit_drift_and_delete(cluster: Any, operator: Operator, namespace: str) -> None:
    md = model_deployment(
        "small",
        "hf://Qwen/Qwen2.5-0.5B-Instruct",
        placement={"nodeTypes": ["l4-24gb"]},
        autoscaling={"mode": "off", "replicas": 1},
    )
    apply_doc(cluster, namespace, md)
    wait_for(lambda: is_ready(cluster, namespace, "small"), "small Ready", operator)

    cluster.kubectl("scale", "modeldeployment/small", "--replicas=3", "-n", namespace)
    wait_for(
        lambda: (
            get(cluster, "modeldeployment", "small", "-n", namespace)["status"].get("readyReplicas")
            == 3
            and len(pods(cluster, namespace, "small")) == 3
        ),
        "3 ready replicas after kubectl scale",
        operator,
    )
    before = {p["metadata"]["name"] for p in pods(cluster, namespace, "small")}

    md["spec"]["serving"] = {"maxContextLength": 2048}
    md["spec"]["autoscaling"]["replicas"] = 3
    apply_doc(cluster, namespace, md)

    def rolled() -> bool:
        now = pods(cluster, namespace, "small")
        fresh = [p for p in now if "--max-model-len=2048" in p["spec"]["containers"][0]["args"]]
        ready = all(
            p["status"]["phase"] == "Running" and not p["metadata"].get("deletionTimestamp")
            for p in now
        )
        return (
            len(fresh) == len(now) == 3
            and ready
            and not (before & {p["metadata"]["name"] for p in now})
        )

    wait_for(rolled, "pods rolled to the new context length", operator)
    status = get(cluster, "modeldeployment", "small", "-n", namespace)["status"]
    assert (
        status["observedGeneration"]
        == get(cluster, "modeldeployment", "small", "-n", namespace)["metadata"]["generation"]
    )

    # Someone edits the Deployment: server-side apply with force puts the operator's fields back.
    patch = [{"op": "replace", "path": "/spec/template/spec/containers/0/args", "value": ["serve"]}]
    cluster.kubectl(
        "patch",
        "deployment",
        "small-l4-24gb",
        "-n",
        namespace,
        "--type=json",
        "-p",
        json.dumps(patch),
    )
    wait_for(
        lambda: "--max-model-len=2048" in _args(cluster, namespace, "small-l4-24gb"),
        "edit reverted",
        operator,
    )
    uid = get(cluster, "deployment", "small-l4-24gb", "-n", namespace)["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", "small-l4-24gb", "-n", namespace)
    wait_for(
        lambda: (
            get(cluster, "deployment", "small-l4-24gb", "-n", namespace)["metadata"]["uid"] != uid
        ),
        "deleted Deployment recreated",
        operator,
    )
    cluster.kubectl("delete", "service", "small", "-n", namespace)
    wait_for(
        lambda: get(cluster, "service", "small", "-n", namespace),
        "deleted Service recreated",
        operator,
    )

    cluster.kubectl("delete", "modeldeployment", "small", "-n", namespace)
    wait_for(
        lambda: (
            not get(
                cluster, "deployments,services", "-n", namespace, "-l", "kvpilot.dev/model=small"
            )["items"]
        ),
        "children garbage-collected",
        operator,
    )


def test_restart_mid_reconcile_converges_without_duplicates(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    names = [f"m{i}" for i in range(8)]
    docs = [
        model_deployment(
            name,
            "hf://Qwen/Qwen2.5-1.5B-Instruct",
            placement={"nodeTypes": ["h100-80gb", "a100-40gb"]},
            autoscaling={"mode": "off", "replicas": 1},
        )
        for name in names
    ]
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
    )
    wait_for(
        lambda: get(cluster, "deployments", "-n", namespace)["items"],
        "a first Deployment",
        operator,
    )
    operator.stop(signal.SIGKILL)
    operator.start()
    for name in names:
        wait_for(ready_check(cluster, namespace, name), f"{name} Ready after restart", operator)
    deployments = get(cluster, "deployments", "-n", namespace)["items"]
    owners = sorted(d["metadata"]["labels"]["kvpilot.dev/model"] for d in deployments)
    assert owners == names  # exactly one Deployment each
    assert all(d["spec"]["replicas"] == 1 for d in deployments)
    assert len(get(cluster, "services", "-n", namespace)["items"]) == len(names)
    assert len(get(cluster, "pods", "-n", namespace, "-l", "kvpilot.dev/model")["items"]) == len(
        names
    )


def test_a_new_node_pool_is_planned_in(cluster: Any, operator: Operator, namespace: str) -> None:
    pool_name = f"b200-{uuid.uuid4().hex[:6]}"
    md = model_deployment(
        "waits",
        "hf://Qwen/Qwen2.5-72B-Instruct",
        placement={"nodeTypes": [pool_name]},
        autoscaling={"mode": "off", "replicas": 1},
    )
    apply_doc(cluster, namespace, md)

    def planned() -> dict[str, Any]:
        return condition(get(cluster, "modeldeployment", "waits", "-n", namespace), "Planned")

    wait_for(lambda: planned().get("reason") == "PlanFailed", "PlanFailed", operator)
    failed = planned()
    assert f"{pool_name}: no such node type in the cluster" in failed["message"]

    pool = nodepools.NodePool(
        pool_name, 1, "64", "512Gi", 40.0, nodepools.Gpu("NVIDIA-B200", 183359, 8)
    )
    node = nodepools.build_node(pool, 0, 90)
    try:
        cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(node))
        wait_for(
            lambda: is_ready(cluster, namespace, "waits"),
            "re-planned onto the new pool",
            operator,
            timeout=120,
        )
        entry = get(cluster, "modeldeployment", "waits", "-n", namespace)["status"]["plan"][0]
        assert (entry["nodeType"], entry["fits"], entry["quantization"]) == (
            pool_name,
            True,
            "bf16",
        )
        assert pods(cluster, namespace, "waits")[0]["spec"]["nodeName"] == node["metadata"]["name"]
    finally:
        cluster.kubectl("delete", "node", node["metadata"]["name"], "--wait=false", check=False)


def lease_holder(cluster: Any) -> str:
    """Who holds the leader-election Lease (the tests' operators run in namespace default)."""
    lease = get(cluster, "lease", LEASE_NAME, "-n", "default")
    return str(lease["spec"].get("holderIdentity") or "")


def identity(operator: Operator) -> str:
    assert operator.proc is not None
    return f"{socket.gethostname()}_{operator.proc.pid}"


def test_the_lease_holder_acts_alone_and_a_standby_takes_over(
    cluster: Any, crds: None, namespace: str, tmp_path: Path
) -> None:
    ports = [free_port(), free_port()]
    first = Operator(cluster, tmp_path / "first.log", f"--metrics-port={ports[0]}")
    second = Operator(cluster, tmp_path / "second.log", f"--metrics-port={ports[1]}")
    first.start()
    try:
        wait_for(lambda: lease_holder(cluster) == identity(first), "first holds the Lease", first)
        second.start()
        wait_for(lambda: "standby: Lease" in second.log.read_text(), "second waits", second)
        md = model_deployment(
            "elected",
            "hf://Qwen/Qwen2.5-0.5B-Instruct",
            placement={"nodeTypes": ["a100-40gb"]},
            autoscaling={"mode": "off", "replicas": 1},
        )
        apply_doc(cluster, namespace, md)
        wait_for(ready_check(cluster, namespace, "elected"), "elected Ready", first)
        assert reconciles(ports[0]) > 0 and reconciles(ports[1]) == 0  # only the holder acts

        # The holder dies without letting go: the standby takes over once the record has not
        # changed for leaseDurationSeconds (15 s) and only then acts.
        first.stop(signal.SIGKILL)
        cluster.kubectl("scale", "modeldeployment/elected", "--replicas=2", "-n", namespace)
        wait_for(
            lambda: (
                get(cluster, "deployment", "elected-a100-40gb", "-n", namespace)["spec"]["replicas"]
                == 2
            ),
            "the standby to take over",
            second,
            timeout=90,
        )
        assert lease_holder(cluster) == identity(second)

        # Someone else takes the Lease: the holder stops acting and exits 1, to restart as a
        # standby (its pod's restart policy), as a client-go controller does.
        lease = get(cluster, "lease", LEASE_NAME, "-n", "default")
        lease["spec"]["holderIdentity"] = "intruder"
        cluster.kubectl("replace", "-f", "-", input=json.dumps(lease))
        assert second.proc is not None
        wait_for(lambda: second.proc.poll() is not None, "second to stop", second, timeout=30)  # type: ignore[union-attr]
        assert second.proc.returncode == 1
        assert "lost Lease default/kvpilot-operator" in second.log.read_text()

        # A clean stop (SIGTERM, as a pod's deletion sends) exits 0 at once and lets the Lease
        # go, so a standby need not wait for it to expire.
        cluster.kubectl("delete", "lease", LEASE_NAME, "-n", "default")
        first.start()
        wait_for(lambda: lease_holder(cluster) == identity(first), "first holds again", first)
        assert first.stop() == 0, first.tail()
        assert lease_holder(cluster) == ""
    finally:
        second.stop()
        first.stop()
        cluster.kubectl("delete", "lease", LEASE_NAME, "-n", "default", check=False)


def test_sigterm_the_moment_the_lease_is_taken_or_while_standing_by_exits_0(
    cluster: Any, crds: None, tmp_path: Path
) -> None:
    """A pod deleted as it starts: SIGTERM can come before kopf has added its own handlers. CI
    once saw an instance killed there (-15), still holding the Lease, so a standby waited 15 s."""
    holder = Operator(cluster, tmp_path / "holder.log", f"--metrics-port={free_port()}")
    standby = Operator(cluster, tmp_path / "standby.log", f"--metrics-port={free_port()}")
    cluster.kubectl("delete", "lease", LEASE_NAME, "-n", "default", check=False)
    try:
        holder.start()
        # Signal as soon as the log says the Lease is held: kopf starts its loop a few ms later.
        deadline = time.monotonic() + 60
        while "holding Lease" not in holder.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert holder.stop() == 0, holder.tail()
        assert lease_holder(cluster) == "", "the Lease is let go, not left to expire"

        holder.start()
        wait_for(
            lambda: lease_holder(cluster) == identity(holder), "holder takes the Lease", holder
        )
        standby.start()
        wait_for(lambda: "standby: Lease" in standby.log.read_text(), "standby waits", standby)
        assert standby.stop() == 0, standby.tail()  # not -15: it stops as it was asked
        assert holder.stop() == 0, holder.tail()
    finally:
        standby.stop()
        holder.stop()
        cluster.kubectl("delete", "lease", LEASE_NAME, "-n", "default", check=False)
