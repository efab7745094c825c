"""What the apiserver and the real operator (`kvpilot-operator run`) refuse or accept: invalid
ModelDeployments, specs the schema cannot catch, the examples, the operator's own config.
Observed with real `kubectl`; each test gets its own namespace and operator process.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.operator_cluster import (
    OPERATOR,
    ROOT,
    Operator,
    apply_doc,
    condition,
    get,
    model_deployment,
    pods,
    ready_check,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


EXAMPLES = ROOT / "examples"


def test_invalid_modeldeployments_are_rejected_naming_the_field(
    cluster: Any, crds: None, namespace: str
) -> None:
    files = sorted((EXAMPLES / "invalid").glob("*.yaml"))
    assert len(files) == 19
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
    wait_for(
        lambda: "not retried until the spec changes" in operator.log.read_text(),
        "the pass giving up on the spec",
        operator,
    )
    assert "retrying in" not in operator.log.read_text()  # no retry storm
    events = get(cluster, "events", "-n", namespace, "--field-selector", "reason=PlanFailed")[
        "items"
    ]
    assert [e["type"] for e in events] == ["Warning"]
    assert not get(cluster, "deployments", "-n", namespace)["items"]


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
