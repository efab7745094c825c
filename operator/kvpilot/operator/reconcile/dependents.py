"""Which ModelDeployments depend on another object, found in the operator's index of them (pure).

An event on a fallback target, the InferencePool CRD, a model cache's fill Job or an eval Job
asks for a pass of every ModelDeployment that refers to it. The operator keeps the
ModelDeployments' specs in a kopf index, so finding them costs no LIST: in a burst of 200
creates, listing the namespace on every ADDED event was a third of the operator's CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import manifests

Obj = Mapping[str, Any]
Key = tuple[str, str]


def indexed(namespace: str, name: str, spec: Obj) -> dict[str, Any]:
    """What the index keeps of a ModelDeployment: its name and spec."""
    return {"metadata": {"namespace": namespace, "name": name}, "spec": dict(spec)}


def _key(md: Obj) -> Key:
    return md["metadata"]["namespace"], md["metadata"]["name"]


def _spec(md: Obj, *path: str) -> Any:
    value: Any = md.get("spec") or {}
    for step in path:
        value = (value or {}).get(step)
    return value


def fallback_users(mds: Iterable[Obj], namespace: str, name: str) -> list[Key]:
    """The ModelDeployments in `namespace` whose spec.routing falls back to `name`."""
    return [
        _key(md)
        for md in mds
        if md["metadata"]["namespace"] == namespace
        and any(f.get("modelDeployment") == name for f in _spec(md, "routing", "fallbacks") or [])
    ]


def pool_users(mds: Iterable[Obj]) -> list[Key]:
    """Every ModelDeployment whose spec asks for an InferencePool."""
    return [_key(md) for md in mds if _spec(md, "routing", "endpointPickerRef")]


def cache_users(mds: Iterable[Obj], namespace: str, claim: str) -> list[Key]:
    """The ModelDeployments in `namespace` with a model cache `claim`: spec.model's or a
    variant's (each cached under its own URI)."""
    return [
        _key(md)
        for md in mds
        if md["metadata"]["namespace"] == namespace
        and _spec(md, "model", "cache") is not None
        and claim in {manifests.cache_claim_name(uri) for uri in _cached_uris(md)}
    ]


def _cached_uris(md: Obj) -> list[str]:
    variants = _spec(md, "model", "variants") or []
    return [_spec(md, "model", "uri"), *(v.get("uri", "") for v in variants)]


def eval_users(mds: Iterable[Obj], namespace: str, cache: str) -> list[Key]:
    """The ModelDeployments in `namespace` with an eval set whose measurements live in `cache`."""
    return [
        _key(md)
        for md in mds
        if md["metadata"]["namespace"] == namespace
        and _spec(md, "quantization", "evaluation")
        and _spec(md, "model", "uri")
        and quality_job.cache_name(_spec(md, "model", "uri")) == cache
    ]
