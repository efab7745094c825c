"""Quantisation admitted by measured quality (admission.py): admission tables, the eval Job, reading
its outcome, and one pass's verdict through desired_state.desire."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from kvpilot.operator import api
from kvpilot.operator.quality import admission
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import desired_state, typed_status
from tests.support.quality_fixtures import (
    CONFIG,
    DIGEST,
    L4,
    NOW,
    URI,
    evaluation,
    failed_pod,
    job,
    md,
    md_spec,
    policy,
    reference,
    summary_pod,
)


@pytest.mark.parametrize(
    ("fields", "losses", "levels", "pending", "excluded"),
    [
        # no eval set: the category alone, as before
        ({"maxQualityLoss": "low"}, {}, ("bf16", "int8"), (), ()),
        ({"maxQualityLoss": "medium"}, {}, ("bf16", "int8", "int4"), (), ()),
        # nothing measured yet: the category capped at low; int4 waits for its measurement
        ({"evaluation": evaluation()}, {}, ("bf16", "int8"), ("bf16", "int8", "int4"), ()),
        (
            {"evaluation": evaluation(), "maxQualityLoss": "none"},
            {},
            ("bf16",),
            ("bf16", "int8", "int4"),
            (),
        ),
        # measured: the budget decides, whatever the category says
        (
            {"evaluation": evaluation(0.5)},
            {"bf16": 0.0, "int8": 0.2, "int4": 3.1},
            ("bf16", "int8"),
            (),
            ("int4: +3.10% > 0.5%",),
        ),
        (
            {"evaluation": evaluation(5), "maxQualityLoss": "none"},
            {"bf16": 0.0, "int8": 0.2, "int4": 3.1},
            ("bf16", "int8", "int4"),
            (),
            (),
        ),
        (  # the budget is inclusive; a level better than the reference is admitted
            {"evaluation": evaluation(0.2)},
            {"bf16": -0.01, "int8": 0.2, "int4": 0.21},
            ("bf16", "int8"),
            (),
            ("int4: +0.21% > 0.2%",),
        ),
        # partly measured: measured levels by the budget, the rest by the fallback
        (
            {"evaluation": evaluation(0.1)},
            {"int8": 0.4},
            ("bf16",),
            ("bf16", "int4"),
            ("int8: +0.40% > 0.1%",),
        ),
        (
            {"evaluation": evaluation(1), "allowed": ["int4", "int8"]},
            {"int4": 0.9},
            ("int4", "int8"),
            ("int8",),
            (),
        ),
    ],
)
def test_admission(
    fields: dict[str, Any],
    losses: dict[str, float],
    levels: tuple[str, ...],
    pending: tuple[str, ...],
    excluded: tuple[str, ...],
) -> None:
    admitted = admission.admit(policy(**fields), losses)
    assert (admitted.levels, admitted.pending, admitted.excluded) == (levels, pending, excluded)


def test_int4_alone_cannot_wait_for_its_measurement() -> None:
    with pytest.raises(ValidationError, match="allowed needs bf16 or int8"):
        policy(allowed=["int4"], evaluation=evaluation())
    with pytest.raises(ValidationError, match="maxQualityLoss"):
        policy(evaluation={"dataset": {"configMap": "x", "key": "e.txt"}, "maxQualityLoss": -1})


def test_the_crd_carries_the_evaluation_rules() -> None:
    from kvpilot.operator import crdgen

    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    quant = schema["properties"]["spec"]["properties"]["quantization"]
    rules = [r["rule"] for r in quant["x-kubernetes-validations"]]
    assert "!has(self.evaluation) || self.allowed.exists(q, q != 'int4')" in rules
    ev = quant["properties"]["evaluation"]
    assert ev["required"] == ["dataset", "maxQualityLoss"]
    assert ev["properties"]["metric"]["enum"] == ["perplexity", "agreement", "exact-match"]


def test_the_digest_is_the_evals(tmp_path: Path) -> None:
    from kvpilot.runtime.evaluate import dataset_digest

    text = "Once upon a time, naïve tokens.\n"
    path = tmp_path / "eval.txt"
    path.write_text(text)
    assert admission.dataset_digest(text.encode()) == dataset_digest(path)
    assert admission.dataset_digest(b"other") != dataset_digest(path)


def test_the_eval_job_runs_like_a_runtime_pod() -> None:
    s = api.parse_spec(md_spec(evaluation=evaluation(metric="agreement")))
    job = quality_job.build_eval_job(md(md_spec()), s, "int4", reference(), DIGEST, CONFIG)
    kubernetes_validate.validate(job, "1.37.0", strict=True)
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"kvpilot.dev/node-type": "l4"}
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model"]  # hf:// is fetched
    (container,) = pod["containers"]
    assert container["args"] == [
        "eval",
        "--model=/mnt/models",
        "--dataset=/mnt/eval/eval.txt",
        "--metric=agreement",
        "--quantization=int4",
        f"--max-length={quality_job.EVAL_WINDOW_TOKENS}",
        "--dtype=auto",
        "--summary-file=/dev/termination-log",
    ]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    dataset = next(v for v in pod["volumes"] if v["name"] == "eval-dataset")
    assert dataset["configMap"] == {
        "name": "tiny-eval",
        "items": [{"key": "eval.txt", "path": "eval.txt"}],
    }
    assert job["spec"]["ttlSecondsAfterFinished"] > 0 and job["spec"]["backoffLimit"] >= 1
    # Named by what it measures: the same level of the same model on the same set is one Job.
    same = quality_job.build_eval_job(md(md_spec()), s, "int4", reference(), DIGEST, CONFIG)
    assert same["metadata"]["name"] == job["metadata"]["name"]
    other = quality_job.build_eval_job(md(md_spec()), s, "int8", reference(), DIGEST, CONFIG)
    assert other["metadata"]["name"] != job["metadata"]["name"]


def test_job_outcomes() -> None:
    complete = {**job("Complete")}
    complete["status"] = {**complete["status"], "completionTime": "2026-12-03T19:59:00Z"}
    done = admission.job_outcome(
        admission.EvalRun(complete, [summary_pod("int8", 141.2, 0.0042)]), "int8", URI, NOW
    )
    assert isinstance(done, api.QualityMeasurement)
    assert (done.level, done.value, done.relative_loss, done.node_type) == (
        "int8",
        141.2,
        0.42,
        "l4",
    )
    assert (done.dataset_digest, done.model_revision) == (DIGEST, URI)
    assert done.measured_at == "2026-12-03T19:59:00Z"  # when the Job completed, for every reader

    older = failed_pod("2026-12-03T19:00:00Z", "old")
    newer = failed_pod("2026-12-03T19:05:00Z", "Traceback\nkvpilot-runtime eval: dataset empty")
    failed = admission.job_outcome(
        admission.EvalRun(job("Failed"), [newer, older]), "int8", URI, NOW
    )
    assert failed == "BackoffLimitExceeded: Traceback | kvpilot-runtime eval: dataset empty"

    assert admission.job_outcome(admission.EvalRun(job(None), [older]), "int8", URI, NOW) is None
    # Complete, but the summary is not there (a runtime that wrote none): say so, do not guess.
    odd = admission.job_outcome(admission.EvalRun(job("Complete"), []), "int8", URI, NOW)
    assert odd == "the eval Job finished without a summary"


def named(level: str, reference: str = "bf16") -> str:
    """Observed.runs are by Job name: the name of what the Job measures."""
    return quality_job.job_name(URI, level, "perplexity", DIGEST, reference)


def record(level: str, loss: float) -> str:
    return api.QualityMeasurement(
        level=level, metric="perplexity", value=140.0, relative_loss=loss, dataset_digest=DIGEST
    ).model_dump_json(by_alias=True)


def records(**losses: float) -> dict[str, str]:
    return {
        admission.record_key(level, "perplexity", DIGEST): record(level, loss)
        for level, loss in losses.items()
    }


def test_nothing_measured_asks_for_a_job_per_level_and_serves_the_fallback() -> None:
    s = api.parse_spec(md_spec(evaluation=evaluation()))
    observed = admission.Observed(dataset_key=DIGEST)
    verdict = admission.assess(md(md_spec()), s, observed, reference(), CONFIG, NOW)
    assert verdict.admission.levels == ("bf16", "int8")
    assert [
        j["metadata"]["annotations"]["kvpilot.dev/quantization"] for j in verdict.jobs_to_create
    ] == ["bf16", "int8", "int4"]
    assert verdict.condition is not None and verdict.condition.status == "False"
    assert verdict.condition.reason == "Measuring"
    assert "measuring bf16, int8, int4 on l4" in verdict.condition.message


def test_cached_measurements_need_no_job() -> None:
    s = api.parse_spec(md_spec(evaluation=evaluation(0.5)))
    observed = admission.Observed(DIGEST, records=records(bf16=0.0, int8=0.3, int4=2.5))
    verdict = admission.assess(md(md_spec()), s, observed, reference(), CONFIG, NOW)
    assert verdict.jobs_to_create == () and verdict.new_records == {}
    assert verdict.admission.levels == ("bf16", "int8")
    assert verdict.condition is not None and verdict.condition.status == "True"
    assert "excluded int4: +2.50% > 0.5%" in verdict.condition.message
    assert [m.level for m in verdict.measurements] == ["bf16", "int8", "int4"]
    # A record of another dataset (another digest) does not count.
    other = admission.Observed("sha256:" + "cd" * 32, records=records(bf16=0.0, int8=0.3, int4=2.5))
    assert (
        len(admission.assess(md(md_spec()), s, other, reference(), CONFIG, NOW).jobs_to_create) == 3
    )


def test_a_finished_job_is_recorded_then_deleted_and_a_failed_one_is_not_retried_at_once() -> None:
    s = api.parse_spec(md_spec(evaluation=evaluation(0.5)))
    runs = {
        named("int8"): admission.EvalRun(job("Complete"), [summary_pod("int8", 141.0, 0.003)]),
        named("int4"): admission.EvalRun(job("Failed"), [failed_pod(NOW, "CUDA out of memory")]),
    }
    observed = admission.Observed(DIGEST, records=records(bf16=0.0), runs=runs)
    verdict = admission.assess(md(md_spec()), s, observed, reference(), CONFIG, NOW)
    # int8's measurement, and that int4's first attempt failed (its retry waits longer each time)
    assert verdict.new_records.keys() == {
        admission.record_key("int8", "perplexity", DIGEST),
        admission.failure_key("int4", "perplexity", DIGEST),
    }
    assert verdict.new_records[admission.failure_key("int4", "perplexity", DIGEST)] == "1"
    assert verdict.jobs_to_delete == (runs[named("int8")].job,)
    assert verdict.jobs_to_create == ()  # int4's failed Job stays until its TTL: no tight loop
    assert verdict.admission.levels == ("bf16", "int8")
    assert verdict.condition is not None and verdict.condition.reason == "EvalFailed"
    assert "int4: BackoffLimitExceeded: CUDA out of memory [attempt 1" in verdict.condition.message


def test_an_unreadable_dataset_falls_back_to_the_category_and_is_retried() -> None:
    s = api.parse_spec(md_spec(evaluation=evaluation()))
    observed = admission.Observed(dataset_error="ConfigMap ns/tiny-eval not found")
    verdict = admission.assess(md(md_spec()), s, observed, reference(), CONFIG, NOW)
    assert verdict.admission.levels == ("bf16", "int8") and verdict.jobs_to_create == ()
    assert verdict.condition is not None and verdict.condition.reason == "DatasetUnreadable"
    assert verdict.condition.message.startswith("ConfigMap ns/tiny-eval not found; until")
    assert admission.needs_retry(verdict)


def test_no_reference_node_makes_no_job() -> None:
    s = api.parse_spec(md_spec(evaluation=evaluation()))
    verdict = admission.assess(md(md_spec()), s, admission.Observed(DIGEST), None, CONFIG, NOW)
    assert verdict.jobs_to_create == ()
    assert verdict.condition is not None and verdict.condition.reason == "NoReferenceNode"


def test_the_pass_plans_with_the_admitted_levels_and_shows_the_loss() -> None:
    spec = md_spec(evaluation=evaluation(0.5), maxQualityLoss="medium")
    spec["quantization"]["allowed"] = ["int4", "int8", "bf16"]  # int4 preferred if good enough
    observed = admission.Observed(DIGEST, records=records(bf16=0.0, int8=0.3, int4=2.5))
    seen = desired_state.Observed(node_types=(L4,), quality=observed, now=NOW)
    desired = desired_state.desire(md(spec), CONFIG, seen)
    assert desired.error is None and desired.quantization == "int8"
    (entry,) = desired.plan
    assert (entry.quantization, entry.quality_loss) == ("int8", 0.3)
    status = desired_state.build_status(md(spec), typed_status.EMPTY, desired, [], CONFIG, NOW)
    assert [q["level"] for q in status["quality"]] == ["int4", "int8", "bf16"]
    measured = next(c for c in status["conditions"] if c["type"] == "QualityMeasured")
    assert measured["status"] == "True" and measured["observedGeneration"] == 1

    # With a budget int4 meets, int4 runs.
    spec["quantization"]["evaluation"]["maxQualityLoss"] = 3
    desired = desired_state.desire(md(spec), CONFIG, seen)
    assert desired.quantization == "int4" and desired.plan[0].quality_loss == 2.5


def test_a_budget_no_level_meets_fails_the_plan_with_the_losses() -> None:
    spec = md_spec(evaluation=evaluation(0.1))
    observed = admission.Observed(DIGEST, records=records(bf16=0.2, int8=0.3, int4=2.5))
    seen = desired_state.Observed(node_types=(L4,), quality=observed, now=NOW)
    desired = desired_state.desire(md(spec), CONFIG, seen)
    assert desired.is_invalid_spec and desired.error is not None
    assert "bf16: +0.20% > 0.1%" in desired.error and "int4: +2.50% > 0.1%" in desired.error


def test_without_an_eval_set_nothing_changes() -> None:
    seen = desired_state.Observed(node_types=(L4,))
    desired = desired_state.desire(md(md_spec(maxQualityLoss="low")), CONFIG, seen)
    assert desired.quantization == "bf16" and desired.plan[0].quality_loss is None
    status = desired_state.build_status(md(md_spec()), typed_status.EMPTY, desired, [], CONFIG, NOW)
    assert "quality" not in status
    assert all(c["type"] != "QualityMeasured" for c in status["conditions"])
