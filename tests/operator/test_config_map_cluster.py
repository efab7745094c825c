"""spec.model.configMapRef on the `local` pool (real processes): a file:// compressed-tensors int4
checkpoint of tiny-llama, written here by the real library, planned from its config.json in a
ConfigMap at int4 and served; the ConfigMap created only after the ModelDeployment is read by a
retry; the same ConfigMap over the 16-bit tiny-llama makes its pod refuse to start."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from bench.reference.prequantized import write_checkpoint
from tests.support.operator_cluster import (
    ROOT,
    Operator,
    apply_doc,
    condition,
    get,
    model_deployment,
    pod_url,
    pods,
    ready_check,
    wait_for,
)
from tests.support.variants_cluster import NUM_TOKENS, PROMPT, in_process_greedy

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CONFIG_MAP = "tiny-config"


def local_tiny(uri: str) -> dict[str, Any]:
    md = model_deployment(
        "tiny",
        uri,
        serving={"maxContextLength": 256, "targetConcurrency": 2},
        placement={"nodeTypes": ["local"]},
        autoscaling={"mode": "off", "replicas": 1},
    )
    md["spec"]["model"].update(servedName="tiny", configMapRef={"name": CONFIG_MAP})
    return md


@pytest.fixture
def node_dir() -> Iterator[Path]:
    """A directory a pod's process can read at its own path in both pool modes: under the
    checkout's models/ (images mode mounts it as a node path), not under /tmp, where the runtime
    container mounts an emptyDir (the pod would see that, as on a real node)."""
    path = Path(tempfile.mkdtemp(prefix=".test-", dir=ROOT / "models"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def create_config_map(cluster: Any, namespace: str, checkpoint: Path) -> None:
    config = f"--from-file=config.json={checkpoint / 'config.json'}"
    cluster.kubectl("create", "configmap", CONFIG_MAP, "-n", namespace, config)


def planned(cluster: Any, namespace: str) -> dict[str, Any]:
    return condition(get(cluster, "modeldeployment", "tiny", "-n", namespace), "Planned")


def test_a_local_int4_checkpoint_is_planned_from_its_config_map_and_served(
    cluster: Any, operator: Operator, namespace: str, node_dir: Path
) -> None:
    int4 = write_checkpoint(node_dir / "int4", "int4-g128")
    apply_doc(cluster, namespace, local_tiny(f"file://{int4}"))

    def waiting_for_the_config_map() -> str:
        found = planned(cluster, namespace)
        return str(found.get("message", "")) if found.get("status") == "False" else ""

    message = wait_for(waiting_for_the_config_map, "Planned=False", operator, timeout=60)
    assert f"spec.model.configMapRef (ConfigMap {CONFIG_MAP}, key config.json)" in message
    assert f"ConfigMap {CONFIG_MAP} not found in namespace {namespace}" in message
    assert pods(cluster, namespace, "tiny") == []

    create_config_map(cluster, namespace, int4)  # read by a retry (back-off at most 60 s)
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=300)

    (plan,) = get(cluster, "modeldeployment", "tiny", "-n", namespace)["status"]["plan"]
    assert (plan["nodeType"], plan["quantization"], plan["variant"]) == ("local", "int4", "")
    assert "16-bit checkpoint" not in planned(cluster, namespace)["message"]
    (pod,) = pods(cluster, namespace, "tiny")
    pod_args = pod["spec"]["containers"][0]["args"]
    assert "--quantization=int4" in pod_args
    assert "--expect-checkpoint=compressed-tensors-int4" in pod_args

    client = OpenAI(base_url=f"{pod_url(pod)}/v1", api_key="unused", max_retries=0, timeout=300)
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0
    )
    assert completion.choices[0].text == in_process_greedy(int4, pod_args)


def test_a_config_map_of_another_checkpoint_makes_the_pod_refuse_to_start(
    cluster: Any, operator: Operator, namespace: str, node_dir: Path
) -> None:
    """Planned as compressed-tensors int4, the 16-bit tiny-llama would be quantised to int4 by
    the runtime itself under --quantization int4 alone: --expect-checkpoint refuses it."""
    int4 = write_checkpoint(node_dir / "int4", "int4-g128")
    create_config_map(cluster, namespace, int4)
    apply_doc(cluster, namespace, local_tiny(f"file://{ROOT / 'models' / 'tiny-llama'}"))

    def degraded() -> str:
        found = condition(get(cluster, "modeldeployment", "tiny", "-n", namespace), "Degraded")
        return str(found.get("message", "")) if found.get("reason") == "PodsFailing" else ""

    message = wait_for(degraded, "Degraded=PodsFailing", operator, timeout=120)
    assert (
        "--expect-checkpoint compressed-tensors-int4: the checkpoint at --model is 16-bit"
        in message
    )
