"""One reconcile pass as pure functions: ModelDeployment + inventory -> children + status.

KubeAI's "plan then execute": `desire` decides everything (plan, replicas per node type, manifests)
without touching the API; `handlers`/`k8s` then apply it; `build_status` turns the outcome and the
Deployments' progress into the status written once per pass.

This module owns `desire` (the plan request, the quality verdict, replicas, children) and the
children a pass no longer wants; what a pass reads and decides is pass_types.py's, the checks that
make a spec unservable source_checks.py's, the status pass_status.py's, and when a watch event
asks for a pass pass_triggers.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from kvpilot.contract import catalog
from kvpilot.contract.memory import ModelFacts
from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import model_facts, planner
from kvpilot.operator.quality import admission
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.quality import variants as quality_variants
from kvpilot.operator.reconcile import manifests, model_cache

# What a pass reads and decides (pass_types.py), its checks (source_checks.py), its status
# (pass_status.py) and its triggers (pass_triggers.py) are this module's API too: callers name
# them as desired_state.X.
from kvpilot.operator.reconcile.pass_status import (
    FALLBACKS_RESOLVED,
    PASS_FIELDS,
    build_status,
    fallbacks_condition,
    fallbacks_news,
    plan_changed,
)
from kvpilot.operator.reconcile.pass_triggers import needs_full_pass, scale_pending, spec_unapplied
from kvpilot.operator.reconcile.pass_types import Desired, Obj, Observed, Read, Unservable
from kvpilot.operator.reconcile.source_checks import check_prequantized, variants

__all__ = [
    "FALLBACKS_RESOLVED",
    "PASS_FIELDS",
    "ConfigMapUnreadError",
    "Desired",
    "Obj",
    "Observed",
    "Read",
    "Unservable",
    "build_status",
    "check_prequantized",
    "desire",
    "fallback_deployments",
    "fallbacks_condition",
    "fallbacks_news",
    "gated_candidates",
    "may_have_dropped",
    "may_have_dropped_pod_monitor",
    "measured_cost",
    "model_facts_of",
    "needs_full_pass",
    "plan_changed",
    "scale_pending",
    "spec_unapplied",
    "stale_children",
    "variants",
]


def desire(md: Obj, config: OperatorConfig, observed: Observed) -> Desired:
    """Everything one pass decides for `md` (plan, replicas per node type, children, quality
    verdict) from what it `observed`; touches no API."""
    sources = (observed.source_facts, observed.draft_facts, *observed.variant_facts.values())
    unservable = [s.reason for s in sources if isinstance(s, Unservable)]
    if unservable:
        return Desired(error="; ".join(unservable), is_invalid_spec=True)
    try:
        spec = api.parse_spec(md.get("spec") or {})
        api.check_routing(md["metadata"]["name"], spec)
        facts = model_facts_of(spec, observed.source_facts)
        check_prequantized(spec, facts)
        draft = _draft(spec, observed.draft_facts)
        request = planner.PlanRequest.from_spec(spec, facts, draft=draft)
        request = dataclasses.replace(request, variants=variants(spec, facts, observed))
    except ConfigMapUnreadError as error:
        return Desired(error=_one_line(error), needs_retry=True)
    except (ValidationError, ValueError) as error:
        unread = [why for why in sources if isinstance(why, str)]
        if unread:  # the source may answer later: try again
            return Desired(error="; ".join([_one_line(error), *unread]), needs_retry=True)
        return Desired(error=_one_line(error), is_invalid_spec=True)
    verdict = _assess_quality(md, spec, request, config, observed)
    if not verdict.admission.levels and not verdict.admission.variants:
        excluded = "; ".join(verdict.admission.excluded)
        why = f"no allowed level is within evaluation.maxQualityLoss: {excluded}"
        return Desired(error=why, is_invalid_spec=True, quality=verdict)
    losses = {planner.loss_key(m.variant, m.level): m.relative_loss for m in verdict.measurements}
    request = dataclasses.replace(
        request,
        **gated_candidates(spec, verdict.admission),
        measured_cost=measured_cost(observed.status),
        losses=tuple(losses.items()),
    )
    plans = planner.plan(request, observed.node_types)
    entries_if_none = planner.status_entries(plans, [0] * len(plans), losses)
    if not any(p.fits for p in plans):
        reasons = "; ".join(p.reason for p in plans) or "the cluster has no GPU node types"
        return Desired(plan=entries_if_none, error=f"no node type fits: {reasons}", quality=verdict)
    replicas = _replicas(spec, plans, observed.status.autoscaling)
    parameters = {"": facts.parameters, **{n: f.parameters for n, f in request.variants}}
    cache_children = model_cache.all_children(md, spec, parameters, plans, config)
    caches = {"": observed.cache, **observed.variant_caches} if cache_children else {}
    if cache_children:  # nothing to load yet where the cache of what it serves is being filled
        replicas = [
            n if _is_cached(caches.get(p.variant)) else 0
            for p, n in zip(plans, replicas, strict=True)
        ]
        verdict = _hold_evals_until_cached(verdict, caches)
    children = manifests.build_all(
        md,
        spec,
        plans,
        replicas,
        config,
        observed.has_pod_monitor_crd,
        observed.has_inference_pool_crd,
    )
    return Desired(
        fallback_names=fallback_deployments(spec),
        cache_children=cache_children,
        cache=caches.get(""),
        variant_caches=tuple(c for n, c in caches.items() if n and c is not None),
        serving_cache=_serving_cache(plans, caches),
        children=children,
        plan=planner.status_entries(plans, replicas, losses),
        summary=_summary(plans, replicas)
        + _unread_note(observed.source_facts)
        + model_facts.local_source_note(spec.model),
        num_unplaceable=sum(
            max(0, n - p.num_free_slots()) for p, n in zip(plans, replicas, strict=True)
        ),
        quantization=_quantization(plans, replicas),
        quality=verdict,
        needs_retry=admission.needs_retry(verdict),  # a ConfigMap is not watched: look again
    )


def _is_cached(cache: api.CacheStatus | None) -> bool:
    return cache is not None and cache.phase == "Cached"


def _serving_cache(
    plans: Sequence[planner.NodePlan], caches: Mapping[str, api.CacheStatus | None]
) -> api.CacheStatus | None:
    """The cache the conditions report: the first not Cached of those a fitting node type
    serves (its replicas wait for it), else the first served one; a variant no node type serves
    is filled for its eval Job and reported in status.variantCaches only."""
    served = [caches.get(p.variant) for p in plans if p.fits and p.variant in caches]
    waiting = [c for c in served if not _is_cached(c)]
    if waiting:
        return waiting[0] or api.CacheStatus(claim_name="", phase="Pending", message="not read")
    return served[0] if served else None


def _hold_evals_until_cached(
    verdict: admission.Assessment, caches: Mapping[str, api.CacheStatus | None]
) -> admission.Assessment:
    """An eval Job reads spec.model (its baseline) and, for a variant, the variant from their
    caches: it is made only once they are Cached, or it would read an empty volume and fail
    (retried only after its back-off). The fill Job's end passes the ModelDeployment again."""

    def ready(job: manifests.Manifest) -> bool:
        variant = job["metadata"]["annotations"].get(quality_job.ANNOTATION_VARIANT, "")
        return _is_cached(caches.get("")) and _is_cached(caches.get(variant))

    held = tuple(j for j in verdict.jobs_to_create if ready(j))
    return dataclasses.replace(verdict, jobs_to_create=held)


