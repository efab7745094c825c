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

from tests.support.operator_cluster import (
    Operator,
    apply_doc,
    wait_for,
)
from tests.support.quality_cluster import condition, status
from tests.support.variants_cluster import (
    METRIC,
    eval_set_config_map,
    int4_variant_in_s3,
    measured,
    measured_variant_tiny,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_the_variant_is_measured_and_the_plan_follows_the_gate(
    cluster: Any, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    int4 = int4_variant_in_s3(cluster, namespace, tmp_path)
    eval_set_config_map(cluster, namespace, tmp_path)
    variant_uri = int4.uri
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
