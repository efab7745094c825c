"""The quality gate over spec.model.variants[] (quality/variants.py): Qwen2.5-7B in bf16 with its
AWQ int4 variant; each variant measured by its own eval Job, its row in status.quality, and the
planner serving a variant only once it is measured within maxQualityLoss."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpilot.operator import api
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.model_facts import facts_from_config_json
from kvpilot.operator.quality import admission, variants
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import desired_state, typed_status
from tests.support.checkpoint_configs import QWEN25_7B
from tests.support.prequant_plans import AWQ, BF16, CONFIG, L4, T4, request
from tests.support.quality_fixtures import DIGEST, NOW, failed_pod, job

URI = "hf://Qwen/Qwen2.5-7B-Instruct"  # in the catalog: nothing to read for it
AWQ_VARIANT = api.ModelVariant(name="awq", uri="hf://Qwen/Qwen2.5-7B-Instruct-AWQ")


def md(budget: float = 2.0, allowed: tuple[str, ...] = ("int4", "int8", "bf16")) -> dict[str, Any]:
    model = {
        "uri": URI,
        "secretRef": {"name": "hf"},
        "variants": [{"name": "awq", "uri": AWQ_VARIANT.uri, "secretRef": {"name": "awq-token"}}],
    }
    evaluation = {
        "dataset": {"configMap": "eval", "key": "eval.txt"},
        "metric": "perplexity",
        "maxQualityLoss": budget,
    }
    spec = {
        "model": model,
        "serving": {"maxContextLength": 8192},
        "quantization": {"allowed": list(allowed), "evaluation": evaluation},
    }
    return {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1}, "spec": spec}


def level_records(**losses: float) -> dict[str, str]:
    return {
        admission.record_key(level, "perplexity", DIGEST): api.QualityMeasurement(
            level=level, metric="perplexity", value=10.0, relative_loss=loss, dataset_digest=DIGEST
        ).model_dump_json(by_alias=True)
        for level, loss in losses.items()
    }


KEYS = variants.Keys(URI, "perplexity", DIGEST)
LEVELS = level_records(bf16=0.0, int8=0.3, int4=2.5)  # kvpilot's int4 is over a 2% budget


def variant_pod(level: str, loss: float) -> dict[str, Any]:
    """A succeeded eval pod whose termination message is eval_report.summary's for `awq`."""
    row = {"value": 10.1, "relative_loss": loss, "weight_bytes": 1, "level": level}
    summary = {"metric": "perplexity", "dataset_digest": DIGEST, "num_samples": 3}
    summary |= {"baseline": 10.0, "reference": "none", "levels": {}, "checkpoints": {"awq": row}}
    terminated = {"message": json.dumps(summary)}
    return {
        "metadata": {"creationTimestamp": NOW},
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [{"state": {"terminated": terminated}}],
        },
    }


def desire(
    records: dict[str, str], runs: dict[str, admission.EvalRun] | None = None, **md_args: Any
) -> desired_state.Desired:
    quality = admission.Observed(DIGEST, records=records, runs=runs or {})
    observed = desired_state.Observed(
        node_types=(L4, T4), variant_facts={"awq": AWQ}, quality=quality, now=NOW
    )
    return desired_state.desire(md(**md_args), CONFIG, observed)


@pytest.mark.parametrize(
    ("loss", "level", "judged"),
    [
        (None, "", "variant awq: not measured yet, not served until it is"),
        (3.0, "int4", "variant awq: +3.00% > 2%"),
        (2.0, "int4", ("awq", "int4")),  # the budget is inclusive, as for levels
        (-0.1, "int4", ("awq", "int4")),
        (0.1, "none", ("awq", "bf16")),  # fp8, dequantised at load, ranks as bf16
    ],
)
def test_judge(loss: float | None, level: str, judged: tuple[str, str] | str) -> None:
    measured = (
        None
        if loss is None
        else api.QualityMeasurement(
            level=level, variant="awq", metric="m", value=1, relative_loss=loss, dataset_digest="d"
        )
    )
    assert variants.judge(AWQ_VARIANT, measured, 2.0) == judged