def gated_candidates(spec: api.ModelDeploymentSpec, verdict: admission.Admission) -> dict[str, Any]:
    """The PlanRequest fields quality sets: the admitted levels; with an eval set and variants,
    also which (source, level) pairs may be planned, so a variant serves only at the level it
    was measured within budget and kvpilot's own levels only where admitted."""
    if verdict.variants is None:
        return {"quantizations": verdict.levels}
    variant_levels = {level for _, level in verdict.variants}
    levels = [q for q in spec.quantization.allowed if q in verdict.levels or q in variant_levels]
    own = [("", q) for q in verdict.levels]
    return {"quantizations": tuple(levels), "admitted": (*own, *verdict.variants)}


def _draft(spec: api.ModelDeploymentSpec, read: Read | None) -> ModelFacts | None:
    """The facts of the speculative draft model the spec names (None: it names none), from the
    catalog or its config.json; ValueError when neither has them."""
    draft = api.draft_source(spec)
    if draft is None:
        return None
    found = catalog.lookup(draft.uri) or _read(read)
    if found is None:
        raise ValueError(
            f"no architecture facts for the draft model {draft.uri}: the operator reads them"
            " from its config.json"
        )
    return found


class ConfigMapUnreadError(ValueError):
    """spec.model.configMapRef's config.json could not be read or is refused: the plan fails
    (the stated facts' 16-bit plan would start pods that refuse, or misserve, the checkpoint)
    and is retried, as the ConfigMap may be created or fixed."""


def model_facts_of(spec: api.ModelDeploymentSpec, read: Read | None) -> ModelFacts:
    """spec.model's facts: stated, the catalog's, or read (catalog.resolve); with a configMapRef
    only once its config.json was read (ConfigMapUnreadError)."""
    if spec.model.config_map_ref is not None and not isinstance(read, ModelFacts):
        raise ConfigMapUnreadError(read or f"{model_facts.CONFIG_MAP_FIELD}: not read yet")
    return catalog.resolve(spec.model, _read(read))


def _unread_note(source_facts: Read | None) -> str:
    """Why spec.model was planned from its stated facts as a 16-bit checkpoint: its config.json,
    which would say it is pre-quantised, could not be read (it is read again on the next pass)."""
    if not isinstance(source_facts, str):
        return ""
    return f"; planned from spec.model's facts as a 16-bit checkpoint: {source_facts}"


def _read(facts: Read | None) -> ModelFacts | None:
    """What was read from a source, or None when it was not (or could not be: a reason)."""
    return facts if isinstance(facts, ModelFacts) else None


