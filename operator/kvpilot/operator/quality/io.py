"""The API side of admission.py: reads the eval set, the measurement cache and the eval Jobs for a
pass, and writes what the pass decided (records first, then Jobs made and finished Jobs deleted).

The cache is a ConfigMap per model in the namespace, not owned by a ModelDeployment: like the
model cache it outlives them (a measurement costs a GPU for minutes), and `kubectl delete cm -l
kvpilot.dev/quality-cache` forgets it. Each pass merges only its new keys into it, so
ModelDeployments sharing it never drop each other's records.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from typing import Any

from kubernetes import client as k8s_client

from kvpilot.contract import k8s
from kvpilot.operator import api
from kvpilot.operator.quality import admission
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import manifests

Obj = Mapping[str, Any]
log = logging.getLogger(__name__)


def observe(
    client: k8s_client.ApiClient, md: Obj, spec: api.ModelDeploymentSpec | None
) -> admission.Observed | None:
    """What this pass needs to judge quality; None without an eval set (or with a spec
    desire reports as invalid: `spec` None)."""
    if spec is None:
        return None
    evaluation = spec.quantization.evaluation
    if evaluation is None:
        return None
    namespace = md["metadata"]["namespace"]
    # An hf://, s3:// or pvc:// file only the Job reads (and, when it cannot, fails saying why).
    is_read_here = evaluation.dataset.uri is None
    data = read_dataset(client, namespace, evaluation.dataset) if is_read_here else b""
    if isinstance(data, str):
        return admission.Observed(dataset_error=data)
    digest = admission.dataset_key(evaluation.dataset, admission.dataset_digest(data))
    cache = quality_job.cache_name(spec.model.uri)
    found = k8s.get(client, "v1", "ConfigMap", namespace, cache)
    records = dict((found or {}).get("data") or {})
    runs = eval_runs(client, namespace, cache)
    return admission.Observed(dataset_key=digest, records=records, runs=runs)


def eval_runs(
    client: k8s_client.ApiClient, namespace: str, cache: str
) -> dict[str, admission.EvalRun]:
    """The eval Jobs of this model (and their pods), by Job name: the pass looks up the ones it
    needs by the name of what they measure (quality_job.job_name)."""
    selector = f"{quality_job.LABEL_CACHE}={cache}"
    jobs = k8s.list_objects(client, "batch/v1", "Job", namespace, selector)
    pods = k8s.list_objects(client, "v1", "Pod", namespace, selector)
    pods_of: dict[str, list[Obj]] = {}
    for pod in pods:
        job_name = (pod["metadata"].get("labels") or {}).get(quality_job.LABEL_EVAL, "")
        pods_of.setdefault(job_name, []).append(pod)
    by_name = {job["metadata"]["name"]: job for job in jobs}
    return {name: admission.EvalRun(job, pods_of.get(name, [])) for name, job in by_name.items()}


def read_dataset(
    client: k8s_client.ApiClient, namespace: str, dataset: api.EvalDataset
) -> bytes | str:
    """The eval set's bytes, as the Job will see them mounted, or what is wrong with it."""
    if dataset.config_map is None or dataset.key is None:
        raise ValueError("the dataset is not a ConfigMap key; only its eval Job reads it")
    where = f"spec.quantization.evaluation.dataset: ConfigMap {namespace}/{dataset.config_map}"
    found = k8s.get(client, "v1", "ConfigMap", namespace, dataset.config_map)
    if found is None:
        return f"{where} not found; create it with the eval set under key {dataset.key}"
    text = (found.get("data") or {}).get(dataset.key)
    binary = (found.get("binaryData") or {}).get(dataset.key)
    if text is None and binary is None:
        keys = sorted({*(found.get("data") or {}), *(found.get("binaryData") or {})})
        return f"{where} has no key {dataset.key} (keys: {', '.join(keys) or 'none'})"
    data = text.encode() if text is not None else base64.b64decode(binary or "")
    if not data.strip():
        return f"{where} key {dataset.key} is empty; put the eval set there"
    return data


def apply(client: k8s_client.ApiClient, md: Obj, verdict: admission.Assessment | None) -> None:
    if verdict is None:
        return
    if verdict.new_records:
        write_records(client, md, verdict)
    for job in verdict.jobs_to_create:
        if k8s.create(client, job) is not None:
            log.info(
                "eval Job %s/%s created", job["metadata"]["namespace"], job["metadata"]["name"]
            )
    for done in verdict.jobs_to_delete:  # measured and recorded: the Job has nothing left to say
        k8s.delete(client, done)


def write_records(client: k8s_client.ApiClient, md: Obj, verdict: admission.Assessment) -> None:
    """Merge the new measurements into the model's cache ConfigMap, creating it if absent."""
    spec = api.parse_spec(md.get("spec") or {})
    name, namespace = quality_job.cache_name(spec.model.uri), md["metadata"]["namespace"]
    cache = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                quality_job.LABEL_CACHE: name,
                manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY,
            },
            "annotations": {"kvpilot.dev/model-uri": spec.model.uri},
        },
        "data": dict(verdict.new_records),
    }
    if k8s.create(client, cache) is None:  # exists: add the keys, keep the others
        k8s.merge_patch(client, cache, {"data": dict(verdict.new_records)})
