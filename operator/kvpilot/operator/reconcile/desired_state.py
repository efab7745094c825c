"""One reconcile pass as pure functions: ModelDeployment + inventory -> children + status.

KubeAI's "plan then execute": `desire` decides everything (plan, replicas per node type, manifests)
without touching the API; `handlers`/`k8s` then apply it; `build_status` turns the outcome and the
Deployments' progress into the status written once per pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from kvpilot.contract import catalog
from kvpilot.contract.memory import ModelFacts
from kvpilot.contract.model_source import parse_model_uri
from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import model_facts, planner
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.quality import admission
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.quality import variants as quality_variants
from kvpilot.operator.reconcile import conditions, manifests, model_cache, typed_status

Obj = Mapping[str, Any]
FALLBACKS_RESOLVED = "FallbacksResolved"


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


def check_prequantized(spec: api.ModelDeploymentSpec, facts: ModelFacts) -> None:
    """The quality gate measures every loss against spec.model unquantised: a pre-quantised
    spec.model leaves it no 16-bit baseline (nor a level of its own to measure), so the spec is
    refused with the arrangement that works: the 16-bit checkpoint as spec.model, the
    pre-quantised one as a variant (measured against it, and served where it wins)."""
    if facts.checkpoint is None or spec.quantization.evaluation is None:
        return
    method = facts.checkpoint.description.split()[0]  # e.g. awq: a DNS label, a variant's name
    # A file:// or pvc:// one (planned from spec.model.configMapRef) cannot be a variant as it is
    is_local = not parse_model_uri(spec.model.uri).is_fetched
    uri = f"s3://BUCKET/{method}" if is_local else spec.model.uri
    upload = " uploaded to S3 (a variant is read from hf:// or s3://)" if is_local else ""
    raise ValueError(
        f"spec.quantization.evaluation needs a 16-bit spec.model as its baseline, and"
        f" spec.model ({spec.model.uri}) is pre-quantised ({facts.checkpoint.description}):"
        f" put the model's 16-bit checkpoint in spec.model.uri and this one{upload} under"
        f" spec.model.variants (e.g. {{name: {method}, uri: {uri}}}),"
        " or remove spec.quantization.evaluation to serve it unmeasured"
    )


# What makes two checkpoints one model: the shapes the KV cache and the served API depend on.
_ARCHITECTURE = ("layers", "kv_heads", "head_dim", "vocab_size", "hidden_size", "attention_heads")


def variants(
    spec: api.ModelDeploymentSpec, facts: ModelFacts, observed: Observed
) -> tuple[tuple[str, ModelFacts], ...]:
    """spec.model.variants[] with the facts read from each; ValueError when one was not read
    (its reason) or is another architecture than spec.model (the fields that differ)."""
    found: list[tuple[str, ModelFacts]] = []
    for variant in spec.model.variants:
        read = observed.variant_facts.get(variant.name)
        if not isinstance(read, ModelFacts):
            raise ValueError(f"spec.model.variants[{variant.name}]: {read or 'not read yet'}")
        differ = [
            f"{to_camel(n)} {getattr(read, n)} vs {getattr(facts, n)}"
            for n in _ARCHITECTURE
            if getattr(facts, n) and getattr(read, n) != getattr(facts, n)
        ]
        if differ:
            raise ValueError(
                f"spec.model.variants[{variant.name}] ({variant.uri}) is not spec.model's"
                f" architecture: {', '.join(differ)}; a variant is the same model published"
                " another way"
            )
        found.append((variant.name, read))
    return tuple(found)


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


def spec_unapplied(md: Obj) -> bool:
    """Whether the spec's generation is not the one the last full pass applied
    (`status.observedGeneration`): a new object, or a spec changed since. Only full passes write
    observedGeneration, so this stays true until one has applied the spec."""
    observed = (md.get("status") or {}).get("observedGeneration")
    return observed is None or int(observed) != int(md["metadata"].get("generation", 0))


def needs_full_pass(md: Obj, first_sight: bool) -> bool:
    """Whether a ModelDeployment's watch event asks for a full pass (pure). kopf may hand over
    only the latest of a quick series of events, so this reads the object's state, not what the
    event changed: first seen since the operator started (it may have missed anything), a spec
    not yet applied, or an autoscaler decision the children do not show."""
    return first_sight or spec_unapplied(md) or scale_pending(md)


def scale_pending(md: Obj) -> bool:
    """Whether the builtin autoscaler's last decision in status (its spread per node type, or
    its count) differs from the replicas the last pass applied (status.plan): the one way from
    a scaling decision to the children is a reconcile pass, which the watch runs on this.
    `md` is the object as the watch delivered it: its status is parsed here."""
    if ((md.get("spec") or {}).get("autoscaling") or {}).get("mode", "builtin") != "builtin":
        return False
    status = typed_status.of(md)
    applied = {e.node_type: e.replicas for e in status.plan}
    wanted = status.autoscaling.replicas_per_node_type
    if wanted:
        return any(applied.get(t, 0) != wanted.get(t, 0) for t in {*applied, *wanted})
    desired = status.autoscaling.desired_replicas
    return desired is not None and desired != sum(applied.values())


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
