"""The adapter sync: spec.adapters loaded into, and unloaded from, the running pods through the
runtime's API, without a restart; status.adapters and the AdaptersLoaded condition say where
each adapter is served.

Why the API and not the pod template: a Deployment rolls its pods whenever its template changes,
so adapters in the pods' args would restart every replica for each adapter added. The template
carries only the LoRA slots (spec.lora: --enable-lora, --max-loras, --max-lora-rank, which do not
change with the adapters), and every adapter, the first ones too, is loaded here: a new pod is
served its adapters within a sync of becoming Ready (`nudge` from its pod event), and until then
the gateway sends an adapter's requests to the pods that hold it (issue 34).

Each sync, per ModelDeployment with LoRA: read each ready pod's /v1/models and its requests per
adapter (observe; with a Prometheus URL, each adapter's request rate over the last ten minutes
instead: adapters/demand.py), decide how many and which pods hold each adapter from its demand
(assignment.plan, pure: hot on every pod, cold on few, within --max-cpu-loras, stable), which
pod loads or unloads what (placement.decide, pure), ask the pods (pod_api), and write
status.adapters (where each adapter is) and AdaptersLoaded from what the pods answered
(placement.statuses). The plan is not stored: the next sync derives it again from where the
adapters are and the demand, which the assignment's hysteresis keeps stable. A pod that
refuses an adapter (a fetch that fails, a rank above --max-lora-rank) is named in the condition;
the other adapters are loaded and served all the same, and the next sync tries again.

A task on kopf's event loop beside the autoscaler's, so only the leader runs it. Nothing is kept
between syncs: the pods and the spec say what to do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from kvpilot.contract import k8s, timestamps
from kvpilot.operator import api
from kvpilot.operator.adapters import assignment, cache_fill, demand, placement, pod_api
from kvpilot.operator.autoscaling.loop import key_of, pods_by_model
from kvpilot.operator.reconcile import conditions, manifests, typed_status
from kvpilot.operator.reconcile.controller import Controller

SYNC_SECONDS = 5.0
Obj = Mapping[str, Any]
log = logging.getLogger(__name__)


def ready_pod_bases(pods: Sequence[Obj], port: int) -> dict[str, str]:
    """pod name -> http://IP:PORT of the ready, running pods not being deleted (pure)."""
    bases = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not meta.get("deletionTimestamp"):
            bases[meta["name"]] = f"http://{status['podIP']}:{port}"
    return bases


def has_lora_work(md: Obj, status: api.ModelDeploymentStatus) -> bool:
    """LoRA is on in the spec, or status still reports adapters (to be cleared)."""
    spec = md.get("spec") or {}
    listed = bool(spec.get("adapters")) or spec.get("lora") is not None
    shown = bool(status.adapters) or conditions.find(status.conditions, placement.ADAPTERS_LOADED)
    return listed or bool(shown)


def status_patch(
    old: api.ModelDeploymentStatus,
    adapters: Sequence[api.AdapterStatus],
    condition: api.Condition | None,
    now: str,
) -> dict[str, Any] | None:
    """The merge patch of status.adapters and AdaptersLoaded (None: nothing changed); without a
    condition (LoRA off) both are cleared."""
    merged = conditions.merge(old.conditions, [condition] if condition else [], now)
    kept = [c for c in merged if condition is not None or c.type != placement.ADAPTERS_LOADED]
    patch = {
        "adapters": [typed_status.wire(a) for a in adapters],
        "conditions": [typed_status.wire(c) for c in kept],
    }
    written = typed_status.wire(old)
    unchanged = all(written.get(k, []) == v for k, v in patch.items())
    return None if unchanged else patch


