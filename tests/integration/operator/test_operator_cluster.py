"""The real operator (`kvpilot-operator run`, a subprocess) against the local control plane.

Everything is observed with real `kubectl`: what the apiserver stored, what the scheduler placed
on which kwok GPU node, what the garbage collector removed. Each test gets its own namespace and
its own operator process; waits poll with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.devcluster import nodepools
from tests.support.operator_cluster import (
    OPERATOR,
    ROOT,
    TINY_FACTS,
    Operator,
    apply_doc,
    apply_secret,
    complete,
    condition,
    get,
    is_ready,
    model_deployment,
    model_server_env,
    pods,
    ready_check,
    tiny_llama_from,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLES = ROOT / "examples"


def test_invalid_modeldeployments_are_rejected_naming_the_field(
    cluster: Any, crds: None, namespace: str
) -> None:
    files = sorted((EXAMPLES / "invalid").glob("*.yaml"))
    assert len(files) == 12
    for path in files:
        field = path.read_text().splitlines()[0].split("the error names: ")[1].strip()
        done = cluster.kubectl("apply", "-n", namespace, "-f", str(path), check=False)
        assert done.returncode != 0, f"{path.name} was accepted"
        assert f"{field}:" in done.stderr, f"{path.name}: {done.stderr}"


def test_examples_run_on_the_right_gpu_nodes(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    # tiny-llama runs on the `local` pool, whose pods the pod runner starts as real processes;
    # the e2e suite covers it, here it is only validated (test_examples_are_valid_yaml_for_kubectl).
    for name in ("qwen2.5-7b-instruct", "llama-3.1-70b-instruct"):
        cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / f"{name}.yaml"))
    for name in ("qwen2-5-7b-instruct", "llama-3-1-70b-instruct"):
        wait_for(ready_check(cluster, namespace, name), f"{name} Ready", operator)

    llama = get(cluster, "modeldeployment", "llama-3-1-70b-instruct", "-n", namespace)
    first = llama["status"]["plan"][0]
    assert (first["nodeType"], first["quantization"], first["tensorParallel"]) == (
        "h100-80gb",
        "bf16",
        4,
    )
    t4 = next(e for e in llama["status"]["plan"] if e["nodeType"] == "t4-16gb")
    assert not t4["fits"] and "GiB usable" in t4["reason"]
    deployment = get(cluster, "deployment", "llama-3-1-70b-instruct-h100-80gb", "-n", namespace)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert "--tensor-parallel-size=4" in container["args"]

    # prefer: cost puts Qwen-7B's two replicas on the T4s, at int4.
    qwen_pods = pods(cluster, namespace, "qwen2-5-7b-instruct")
    assert len(qwen_pods) == 2
    assert all(p["status"]["phase"] == "Running" for p in qwen_pods)
    assert sorted(p["spec"]["nodeName"] for p in qwen_pods) == ["t4-16gb-0", "t4-16gb-1"]
    llama_pod = pods(cluster, namespace, "llama-3-1-70b-instruct")[0]
    assert llama_pod["spec"]["nodeName"].startswith("h100-80gb-")

    services = {s["metadata"]["name"] for s in get(cluster, "services", "-n", namespace)["items"]}
    assert services == {"qwen2-5-7b-instruct", "llama-3-1-70b-instruct"}

    table = cluster.kubectl("get", "modeldeployments", "-n", namespace).stdout.splitlines()
    header = ["NAME", "MODEL", "READY", "REPLICAS", "QUANTIZATION", "$/1K", "REQ", "AGE"]
    assert table[0].split() == header  # the cost column's name, "$/1k req", is two words
    row = next(line.split() for line in table if line.startswith("llama-3-1-70b-instruct"))
    assert row[1:5] == ["hf://meta-llama/Llama-3.1-70B-Instruct", "True", "1", "bf16"]
    events = get(cluster, "events", "-n", namespace, "--field-selector", "reason=Planned")["items"]
    assert {e["involvedObject"]["name"] for e in events} >= {
        "llama-3-1-70b-instruct",
        "qwen2-5-7b-instruct",
    }


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


def test_spec_the_schema_cannot_catch_fails_once_with_a_condition(
    cluster: Any, crds: None, namespace: str, tmp_path: Path
) -> None:
    # Watching only this namespace, so objects of earlier tests' namespaces, still being
    # deleted, cannot put their own retries into the log this test reads.
    operator = Operator(
        cluster, tmp_path / "operator.log", f"--namespace={namespace}", "--standalone"
    )
    operator.start()
    try:
        _fails_once_with_a_condition(cluster, operator, namespace)
    finally:
        operator.stop()


def _fails_once_with_a_condition(cluster: Any, operator: Operator, namespace: str) -> None:
    apply_doc(cluster, namespace, model_deployment("nofacts", "pvc://weights/my-model"))

    def planned() -> dict[str, Any]:
        return condition(get(cluster, "modeldeployment", "nofacts", "-n", namespace), "Planned")

    wait_for(lambda: planned().get("reason") == "PlanFailed", "PlanFailed condition", operator)
    assert "set spec.model parameters, layers, kvHeads, headDim" in planned()["message"]
    wait_for(lambda: "failed permanently" in operator.log.read_text(), "PermanentError", operator)
    assert "failed temporarily" not in operator.log.read_text()  # no retry storm
    events = get(cluster, "events", "-n", namespace, "--field-selector", "reason=PlanFailed")[
        "items"
    ]
    assert [e["type"] for e in events] == ["Warning"]
    assert not get(cluster, "deployments", "-n", namespace)["items"]


def test_peering_lets_one_instance_act(
    cluster: Any, crds: None, namespace: str, tmp_path: Path
) -> None:
    low = Operator(cluster, tmp_path / "low.log", "--priority=10")
    high = Operator(cluster, tmp_path / "high.log", "--priority=20")
    high.start()
    low.start()
    try:
        # Until an instance has seen the other's peering record it acts on its own (as kopf
        # does); apply only once both records are in the peering object.
        wait_for(
            lambda: len(get(cluster, "clusterkopfpeering", "kvpilot").get("status") or {}) >= 2,
            "both instances in the peering object",
            low,
        )
        md = model_deployment(
            "peered",
            "hf://Qwen/Qwen2.5-0.5B-Instruct",
            placement={"nodeTypes": ["a100-40gb"]},
            autoscaling={"mode": "off", "replicas": 1},
        )
        apply_doc(cluster, namespace, md)
        wait_for(ready_check(cluster, namespace, "peered"), "peered Ready", high)
        # kopf logs success after its own bookkeeping patch, a moment after our status write.
        wait_for(
            lambda: "Handler 'md-create' succeeded" in high.log.read_text(), "high's log", high
        )
        assert "Handler 'md-create'" not in low.log.read_text()

        # The acting instance dies; the other resumes once its peering record expires.
        high.stop(signal.SIGKILL)
        cluster.kubectl("scale", "modeldeployment/peered", "--replicas=2", "-n", namespace)
        wait_for(
            lambda: (
                get(cluster, "deployment", "peered-a100-40gb", "-n", namespace)["spec"]["replicas"]
                == 2
            ),
            "the standby instance to take over",
            low,
            timeout=90,
        )
    finally:
        low.stop()
        high.stop()


def test_examples_are_valid_yaml_for_kubectl(cluster: Any, crds: None, namespace: str) -> None:
    for path in sorted(EXAMPLES.glob("*.yaml")):
        done = cluster.kubectl(
            "apply", "--dry-run=server", "-n", namespace, "-f", str(path), check=False
        )
        assert done.returncode == 0, f"{path.name}: {done.stderr}"
        assert yaml.safe_load(path.read_text())["kind"] == "ModelDeployment"


def test_operator_cli_rejects_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "config.yaml"
    bad.write_text("nodeTypes: [{name: x}]\n")
    done = subprocess.run(
        [str(OPERATOR), "run", "--config", str(bad)],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": "/nonexistent"},
        timeout=60,
    )
    assert done.returncode == 2
    assert "lacks 'nodeSelector'" in done.stderr


# The Prometheus Operator's PodMonitor, reduced to what the apiserver needs to store one.
POD_MONITOR_CRD_NAME = "podmonitors.monitoring.coreos.com"
POD_MONITOR_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": POD_MONITOR_CRD_NAME},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {
            "kind": "PodMonitor",
            "listKind": "PodMonitorList",
            "plural": "podmonitors",
            "singular": "podmonitor",
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


@pytest.fixture
def pod_monitor_crd(cluster: Any) -> Iterator[None]:
    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(POD_MONITOR_CRD))
    name = POD_MONITOR_CRD_NAME
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{name}")
    yield
    cluster.kubectl("delete", "crd", name, "--wait=false", check=False)


def test_a_pod_monitor_follows_the_spec_on_and_off(
    cluster: Any, pod_monitor_crd: None, operator: Operator, namespace: str
) -> None:
    md = model_deployment(
        "watched",
        "hf://Qwen/Qwen2.5-0.5B-Instruct",
        placement={"nodeTypes": ["l4-24gb"]},
        autoscaling={"mode": "off", "replicas": 1},
        monitoring={"podMonitor": True},
    )
    apply_doc(cluster, namespace, md)
    monitor = wait_for(
        lambda: get(cluster, "podmonitor", "watched", "-n", namespace),
        "the PodMonitor",
        operator,
    )
    owner = get(cluster, "modeldeployment", "watched", "-n", namespace)["metadata"]["uid"]
    assert [ref["uid"] for ref in monitor["metadata"]["ownerReferences"]] == [owner]
    assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"

    cluster.kubectl(
        "patch",
        "modeldeployment",
        "watched",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"monitoring": {"podMonitor": False}}}),
    )

    def gone() -> bool:
        found = cluster.kubectl("get", "podmonitor", "-n", namespace, "-o", "name")
        return found.stdout.strip() == ""

    wait_for(gone, "the PodMonitor deleted once monitoring is off", operator)
    assert is_ready(cluster, namespace, "watched")  # the model kept serving


@pytest.mark.parametrize("scheme", ["hf", "s3"])
def test_fetched_models_serve_on_real_pods(
    cluster: Any, operator: Operator, namespace: str, scheme: str
) -> None:
    env = model_server_env(cluster)
    uri = {"hf": "hf://kvpilot/tiny-llama", "s3": "s3://models/tiny-llama"}[scheme]
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    apply_secret(
        cluster, namespace, "model-creds", {"HF_TOKEN": "unused-here", **{k: env[k] for k in keys}}
    )
    apply_doc(cluster, namespace, tiny_llama_from(uri, cluster, "model-creds"))
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=240)
    (pod,) = pods(cluster, namespace, "tiny")
    (init,) = pod["status"]["initContainerStatuses"]
    assert init["name"] == "fetch-model" and init["state"]["terminated"]["exitCode"] == 0
    assert complete(pod)["usage"]["completion_tokens"] == 4
    md = get(cluster, "modeldeployment", "tiny", "-n", namespace)
    assert md["status"]["plan"][0]["nodeType"] == "local"  # planned from the source's facts


def test_a_fetch_that_fails_says_why_in_the_pod_status(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    model_server_env(cluster)
    apply_secret(cluster, namespace, "model-creds", {"HF_TOKEN": "unused-here"})
    missing = tiny_llama_from("hf://kvpilot/no-such-model", cluster, "model-creds")
    apply_doc(cluster, namespace, missing)

    def plan_failed() -> str:
        planned = condition(get(cluster, "modeldeployment", "tiny", "-n", namespace), "Planned")
        return str(planned.get("message", "")) if planned.get("status") == "False" else ""

    # Without facts in the spec the operator reads config.json itself, and says why it cannot.
    assert "404 repository not found" in wait_for(plan_failed, "PlanFailed", operator)
    # With the facts given, the plan runs and the pod's fetch fails in its own words.
    missing["spec"]["model"].update(TINY_FACTS)
    apply_doc(cluster, namespace, missing)

    def failed_fetch() -> str:
        (pod,) = pods(cluster, namespace, "tiny")
        (init,) = pod["status"].get("initContainerStatuses") or [{}]
        return str(init.get("lastState", {}).get("terminated", {}).get("message", ""))

    message = wait_for(failed_fetch, "the fetch to fail", operator, timeout=120)
    assert message.splitlines()[-1].startswith(
        "kvpilot-runtime fetch: hf://kvpilot/no-such-model: 404 repository not found"
    )
    assert "Traceback" not in message

    def degraded() -> dict[str, Any]:
        found = condition(get(cluster, "modeldeployment", "tiny", "-n", namespace), "Degraded")
        return found if found.get("reason") == "PodsFailing" else {}

    found = wait_for(degraded, "Degraded=PodsFailing on the ModelDeployment", operator, timeout=60)
    assert "404 repository not found" in found["message"]


def test_a_tensor_parallel_plan_runs_on_real_pods(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    """TP 2 on the two-GPU local pool: the operator's args start two ranks that answer."""
    md = model_deployment(
        "tiny",
        f"file://{ROOT / 'models' / 'tiny-llama'}",
        serving={"maxContextLength": 256, "targetConcurrency": 2},
        placement={"nodeTypes": ["local-tp2"], "minGpusPerReplica": 2},
        autoscaling={"mode": "off", "replicas": 1},
    )
    md["spec"]["model"].update(servedName="tiny", **TINY_FACTS)
    apply_doc(cluster, namespace, md)
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=240)
    plan = get(cluster, "modeldeployment", "tiny", "-n", namespace)["status"]["plan"][0]
    assert (plan["nodeType"], plan["tensorParallel"]) == ("local-tp2", 2)
    (pod,) = pods(cluster, namespace, "tiny")
    assert "--tensor-parallel-size=2" in pod["spec"]["containers"][0]["args"]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert complete(pod)["usage"]["completion_tokens"] == 4


def test_a_runtime_that_cannot_start_says_why_on_the_model_deployment(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    """tiny-llama holds 2048 positions; a 4096 context plans (the catalog-free facts do not
    say) but the runtime refuses it, and its last log line reaches the Degraded condition."""
    md = model_deployment(
        "tiny",
        f"file://{ROOT / 'models' / 'tiny-llama'}",
        serving={"maxContextLength": 4096, "targetConcurrency": 1},
        placement={"nodeTypes": ["local"]},
        autoscaling={"mode": "off", "replicas": 1},
    )
    md["spec"]["model"].update(servedName="tiny", **TINY_FACTS)
    apply_doc(cluster, namespace, md)

    def degraded() -> str:
        found = condition(get(cluster, "modeldeployment", "tiny", "-n", namespace), "Degraded")
        return str(found.get("message", "")) if found.get("reason") == "PodsFailing" else ""

    message = wait_for(degraded, "Degraded=PodsFailing", operator, timeout=120)
    assert "max_model_len 4096 exceeds the model's limit 2048" in message
    assert message.startswith("runtime: CrashLoopBackOff: kvpilot-runtime serve: cannot load")
