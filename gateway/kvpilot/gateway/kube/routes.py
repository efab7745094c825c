"""ModelDeployments and their runtime pods (as the API returns them, plain dicts) -> the gateway's
routes. Pure: the watch in kube/discovery.py keeps the objects and calls `build_routes` on a change.

- A ModelDeployment's served name is `resource.served_name` of spec.model, what the runtime serves.
- Its ready replicas are its pods (label `kvpilot.dev/model=<name>`, the operator's selector) that
  run, have an IP and the condition Ready, and are not terminating (no deletionTimestamp), on
  their container port named `http`: a pod that turns not-Ready or is being deleted leaves the
  route at its next watch event, before the endpoints controller would have noticed. (Pods, not
  EndpointSlices: the apiserver refuses loopback addresses in EndpointSlices, and the dev
  cluster's pods, real processes, have 127.x addresses.)
- `spec.routing.fallbacks` become the route's fallbacks in order: another ModelDeployment of the
  same namespace by its served name, or an external provider named `<md>/<index>` with its API
  key from a Secret of the same namespace.
- `spec.routing.cascade` rules, in order: `modelDeployment` by its served name (same namespace);
  a rule naming a ModelDeployment that does not exist is skipped (target None) with a problem.
- `spec.serving.schedulingPolicy: priority` marks the route `takes_priority` (the gateway sends
  each request's `priority` to its replicas), once every ready pod runs the runtime with
  `--scheduling-policy=priority`: while a rollout from fcfs still has an old pod serving, which
  would refuse a priority other than 0, none is sent (the gateway's own queue still orders by it).
- Two ModelDeployments serving one name: the oldest wins (then namespace/name), and a problem
  says so. Every problem is one line for the log; a bad object never stops the others' routes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.contract import resource
from kvpilot.gateway.budget.arithmetic import Price
from kvpilot.gateway.routing.cascade_rules import CascadeRule, find_cycle
from kvpilot.gateway.routing.routes import Backend, Fallback, Provider, Route, ScaleTarget

Obj = Mapping[str, Any]
PORT_NAME = "http"  # the runtime container's port, as manifests.build_deployment names it
# The runtime's flag as the operator writes it (serve_config.to_args: `--flag=value`).
SCHEDULING_FLAG = "--scheduling-policy="

# (namespace, Secret name, key) -> the value, or None when it cannot be read
SecretLookup = Callable[[str, str, str], str | None]


@dataclass(frozen=True)
class SecretKey:
    """A key of a Secret a route needs (a provider's API key)."""

    namespace: str
    name: str
    key: str


@dataclass(frozen=True)
class Resolution:
    routes: tuple[Route, ...]
    problems: tuple[str, ...]


def key_of(obj: Obj) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"


def served_name(md: Obj) -> str:
    """The name the runtime serves; ValueError naming the object when spec.model is invalid."""
    try:
        model = md["spec"]["model"]
        return resource.served_name(model["uri"], model.get("servedName"))
    except (KeyError, TypeError, ValueError) as error:
        first = str(error).splitlines()[0]
        raise ValueError(f"ModelDeployment {key_of(md)}: spec.model is invalid ({first})") from None


def fallback_specs(md: Obj) -> list[Obj]:
    routing = md.get("spec", {}).get("routing") or {}
    return list(routing.get("fallbacks") or [])


def fallback_after_s(md: Obj) -> float | None:
    """spec.routing.fallbackAfterSeconds; None (the gateway's default) without spec.routing."""
    seconds = (md.get("spec", {}).get("routing") or {}).get("fallbackAfterSeconds")
    return float(seconds) if seconds is not None else None


def price(md: Obj) -> Price | None:
    """status.cost.perMillionOutputTokens as the price of output tokens: the operator divides the
    replicas' price by the output tokens they completed, so prompt processing is already in it
    (input tokens are priced 0). None until the operator has measured traffic."""
    per_million = ((md.get("status") or {}).get("cost") or {}).get("perMillionOutputTokens")
    if not isinstance(per_million, (int, float)) or per_million < 0:
        return None
    return Price(input_per_million=0.0, output_per_million=float(per_million))


def pod_scheduling_policy(pod: Obj) -> str:
    """The runtime's --scheduling-policy in the pod's args; fcfs (its default) when absent."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for arg in container.get("args") or []:
            if arg.startswith(SCHEDULING_FLAG):
                return str(arg.removeprefix(SCHEDULING_FLAG))
    return "fcfs"


def takes_priority(md: Obj, pods: Iterable[Obj]) -> bool:
    """spec.serving.schedulingPolicy is priority and every serving pod already runs it."""
    serving = (md.get("spec") or {}).get("serving") or {}
    if serving.get("schedulingPolicy") != "priority":
        return False
    return all(pod_scheduling_policy(pod) == "priority" for pod in pods if is_serving(pod))


def secrets_needed(deployments: Iterable[Obj]) -> set[SecretKey]:
    """The Secret keys the providers of these ModelDeployments name (read before building)."""
    needed = set()
    for md in deployments:
        for spec in fallback_specs(md):
            ref = (spec.get("provider") or {}).get("apiKeySecretRef")
            if ref:
                needed.add(SecretKey(md["metadata"]["namespace"], ref["name"], ref["key"]))
    return needed


def build_routes(
    deployments: Iterable[Obj], pods: Iterable[Obj], secret: SecretLookup
) -> Resolution:
    """Every served model's route. `secret` answers for the keys `secrets_needed` names."""
    problems: list[str] = []
    owners = _owners(list(deployments), problems)
    names = {(md["metadata"]["namespace"], md["metadata"]["name"]): n for n, md in owners.items()}
    by_model = _pods_by_model(pods)
    routes = []
    for model, md in sorted(owners.items()):
        meta = md["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        fallbacks = _fallbacks(md, names, secret, problems)
        model_pods = by_model.get((namespace, name), [])
        backends = ready_backends(model_pods)
        target = ScaleTarget(namespace, name)
        cascade = cascade_rules(md, names, problems)
        routes.append(Route(model, backends, fallbacks, target, fallback_after_s(md),
                            cascade=cascade, price=price(md),
                            takes_priority=takes_priority(md, model_pods)))  # fmt: skip
    report_cascade_cycle(routes, problems)
    routes += adapter_routes(routes, owners, problems)
    return Resolution(tuple(routes), tuple(problems))


def adapter_routes(base: list[Route], owners: dict[str, Obj], problems: list[str]) -> list[Route]:
    """A route per spec.adapters name: its base model's replicas, fallbacks, scale target and
    price under the adapter's name (what clients send, what budgets and the cache key on); an
    adapter whose name another model or adapter serves already is left out, with a problem."""
    taken = {route.model for route in base}
    routes = []
    for route in base:
        md = owners[route.model]
        for adapter in (md.get("spec") or {}).get("adapters") or []:
            name = str(adapter.get("name", ""))
            if not name or name in taken:
                problems.append(
                    f"ModelDeployment {key_of(md)}: adapter {name!r} is not routed: another"
                    " model or adapter is served under that name; rename one of them"
                )
                continue
            taken.add(name)
            routes.append(
                dataclasses.replace(route, model=name, cascade=(), adapter_of=route.model)
            )
    return routes


def report_cascade_cycle(routes: list[Route], problems: list[str]) -> None:
    """Cascade rules of several ModelDeployments may form a cycle no one object's CEL rule can
    see: a problem line names its rules (a request is re-routed once, so it never loops; the
    static config refuses such rules)."""
    edges = {r.model: [(i, rule.target) for i, rule in enumerate(r.cascade) if rule.target]
             for r in routes}  # fmt: skip
    cycle = find_cycle(edges)
    if cycle is not None:
        rules = ", ".join(
            f"{model}: cascade[{index}] -> {target}" for model, index, target in cycle
        )
        problems.append(f"cascade rules form a cycle ({rules}): a model that requests cascade "
                        "to should not cascade back; remove one of them")  # fmt: skip


def _age_order(md: Obj) -> tuple[str, str, str]:
    # RFC 3339 UTC timestamps sort as text; a missing one (never from the API) sorts first.
    meta = md["metadata"]
    return meta.get("creationTimestamp", ""), meta["namespace"], meta["name"]


def _owners(deployments: list[Obj], problems: list[str]) -> dict[str, Obj]:
    """Served name -> the ModelDeployment that serves it (the oldest of several)."""
    claims: dict[str, list[Obj]] = {}
    for md in sorted(deployments, key=_age_order):
        try:
            claims.setdefault(served_name(md), []).append(md)
        except ValueError as error:
            problems.append(str(error))
    for model, claimants in claims.items():
        if len(claimants) > 1:
            others = ", ".join(key_of(md) for md in claimants[1:])
            problems.append(
                f"served name {model!r} is claimed by {len(claimants)} ModelDeployments: routing"
                f" to {key_of(claimants[0])} (the oldest), not {others}; give the others their"
                " own spec.model.servedName"
            )
    return {model: claimants[0] for model, claimants in claims.items()}


def _pods_by_model(pods: Iterable[Obj]) -> dict[tuple[str, str], list[Obj]]:
    grouped: dict[tuple[str, str], list[Obj]] = {}
    for pod in pods:
        meta = pod["metadata"]
        model = (meta.get("labels") or {}).get(resource.LABEL_MODEL)
        if model:
            grouped.setdefault((meta["namespace"], model), []).append(pod)
    return grouped


def ready_backends(pods: Iterable[Obj]) -> tuple[Backend, ...]:
    """The pods that can take a request now, by name."""
    found = [backend for pod in pods if (backend := _backend(pod)) is not None]
    return tuple(sorted(found, key=lambda b: b.name))


def is_serving(pod: Obj) -> bool:
    """Running, Ready and not being deleted (a terminating pod drains; it takes nothing new)."""
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def http_port(pod: Obj) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == PORT_NAME:
                return int(port["containerPort"])
    return None


def _backend(pod: Obj) -> Backend | None:
    address, port = (pod.get("status") or {}).get("podIP"), http_port(pod)
    if not is_serving(pod) or not address or port is None:
        return None
    host = f"[{address}]" if ":" in address else address
    meta = pod["metadata"]
    return Backend(f"{meta['namespace']}/{meta['name']}", f"http://{host}:{port}")


def slim_pod(pod: Obj) -> dict[str, Any]:
    """What routing reads of a pod (the watch keeps this, not the whole object)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    return {
        "metadata": {
            key: meta[key]
            for key in ("name", "namespace", "labels", "deletionTimestamp", "resourceVersion")
            if key in meta
        },
        "spec": {
            "containers": [
                {
                    "ports": c.get("ports") or [],
                    "args": [a for a in c.get("args") or [] if a.startswith(SCHEDULING_FLAG)],
                }
                for c in containers
            ]
        },
        "status": {
            "phase": status.get("phase"),
            "podIP": status.get("podIP"),
            "conditions": [
                {"type": c.get("type"), "status": c.get("status")}
                for c in status.get("conditions") or []
            ],
        },
    }


def _fallbacks(
    md: Obj, served: Mapping[tuple[str, str], str], secret: SecretLookup, problems: list[str]
) -> tuple[Fallback, ...]:
    namespace, name = md["metadata"]["namespace"], md["metadata"]["name"]
    out: list[Fallback] = []
    for index, spec in enumerate(fallback_specs(md)):
        where = f"ModelDeployment {namespace}/{name} spec.routing.fallbacks[{index}]"
        if "modelDeployment" in spec:
            other = served.get((namespace, spec["modelDeployment"]))
            if other is None:
                problems.append(
                    f"{where}: no ModelDeployment {spec['modelDeployment']!r} serves in"
                    f" {namespace}; that fallback is skipped until it exists"
                )
            elif other != served.get((namespace, name)):
                out.append(other)
        elif "provider" in spec:
            provider = _provider(f"{name}/{index}", namespace, spec["provider"], secret)
            if isinstance(provider, str):
                problems.append(f"{where}: {provider}; that fallback is skipped")
            else:
                out.append(provider)
    return tuple(out)


def _provider(label: str, namespace: str, spec: Obj, secret: SecretLookup) -> Provider | str:
    """The Provider, or what is wrong with it."""
    ref = spec.get("apiKeySecretRef")
    api_key = None
    if ref:
        api_key = secret(namespace, ref["name"], ref["key"])
        if api_key is None:
            return (
                f"cannot read key {ref['key']!r} of Secret {namespace}/{ref['name']} (missing, or"
                " the gateway may not get it: chart value gateway.rbac.readProviderSecrets)"
            )
    return Provider(label, str(spec["baseURL"]).rstrip("/"), str(spec["model"]), api_key)


def cascade_rules(
    md: Obj, served: Mapping[tuple[str, str], str], problems: list[str]
) -> tuple[CascadeRule, ...]:
    """spec.routing.cascade with each modelDeployment as the served name it routes to (None
    while it does not exist: the rule is skipped, the others keep their indices)."""
    namespace, name = md["metadata"]["namespace"], md["metadata"]["name"]
    rules = (md.get("spec", {}).get("routing") or {}).get("cascade") or []
    out = []
    for index, rule in enumerate(rules):
        target = served.get((namespace, rule.get("modelDeployment", "")))
        if target is None:
            problems.append(
                f"ModelDeployment {namespace}/{name} spec.routing.cascade[{index}]: no"
                f" ModelDeployment {rule.get('modelDeployment')!r} serves in {namespace}; that"
                " rule is skipped until it exists"
            )
        when = rule.get("when") or {}
        out.append(CascadeRule(target, when.get("maxPromptTokens"), bool(when.get("noTools"))))
    return tuple(out)