def measured_cost(status: api.ModelDeploymentStatus) -> tuple[tuple[str, float], ...]:
    """$ per 1,000 requests per node type on real traffic, as the autoscaler loop wrote it
    (status.cost.nodeTypes; planning/cost.py); node types without traffic or price have none."""
    per_type = status.cost.node_types if status.cost is not None else {}
    found = {name: figures.per_thousand_requests for name, figures in per_type.items()}
    return tuple(sorted((n, c) for n, c in found.items() if c is not None))


def _assess_quality(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    request: planner.PlanRequest,
    config: OperatorConfig,
    observed: Observed,
) -> admission.Assessment:
    """The levels quality admits; without an eval set (or before anything was read), the
    category's. With an eval set, a variant is served only once measured (none before)."""
    evaluation = observed.quality
    if spec.quantization.evaluation is None or evaluation is None:
        unmeasured = admission.admit(spec.quantization, {})
        if spec.quantization.evaluation is not None:
            unmeasured = dataclasses.replace(unmeasured, variants=())
        return admission.Assessment(unmeasured)
    windows = quality_job.EVAL_WINDOW_TOKENS
    reference = planner.reference_plan(request, observed.node_types, windows)
    levels = admission.assess(md, spec, evaluation, reference, config, observed.now)
    if not spec.model.variants:
        return levels
    measured = quality_variants.verdict(md, spec, evaluation, reference, config, observed.now)
    return quality_variants.fold(levels, measured)


def _replicas(
    spec: api.ModelDeploymentSpec,
    plans: Sequence[planner.NodePlan],
    autoscaling: api.AutoscalingStatus,
) -> list[int]:
    """Replicas per node type in plan order.

    With the builtin autoscaler, its `status.autoscaling.replicasPerNodeType` (it keeps running
    replicas in place and spills Unschedulable ones over) wins while it adds up to the total
    wanted; else its `desiredReplicas`, or the scale subresource's figure, is spread here over
    the free GPUs.
    """
    total = planner.desired_total(spec, autoscaling.desired_replicas)
    per_type = autoscaling.replicas_per_node_type
    if spec.autoscaling.mode == "builtin" and per_type:
        spread = [per_type.get(p.node_type.name, 0) if p.fits else 0 for p in plans]
        # A spread made for another plan or other bounds (the spec changed since) is not used.
        if sum(spread) == total:
            return spread
    return planner.assign_replicas(total, plans)


def fallback_deployments(spec: api.ModelDeploymentSpec) -> tuple[str, ...]:
    """The ModelDeployments spec.routing falls back to, in order."""
    return tuple(f.model_deployment for f in spec.routing.fallbacks if f.model_deployment)


def _one_line(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return "; ".join(
            f"spec.{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in error.errors()
        )
    return str(error)


def _summary(plans: Sequence[planner.NodePlan], replicas: Sequence[int]) -> str:
    used = [
        f"{p.node_type.name}: {_variant_text(p)}{p.quantization} on {p.tensor_parallel} GPU(s)"
        f" x{n},"
        f" up to {p.max_concurrency} sequences"
        for p, n in zip(plans, replicas, strict=True)
        if p.fits and n > 0
    ]
    spare = sum(1 for p, n in zip(plans, replicas, strict=True) if p.fits and n == 0)
    misfits = sum(1 for p in plans if not p.fits)
    text = "; ".join(used) or "no replicas"
    return f"{text} ({spare} more node types fit, {misfits} do not)"


def _variant_text(p: planner.NodePlan) -> str:
    return f"variant {p.variant} " if p.variant else ""


def _quantization(plans: Sequence[planner.NodePlan], replicas: Sequence[int]) -> str:
    levels = [p.quantization for p, n in zip(plans, replicas, strict=True) if p.fits and n > 0]
    if not levels:
        levels = [p.quantization for p in plans if p.fits][:1]
    return ",".join(dict.fromkeys(levels))


def stale_children(existing: Sequence[Obj], desired: Desired) -> list[Obj]:
    """Owned children this pass no longer wants (a node type dropped out of the plan)."""
    wanted = {(c["kind"], c["metadata"]["name"]) for c in desired.children}
    return [o for o in existing if (o.get("kind"), o["metadata"]["name"]) not in wanted]


def may_have_dropped_pod_monitor(
    md: Obj, status: api.ModelDeploymentStatus, desired: Desired
) -> bool:
    """Whether a PodMonitor an earlier spec asked for may be left over: this pass wants none,
    and the spec changed since the last pass (the first pass and ordinary passes cost no
    extra API reads)."""
    return may_have_dropped(md, status, desired, "PodMonitor")


def may_have_dropped(
    md: Obj, status: api.ModelDeploymentStatus, desired: Desired, kind: str
) -> bool:
    """Whether an optional child of `kind` (PodMonitor, InferencePool) an earlier spec asked for
    may be left over: this pass wants none, and the spec changed since the last pass."""
    observed = status.observed_generation
    changed = observed > 0 and int(md["metadata"].get("generation", 0)) != observed
    return changed and not any(c["kind"] == kind for c in desired.children)
