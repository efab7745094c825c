"""The eval Job (quality/job.py): each dataset form reaches the eval (a ConfigMap key or pvc://
file mounted read-only, an hf:// or s3:// file fetched with the model's credentials), the pod is
the runtime's own (podTemplate included), and measurements are keyed by what identifies the set."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from kvpilot.operator import api, crdgen
from kvpilot.operator.quality import admission
from kvpilot.operator.quality import job as quality_job
from tests.support.quality_fixtures import CONFIG, DIGEST, md, md_spec, reference


def spec_with(
    dataset: dict[str, Any], allowed: tuple[str, ...] = ("bf16", "int8", "int4"), **runtime: Any
) -> api.ModelDeploymentSpec:
    evaluation = {"dataset": dataset, "metric": "perplexity", "maxQualityLoss": 1}
    raw = md_spec(evaluation=evaluation)
    raw["quantization"]["allowed"] = list(allowed)
    raw["model"]["secretRef"] = {"name": "model-creds"}
    raw["runtime"] = runtime
    return api.parse_spec(raw)


def eval_job(spec: api.ModelDeploymentSpec, key: str = DIGEST) -> dict[str, Any]:
    job = quality_job.build_eval_job(md(md_spec()), spec, "int8", reference(), key, CONFIG)
    kubernetes_validate.validate(job, "1.37.0", strict=True)
    return job


def dataset_arg(job: dict[str, Any]) -> str:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return next(a for a in container["args"] if a.startswith("--dataset="))


@pytest.mark.parametrize(
    "dataset",
    [
        {"uri": "hf://kvpilot/tiny-llama/eval.txt"},
        {"uri": "hf://datasets/org/evals@v2/qa/test.jsonl"},
        {"uri": "s3://evals/tiny/eval.txt"},
        {"uri": "pvc://eval-sets/tiny/eval.txt"},
        {"configMap": "tiny-eval", "key": "eval.txt"},
    ],
)
def test_each_dataset_form_is_valid(dataset: dict[str, Any]) -> None:
    assert api.EvalDataset.model_validate(dataset).model_dump(by_alias=True, exclude_none=True)


@pytest.mark.parametrize(
    ("dataset", "why"),
    [
        ({"uri": "s3://evals/eval.txt", "configMap": "x", "key": "e.txt"}, "either uri"),
        ({"uri": "s3://evals/eval.txt", "key": "e.txt"}, "either uri"),
        ({"configMap": "x"}, "either uri"),
        ({}, "either uri"),
        (
            {"uri": "file:///data/eval.txt"},
            "must be one file: hf:",
        ),  # the Job cannot see the user's disk
        ({"uri": "s3://evals/folder/"}, "must be one file: hf:"),  # a prefix, not one file
        ({"uri": "hf://kvpilot/tiny-llama"}, "must be one file: hf:"),  # a repo, not one file
        ({"uri": "pvc://Bad_Claim/eval.txt"}, "must be one file: hf:"),
    ],
)
def test_a_dataset_in_no_form_or_two_is_refused_with_the_reason(
    dataset: dict[str, Any], why: str
) -> None:
    with pytest.raises(ValidationError, match=why):
        api.EvalDataset.model_validate(dataset)


def test_the_crd_says_the_same_one_form_rule() -> None:
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    quant = schema["properties"]["spec"]["properties"]["quantization"]
    dataset = quant["properties"]["evaluation"]["properties"]["dataset"]
    assert "required" not in dataset and set(dataset["properties"]) == {"configMap", "key", "uri"}
    (rule,) = dataset["x-kubernetes-validations"]
    assert rule["rule"].startswith("has(self.uri) ? !has(self.configMap)")
    assert "either uri" in rule["message"]


def test_an_hf_or_s3_dataset_is_fetched_by_the_eval_with_the_models_credentials() -> None:
    for uri in ("hf://kvpilot/tiny-llama/eval.txt", "s3://evals/tiny/eval.txt"):
        job = eval_job(spec_with({"uri": uri}))
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert dataset_arg(job) == f"--dataset={uri}"
        assert container["envFrom"] == [{"secretRef": {"name": "model-creds"}}]
        assert all(v["name"] != quality_job.DATASET_VOLUME for v in pod["volumes"])
        # fetched into the pod's writable /tmp, under a read-only root filesystem
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_a_pvc_dataset_is_mounted_read_only_and_gets_no_credentials() -> None:
    job = eval_job(spec_with({"uri": "pvc://eval-sets/tiny/eval.txt"}))
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert dataset_arg(job) == f"--dataset={quality_job.DATASET_MOUNT}/tiny/eval.txt"
    volume = next(v for v in pod["volumes"] if v["name"] == quality_job.DATASET_VOLUME)
    assert volume["persistentVolumeClaim"] == {"claimName": "eval-sets", "readOnly": True}
    mount = next(m for m in container["volumeMounts"] if m["name"] == quality_job.DATASET_VOLUME)
    assert mount == {"name": "eval-dataset", "mountPath": "/mnt/eval", "readOnly": True}
    assert "envFrom" not in container


def test_the_eval_pod_is_the_runtime_pod_with_its_pod_template() -> None:
    template = {
        "metadata": {"labels": {"team": "search"}, "annotations": {"sidecar.io/inject": "false"}},
        "spec": {
            "priorityClassName": "batch-low",
            "securityContext": {"runAsUser": 20001, "runAsGroup": 20001},
        },
    }
    job = eval_job(spec_with({"configMap": "tiny-eval", "key": "eval.txt"}, podTemplate=template))
    pod_template = job["spec"]["template"]
    pod = pod_template["spec"]
    assert pod["priorityClassName"] == "batch-low"
    assert pod["securityContext"]["runAsUser"] == 20001
    assert pod["securityContext"]["runAsNonRoot"] is True  # the generated fields stay
    assert pod_template["metadata"]["annotations"] == {"sidecar.io/inject": "false"}
    labels = pod_template["metadata"]["labels"]
    assert labels["team"] == "search" and labels[quality_job.LABEL_EVAL] == job["metadata"]["name"]
    assert [c["name"] for c in pod["containers"]] == ["eval"]
    assert pod["restartPolicy"] == "Never"


def test_measurements_are_keyed_by_content_for_a_config_map_and_by_uri_otherwise() -> None:
    config_map = api.EvalDataset.model_validate({"configMap": "tiny-eval", "key": "eval.txt"})
    assert admission.dataset_key(config_map, DIGEST) == DIGEST
    s3 = api.EvalDataset.model_validate({"uri": "s3://evals/tiny/eval.txt"})
    other = api.EvalDataset.model_validate({"uri": "s3://evals/tiny/eval-v2.txt"})
    key = admission.dataset_key(s3)
    assert key == admission.dataset_key(s3, "ignored: only the Job reads it")
    assert key.startswith("uri-") and key != admission.dataset_key(other)
    record = admission.record_key("int8", "perplexity", key)
    assert record == f"int8.perplexity.{key}"
    first = eval_job(spec_with({"uri": "s3://evals/tiny/eval.txt"}), key)
    second = eval_job(
        spec_with({"uri": "s3://evals/tiny/eval-v2.txt"}), admission.dataset_key(other)
    )
    assert first["metadata"]["name"] != second["metadata"]["name"]


def test_a_uri_datasets_measurement_records_the_content_digest_the_job_reported() -> None:
    from tests.support.quality_fixtures import job, summary_pod

    s = spec_with({"uri": "s3://evals/tiny/eval.txt"})
    key = admission.dataset_key(s.quantization.evaluation.dataset)  # type: ignore[union-attr]
    run = admission.EvalRun(job("Complete"), [summary_pod("int8", 141.0, 0.004)])
    name = quality_job.job_name(s.model.uri, "int8", "perplexity", key)
    observed = admission.Observed(key, runs={name: run})
    verdict = admission.assess(md(md_spec()), s, observed, reference(), CONFIG, "now")
    (measured,) = [m for m in verdict.measurements if m.level == "int8"]
    assert measured.dataset_digest == DIGEST  # the summary's content digest, not the URI key
    assert list(verdict.new_records) == [admission.record_key("int8", "perplexity", key)]


@pytest.mark.parametrize(
    ("attempt", "seconds"),
    [(1, 600), (2, 1200), (3, 2400), (6, 19200), (7, 21600), (12, 21600)],
)
def test_each_failed_job_waits_twice_as_long_capped(attempt: int, seconds: int) -> None:
    assert quality_job.retry_delay_seconds(attempt) == seconds


def test_a_failed_measurement_is_retried_later_each_time_never_in_a_tight_loop() -> None:
    from tests.support.quality_fixtures import failed_pod, job

    s = spec_with({"configMap": "tiny-eval", "key": "eval.txt"}, allowed=("int8",))
    failures = admission.failure_key("int8", "perplexity", DIGEST)
    # Two Jobs failed and expired: the third is made, and stays 40 min if it fails too.
    observed = admission.Observed(DIGEST, records={failures: "2"})
    (third,) = admission.assess(
        md(md_spec()), s, observed, reference(), CONFIG, "now"
    ).jobs_to_create
    assert third["metadata"]["annotations"][quality_job.ANNOTATION_ATTEMPT] == "3"
    assert third["spec"]["ttlSecondsAfterFinished"] == 2400
    # It failed: counted, no new Job while it stays, its log tail and the wait in the condition.
    failed = job("Failed")
    failed["metadata"]["annotations"][quality_job.ANNOTATION_ATTEMPT] = "3"
    name = third["metadata"]["name"]
    runs = {name: admission.EvalRun(failed, [failed_pod("t", "Traceback\nCUDA error: no device")])}
    observed = admission.Observed(DIGEST, records={failures: "2"}, runs=runs)
    verdict = admission.assess(md(md_spec()), s, observed, reference(), CONFIG, "now")
    assert verdict.jobs_to_create == () and verdict.new_records == {failures: "3"}
    assert verdict.condition is not None and verdict.condition.reason == "EvalFailed"
    message = verdict.condition.message
    assert "CUDA error: no device [attempt 3, next in 40 min]" in message
    assert "the wait doubles" in message
