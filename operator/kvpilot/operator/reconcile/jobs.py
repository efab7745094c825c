"""The one shape of the operator's batch/v1 Jobs: the model cache's fill Job (model_cache.py), the
adapters' fill Jobs (adapters/cache_fill.py) and the quality eval Jobs (quality/job.py). Pure.

Each runs one `kvpilot-runtime` subcommand to completion in a pod that never restarts in place
(the Job controller retries with a new pod, whose log says why the last one failed). Their
containers come from `manifests.task_container`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpilot.operator.reconcile import manifests


def build_job(
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    template: Mapping[str, Any],
    *,
    backoff_limit: int,
    owners: Sequence[Mapping[str, Any]] | None = None,
    ttl_seconds: int | None = None,
) -> manifests.Manifest:
    """A Job `name` running `template` (its pod: metadata, spec) with `restartPolicy: Never`.
    `labels` go on the Job (with the managed-by label) and on its pods, over the template's own,
    so a watch or list finds either. `owners`: its ownerReferences (None: the key is left out;
    Jobs shared between ModelDeployments have none). `ttl_seconds`: ttlSecondsAfterFinished."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {**labels, manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY},
        "annotations": dict(annotations),
    }
    if owners is not None:
        metadata["ownerReferences"] = [dict(o) for o in owners]
    spec: dict[str, Any] = {"backoffLimit": backoff_limit}
    if ttl_seconds is not None:
        spec["ttlSecondsAfterFinished"] = ttl_seconds
    spec["template"] = _pod_template(template, labels)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


def _pod_template(template: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
    metadata = dict(template.get("metadata") or {})
    metadata["labels"] = {**metadata.get("labels", {}), **labels}
    pod = {k: v for k, v in template["spec"].items() if k != "restartPolicy"}
    # Never, not OnFailure: a failed attempt's pod stays, so its log tail can be read back.
    return {"metadata": metadata, "spec": {"restartPolicy": "Never", **pod}}
