"""The quality gate over a variant on the dev cluster's `local` pool (real processes): tiny-llama
in bf16 and a compressed-tensors int4 checkpoint of it (made here with the real library), both in
the dev cluster's S3 store, with an eval set in a ConfigMap. Real eval Jobs measure kvpilot's
levels and the variant (its Job fetches the variant's URI beside spec.model's); status.quality
gets the variant's row, and the plan serves the cheapest source within maxQualityLoss: kvpilot's
own int4 while it is within, the variant while only it is, int8 once neither is."""

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
    # Everything within 100%: int4 preferred, and of its sources the cheapest: kvpilot's own int4
    # packs the embeddings and lm_head too, so it holds fewer bytes than the variant.
    (plan,) = now["plan"]
    assert (plan["variant"], plan["quantization"]) == ("", "int4")
    assert plan["qualityLoss"] == rows["int4"]["relativeLoss"]
    assert plan["reason"].startswith("spec.model over variant ct-int4 (weights ")

    # A budget between the variant's loss and kvpilot's int4's: the variant serves int4.
    assert variant["relativeLoss"] < rows["int4"]["relativeLoss"]
    budget = round((variant["relativeLoss"] + rows["int4"]["relativeLoss"]) / 2, 4)
    patch_budget(cluster, namespace, budget)
    now = wait_for(
        lambda: re_planned(cluster, namespace, budget, "ct-int4"), "the variant served", operator
    )
    (plan,) = now["plan"]
    assert (plan["quantization"], plan["qualityLoss"]) == ("int4", variant["relativeLoss"])
    message = condition(now, "QualityMeasured")["message"]
    assert f"int4: +{rows['int4']['relativeLoss']:.2f}% > {budget:g}%" in message

    # A budget between int8's loss and the variant's: the variant is no longer served (int8
    # is); the condition says why.
    assert rows["int8"]["relativeLoss"] < variant["relativeLoss"]
    budget = round((rows["int8"]["relativeLoss"] + variant["relativeLoss"]) / 2, 4)
    patch_budget(cluster, namespace, budget)
    now = wait_for(
        lambda: re_planned(cluster, namespace, budget, ""), "re-planned without it", operator
    )
    message = condition(now, "QualityMeasured")["message"]
    assert f"variant ct-int4: +{variant['relativeLoss']:.2f}% > {budget:g}%" in message
    (plan,) = now["plan"]
    assert (plan["variant"], plan["quantization"]) == ("", "int8")


def patch_budget(cluster: Any, namespace: str, budget: float) -> None:
    patch = {"spec": {"quantization": {"evaluation": {"maxQualityLoss": budget}}}}
    cluster.kubectl("patch", "md", "tiny", "-n", namespace, "--type=merge", "-p", json.dumps(patch))


def re_planned(cluster: Any, namespace: str, budget: float, variant: str) -> dict[str, Any]:
    """The status once the plan serves `variant` under maxQualityLoss `budget`."""
    now = status(cluster, namespace, "tiny")
    plan = (now.get("plan") or [{}])[0]
    budget_seen = f"budget {budget:g}%" in condition(now, "QualityMeasured").get("message", "")
    if plan.get("variant") != variant or not budget_seen:
        raise AssertionError(f"plan {plan}; {condition(now, 'QualityMeasured')}")
    return now