class AdapterSync:
    """A sync every `interval_s`, sooner after a `nudge` (a spec or pod changed)."""

    def __init__(self, controller: Controller, interval_s: float = SYNC_SECONDS) -> None:
        self.controller, self.interval_s = controller, interval_s
        url = controller.config.prometheus_url
        self.demand = demand.PrometheusDemand(url) if url else None
        self.nudged = asyncio.Event()
        # Whether the last sync found LoRA work: without it, only a nudge (a ModelDeployment with
        # LoRA changed) syncs, so a cluster without adapters pays no LIST every few seconds. A
        # start assumes work: the first sync finds out.
        self.had_work = True

    def nudge(self) -> None:
        self.nudged.set()

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.interval_s):
                    await self.nudged.wait()
            except TimeoutError:
                if not self.had_work:
                    continue
            self.nudged.clear()
            try:
                await self.sync()
            except Exception:  # the API unreachable, a bug: the next sync tries again
                log.exception("adapter sync failed; the next one tries again")

    async def sync(self) -> None:
        """Every ModelDeployment with LoRA work: one LIST of them and one of their pods."""
        listed = await asyncio.to_thread(self.controller.list_model_deployments)
        todo = [(md, typed_status.of(md)) for md in listed]
        todo = [(md, status) for md, status in todo if has_lora_work(md, status)]
        self.had_work = bool(todo)
        if not todo:
            return
        pods = await asyncio.to_thread(self._model_pods)
        async with httpx.AsyncClient() as client:
            await asyncio.gather(
                *(self.sync_one(client, md, s, pods.get(key_of(md), [])) for md, s in todo)
            )

    async def sync_one(
        self,
        client: httpx.AsyncClient,
        md: Obj,
        status: api.ModelDeploymentStatus,
        pods: Sequence[Obj],
    ) -> None:
        try:
            spec = api.parse_spec(md.get("spec") or {})
        except ValidationError:
            return  # the reconcile pass reports an invalid spec; nothing to load from it
        bases = ready_pod_bases(pods, self.controller.config.runtime_port)
        want = placement.wanted(spec)
        gate = await asyncio.to_thread(self._cache_gate, md, spec, want)
        synced: Synced | None = None
        if spec.lora_enabled:
            recent = await self._recent_demand(md)
            synced = await converge(client, bases, gate.ready, slots_of(spec), recent)
        held, outcomes = (synced.pods, synced.outcomes) if synced else ([], [])
        adapters = with_waiting(want, placement.statuses(gate.ready, held, outcomes), gate)
        generation = int(md["metadata"].get("generation", 0))
        fetching = set(gate.waiting) - gate.failed
        condition = (
            placement.condition(adapters, synced.plan, len(held), generation, fetching)
            if synced
            else None
        )
        patch = status_patch(status, adapters, condition, timestamps.rfc3339())
        if patch is not None:
            await asyncio.to_thread(self._write, md, patch)

    def _cache_gate(
        self, md: Obj, spec: api.ModelDeploymentSpec, want: dict[str, str]
    ) -> cache_fill.Gate:
        """With the model cache: each hf:// or s3:// adapter's fill Job, made if missing (once
        the model's own fill Job exists, whose node and mounts it takes), and which adapters
        the pods may load now (their Job Complete); without it every adapter may be loaded."""
        uris = cache_fill.cached_uris(spec)
        if not uris:
            return cache_fill.Gate(dict(want), {}, frozenset())
        namespace, claim = md["metadata"]["namespace"], cache_fill.claim_of(spec)
        selector = f"{cache_fill.LABEL_ADAPTER_CACHE}={claim}"
        found = k8s.list_objects(self.controller.client, "batch/v1", "Job", namespace, selector)
        jobs = {job["metadata"]["name"]: job for job in found}
        missing = [uri for uri in uris if cache_fill.job_name(claim, uri) not in jobs]
        if missing:
            self._make_fill_jobs(md, spec, missing)
        return cache_fill.gate(want, uris, jobs, claim)

    def _make_fill_jobs(self, md: Obj, spec: api.ModelDeploymentSpec, uris: list[str]) -> None:
        """The adapters' fill Jobs, beside the model's (none yet: the next sync, once the
        reconcile pass has made it)."""
        namespace, claim = md["metadata"]["namespace"], cache_fill.claim_of(spec)
        model_job = k8s.get(self.controller.client, "batch/v1", "Job", namespace, claim)
        if model_job is None:
            return
        for uri in uris:
            log.info("fetching adapter %s into the model cache %s/%s", uri, namespace, claim)
            k8s.create(self.controller.client, cache_fill.build_job(md, spec, uri, model_job))

    async def _recent_demand(self, md: Obj) -> dict[str, float] | None:
        """Each adapter's request rate from Prometheus (None: none configured, or no answer)."""
        if self.demand is None:
            return None
        meta = md["metadata"]
        return await asyncio.to_thread(self.demand.read, meta["namespace"], meta["name"])

    def _model_pods(self) -> dict[tuple[str, str], list[dict[str, Any]]]:
        namespace = self.controller.config.namespace or None
        found = k8s.list_objects(
            self.controller.client, "v1", "Pod", namespace, manifests.LABEL_MODEL
        )
        return pods_by_model(found)

    def _write(self, md: Obj, patch: dict[str, Any]) -> None:
        """Only over the status this sync read (409: the next sync reads again), so a
        reconcile pass's conditions written meanwhile are never lost."""
        meta = md["metadata"]
        try:
            k8s.patch_status(
                self.controller.client,
                meta["namespace"],
                meta["name"],
                patch,
                resource_version=meta.get("resourceVersion"),
            )
        except k8s.ApiException as error:
            if error.status not in (404, 409):
                raise
            log.debug("adapters of %s/%s: %s; next sync", meta["namespace"], meta["name"], error)


