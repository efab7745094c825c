"""The quality gate over a variant with spec.model.cache on the dev cluster's `local` pool (real
processes): spec.model and the variant are each filled once into a claim of their own, and the
variant's eval Job reads both from their claims (no fetch of its own) once they are Cached;
status.quality gets the variant's measured row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.reference.prequantized import write_checkpoint
from hack.devcluster.modelsources import S3Endpoint, s3_client, upload_model
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import manifests
from tests.support.operator_cluster import (
    ROOT,
    Operator,
    apply_doc,
    apply_secret,
    model_server_env,
    wait_for,
)
from tests.support.quality_cluster import eval_jobs
from tests.support.variants_cluster import (
    EVAL_CHARS,
    METRIC,
    measured,
    measured_variant_tiny,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
BUCKET = "models"


def test_a_cached_variants_eval_job_reads_it_from_its_claim(
    cluster: Any, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    env = model_server_env(cluster)
    s3 = S3Endpoint(
        env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], BUCKET
    )
    int4 = write_checkpoint(tmp_path / "int4", "int4-g128")  # compressed-tensors itself
    prefix = f"{namespace}/tiny-int4"
    upload_model(s3_client(s3), BUCKET, int4, prefix + "/")
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    apply_secret(cluster, namespace, "model-creds", {k: env[k] for k in keys})
    dataset = tmp_path / "eval.txt"
    dataset.write_text((ROOT / "models" / "tiny-llama" / "eval.txt").read_text()[:EVAL_CHARS])
    cluster.kubectl(
        "create", "configmap", "tiny-eval", "-n", namespace, f"--from-file=eval.txt={dataset}"
    )
    variant_uri = f"s3://{BUCKET}/{prefix}"
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
