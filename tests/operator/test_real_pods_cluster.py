"""ModelDeployments whose pods run for real on the `local` pool: fetched models (hf://, s3://),
fetches that fail, tensor-parallel plans, runtimes that cannot start. What the pod runner ran is
what the operator wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.operator_cluster import (
    ROOT,
    TINY_FACTS,
    Operator,
    apply_doc,
    apply_secret,
    complete,
    condition,
    get,
    model_deployment,
    model_server_env,
    pod_metrics,
    pod_samples,
    pods,
    ready_check,
    tiny_llama_from,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


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


def test_a_draft_model_is_fetched_beside_the_served_one_and_proposes(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    model_server_env(cluster)
    apply_secret(cluster, namespace, "model-creds", {"HF_TOKEN": "unused-here"})
    md = tiny_llama_from("hf://kvpilot/tiny-llama", cluster, "model-creds")
    # tiny-llama drafts for itself: the same tokenizer, and greedy proposals it accepts
    draft = {"method": "draft_model", "model": "hf://kvpilot/tiny-llama", "numSpeculativeTokens": 3}
    md["spec"]["serving"]["speculative"] = draft
    apply_doc(cluster, namespace, md)
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=240)
    (pod,) = pods(cluster, namespace, "tiny")
    inits = {
        s["name"]: s["state"]["terminated"]["exitCode"]
        for s in pod["status"]["initContainerStatuses"]
    }
    assert inits == {"fetch-model": 0, "fetch-draft-model": 0}
    assert complete(pod, max_tokens=16, temperature=0)["usage"]["completion_tokens"] == 16
    counts = pod_metrics(pod)
    assert counts["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert counts["vllm:spec_decode_num_accepted_tokens_total"] > 0


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


def test_kv_offload_runs_the_runtimes_host_and_disk_tiers_on_real_pods(
    cluster: Any, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    """spec.runtime.kvOffload with a host tier and a disk tier on a hostPath: the pod the
    operator writes starts the runtime with both tiers, where the spec put them."""
    directory = tmp_path / "kv-blocks"
    md = model_deployment(
        "tiny",
        f"file://{ROOT / 'models' / 'tiny-llama'}",
        serving={"maxContextLength": 256, "targetConcurrency": 2},
        placement={"nodeTypes": ["local"]},
        autoscaling={"mode": "off", "replicas": 1},
        runtime={
            "kvOffload": {
                "hostGiB": 0.01,
                "disk": {"sizeGiB": 0.05, "hostPath": str(directory)},
            }
        },
    )
    md["spec"]["model"].update(servedName="tiny", **TINY_FACTS)
    apply_doc(cluster, namespace, md)
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=240)
    (pod,) = pods(cluster, namespace, "tiny")
    container = pod["spec"]["containers"][0]
    assert "--kv-offloading-size=0.01" in container["args"]
    assert container["resources"]["requests"]["memory"] == "11Mi"  # 0.01 GiB, whole MiB up
    assert complete(pod)["usage"]["completion_tokens"] == 4
    capacity = {
        labels["tier"]: value
        for name, labels, value in pod_samples(pod)
        if name == "kvpilot_kv_offload_capacity_blocks"
    }
    assert set(capacity) == {"host", "disk"} and capacity["disk"] > capacity["host"] > 0
    assert directory.is_dir()  # the runtime's disk tier opened the node's directory
