"""spec.model.variants[] through spec.model.cache, as data: each variant cached under its own
URI, a node type's replicas waiting for the cache of what it serves, the eval Job of a variant
reading it from its cache, and the status reporting each cache."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator import api
from kvpilot.operator.quality import admission
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.quality import variants as quality_variants
from kvpilot.operator.reconcile import (
    conditions,
    dependents,
    desired_state,
    manifests,
    typed_status,
)
from tests.support.prequant_plans import AWQ, CONFIG, L4, T4
from tests.support.quality_fixtures import DIGEST, NOW

URI = "hf://Qwen/Qwen2.5-7B-Instruct"  # in the catalog: nothing to read for it
AWQ_URI = "hf://Qwen/Qwen2.5-7B-Instruct-AWQ"
MODEL_CLAIM = manifests.cache_claim_name(URI)
AWQ_CLAIM = manifests.cache_claim_name(AWQ_URI)
EVALUATION = {
    "dataset": {"configMap": "eval", "key": "eval.txt"},
    "metric": "perplexity",
    "maxQualityLoss": 2,
}
AWQ_VARIANT = api.ModelVariant(name="awq", uri=AWQ_URI)  # its record key: name and URI


def measurement(level: str, loss: float, variant: str = "") -> str:
    return api.QualityMeasurement(
        level=level,
        variant=variant,
        metric="perplexity",
        value=10.0,
        relative_loss=loss,
        dataset_digest=DIGEST,
    ).model_dump_json(by_alias=True)


# The gate measured everything: kvpilot's own int4 is over the 2% budget, the AWQ checkpoint
# within, so a T4 (where bf16 does not fit) serves awq and an L4 bf16. Without the gate kvpilot's
# int4 would win on a T4: it holds fewer weight bytes (planning/choice.py).
MEASURED = {
    admission.record_key("bf16", "perplexity", DIGEST): measurement("bf16", 0.0),
    admission.record_key("int4", "perplexity", DIGEST): measurement("int4", 3.0),
    quality_variants.Keys(URI, "perplexity", DIGEST).record(AWQ_VARIANT): measurement(
        "int4", 1.0, "awq"
    ),
}


def md() -> dict[str, Any]:
    model = {
        "uri": URI,
        "secretRef": {"name": "hf"},
        "cache": {},
        "variants": [{"name": "awq", "uri": AWQ_URI, "secretRef": {"name": "awq-token"}}],
    }
    quantization: dict[str, Any] = {"allowed": ["bf16", "int4"], "evaluation": EVALUATION}
    spec = {
        "model": model,
        "serving": {"maxContextLength": 8192},
        "quantization": quantization,
        "autoscaling": {"mode": "off", "replicas": 2},
    }
    meta = {"name": "m", "namespace": "ns", "uid": "u", "generation": 1}
    return {"metadata": meta, "spec": spec}


def cache(claim: str, phase: str) -> api.CacheStatus:
    return api.CacheStatus(claim_name=claim, phase=phase)  # type: ignore[arg-type]


def desire(model_phase: str, awq_phase: str, measured: bool = True) -> desired_state.Desired:
    """`measured`: the gate's records hold every measurement (else none: eval Jobs to make)."""
    quality = admission.Observed(DIGEST, records=MEASURED if measured else {}, runs={})
    observed = desired_state.Observed(
        node_types=(L4, T4),
        variant_facts={"awq": AWQ},
        cache=cache(MODEL_CLAIM, model_phase),
        variant_caches={"awq": cache(AWQ_CLAIM, awq_phase).model_copy(update={"variant": "awq"})},
        quality=quality,
        now=NOW,
    )
    return desired_state.desire(md(), CONFIG, observed)


def deployments(desired: desired_state.Desired) -> dict[str, dict[str, Any]]:
    found = [c for c in desired.children if c["kind"] == "Deployment"]
    return {
        d["spec"]["template"]["metadata"]["labels"][manifests.LABEL_NODE_TYPE]: d for d in found
    }


def test_variants_with_a_cache_are_accepted_at_parse() -> None:
    spec = api.parse_spec(md()["spec"])
    assert spec.model.variant("awq").cache == spec.model.cache


def test_each_source_is_cached_once_under_its_own_uri_and_filled_where_it_is_served() -> None:
    desired = desire("Pending", "Pending")
    assert desired.error is None
    kinds = [(c["kind"], c["metadata"]["name"]) for c in desired.cache_children]
    assert kinds == [
        ("PersistentVolumeClaim", MODEL_CLAIM),
        ("Job", MODEL_CLAIM),
        ("PersistentVolumeClaim", AWQ_CLAIM),
        ("Job", AWQ_CLAIM),
    ]
    jobs = {c["metadata"]["name"]: c for c in desired.cache_children if c["kind"] == "Job"}
    awq_pod = jobs[AWQ_CLAIM]["spec"]["template"]["spec"]
    (fetch,) = awq_pod["containers"]
    assert f"--model={AWQ_URI}" in fetch["args"]
    assert fetch["envFrom"] == [{"secretRef": {"name": "awq-token"}}]
    assert awq_pod["nodeSelector"] == dict(T4.node_selector)  # the node type that serves awq
    model_pod = jobs[MODEL_CLAIM]["spec"]["template"]["spec"]
    assert model_pod["nodeSelector"] == dict(L4.node_selector)
    assert jobs[AWQ_CLAIM]["metadata"]["annotations"]["kvpilot.dev/model-uri"] == AWQ_URI


