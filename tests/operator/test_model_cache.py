"""The model cache as data: its claim, its fill Job, its status, and how a pass uses it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.reconcile import (
    conditions,
    desired_state,
    manifests,
    model_cache,
    typed_status,
)

CONFIG = OperatorConfig()
L4 = NodeType(
    name="l4",
    product="NVIDIA-L4",
    gpu_memory_mib=23034,
    gpus_per_node=2,
    price_per_hour=0.8,
    node_selector={"kvpilot.dev/node-type": "l4"},
    nodes=("n",),
    free_gpus_per_node=(2,),
)
URI = "hf://kvpilot/tiny-llama"
TINY = {"parameters": 1_000_000, "layers": 2, "kvHeads": 2, "headDim": 16, "vocabSize": 512}


def md(cache: dict[str, Any] | None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"uri": URI, **TINY}
    if cache is not None:
        model["cache"] = cache
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "tiny", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {"model": model, "autoscaling": {"mode": "off", "replicas": 2}},
        "status": status or {},
    }


def job(conditions_: list[str], **status: Any) -> dict[str, Any]:
    found = [{"type": c, "status": "True", "message": f"job {c}"} for c in conditions_]
    return {"metadata": {"name": "c"}, "status": {"conditions": found, **status}}


def pod(phase: str, message: str, created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    terminated = {"exitCode": 0 if phase == "Succeeded" else 1, "message": message}
    return {
        "metadata": {"creationTimestamp": created},
        "status": {"phase": phase, "containerStatuses": [{"state": {"terminated": terminated}}]},
    }


SUMMARY = json.dumps({"files": 5, "bytes": 4096, "seconds": 1.5})


@pytest.mark.parametrize(
    ("job_doc", "pods", "phase", "bytes_", "message"),
    [
        (None, [], "Pending", None, "fill Job not made"),
        (job([]), [], "Downloading", None, ""),
        (
            job([]),
            [pod("Failed", "loading\nkvpilot-runtime fetch: hf://x: 404 not found")],
            "Downloading",
            None,
            "kvpilot-runtime fetch: hf://x: 404 not found",  # an attempt failed; retrying
        ),
        (
            job(["Complete"]),
            [pod("Failed", "flaky"), pod("Succeeded", SUMMARY)],
            "Cached",
            4096,
            "",
        ),
        (
            job(["Failed"]),
            [
                pod("Failed", "first", "2026-01-01T00:00:00Z"),
                pod("Failed", "newest", "2026-01-01T00:01:00Z"),
            ],
            "Failed",
            None,
            "job Failed; newest",
        ),
    ],
)
def test_status_from_the_fill_job_and_its_pods(
    job_doc: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    phase: str,
    bytes_: int | None,
    message: str,
) -> None:
    status = model_cache.status("c", job_doc, pods)
    assert (status.phase, status.bytes, status.message) == (phase, bytes_, message)


def test_cached_duration_falls_back_to_the_jobs_own_times() -> None:
    done = job(
        ["Complete"], startTime="2026-01-01T00:00:00Z", completionTime="2026-01-01T00:00:42Z"
    )
    status = model_cache.status("c", done, [pod("Succeeded", "not json")])
    assert status.phase == "Cached" and status.duration_seconds == 42.0 and status.bytes is None


@pytest.mark.parametrize(
    ("parameters", "size"),
    [(1_000_000, "2Gi"), (7_000_000_000, "17Gi"), (70_000_000_000, "158Gi")],
)
def test_default_size_holds_a_16_bit_checkpoint(parameters: int, size: str) -> None:
    assert model_cache.default_size(parameters) == size


def test_claim_and_job_share_the_name_of_the_source_and_no_owner_by_default() -> None:
    spec = api.parse_spec(md({})["spec"])
    node_plan = planner.NodePlan(L4, True, "bf16", 1, max_concurrency=8)
    claim, fill = model_cache.children(md({}), spec, 1_000_000, node_plan, CONFIG)
    name = manifests.cache_claim_name(URI)
    assert claim["metadata"]["name"] == fill["metadata"]["name"] == name
    assert claim["metadata"]["ownerReferences"] == []  # deleting the model leaves the cache
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert "storageClassName" not in claim["spec"]  # the cluster's default class
    template = fill["spec"]["template"]["spec"]
    assert template["restartPolicy"] == "Never"
    assert template["nodeSelector"] == {"kvpilot.dev/node-type": "l4"}  # where replicas run
    assert template["volumes"][-1] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": name},
    }
    assert "nvidia.com/gpu" not in json.dumps(template["containers"][0].get("resources", {}))


def test_delete_with_model_makes_each_user_a_non_controlling_owner() -> None:
    cache = {"deleteWithModel": True, "size": "5Gi", "storageClassName": "nfs"}
    spec = api.parse_spec(md(cache)["spec"])
    claim = model_cache.build_claim(md(cache), spec, 1_000_000)
    (owner,) = claim["metadata"]["ownerReferences"]
    assert owner["uid"] == "u-1" and owner["controller"] is False
    assert claim["spec"]["storageClassName"] == "nfs"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"


@pytest.mark.parametrize(
    ("cache_phase", "replicas", "ready_reason"),
    [
        ("Pending", 0, "FillingCache"),
        ("Downloading", 0, "FillingCache"),
        ("Failed", 0, "CacheFailed"),
        ("Cached", 2, "ReplicasNotReady"),
    ],
)
def test_replicas_wait_at_zero_until_the_cache_is_filled(
    cache_phase: str, replicas: int, ready_reason: str
) -> None:
    cache = api.CacheStatus(claim_name="c", phase=cache_phase)  # type: ignore[arg-type]
    desired = desired_state.desire(
        md({}), CONFIG, desired_state.Observed(node_types=(L4,), cache=cache)
    )
    deployment = next(c for c in desired.children if c["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == replicas
    assert [c["kind"] for c in desired.cache_children] == ["PersistentVolumeClaim", "Job"]
    status = desired_state.build_status(
        md({}), typed_status.EMPTY, desired, [deployment], CONFIG, "now"
    )
    assert status["cache"]["phase"] == cache_phase
    ready = next(c for c in status["conditions"] if c["type"] == conditions.READY)
    assert ready["reason"] == ready_reason


def test_without_a_cache_nothing_changes() -> None:
    desired = desired_state.desire(md(None), CONFIG, desired_state.Observed(node_types=(L4,)))
    assert desired.cache_children == [] and desired.cache is None
    status = desired_state.build_status(md(None), typed_status.EMPTY, desired, [], CONFIG, "now")
    assert "cache" not in status


@pytest.mark.parametrize("uri", ["pvc://weights/m", "file:///srv/m"])
def test_cache_is_refused_for_local_sources(uri: str) -> None:
    with pytest.raises(ValueError, match="cache applies to hf:// and s3://"):
        api.parse_spec({"model": {"uri": uri, "cache": {}}})
