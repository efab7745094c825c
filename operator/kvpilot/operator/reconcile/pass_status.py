"""The status one pass writes (`build_status`: plan, replicas, conditions over the old ones,
endpoint, caches, quality) and what in it is news: the FallbacksResolved condition and its Warning
Event, and whether the plan changed (worth an Event).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.quality import admission
from kvpilot.operator.reconcile import conditions, manifests, typed_status
from kvpilot.operator.reconcile.pass_types import Desired, Obj

FALLBACKS_RESOLVED = "FallbacksResolved"


def fallbacks_condition(desired: Desired, generation: int) -> api.Condition | None:
    """FallbacksResolved: whether every ModelDeployment named as a fallback exists in the
    namespace (the gateway skips a missing one); None without ModelDeployment fallbacks."""
    if not desired.fallback_names:
        return None
    missing = desired.missing_fallbacks
    found = f"{len(desired.fallback_names) - len(missing)}/{len(desired.fallback_names)}"
    message = f"{found} fallback ModelDeployments found"
    if missing:
        message = f"{message}; missing: {', '.join(missing)} (create them or edit spec.routing)"
    return api.Condition(
        type=FALLBACKS_RESOLVED,
        status="False" if missing else "True",
        reason="FallbackMissing" if missing else "FallbacksFound",
        message=message,
        observed_generation=generation,
    )


def fallbacks_news(status: api.ModelDeploymentStatus, desired: Desired) -> str | None:
    """The Warning Event text when this pass finds fallbacks missing that the last did not."""
    if not desired.missing_fallbacks:
        return None
    old = conditions.find(status.conditions, FALLBACKS_RESOLVED)
    fresh = fallbacks_condition(desired, 0)
    if old is not None and fresh is not None and old.message == fresh.message:
        return None
    names = ", ".join(desired.missing_fallbacks)
    return f"spec.routing.fallbacks name missing ModelDeployments: {names}"


# What a pass writes (a merge patch leaves the rest): autoscaling and cost are the autoscaler
# loop's; cache and quality are written only when the pass has something to say about them.
PASS_FIELDS = frozenset(
    {
        "observed_generation",
        "conditions",
        "plan",
        "replicas",
        "ready_replicas",
        "selector",
        "quantization",
        "endpoint",
        "cache",
        "variant_caches",
    }
)


def build_status(
    md: Obj,
    old: api.ModelDeploymentStatus,
    desired: Desired,
    deployments: Sequence[Obj],
    config: OperatorConfig,
    now: str,
) -> dict[str, Any]:
    """The status of this pass in wire form, over `old` (the status the pass started from)."""
    meta = md["metadata"]
    generation = int(meta.get("generation", 0))
    rollout = conditions.summarize(deployments)
    verdict = desired.quality
    measuring = verdict.condition if verdict is not None else None
    status = api.ModelDeploymentStatus(
        observed_generation=generation,
        conditions=_merged_conditions(old, desired, rollout, generation, now),
        plan=list(desired.plan),
        replicas=rollout.replicas,
        ready_replicas=rollout.ready,
        selector=",".join(f"{k}={v}" for k, v in manifests.selector_labels(meta["name"]).items()),
        quantization=desired.quantization,
        endpoint=manifests.endpoint(md, config) if desired.error is None else "",
        cache=desired.cache,
        variant_caches=list(desired.variant_caches),
        quality=list(verdict.measurements) if verdict is not None and measuring else [],
    )
    return typed_status.wire(status, include=PASS_FIELDS | ({"quality"} if measuring else set()))


def _merged_conditions(
    old: api.ModelDeploymentStatus,
    desired: Desired,
    rollout: conditions.Rollout,
    generation: int,
    now: str,
) -> list[api.Condition]:
    """This pass's conditions merged over the old ones (transition times kept where unchanged);
    the autoscaler's stay as they are."""
    new = conditions.compute(
        desired.error,
        desired.summary,
        rollout,
        desired.num_unplaceable,
        generation,
        desired.pod_problems,
        desired.serving_cache,
    )
    routing = fallbacks_condition(desired, generation)
    new += [routing] if routing is not None else []
    measuring = desired.quality.condition if desired.quality is not None else None
    if measuring is not None:
        new.append(measuring.model_copy(update={"observed_generation": generation}))
    return [
        c
        for c in conditions.merge(old.conditions, new, now)
        if (c.type != FALLBACKS_RESOLVED or routing is not None)  # fallbacks removed: so is it
        and (c.type != admission.QUALITY_MEASURED or measuring is not None)  # so is an eval set
    ]


def plan_changed(status: api.ModelDeploymentStatus, desired: Desired) -> bool:
    """Whether this pass changes the plan in status, or fails anew: worth a Kubernetes Event."""
    if desired.error is not None:
        planned = conditions.find(status.conditions, conditions.PLANNED)
        return planned is None or planned.message != desired.error
    return [_plan_key(e) for e in status.plan] != [_plan_key(e) for e in desired.plan]


def _plan_key(entry: api.PlanEntry) -> tuple[str, bool, str, int, int]:
    """What makes two plans differ for the user: where, at what level and size, how many."""
    return (
        entry.node_type,
        entry.fits,
        entry.quantization,
        entry.tensor_parallel,
        entry.replicas,
    )