# Each node type waits for the cache of what it serves (L4: spec.model bf16; T4: awq int4), and
# the Ready condition names the first cache a served node type waits for.
@pytest.mark.parametrize(
    ("model_phase", "awq_phase", "l4_replicas", "t4_replicas", "ready_reason", "waits_for"),
    [
        ("Cached", "Cached", 1, 1, "ReplicasNotReady", None),
        ("Cached", "Downloading", 1, 0, "FillingCache", AWQ_CLAIM),
        ("Downloading", "Cached", 0, 1, "FillingCache", MODEL_CLAIM),
        ("Cached", "Failed", 1, 0, "CacheFailed", AWQ_CLAIM),
    ],
)
def test_a_node_types_replicas_wait_for_the_cache_of_what_it_serves(
    model_phase: str,
    awq_phase: str,
    l4_replicas: int,
    t4_replicas: int,
    ready_reason: str,
    waits_for: str | None,
) -> None:
    desired = desire(model_phase, awq_phase)
    # the 2 replicas spread one per node type (each has one free GPU), then the wait
    assert {(e.node_type, e.variant, e.replicas) for e in desired.plan} == {
        ("l4-24gb", "", l4_replicas),
        ("t4-16gb", "awq", t4_replicas),
    }
    for name, deployment in deployments(desired).items():
        assert deployment["spec"]["replicas"] == {"l4-24gb": l4_replicas}.get(name, t4_replicas)
    status = desired_state.build_status(md(), typed_status.EMPTY, desired, [], CONFIG, NOW)
    assert status["cache"]["claimName"] == MODEL_CLAIM
    assert [(c["claimName"], c["variant"], c["phase"]) for c in status["variantCaches"]] == [
        (AWQ_CLAIM, "awq", awq_phase)
    ]
    ready = next(c for c in status["conditions"] if c["type"] == conditions.READY)
    if waits_for is None:
        assert ready["reason"] in ("ReplicasNotReady", "ScaledToZero")
    else:
        assert ready["reason"] == ready_reason and waits_for in ready["message"]


def test_the_variants_pods_read_its_uri_from_its_cache_without_fetching() -> None:
    t4 = deployments(desire("Cached", "Cached"))["t4-16gb"]["spec"]["template"]["spec"]
    assert "initContainers" not in t4
    model_volume = next(v for v in t4["volumes"] if v["name"] == "model")
    assert model_volume["persistentVolumeClaim"] == {"claimName": AWQ_CLAIM, "readOnly": True}
    (runtime,) = t4["containers"]
    assert f"--model=file://{manifests.MODEL_MOUNT}" in runtime["args"]
    assert "--quantization=int4" in runtime["args"]
    assert "--served-name=Qwen2.5-7B-Instruct" in runtime["args"]  # spec.model's name


# An eval Job reads spec.model (its baseline) and the variant from their caches: it is made
# only once both are Cached.
@pytest.mark.parametrize(
    ("model_phase", "awq_phase", "variant_job_made"),
    [
        ("Cached", "Cached", True),
        ("Cached", "Downloading", False),
        ("Downloading", "Cached", False),
    ],
)
def test_a_variants_eval_job_reads_it_from_its_cache_once_filled(
    model_phase: str, awq_phase: str, variant_job_made: bool
) -> None:
    desired = desire(model_phase, awq_phase, measured=False)
    assert desired.quality is not None
    made = [
        j
        for j in desired.quality.jobs_to_create
        if j["metadata"]["annotations"].get(quality_job.ANNOTATION_VARIANT) == "awq"
    ]
    assert bool(made) == variant_job_made
    levels_made = [
        j
        for j in desired.quality.jobs_to_create
        if not j["metadata"]["annotations"].get(quality_job.ANNOTATION_VARIANT)
    ]
    assert bool(levels_made) == (model_phase == "Cached")
    if not made:
        return
    pod = made[0]["spec"]["template"]["spec"]
    assert "initContainers" not in pod  # nothing fetched: both come from their caches
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[quality_job.VARIANT_VOLUME]["persistentVolumeClaim"] == {
        "claimName": AWQ_CLAIM,
        "readOnly": True,
    }
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == MODEL_CLAIM
    (container,) = pod["containers"]
    assert f"--checkpoint=awq={quality_job.VARIANT_MOUNT}" in container["args"]


@pytest.mark.parametrize(
    ("claim", "users"),
    [(MODEL_CLAIM, [("ns", "m")]), (AWQ_CLAIM, [("ns", "m")]), ("other", [])],
)
def test_a_variants_fill_job_passes_the_model_deployments_using_it(
    claim: str, users: list[tuple[str, str]]
) -> None:
    assert [tuple(k) for k in dependents.cache_users([md()], "ns", claim)] == users
