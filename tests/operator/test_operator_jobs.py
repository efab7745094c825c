"""The operator's batch/v1 Jobs share one shape (reconcile/jobs.py): the model cache's fill Job,
an adapter's fill Job and a quality eval Job, each as the cluster accepts it, its labels on the Job
and its pods, owners and TTL where each has them, a pod that never restarts in place, and one
container that runs a `kvpilot-runtime` subcommand through the image's entrypoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest

from kvpilot.operator import api
from kvpilot.operator.adapters import cache_fill
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import jobs, manifests, model_cache
from tests.support.quality_fixtures import CONFIG, DIGEST, md, md_spec, reference

MANAGED = {manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY}


def cached_spec(delete_with_model: bool) -> tuple[dict[str, Any], api.ModelDeploymentSpec]:
    raw = md_spec()
    raw["model"].update(cache={"deleteWithModel": delete_with_model}, secretRef={"name": "hf"})
    raw["lora"] = {"maxLoras": 2, "maxLoraRank": 16}
    raw["adapters"] = [{"name": "sql", "uri": "s3://loras/sql"}]
    return md(raw), api.parse_spec(raw)


def fill_job(delete_with_model: bool = False) -> dict[str, Any]:
    obj, spec = cached_spec(delete_with_model)
    return model_cache.build_fill_job(obj, spec, reference(), CONFIG)


def adapter_job(delete_with_model: bool = False) -> dict[str, Any]:
    obj, spec = cached_spec(delete_with_model)
    return cache_fill.build_job(obj, spec, "s3://loras/sql", fill_job(delete_with_model))


def eval_job(attempt: int = 1) -> dict[str, Any]:
    evaluation = {"dataset": {"uri": "s3://evals/e.txt"}, "metric": "perplexity"}
    raw = md_spec(evaluation={**evaluation, "maxQualityLoss": 1})
    raw["model"]["secretRef"] = {"name": "hf"}
    spec = api.parse_spec(raw)
    return quality_job.build_eval_job(md(raw), spec, "int8", reference(), DIGEST, CONFIG, attempt)


OWNED = [{"kind": "ModelDeployment", "name": "tiny", "uid": "u1", "controller": False}]
CACHE, ADAPTER = [model_cache.LABEL_CACHE], [cache_fill.LABEL_ADAPTER_CACHE]
EVAL = [quality_job.LABEL_EVAL, quality_job.LABEL_CACHE]

# build, labels on the Job and its pods (besides managed-by), backoffLimit, TTL, owners (None: the
# key is absent), the container's name and the subcommand it runs
CASES: list[tuple[Callable[[], dict[str, Any]], list[str], int, int | None, Any, str, str]] = [
    (fill_job, CACHE, 4, None, [], "fetch-model", "fetch"),
    (lambda: fill_job(True), CACHE, 4, None, OWNED, "fetch-model", "fetch"),
    (adapter_job, ADAPTER, 4, None, [], "fetch-adapter", "fetch"),
    (lambda: adapter_job(True), ADAPTER, 4, None, OWNED, "fetch-adapter", "fetch"),
    (eval_job, EVAL, 2, 600, None, "eval", "eval"),
    (lambda: eval_job(3), EVAL, 2, 2400, None, "eval", "eval"),
]


@pytest.mark.parametrize(("build", "labels", "backoff", "ttl", "owners", "name", "command"), CASES)
def test_each_job_has_the_shared_shape(
    build: Callable[[], dict[str, Any]],
    labels: list[str],
    backoff: int,
    ttl: int | None,
    owners: Any,
    name: str,
    command: str,
) -> None:
    job = build()
    kubernetes_validate.validate(job, "1.37.0", strict=True)
    meta, spec = job["metadata"], job["spec"]
    assert (job["apiVersion"], job["kind"], meta["namespace"]) == ("batch/v1", "Job", "ns")
    assert (
        sorted(meta["labels"]) == sorted([*labels, *MANAGED])
        and MANAGED.items() <= meta["labels"].items()
    )
    pod_labels = spec["template"]["metadata"]["labels"]
    assert {k: meta["labels"][k] for k in labels}.items() <= pod_labels.items()
    assert spec["backoffLimit"] == backoff and spec.get("ttlSecondsAfterFinished") == ttl
    found_owners = meta.get("ownerReferences")
    assert (found_owners is None) == (owners is None)
    assert [
        {k: o[k] for k in ("kind", "name", "uid", "controller")} for o in found_owners or []
    ] == (owners or [])
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["name"] == name and "command" not in container  # the image's tini runs it
    assert (
        container["args"][0] == command
        and "--summary-file=/dev/termination-log" in container["args"]
    )
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["envFrom"] == [{"secretRef": {"name": "hf"}}]  # fetched with the Secret
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    # a fill Job lands on the reference node type's nodes without asking for a GPU
    assert pod["nodeSelector"] == reference().node_type.node_selector
    assert ("nvidia.com/gpu" in str(container.get("resources"))) == (command == "eval")  # fmt: skip


META = ["name", "namespace", "labels", "annotations"]


@pytest.mark.parametrize(
    ("owners", "ttl", "meta_keys", "spec_keys"),
    [
        (None, None, META, ["backoffLimit", "template"]),
        ([], None, [*META, "ownerReferences"], ["backoffLimit", "template"]),
        (None, 60, META, ["backoffLimit", "ttlSecondsAfterFinished", "template"]),
    ],
)
def test_build_job_leaves_out_what_it_is_not_given(
    owners: list[dict[str, Any]] | None, ttl: int | None, meta_keys: list[str], spec_keys: list[str]
) -> None:
    template = {"spec": {"containers": [{"name": "c", "image": "i"}]}}
    job = jobs.build_job(
        "j", "ns", {"a": "1"}, {}, template, backoff_limit=1, owners=owners, ttl_seconds=ttl
    )
    assert list(job["metadata"]) == meta_keys and list(job["spec"]) == spec_keys


def test_build_job_puts_its_labels_over_the_templates_and_never_restarts_in_place() -> None:
    template: dict[str, Any] = {
        "metadata": {"labels": {"team": "a", "k": "theirs"}, "annotations": {"x": "y"}},
        "spec": {"restartPolicy": "Always", "containers": [{"name": "c", "image": "i"}]},
    }
    job = jobs.build_job("j", "ns", {"k": "ours"}, {"n": "v"}, template, backoff_limit=3)
    assert job["metadata"]["labels"] == {"k": "ours", **MANAGED}
    assert job["metadata"]["annotations"] == {"n": "v"}
    pod_template = job["spec"]["template"]
    assert pod_template["metadata"] == {
        "labels": {"team": "a", "k": "ours"},
        "annotations": {"x": "y"},
    }
    assert pod_template["spec"]["restartPolicy"] == "Never"
    assert template["metadata"]["labels"]["k"] == "theirs"  # the caller's template is not changed