# The gate's (source, level) pairs decide what the planner may serve on a T4 (bf16 does not
# fit; AWQ int4 and kvpilot's int4 and int8 do) and an L4 (bf16 fits).
@pytest.mark.parametrize(
    ("admitted", "node_type", "served"),
    [
        (None, T4, ("awq", "int4")),  # no eval set: every source; the published one first
        ((("", "int8"), ("awq", "int4")), T4, ("awq", "int4")),
        ((("", "int8"), ("", "int4")), T4, ("", "int4")),  # the variant not measured
        ((("", "int8"),), T4, ("", "int8")),  # neither int4 within budget
        ((("", "bf16"), ("awq", "int4")), L4, ("awq", "int4")),  # int4 preferred
    ],
)
def test_the_planner_serves_only_what_the_gate_admits(
    admitted: tuple[tuple[str, str], ...] | None,
    node_type: Any,
    served: tuple[str, str],
) -> None:
    levels = ("int4", "int8", "bf16")
    plan = planner.plan_node_type(
        request(BF16, levels, variants=(("awq", AWQ),), admitted=admitted), node_type
    )
    assert plan.fits and (plan.variant, plan.quantization) == served


def test_an_unmeasured_variant_gets_its_job_and_is_not_served() -> None:
    desired = desire(LEVELS)
    assert desired.error is None
    assert {(e.node_type, e.variant, e.quantization) for e in desired.plan} == {
        ("l4-24gb", "", "int8"),
        ("t4-16gb", "", "int8"),
    }
    verdict = desired.quality
    assert verdict is not None and verdict.condition is not None
    assert (verdict.condition.status, verdict.condition.reason) == ("False", "Measuring")
    assert "variant awq: not measured yet, not served until it is" in verdict.condition.message
    (eval_job,) = verdict.jobs_to_create
    assert eval_job["metadata"]["name"] == KEYS.job(AWQ_VARIANT)
    assert eval_job["metadata"]["annotations"][quality_job.ANNOTATION_VARIANT] == "awq"
    pod = eval_job["spec"]["template"]["spec"]
    # spec.model fetched as a serving pod fetches it, then the variant with its own Secret
    fetch_model, fetch_variant = pod["initContainers"]
    assert f"--model={URI}" in fetch_model["args"]
    assert fetch_variant["args"] == [
        "fetch",
        f"--model={AWQ_VARIANT.uri}",
        f"--to={quality_job.VARIANT_MOUNT}",
    ]
    assert fetch_variant["envFrom"] == [{"secretRef": {"name": "awq-token"}}]
    assert {"name": quality_job.VARIANT_VOLUME, "emptyDir": {}} in pod["volumes"]
    variant_mount = {"name": quality_job.VARIANT_VOLUME, "mountPath": quality_job.VARIANT_MOUNT}
    assert variant_mount in fetch_variant["volumeMounts"]
    assert {"name": "model", "mountPath": "/mnt/models"} not in fetch_variant["volumeMounts"]
    (container,) = pod["containers"]
    assert "--quantization=" in container["args"]
    assert f"--checkpoint=awq={quality_job.VARIANT_MOUNT}" in container["args"]
    assert not any(a.startswith("--quantization=int") for a in container["args"])


def test_a_measured_variant_within_budget_is_served_and_its_row_round_trips() -> None:
    runs = {KEYS.job(AWQ_VARIANT): admission.EvalRun(job("Complete"), [variant_pod("int4", 0.012)])}
    desired = desire(LEVELS, runs)
    assert desired.error is None
    # int4 is preferred: AWQ's measured 1.2% is within 2%, kvpilot's own int4 (2.5%) is not
    assert {(e.variant, e.quantization, e.quality_loss) for e in desired.plan} == {
        ("awq", "int4", 1.2)
    }
    verdict = desired.quality
    assert verdict is not None and verdict.condition is not None
    assert verdict.condition.status == "True"
    assert "variant awq (int4) +1.20%" in verdict.condition.message
    assert verdict.jobs_to_delete == (runs[KEYS.job(AWQ_VARIANT)].job,)
    recorded = api.QualityMeasurement.model_validate_json(
        verdict.new_records[KEYS.record(AWQ_VARIANT)]
    )
    assert (recorded.variant, recorded.level, recorded.relative_loss) == ("awq", "int4", 1.2)

    status = desired_state.build_status(md(), typed_status.EMPTY, desired, [], CONFIG, NOW)
    row = next(q for q in status["quality"] if q.get("variant"))
    assert (row["variant"], row["level"], row["relativeLoss"]) == ("awq", "int4", 1.2)
    parsed = typed_status.parse(status)
    assert [(q.variant, q.level) for q in parsed.quality] == [
        ("", "int4"),
        ("", "int8"),
        ("", "bf16"),
        ("awq", "int4"),
    ]

    # The next pass reads the record, not the Job (deleted), and decides the same.
    again = desire({**LEVELS, **verdict.new_records})
    assert again.quality is not None and again.quality.jobs_to_create == ()
    assert {(e.variant, e.quantization) for e in again.plan} == {("awq", "int4")}


