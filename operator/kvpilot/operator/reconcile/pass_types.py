"""What one reconcile pass reads (`Observed`: the cluster's node types, what each model source's
config.json held, the caches, the quality side's reads) and what it decides (`Desired`: children,
plan, status inputs). desired_state.desire maps the one to the other; the controller fills
`Observed` and applies `Desired`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.contract.memory import ModelFacts
from kvpilot.operator import api
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.quality import admission
from kvpilot.operator.reconcile import manifests, typed_status

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Desired:
    children: list[manifests.Manifest] = field(default_factory=list)
    plan: list[api.PlanEntry] = field(default_factory=list)
    summary: str = ""
    error: str | None = None  # set when nothing can run; the pass still writes status
    is_invalid_spec: bool = False  # the user must change the spec; retrying cannot help
    needs_retry: bool = False  # a source could not be read now; a later pass may succeed
    num_unplaceable: int = 0
    quantization: str = ""
    pod_problems: tuple[str, ...] = ()  # conditions.pod_problem of this ModelDeployment's pods
    # The model caches' claims and fill Jobs (spec.model's and each variant's), created if
    # absent and never patched (reconcile/model_cache.py)
    cache_children: list[manifests.Manifest] = field(default_factory=list)
    cache: api.CacheStatus | None = None  # spec.model's (status.cache)
    variant_caches: tuple[api.CacheStatus, ...] = ()  # each variant's (status.variantCaches)
    # The cache the conditions report: the first not Cached of those a fitting node type serves
    serving_cache: api.CacheStatus | None = None
    # Set by the controller from what it read, by claim name: the fill Job is absent (create the
    # cache), or exists without this ModelDeployment among its owners while deleteWithModel
    # asks for it.
    caches_missing: frozenset[str] = frozenset()
    caches_needing_owner: frozenset[str] = frozenset()
    # spec.routing's ModelDeployment fallbacks, and those of them the controller did not find
    fallback_names: tuple[str, ...] = ()
    missing_fallbacks: tuple[str, ...] = ()
    # spec.quantization.evaluation's verdict and the eval Jobs and records it asks for
    quality: admission.Assessment | None = None
    # Set by the controller on a new object's first pass, which applied only these Deployments
    # (by (kind, name), as sent): a finishing pass is due.
    applied_first: Mapping[tuple[str, str], Obj] | None = None


@dataclass(frozen=True)
class Unservable:
    """A source that was read and holds a checkpoint the runtime would refuse (e.g. 3-bit AWQ):
    the spec is invalid until it names another, and `reason` names the field."""

    reason: str


# What the operator read from a source's config.json: its facts, why it could not be read (read
# again later), or why its checkpoint cannot be served (for good).
Read = ModelFacts | str | Unservable


@dataclass(frozen=True, kw_only=True)
class Observed:
    """What one pass read before deciding anything: all `desire` needs besides the
    ModelDeployment and the operator's config. The controller reads it from the cluster and the
    model's sources; tests write it. Its `quality` field holds an `admission.Observed`, the eval
    side's own (smaller) part of it."""

    # The cluster's GPU node types, with the GPUs free on each node for this ModelDeployment
    # (inventory.discover: its own pods' GPUs count as free).
    node_types: tuple[NodeType, ...]
    # Whether the cluster has the PodMonitor CRD (spec.monitoring.podMonitor makes one only
    # then) and the InferencePool CRD (spec.routing.endpointPickerRef makes a pool only then);
    # the controller asks only when the spec wants one.
    has_pod_monitor_crd: bool = False
    has_inference_pool_crd: bool = False
    # What the operator read from the model's config.json, or why it could not (then the plan
    # fails for now and the pass is retried); None when there was nothing to read (the spec or
    # the catalog has the facts).
    source_facts: Read | None = None
    # As `source_facts`, for the speculative draft model the spec may name.
    draft_facts: Read | None = None
    # As `source_facts`, per spec.model.variants[] name (always read: a catalog entry does not
    # say how a checkpoint is quantised).
    variant_facts: Mapping[str, Read] = field(default_factory=dict)
    # The model cache as its fill Job reports it, and each variant's by name; a node type's
    # replicas wait at zero until the cache of what it serves is Cached.
    cache: api.CacheStatus | None = None
    variant_caches: Mapping[str, api.CacheStatus] = field(default_factory=dict)
    # The eval set's digest, cached measurements and eval Jobs (spec.quantization.evaluation);
    # None before anything was read (the category decides the levels).
    quality: admission.Observed | None = None
    # The pass's time (RFC 3339): a measurement whose eval Job gives no completion time has it.
    now: str = ""
    # The object's status as parsed where it came in (the autoscaler's decision, measured
    # cost); EMPTY for one never reconciled.
    status: api.ModelDeploymentStatus = typed_status.EMPTY
