"""The quality gate over a variant on the dev cluster's `local` pool (real processes): tiny-llama
in bf16 and a compressed-tensors int4 checkpoint of it (made here with the real library), both in
the dev cluster's S3 store, with an eval set in a ConfigMap. Real eval Jobs measure kvpilot's
levels and the variant (its Job fetches the variant's URI beside spec.model's); status.quality
gets the variant's row, and the plan serves the variant only while its measured loss is within
maxQualityLoss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.reference.prequantized import write_checkpoint
from hack.devcluster.modelsources import S3Endpoint, s3_client, upload_model
from tests.support.operator_cluster import (
    ROOT,
    Operator,
    apply_doc,
    apply_secret,
    model_server_env,
    wait_for,
)
from tests.support.quality_cluster import condition, status
from tests.support.variants_cluster import EVAL_CHARS, METRIC, measured, measured_variant_tiny

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
BUCKET = "models"


def test_the_variant_is_measured_and_the_plan_follows_the_gate(
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
    apply_doc(cluster, namespace, measured_variant_tiny(cluster, variant_uri, max_loss=100))

    now = wait_for(lambda: measured(cluster, namespace), "measured", operator, timeout=1200)
    rows = {q.get("variant") or q["level"]: q for q in now["quality"]}
    assert sorted(rows) == ["ct-int4", "int4", "int8"]
    variant = rows["ct-int4"]
    assert variant["level"] == "int4" and variant["metric"] == METRIC
    assert 0 < variant["value"] < 1 and variant["relativeLoss"] > 0  # a real, measured loss
    assert variant["nodeType"] == "local"
    # Everything within 100%: int4 preferred, the pre-quantised variant first, its loss shown.
    (plan,) = now["plan"]
    assert (plan["variant"], plan["quantization"]) == ("ct-int4", "int4")
    assert plan["qualityLoss"] == variant["relativeLoss"]

    # A budget between int8's loss and the variant's: the variant is no longer served (int8 is,
    # or kvpilot's int4 if it measured within); the condition says why.
    assert rows["int8"]["relativeLoss"] < variant["relativeLoss"]
    budget = round((rows["int8"]["relativeLoss"] + variant["relativeLoss"]) / 2, 4)
    patch = {"spec": {"quantization": {"evaluation": {"maxQualityLoss": budget}}}}
    cluster.kubectl("patch", "md", "tiny", "-n", namespace, "--type=merge", "-p", json.dumps(patch))

    def off_the_variant() -> dict[str, Any]:
        now = status(cluster, namespace, "tiny")
        plan = (now.get("plan") or [{}])[0]
        if plan.get("variant") != "" or "ct-int4" not in condition(now, "QualityMeasured").get(
            "message", ""
        ):
            raise AssertionError(f"plan {plan}; {condition(now, 'QualityMeasured')}")
        return now

    now = wait_for(off_the_variant, "re-planned without the variant", operator)
    message = condition(now, "QualityMeasured")["message"]
    assert f"variant ct-int4: +{variant['relativeLoss']:.2f}% > {budget:g}%" in message
    (plan,) = now["plan"]
    expected = "int4" if rows["int4"]["relativeLoss"] <= budget else "int8"
    assert (plan["variant"], plan["quantization"]) == ("", expected)