def test_a_variant_over_budget_or_failed_is_not_served_and_the_condition_says_why() -> None:
    over = {KEYS.job(AWQ_VARIANT): admission.EvalRun(job("Complete"), [variant_pod("int4", 0.03)])}
    desired = desire(LEVELS, over)
    assert {(e.variant, e.quantization) for e in desired.plan} == {("", "int8")}
    assert desired.quality is not None and desired.quality.condition is not None
    assert desired.quality.condition.status == "True"  # measured: it just does not qualify
    assert "variant awq: +3.00% > 2%" in desired.quality.condition.message

    failed = {KEYS.job(AWQ_VARIANT): admission.EvalRun(job("Failed"), [failed_pod(NOW, "401")])}
    desired = desire(LEVELS, failed)
    assert {(e.variant, e.quantization) for e in desired.plan} == {("", "int8")}
    verdict = desired.quality
    assert verdict is not None and verdict.condition is not None
    assert (verdict.condition.status, verdict.condition.reason) == ("False", "EvalFailed")
    assert "variant awq: BackoffLimitExceeded: 401 [attempt 1" in verdict.condition.message
    assert verdict.new_records == {KEYS.failures(AWQ_VARIANT): "1"}
    assert verdict.jobs_to_create == ()  # the failed Job stays until its TTL


# A compressed-tensors int8 checkpoint of the same model: int8 is a level the unmeasured
# fallback admits, so only the gate keeps it from being served before it is measured.
CT_INT8 = facts_from_config_json(
    QWEN25_7B
    | {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                }
            },
            "ignore": ["lm_head"],
        }
    },
    lambda: 0,
    "variant",
    "",
)


def test_before_the_eval_set_is_read_no_variant_is_served() -> None:
    assert CT_INT8.checkpoint is not None and CT_INT8.checkpoint.level == "int8"
    facts: dict[str, desired_state.Read] = {"awq": CT_INT8}  # here an int8 checkpoint
    observed = desired_state.Observed(node_types=(L4, T4), variant_facts=facts, now=NOW)
    desired = desired_state.desire(md(), CONFIG, observed)
    assert desired.error is None and {e.variant for e in desired.plan} == {""}


def test_a_variant_alone_within_budget_is_enough_to_plan() -> None:
    """Only int4 allowed and kvpilot's int4 over budget: the AWQ variant is what is served."""
    done = {KEYS.job(AWQ_VARIANT): admission.EvalRun(job("Complete"), [variant_pod("int4", 0.001)])}
    desired = desire(LEVELS, done, allowed=("int4", "int8"), budget=0.2)
    assert desired.error is None
    assert {(e.variant, e.quantization) for e in desired.plan} == {("awq", "int4")}


# A pre-quantised spec.model leaves the gate no 16-bit baseline: with an eval set the spec is
# refused saying how to list the checkpoints; without one it is served as published.
@pytest.mark.parametrize(
    ("with_evaluation", "refused"),
    [(True, True), (False, False)],
)
def test_a_pre_quantised_spec_model_under_the_gate_is_refused_saying_to_list_it_as_a_variant(
    with_evaluation: bool, refused: bool
) -> None:
    awq_model = md(allowed=("int4", "int8", "bf16"))
    awq_model["spec"]["model"] = {"uri": AWQ_VARIANT.uri}
    if not with_evaluation:
        del awq_model["spec"]["quantization"]["evaluation"]
    quality = admission.Observed(DIGEST, records=LEVELS, runs={})
    observed = desired_state.Observed(node_types=(T4,), source_facts=AWQ, quality=quality, now=NOW)
    desired = desired_state.desire(awq_model, CONFIG, observed)
    if not refused:
        assert desired.error is None and desired.plan[0].quantization == "int4"
        return
    assert desired.is_invalid_spec and not desired.needs_retry
    assert AWQ.checkpoint is not None
    assert desired.error == (
        "spec.quantization.evaluation needs a 16-bit spec.model as its baseline, and spec.model"
        f" ({AWQ_VARIANT.uri}) is pre-quantised ({AWQ.checkpoint.description}): put the model's"
        " 16-bit checkpoint in spec.model.uri and this one under spec.model.variants (e.g."
        f" {{name: awq, uri: {AWQ_VARIANT.uri}}}), or remove spec.quantization.evaluation to"
        " serve it unmeasured"
    )
