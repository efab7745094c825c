"""spec.model.cache on real pods: the dev cluster's provisioner binds the claim, a Job fills it
from the dev cluster's Hugging Face server once, and every replica serves from it."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.operator_cluster import (
    TINY_FACTS,
    Operator,
    apply_doc,
    apply_secret,
    complete,
    fill_pods,
    get,
    pods,
    ready_check,
    tiny_llama_from,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
URI = "hf://kvpilot/tiny-llama"


def cached_tiny(cluster: Any, name: str, replicas: int, **cache: Any) -> dict[str, Any]:
    md = tiny_llama_from(URI, cluster, "model-creds", TINY_FACTS)
    md["metadata"]["name"] = name
    md["spec"]["model"]["cache"] = {"size": "1Gi", **cache}
    md["spec"]["autoscaling"] = {"mode": "off", "replicas": replicas}
    return md


def exists(cluster: Any, namespace: str, kind: str, name: str) -> bool:
    found = cluster.kubectl("get", kind, name, "-n", namespace, "--ignore-not-found", "-o", "name")
    return bool(found.stdout.strip())


def test_a_cached_model_is_fetched_once_and_outlives_its_model_deployments(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    apply_secret(cluster, namespace, "model-creds", {"HF_TOKEN": "unused-here"})
    apply_doc(cluster, namespace, cached_tiny(cluster, "tiny", replicas=2))
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=240)

    cache = get(cluster, "modeldeployment", "tiny", "-n", namespace)["status"]["cache"]
    assert cache["phase"] == "Cached" and cache["files"] >= 3 and cache["bytes"] > 1_000_000
    claim = cache["claimName"]
    assert get(cluster, "pvc", claim, "-n", namespace)["status"]["phase"] == "Bound"
    (filler,) = fill_pods(cluster, namespace, claim)  # two replicas, one download
    assert filler["status"]["phase"] == "Succeeded"
    replicas = pods(cluster, namespace, "tiny")
    assert len(replicas) == 2
    for pod in replicas:
        assert "initContainers" not in pod["spec"]  # nothing fetched per pod
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        assert complete(pod)["usage"]["completion_tokens"] == 4

    # Deleting the ModelDeployment leaves the cache; the next one of that model finds it filled.
    cluster.kubectl("delete", "modeldeployment", "tiny", "-n", namespace, "--wait=true")
    wait_for(lambda: not pods(cluster, namespace, "tiny"), "tiny's pods gone", operator)
    assert exists(cluster, namespace, "pvc", claim) and exists(cluster, namespace, "job", claim)
    apply_doc(cluster, namespace, cached_tiny(cluster, "again", replicas=1, deleteWithModel=True))
    wait_for(ready_check(cluster, namespace, "again"), "again Ready", operator, timeout=120)
    assert len(fill_pods(cluster, namespace, claim)) == 1  # not downloaded a second time
    (pod,) = pods(cluster, namespace, "again")
    assert complete(pod)["usage"]["completion_tokens"] == 4

    # Asked to, the cache goes with the last ModelDeployment that uses it.
    cluster.kubectl("delete", "modeldeployment", "again", "-n", namespace, "--wait=true")
    wait_for(
        lambda: (
            not exists(cluster, namespace, "pvc", claim)
            and not exists(cluster, namespace, "job", claim)
        ),
        "the cache deleted with its last user",
        operator,
        timeout=120,
    )


def test_a_cache_that_cannot_be_filled_says_why(
    cluster: Any, operator: Operator, namespace: str
) -> None:
    apply_secret(cluster, namespace, "model-creds", {"HF_TOKEN": "unused-here"})
    md = cached_tiny(cluster, "tiny", replicas=1)
    md["spec"]["model"]["uri"] = "hf://kvpilot/no-such-model"
    apply_doc(cluster, namespace, md)

    def waiting() -> str:
        found = get(cluster, "modeldeployment", "tiny", "-n", namespace)
        cache = (found.get("status") or {}).get("cache") or {}
        failed_attempt = cache.get("phase") in ("Downloading", "Failed")
        return str(cache.get("message", "")) if failed_attempt else ""

    message = wait_for(waiting, "the fill's error in status.cache", operator, timeout=120)
    assert "hf://kvpilot/no-such-model: 404 repository not found" in message
    assert pods(cluster, namespace, "tiny") == []  # no replica starts without its model
