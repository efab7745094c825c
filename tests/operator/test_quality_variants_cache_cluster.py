"""The quality gate over a variant with spec.model.cache on the dev cluster's `local` pool (real
processes): spec.model and the variant are each filled once into a claim of their own, and the
variant's eval Job reads both from their claims (no fetch of its own) once they are Cached;
status.quality gets the variant's measured row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import manifests
from tests.support.operator_cluster import (
    Operator,
    apply_doc,
    wait_for,
)
from tests.support.quality_cluster import eval_jobs
from tests.support.variants_cluster import (
    METRIC,
    eval_set_config_map,
    int4_variant_in_s3,
    measured,
    measured_variant_tiny,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_a_cached_variants_eval_job_reads_it_from_its_claim(
    cluster: Any, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    int4 = int4_variant_in_s3(cluster, namespace, tmp_path)
    eval_set_config_map(cluster, namespace, tmp_path)
    variant_uri = int4.uri
    md = measured_variant_tiny(cluster, variant_uri, max_loss=100)
    md["spec"]["model"]["cache"] = {"size": "1Gi"}
    apply_doc(cluster, namespace, md)

    seen: dict[str, Any] = {}  # the variant's eval Job as made (it is deleted once read)

    def measured_seeing_the_job() -> dict[str, Any]:
        for job in eval_jobs(cluster, namespace):
            if job["metadata"]["annotations"].get(quality_job.ANNOTATION_VARIANT) == "ct-int4":
                seen["job"] = job
        return measured(cluster, namespace)

    now = wait_for(measured_seeing_the_job, "measured", operator, timeout=1200)
    rows = {q.get("variant") or q["level"]: q for q in now["quality"]}
    assert sorted(rows) == ["ct-int4", "int4", "int8"]
    variant = rows["ct-int4"]
    assert variant["level"] == "int4" and variant["metric"] == METRIC
    assert 0 < variant["value"] < 1 and variant["relativeLoss"] > 0  # a real, measured loss
    assert [c["phase"] for c in now["variantCaches"]] == ["Cached"]

    pod = seen["job"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod  # nothing fetched: both come from their claims
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[quality_job.VARIANT_VOLUME]["persistentVolumeClaim"] == {
        "claimName": manifests.cache_claim_name(variant_uri),
        "readOnly": True,
    }
    model_claim = manifests.cache_claim_name("s3://models/tiny-llama")
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == model_claim