def with_waiting(
    want: Mapping[str, str], loaded: Sequence[api.AdapterStatus], gate: cache_fill.Gate
) -> list[api.AdapterStatus]:
    """status.adapters in the spec's order: the loadable ones as the pods hold them, and those
    waiting for the model cache on no pod, saying why."""
    by_name = {s.name: s for s in loaded}
    waiting = {
        name: api.AdapterStatus(name=name, uri=want[name], message=why)
        for name, why in gate.waiting.items()
    }
    return [by_name.get(name) or waiting[name] for name in want]


def slots_of(spec: api.ModelDeploymentSpec) -> int:
    """The adapters one pod holds without re-reading them from disk: --max-cpu-loras."""
    slots = spec.lora_slots
    return slots.max_cpu_loras or slots.max_loras


@dataclass(frozen=True)
class Synced:
    """One sync of a ModelDeployment: the pods as the actions left them, each action's outcome,
    and the plan (pod -> adapters) they carried out."""

    pods: list[placement.PodAdapters]
    outcomes: list[placement.Outcome]
    plan: assignment.Plan


async def converge(
    client: httpx.AsyncClient,
    bases: Mapping[str, str],
    want: Mapping[str, str],
    slots: int,
    recent: Mapping[str, float] | None = None,
) -> Synced:
    """Observe the pods, plan from the demand (`recent` rates, else the pods' counters since
    they started), decide, act."""
    observed, counted = await observe(client, bases)
    held = {p.pod: {n for n, uri in p.loaded.items() if want.get(n) == uri} for p in observed}
    plan = assignment.plan(list(want), counted if recent is None else recent, held, slots)
    outcomes = await execute(client, bases, placement.decide(want, plan, observed))
    return Synced(placement.after(observed, outcomes), outcomes, plan)


async def observe(
    client: httpx.AsyncClient, bases: Mapping[str, str]
) -> tuple[list[placement.PodAdapters], dict[str, float]]:
    """Each pod's adapters (a pod that does not answer is left out: not ready for loads), and
    each adapter's requests summed over the pods (a pod whose /metrics fails counts none)."""
    names = sorted(bases)
    found = await asyncio.gather(
        *(pod_api.loaded(client, bases[n]) for n in names), return_exceptions=True
    )
    counted = await asyncio.gather(
        *(pod_api.requests_by_adapter(client, bases[n]) for n in names), return_exceptions=True
    )
    pods: list[placement.PodAdapters] = []
    total: dict[str, float] = {}
    for name, loaded, counts in zip(names, found, counted, strict=True):
        if isinstance(loaded, BaseException):
            log.info("adapters of pod %s unknown: %s", name, loaded)
            continue
        pods.append(placement.PodAdapters(name, loaded))
        for adapter, count in ({} if isinstance(counts, BaseException) else counts).items():
            total[adapter] = total.get(adapter, 0.0) + count
    return pods, total


async def execute(
    client: httpx.AsyncClient, bases: Mapping[str, str], actions: Sequence[placement.Action]
) -> list[placement.Outcome]:
    """The actions, each pod's in order (unloads before loads), the pods at once."""
    by_pod: dict[str, list[placement.Action]] = {}
    for action in actions:
        by_pod.setdefault(action.pod, []).append(action)
    done = await asyncio.gather(*(_on_pod(client, bases[p], todo) for p, todo in by_pod.items()))
    return [outcome for outcomes in done for outcome in outcomes]


async def _on_pod(
    client: httpx.AsyncClient, base: str, actions: Sequence[placement.Action]
) -> list[placement.Outcome]:
    outcomes = []
    for action in actions:
        if action.verb == "load":
            error = await pod_api.load(client, base, action.name, action.uri)
        else:
            error = await pod_api.unload(client, base, action.name)
        if error is not None:
            log.warning("pod %s: %s %s: %s", action.pod, action.verb, action.name, error)
        outcomes.append(placement.Outcome(action, error))
    return outcomes
