"""Adapters through the model cache: with spec.model.cache, each hf:// or s3:// adapter is
fetched once into the cache's claim (`.adapters/<entry>`, contract/adapter_cache.py) by a Job,
and the pods, which mount the claim and run with --lora-cache-dir, read it from there instead of
each fetching it. Pure: the adapter sync (sync.py) creates the Jobs and loads an adapter only
once its Job is Complete.

A Job per adapter URI and claim (`<claim>-lora-<entry>`), so ModelDeployments sharing a cache
share its adapters' fetches too. Created once and never patched, as the model's fill Job; it
runs where the model's fill Job ran (its node selector and tolerations), so a ReadWriteOnce or
zonal claim is reachable, and it is made only once that Job exists. Owned as the cache is
(`deleteWithModel`); an adapter removed from the spec leaves its entry in the cache, as a
model left by its last user does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.contract.adapter_cache import CACHE_SUBDIR, entry_name
from kvpilot.contract.model_source import parse_model_uri
from kvpilot.operator import api
from kvpilot.operator.reconcile import jobs, manifests, model_cache

Obj = Mapping[str, Any]
# On an adapter fill Job and its pods: the claim it fills (not model_cache.LABEL_CACHE, whose
# pods the model cache's status reads).
LABEL_ADAPTER_CACHE = "kvpilot.dev/adapter-cache"
ANNOTATION_ADAPTER_URI = "kvpilot.dev/adapter-uri"


def uses_cache(spec: api.ModelDeploymentSpec) -> bool:
    return spec.model.cache is not None and spec.lora_enabled


def is_fetched(uri: str) -> bool:
    return parse_model_uri(uri).is_fetched


def cached_uris(spec: api.ModelDeploymentSpec) -> list[str]:
    """The adapter URIs that go through the cache (file:// and pvc:// are read where they are)."""
    if not uses_cache(spec):
        return []
    return list(dict.fromkeys(a.uri for a in spec.adapters if is_fetched(a.uri)))


def claim_of(spec: api.ModelDeploymentSpec) -> str:
    return manifests.cache_claim_name(spec.model.uri)


def job_name(claim: str, uri: str) -> str:
    return f"{claim}-lora-{entry_name(uri)}"


def build_job(md: Obj, spec: api.ModelDeploymentSpec, uri: str, model_job: Obj) -> dict[str, Any]:
    """The Job that fetches adapter `uri` into the cache, beside the model's fill Job
    (`model_job`), with the Secret the adapter is fetched with."""
    claim = claim_of(spec)
    name = job_name(claim, uri)
    fetch = _fetch_container(spec, uri, model_job)
    pod = copy.deepcopy(dict(model_job["spec"]["template"]["spec"]))
    pod["containers"] = [fetch]
    return jobs.build_job(
        name,
        md["metadata"]["namespace"],
        {LABEL_ADAPTER_CACHE: claim},
        {ANNOTATION_ADAPTER_URI: uri},
        {"spec": pod},  # not the model Job's pod labels, which model_cache.status reads by
        backoff_limit=model_cache.FILL_BACKOFF_LIMIT,
        owners=model_cache.owner_references(md, _cache(spec)),
    )


def _fetch_container(spec: api.ModelDeploymentSpec, uri: str, model_job: Obj) -> dict[str, Any]:
    """The model fill Job's fetch container (image, mounts, security), fetching the adapter
    into its entry with the adapter's Secret instead."""
    model_fetch = model_job["spec"]["template"]["spec"]["containers"][0]
    container = copy.deepcopy(dict(model_fetch))
    container["name"] = "fetch-adapter"
    to = f"{manifests.MODEL_MOUNT}/{CACHE_SUBDIR}/{entry_name(uri)}"
    container["args"] = [
        "fetch",
        f"--model={uri}",
        f"--to={to}",
        "--summary-file=/dev/termination-log",
    ]
    container.pop("envFrom", None)
    secret = secret_of(spec, uri)
    if secret is not None:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    return container


def secret_of(spec: api.ModelDeploymentSpec, uri: str) -> str | None:
    """The Secret the (first) adapter of this URI is fetched with: its own, else spec.model's."""
    adapter = next(a for a in spec.adapters if a.uri == uri)
    ref = adapter.secret_ref or spec.model.secret_ref
    return None if ref is None else ref.name


@dataclass(frozen=True)
class Gate:
    """The spec's adapters split by the cache: `ready` (name -> URI) may be loaded now;
    `waiting` (name -> why not yet) are being fetched, or their fetch failed (`failed`)."""

    ready: dict[str, str]
    waiting: dict[str, str]
    failed: frozenset[str]


def gate(
    want: Mapping[str, str], cached: Sequence[str], jobs: Mapping[str, Obj], claim: str
) -> Gate:
    """Which adapters a pod may load: those not cached at once, cached ones once their Job is
    Complete (`jobs`: Job name -> Job)."""
    ready, waiting, failed = {}, {}, set()
    for name, uri in want.items():
        if uri not in cached:
            ready[name] = uri
            continue
        job_id = job_name(claim, uri)
        finished = _finished(jobs.get(job_id))
        if "Complete" in finished:
            ready[name] = uri
        elif "Failed" in finished:
            waiting[name] = (
                f"fetch into the model cache failed (Job {job_id}): {finished['Failed']}"
            )
            failed.add(name)
        else:
            waiting[name] = f"being fetched into the model cache (Job {job_id})"
    return Gate(ready, waiting, frozenset(failed))


def _finished(job: Obj | None) -> dict[str, str]:
    """The Job's true Complete/Failed conditions: type -> message."""
    if job is None:
        return {}
    found = (job.get("status") or {}).get("conditions") or []
    return {
        c["type"]: c.get("message") or c.get("reason") or ""
        for c in found
        if c.get("status") == "True" and c.get("type") in ("Complete", "Failed")
    }


def _cache(spec: api.ModelDeploymentSpec) -> api.ModelCache:
    if spec.model.cache is None:
        raise ValueError("spec.model.cache is not set")
    return spec.model.cache
