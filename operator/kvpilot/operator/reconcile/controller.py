"""Executes reconcile passes: reads the ModelDeployment, applies what `desired_state.desire`
decided, writes the status once, and posts Events when the plan changes.

A pass runs in a worker thread (the Kubernetes client blocks); passes.PassScheduler's work queue
runs one at a time per ModelDeployment. Everything the pass decides comes from the API and the
node/pod lists it is handed, so nothing here needs to survive a restart.

A new ModelDeployment's first pass applies only its Deployments (and the model cache its pods
mount) and leaves the rest, the Service, the status and the Planned event, to a finishing pass
that the PassScheduler asks for shortly after, handing back what the first one applied so the
Deployments are not sent twice. In a burst of creates those other writes were more than half of
the operator's, and the apiserver served them while later creates waited for their Deployments
(`python -m bench.operator_scale`, 200 creates on 2 cores: create -> Deployment p95 1.18 s with
one pass, 0.53 s with the Deployments first).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s_client
from pydantic import ValidationError

from kvpilot.contract import k8s, resource, timestamps
from kvpilot.operator import api, observability
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import inventory, model_facts
from kvpilot.operator.quality import io as quality_io
from kvpilot.operator.reconcile import desired_state, manifests, model_cache, typed_status

POD_MONITOR_CRD = "podmonitors.monitoring.coreos.com"
INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io"
COMPONENT = "kvpilot-operator"
Obj = Mapping[str, Any]
ChildRef = tuple[str, str]  # (kind, name)
Applied = Mapping[ChildRef, Obj]  # a first pass's Deployments, as it sent them
log = logging.getLogger(__name__)


@dataclass
class Controller:
    """One pass at a time per ModelDeployment is the caller's promise (passes.PassScheduler's work
    queue); nothing here is shared between passes but the read-only config and the facts cache."""

    client: k8s_client.ApiClient
    config: OperatorConfig
    facts: model_facts.ModelFactsReader = field(init=False)

    def __post_init__(self) -> None:
        self.facts = model_facts.ModelFactsReader(self.client)

    def run_pass(
        self,
        namespace: str,
        name: str,
        nodes: list[Obj],
        pods: list[Obj],
        apply_children: bool = True,
        body: Obj | None = None,
        applied_first: Applied | None = None,
    ) -> desired_state.Desired | None:
        """One pass; None when the ModelDeployment is gone or going. Without `apply_children`
        only the status is refreshed (a child's status changed).

        `body` is the object as kopf just delivered it, which saves a GET; without it (a child's
        event) the pass reads the ModelDeployment itself. `applied_first`: what this object's
        first pass applied (its `Desired.applied_first`); a Deployment it holds unchanged that
        exists is not applied again. A first pass returns that in `Desired.applied_first` and
        writes nothing else: the caller runs the finishing pass.
        """
        md = body or k8s.get(self.client, k8s.MD_API_VERSION, "ModelDeployment", namespace, name)
        if md is None or md["metadata"].get("deletionTimestamp"):
            return None
        # A spec not applied yet is applied now, so observedGeneration (which this pass writes)
        # always names the spec the children were made from.
        apply_children = apply_children or desired_state.spec_unapplied(md)
        status = typed_status.of(md)  # once per pass, like the spec: readers get it typed
        desired = self._desire(md, status, nodes, pods)
        is_new = apply_children and not status.observed_generation
        if is_new and applied_first is None and desired.error is None:
            first = self._apply_first(md, desired)
            if first:
                return dataclasses.replace(desired, applied_first=first)
        deployments = self._converge(
            md, status, desired, apply_children, is_new and not applied_first, applied_first or {}
        )
        self._write_status(md, status, desired, deployments)
        return desired

    def list_model_deployments(self) -> list[dict[str, Any]]:
        namespace = self.config.namespace or None
        return k8s.list_objects(self.client, k8s.MD_API_VERSION, "ModelDeployment", namespace)

    def _desire(
        self, md: Obj, status: api.ModelDeploymentStatus, nodes: list[Obj], pods: Iterable[Obj]
    ) -> desired_state.Desired:
        meta = md["metadata"]
        # This ModelDeployment's own pods hold GPUs it may keep: count them as free for its plan.
        others = [p for p in pods if not _belongs_to(p, meta["namespace"], meta["name"])]
        node_types = inventory.discover(nodes, others, self.config.node_types)
        spec = parse_spec(md)
        wants_monitor = spec is not None and spec.monitoring.pod_monitor
        has_crd = wants_monitor and k8s.has_crd(self.client, POD_MONITOR_CRD)
        # One GET per pass, and only for a ModelDeployment that asks for a pool; the
        # inference-pool-crd handler passes those again when the CRD arrives later.
        wants_pool = spec is not None and spec.routing.endpoint_picker_ref is not None
        has_pool_crd = wants_pool and k8s.has_crd(self.client, INFERENCE_POOL_CRD)
        caches = self._read_caches(md, spec, status)
        observed = desired_state.Observed(  # read in this order: the API calls keep theirs
            node_types=tuple(node_types),
            has_pod_monitor_crd=has_crd,
            has_inference_pool_crd=has_pool_crd,
            source_facts=self._source_facts(md, spec, None if spec is None else spec.model),
            cache=caches[""][0] if "" in caches else None,
            variant_caches={n: cache for n, (cache, _) in caches.items() if n},
            quality=quality_io.observe(self.client, md, spec),
            now=timestamps.rfc3339(),
            status=status,
            draft_facts=self._source_facts(
                md, spec, None if spec is None else api.draft_source(spec)
            ),
            variant_facts=self._variant_facts(md, spec),
        )
        desired = desired_state.desire(md, self.config, observed)
        own = [p for p in pods if _belongs_to(p, meta["namespace"], meta["name"])]
        problems = tuple(p["status"]["problem"] for p in own if p["status"].get("problem"))
        wants_owner = any(c["metadata"]["ownerReferences"] for c in desired.cache_children)
        jobs = [(cache.claim_name, job) for cache, job in caches.values()]
        return dataclasses.replace(
            desired,
            missing_fallbacks=self._missing(meta["namespace"], desired.fallback_names),
            pod_problems=problems,
            caches_missing=frozenset(name for name, job in jobs if job is None),
            caches_needing_owner=frozenset(
                name
                for name, job in jobs
                if job is not None and wants_owner and meta["uid"] not in _owner_uids(job)
            ),
        )

    def _missing(self, namespace: str, names: Iterable[str]) -> tuple[str, ...]:
        """The fallback ModelDeployments not found in the namespace (one GET each; a spec
        has at most a few)."""
        return tuple(
            name
            for name in names
            if k8s.get(self.client, k8s.MD_API_VERSION, resource.KIND, namespace, name) is None
        )

    def _read_caches(
        self, md: Obj, spec: api.ModelDeploymentSpec | None, status: api.ModelDeploymentStatus
    ) -> dict[str, tuple[api.CacheStatus, dict[str, Any] | None]]:
        """Each cache's state and fill Job (None: not made yet) by source ("": spec.model, else
        the variant's name: model_cache.sources); {} when the spec asks for no cache (or is
        invalid: desire reports it)."""
        if spec is None or spec.model.cache is None:
            return {}
        old = {c.claim_name: c for c in [*filter(None, [status.cache]), *status.variant_caches]}
        found = {}
        for name, source in model_cache.sources(spec):
            claim = manifests.cache_claim_name(source.model.uri)
            cache, job = self._read_cache(md["metadata"]["namespace"], claim, old.get(claim))
            found[name] = (cache.model_copy(update={"variant": name}), job)
        return found

    def _read_cache(
        self, namespace: str, name: str, old: api.CacheStatus | None
    ) -> tuple[api.CacheStatus, dict[str, Any] | None]:
        """The cache `name`'s state and its fill Job (None: not made yet). `old`: as the status
        last reported it."""
        job = k8s.get(self.client, "batch/v1", "Job", namespace, name)
        if job is not None and old is not None and old.phase == "Cached":
            return old, job  # final: no need to read the pods
        selector = f"{model_cache.LABEL_CACHE}={name}"
        pods = (
            [] if job is None else k8s.list_objects(self.client, "v1", "Pod", namespace, selector)
        )
        return model_cache.status(name, job, pods), job

    def _source_facts(
        self, md: Obj, spec: api.ModelDeploymentSpec | None, model: api.ModelSource | None
    ) -> desired_state.Read | None:
        """Facts read from an uncatalogued model's config.json (spec.model, or the draft
        model), or from the ConfigMap spec.model.configMapRef names, or why they could not be."""
        if spec is None or model is None:
            return None
        if model.config_map_ref is not None:
            return self._read_config_map(md, model.config_map_ref)
        if not model_facts.needs_reading(model):
            return None
        return self._read_facts(md, spec, model.uri)

    def _read_config_map(self, md: Obj, ref: api.ConfigMapKeyRef) -> desired_state.Read:
        try:
            return self.facts.read_config_map(md["metadata"]["namespace"], ref)
        except ValueError as error:  # the ConfigMap may be created or fixed: retried
            return str(error)

    def _variant_facts(
        self, md: Obj, spec: api.ModelDeploymentSpec | None
    ) -> dict[str, desired_state.Read]:
        """Facts read from each spec.model.variants[] config.json, or why they could not be."""
        if spec is None:
            return {}
        return {v.name: self._read_facts(md, spec, v.uri, v) for v in spec.model.variants}

    def _read_facts(
        self,
        md: Obj,
        spec: api.ModelDeploymentSpec,
        uri: str,
        variant: api.ModelVariant | None = None,
    ) -> desired_state.Read:
        try:
            return self.facts.read(md["metadata"]["namespace"], spec, uri, variant)
        except model_facts.UnservableCheckpointError as error:
            return desired_state.Unservable(str(error))
        except ValueError as error:
            return str(error)

    def _apply_first(self, md: Obj, desired: desired_state.Desired) -> dict[ChildRef, Obj]:
        """A new object's Deployments, and the model cache their pods mount: what serves."""
        self._ensure_cache(md, desired)
        deployments = [c for c in desired.children if c["kind"] == "Deployment"]
        for child in deployments:
            k8s.apply(self.client, child, self.config.field_manager)
        return {(child["kind"], child["metadata"]["name"]): child for child in deployments}

    def _converge(
        self,
        md: Obj,
        status: api.ModelDeploymentStatus,
        desired: desired_state.Desired,
        apply_children: bool,
        is_first: bool,
        applied_first: Applied,
    ) -> list[dict[str, Any]]:
        meta = md["metadata"]
        selector = f"{manifests.LABEL_MODEL}={meta['name']}"
        # `is_first`: a ModelDeployment never planned has no children yet, so the LIST is
        # skipped. (Had a crash cut that pass short, what it applied is what this pass wants
        # again.) The finishing pass lists them: the status reports them as they are now.
        existing = [
            d
            for d in (
                []
                if is_first
                else k8s.list_objects(
                    self.client, "apps/v1", "Deployment", meta["namespace"], selector
                )
            )
            if _owned_by(d, meta["uid"])
        ]
        if apply_children:  # eval Jobs and measurements, whatever the plan's outcome
            quality_io.apply(self.client, md, desired.quality)
        if desired.error is not None or not apply_children:
            return existing  # a spec that cannot run leaves the running pods serving
        self._ensure_cache(md, desired)
        if desired_state.may_have_dropped_pod_monitor(md, status, desired):
            self._delete_pod_monitor(md)
        if desired_state.may_have_dropped(md, status, desired, "InferencePool"):
            self._delete_optional(
                md, INFERENCE_POOL_CRD, manifests.INFERENCE_POOL_API_VERSION, "InferencePool"
            )
        listed = {d["metadata"]["name"]: d for d in existing}
        applied = [self._apply(child, applied_first, listed) for child in desired.children]
        for stale in desired_state.stale_children(existing, desired):
            log.info(
                "deleting %s/%s: its node type left the plan",
                meta["namespace"],
                stale["metadata"]["name"],
            )
            k8s.delete(self.client, stale)
        return [obj for obj in applied if obj.get("kind") == "Deployment"]

    def _apply(
        self, child: manifests.Manifest, applied_first: Applied, listed: Mapping[str, Obj]
    ) -> dict[str, Any]:
        """Server-side apply, unless the first pass sent this very Deployment and it exists:
        then the Deployment as listed."""
        name = child["metadata"]["name"]
        if applied_first.get((child["kind"], name)) == child and name in listed:
            return dict(listed[name])
        return k8s.apply(self.client, child, self.config.field_manager)

    def _ensure_cache(self, md: Obj, desired: desired_state.Desired) -> None:
        """Create the model cache's claim and fill Job if absent; with deleteWithModel, add this
        ModelDeployment to the owners of a cache another one made."""
        for child in desired.cache_children:
            if child["metadata"]["name"] in desired.caches_missing:
                k8s.create(self.client, child)
            elif child["metadata"]["name"] in desired.caches_needing_owner:
                k8s.add_owner_reference(self.client, child, child["metadata"]["ownerReferences"][0])

    def _delete_pod_monitor(self, md: Obj) -> None:
        """Delete the PodMonitor an earlier spec asked for, if this ModelDeployment owns one."""
        self._delete_optional(md, POD_MONITOR_CRD, "monitoring.coreos.com/v1", "PodMonitor")

    def _delete_optional(self, md: Obj, crd: str, api_version: str, kind: str) -> None:
        """Delete the optional child (named like the ModelDeployment) of a CRD that may not be
        installed, which an earlier spec asked for, if this ModelDeployment owns one."""
        meta = md["metadata"]
        try:
            if not k8s.has_crd(self.client, crd):
                return
            found = k8s.get(self.client, api_version, kind, meta["namespace"], meta["name"])
            if found is not None and _owned_by(found, meta["uid"]):
                log.info(
                    "deleting %s %s/%s: the spec no longer asks for it",
                    kind,
                    meta["namespace"],
                    meta["name"],
                )
                k8s.delete(self.client, found)
        except k8s.ApiException as error:  # 403: the chart grants no rights on it (e.g.
            # podMonitors.enabled is off), so the operator never made one; anything else: the
            # next spec change looks again
            log.debug("%s check for %s/%s: %s", kind, meta["namespace"], meta["name"], error.reason)

    def _write_status(
        self,
        md: Obj,
        old: api.ModelDeploymentStatus,
        desired: desired_state.Desired,
        deployments: list[dict[str, Any]],
    ) -> None:
        meta = md["metadata"]
        now = timestamps.rfc3339()
        status = desired_state.build_status(md, old, desired, deployments, self.config, now)
        # Compared in the same wire form, so an unchanged status costs no write.
        written = typed_status.wire(old)
        if any(written.get(k) != v for k, v in status.items()):
            k8s.patch_status(self.client, meta["namespace"], meta["name"], status)
        if desired_state.plan_changed(old, desired):
            self._event(md, desired)
        missing = desired_state.fallbacks_news(old, desired)
        if missing is not None:
            self._post(md, "Warning", "FallbackMissing", missing)

    def _event(self, md: Obj, desired: desired_state.Desired) -> None:
        if desired.error is None:
            kind, reason, message = "Normal", "Planned", desired.summary
        else:
            kind, reason, message = "Warning", "PlanFailed", desired.error
            observability.record_plan_failure(
                "invalid-spec" if desired.is_invalid_spec else "no-fit"
            )
        self._post(md, kind, reason, message)

    def _post(self, md: Obj, kind: str, reason: str, message: str) -> None:
        try:
            k8s.emit_event(self.client, md, kind, reason, message, COMPONENT)
        except k8s.ApiException as error:  # an Event is a courtesy; never fail the pass over it
            log.warning("could not post event %s: %s", reason, error.reason)


def parse_spec(md: Obj) -> api.ModelDeploymentSpec | None:
    """The spec, parsed once per pass where the object comes in; None when it is invalid (the
    pass's `desired_state.desire` says why, in the status)."""
    try:
        return api.parse_spec(md.get("spec") or {})
    except ValidationError:
        return None


def _belongs_to(pod: Obj, namespace: str, name: str) -> bool:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    return meta.get("namespace") == namespace and labels.get(manifests.LABEL_MODEL) == name


def _owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or ())


def controller_owner(obj: Obj) -> str | None:
    """Name of the ModelDeployment that controls `obj`, if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("kind") == "ModelDeployment" and ref.get("controller"):
            return str(ref["name"])
    return None


def _owner_uids(obj: Obj) -> set[str]:
    return {o.get("uid") for o in (obj.get("metadata") or {}).get("ownerReferences") or []}
