"""Which LoRA adapters each running pod should load or unload, and what status says. Pure.

Each pod holds the adapters the demand-driven assignment gives it (adapters/assignment.py): hot
ones on every pod, cold ones on few, within the pods' slots. An adapter a pod holds from another
URI (the spec's `uri` changed) is unloaded and loaded again; one the spec no longer names is
unloaded; one that moves to another pod is unloaded from the old one only once a pod the plan
names holds it (make before break: the gateway always has a holder to send it to).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvpilot.operator import api

ADAPTERS_LOADED = "AdaptersLoaded"


@dataclass(frozen=True)
class PodAdapters:
    """A ready pod and the adapters its /v1/models lists: name -> the URI it was loaded from."""

    pod: str
    loaded: Mapping[str, str]


@dataclass(frozen=True)
class Action:
    pod: str
    verb: Literal["load", "unload"]
    name: str
    uri: str = ""  # load only


@dataclass(frozen=True)
class Outcome:
    """An action as the pod answered it: `error` None when it did what was asked."""

    action: Action
    error: str | None = None


def wanted(spec: api.ModelDeploymentSpec) -> dict[str, str]:
    """The spec's adapters: name -> URI."""
    return {adapter.name: adapter.uri for adapter in spec.adapters}


def decide(
    want: Mapping[str, str], plan: Mapping[str, Collection[str]], pods: Sequence[PodAdapters]
) -> list[Action]:
    """Per pod, its unloads first (they free host memory), then its loads, in the spec's order:
    each pod ends with the adapters `plan` gives it (pod -> names), from the spec's URIs."""
    actions = []
    for pod in pods:
        here = {name: want[name] for name in want if name in plan.get(pod.pod, ())}
        stale = [n for n, uri in pod.loaded.items() if here.get(n) != uri]
        missing = [n for n in here if n in stale or n not in pod.loaded]
        stale = [n for n in stale if n in here or not _moving(n, want, plan, pods)]
        actions += [Action(pod.pod, "unload", name) for name in stale]
        actions += [Action(pod.pod, "load", name, here[name]) for name in missing]
    return actions


def _moving(
    name: str,
    want: Mapping[str, str],
    plan: Mapping[str, Collection[str]],
    pods: Sequence[PodAdapters],
) -> bool:
    """The adapter leaves a pod for others, none of which holds it from the spec's URI yet: the
    old pod keeps it until one does."""
    if name not in want:
        return False
    return not any(name in plan.get(p.pod, ()) and p.loaded.get(name) == want[name] for p in pods)


def planned_pods(plan: Mapping[str, Collection[str]]) -> dict[str, list[str]]:
    """adapter -> the pods the plan puts it on, sorted."""
    pods: dict[str, list[str]] = {}
    for pod in sorted(plan):
        for name in plan[pod]:
            pods.setdefault(name, []).append(pod)
    return pods


def after(pods: Sequence[PodAdapters], outcomes: Sequence[Outcome]) -> list[PodAdapters]:
    """The pods as the actions that succeeded left them."""
    loaded = {pod.pod: dict(pod.loaded) for pod in pods}
    for outcome in outcomes:
        if outcome.error is not None:
            continue
        action = outcome.action
        if action.verb == "load":
            loaded[action.pod][action.name] = action.uri
        else:
            loaded[action.pod].pop(action.name, None)
    return [PodAdapters(pod, held) for pod, held in loaded.items()]


def statuses(
    want: Mapping[str, str], pods: Sequence[PodAdapters], outcomes: Sequence[Outcome]
) -> list[api.AdapterStatus]:
    """status.adapters: per spec adapter, the pods that hold it from its URI, and the first
    refusal of a load of it."""
    failed: dict[str, str] = {}
    for outcome in outcomes:
        action = outcome.action
        if outcome.error is not None and action.verb == "load":
            failed.setdefault(action.name, f"{action.pod}: {outcome.error}")
    return [
        api.AdapterStatus(
            name=name,
            uri=uri,
            pods=sorted(p.pod for p in pods if p.loaded.get(name) == uri),
            message=failed.get(name, ""),
        )
        for name, uri in want.items()
    ]


def condition(
    status: Sequence[api.AdapterStatus],
    plan: Mapping[str, Collection[str]],
    num_pods: int,
    generation: int,
    fetching: Collection[str] = (),
) -> api.Condition:
    """AdaptersLoaded: True when every adapter is on the pods the plan gives it; False naming
    each adapter some pod could not load (the others are served meanwhile), or else each one
    still `fetching` into the model cache (adapters/cache_fill.py)."""
    ok: Literal["True", "False", "Unknown"]
    where = planned_pods(plan)
    failing = [s for s in status if s.message and s.name not in fetching]
    waiting = [s for s in status if s.name in fetching]
    missing = [
        s.name for s in status if not s.message and not set(where.get(s.name, [])) <= set(s.pods)
    ]
    if failing:
        reasons = "; ".join(f"adapter {s.name}: {s.message}" for s in failing)
        served = len(status) - len(failing) - len(waiting)
        ok, reason = "False", "AdapterLoadFailed"
        message = f"{reasons} ({served} other adapter(s) served)"
    elif waiting:
        ok, reason = "False", "FetchingIntoCache"
        message = "; ".join(f"adapter {s.name}: {s.message}" for s in waiting)
    elif num_pods == 0:
        ok, reason, message = "Unknown", "NoReadyPods", "no ready pod to load adapters into"
    elif missing:
        ok, reason = "False", "Loading"
        message = f"not on every pod placed for it yet: {', '.join(missing)}"
    else:
        ok, reason = "True", "AllLoaded"
        copies = sorted(len(s.pods) for s in status)
        spread = f"{copies[0]}-{copies[-1]}" if copies else "0"
        message = f"{len(status)} adapter(s), each on {spread} of {num_pods} ready pod(s)"
    return api.Condition(
        type=ADAPTERS_LOADED,
        status=ok,
        reason=reason,
        message=message,
        observed_generation=generation,
    )
