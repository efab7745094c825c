"""kube_routes.build_routes: ModelDeployments and their pods as the API returns them -> routes
(served names, ready backends, fallbacks, conflicts), table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.gateway.kube.routes import (
    Resolution,
    SecretKey,
    build_routes,
    ready_backends,
    secrets_needed,
    slim_pod,
)
from kvpilot.gateway.routing.routes import Backend, Provider, Route, ScaleTarget


def md(
    name: str,
    uri: str = "hf://org/Model-7B",
    namespace: str = "ml",
    created: str = "2026-01-01T00:00:00Z",
    served: str | None = None,
    fallbacks: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    model: dict[str, Any] = {"uri": uri}
    if served:
        model["servedName"] = served
    spec: dict[str, Any] = {"model": model}
    if fallbacks is not None:
        spec["routing"] = {"fallbacks": fallbacks, "fallbackAfterSeconds": 30}
    meta = {"name": name, "namespace": namespace, "creationTimestamp": created}
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": meta,
        "spec": spec,
    }


def pod(
    name: str,
    ip: str | None = "10.0.0.1",
    model: str = "llm",
    namespace: str = "ml",
    ready: str | None = "True",
    phase: str = "Running",
    deleting: bool = False,
    port_name: str = "http",
) -> dict[str, Any]:
    """A runtime pod as the API returns it (the fields routing reads, and some it does not)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"kvpilot.dev/model": model, "kvpilot.dev/node-type": "l4"},
        "uid": "u",
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    conditions = [{"type": "PodScheduled", "status": "True"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": ready, "lastTransitionTime": "x"})
    status: dict[str, Any] = {"phase": phase, "conditions": conditions, "hostIP": "10.1.0.1"}
    if ip:
        status["podIP"] = ip
    container = {
        "name": "runtime",
        "image": "runtime:1",
        "ports": [{"name": port_name, "containerPort": 8000, "protocol": "TCP"}],
    }
    return {"metadata": meta, "spec": {"containers": [container]}, "status": status}


def no_secrets(namespace: str, name: str, key: str) -> str | None:
    return None


def backends(resolution: Resolution, model: str) -> list[str]:
    route = next(r for r in resolution.routes if r.model == model)
    return [b.name for b in route.backends]


READY_CASES = [
    ("ready", [pod("p0")], ["ml/p0"]),
    ("not ready", [pod("p0", ready="False")], []),
    ("no Ready condition yet", [pod("p0", ready=None)], []),
    ("terminating, still ready", [pod("p0", deleting=True)], []),
    ("pending", [pod("p0", phase="Pending")], []),
    ("no IP yet", [pod("p0", ip=None)], []),
    ("no port named http", [pod("p0", port_name="metrics")], []),
    (
        "sorted by pod, one of three not ready",
        [pod("p1", "10.0.0.2"), pod("p2", "10.0.0.3", ready="False"), pod("p0")],
        ["ml/p0", "ml/p1"],
    ),
    ("another model's pod", [pod("p0", model="other")], []),
    ("same model name, other namespace", [pod("p0", namespace="dev")], []),
]


@pytest.mark.parametrize(("case", "pods", "want"), READY_CASES, ids=[c[0] for c in READY_CASES])
def test_only_running_ready_not_terminating_pods_are_backends(
    case: str, pods: list[dict[str, Any]], want: list[str]
) -> None:
    got = build_routes([md("llm")], pods, no_secrets)
    assert backends(got, "Model-7B") == want, case


@pytest.mark.parametrize(
    ("ip", "want"),
    [("10.0.0.1", "http://10.0.0.1:8000"), ("fd00::1", "http://[fd00::1]:8000")],
)
def test_backend_url_is_the_pod_ip_and_its_http_port(ip: str, want: str) -> None:
    (route,) = build_routes([md("llm")], [pod("p0", ip)], no_secrets).routes
    assert route.backends == (Backend("ml/p0", want),)


@pytest.mark.parametrize(
    "variant",
    [{}, {"ready": "False"}, {"deleting": True}, {"ip": None}, {"phase": "Pending"}],
)
def test_slim_pod_keeps_what_routing_reads(variant: dict[str, Any]) -> None:
    full = pod("p0", **variant)
    slim = slim_pod(full)
    assert ready_backends([slim]) == ready_backends([full])
    assert "uid" not in slim["metadata"] and "hostIP" not in slim["status"]


SERVED_CASES = [
    ("last element of the URI", md("a", uri="hf://org/Model-7B"), "Model-7B"),
    ("without the hf revision", md("a", uri="hf://org/Model-7B@abc123"), "Model-7B"),
    ("servedName wins", md("a", served="chat"), "chat"),
    ("pvc path", md("a", uri="pvc://claim/models/qwen"), "qwen"),
]


@pytest.mark.parametrize(("case", "obj", "want"), SERVED_CASES, ids=[c[0] for c in SERVED_CASES])
def test_route_is_keyed_by_the_served_name(case: str, obj: dict[str, Any], want: str) -> None:
    (route,) = build_routes([obj], [], no_secrets).routes
    assert route == Route(want, scale_target=ScaleTarget("ml", "a")), case


def test_a_model_with_no_ready_replica_still_has_a_route_to_wake() -> None:
    (route,) = build_routes([md("llm")], [], no_secrets).routes
    assert route.backends == () and route.scale_target == ScaleTarget("ml", "llm")


def test_an_invalid_spec_is_a_problem_not_a_crash() -> None:
    broken = md("broken")
    broken["spec"]["model"] = {"url": "hf://x/y"}
    got = build_routes([broken, md("ok", served="ok")], [], no_secrets)
    assert [r.model for r in got.routes] == ["ok"]
    (problem,) = got.problems
    assert problem.startswith("ModelDeployment ml/broken: spec.model is invalid")


CONFLICT_CASES = [
    (
        "the oldest wins",
        [md("new", created="2026-02-01T00:00:00Z"), md("old", created="2026-01-01T00:00:00Z")],
        ScaleTarget("ml", "old"),
    ),
    (
        "same age: namespace then name",
        [md("b", namespace="x"), md("a", namespace="y"), md("c", namespace="x")],
        ScaleTarget("x", "b"),
    ),
]


@pytest.mark.parametrize(
    ("case", "objs", "want"), CONFLICT_CASES, ids=[c[0] for c in CONFLICT_CASES]
)
def test_two_deployments_serving_one_name_pick_deterministically(
    case: str, objs: list[dict[str, Any]], want: ScaleTarget
) -> None:
    for order in (objs, objs[::-1]):
        got = build_routes(order, [], no_secrets)
        (route,) = got.routes
        assert route.scale_target == want, case
        (problem,) = got.problems
        assert f"routing to {want.namespace}/{want.name} (the oldest)" in problem
        assert "servedName" in problem


def test_the_loser_of_a_conflict_lends_no_backends() -> None:
    old, new = md("old", created="2026-01-01T00:00:00Z"), md("new", created="2026-03-01T00:00:00Z")
    pods = [pod("o0", model="old"), pod("n0", "10.0.0.2", model="new")]
    assert backends(build_routes([new, old], pods, no_secrets), "Model-7B") == ["ml/o0"]


KEYS = {("ml", "example-key", "api-key"): "sk-test"}


def lookup(namespace: str, name: str, key: str) -> str | None:
    return KEYS.get((namespace, name, key))


PROVIDER = {
    "baseURL": "https://api.example.com/v1/",
    "model": "gpt-4o-mini",
    "apiKeySecretRef": {"name": "example-key", "key": "api-key"},
}


FALLBACK_CASES: list[tuple[str, list[dict[str, Any]], tuple[Any, ...], list[str]]] = [
    ("none", [], (), []),
    ("another deployment by served name", [{"modelDeployment": "small"}], ("small-chat",), []),
    (
        "provider with its key",
        [{"provider": PROVIDER}],
        (Provider("big/0", "https://api.example.com/v1", "gpt-4o-mini", "sk-test"),),
        [],
    ),
    (
        "in order, provider named by its index",
        [{"provider": PROVIDER}, {"modelDeployment": "small"}],
        (Provider("big/0", "https://api.example.com/v1", "gpt-4o-mini", "sk-test"), "small-chat"),
        [],
    ),
    (
        "provider without a key",
        [{"provider": {"baseURL": "http://local:8080/v1", "model": "m"}}],
        (Provider("big/0", "http://local:8080/v1", "m", None),),
        [],
    ),
    (
        "unreadable key: skipped, said",
        [
            {"provider": {**PROVIDER, "apiKeySecretRef": {"name": "gone", "key": "k"}}},
            {"modelDeployment": "small"},
        ],
        ("small-chat",),
        ["spec.routing.fallbacks[0]: cannot read key 'k' of Secret ml/gone"],
    ),
    (
        "missing deployment: skipped, said",
        [{"modelDeployment": "nope"}, {"modelDeployment": "small"}],
        ("small-chat",),
        ["spec.routing.fallbacks[0]: no ModelDeployment 'nope' serves in ml"],
    ),
    ("itself is no fallback", [{"modelDeployment": "big"}], (), []),
]


@pytest.mark.parametrize(
    ("case", "specs", "want", "problems"), FALLBACK_CASES, ids=[c[0] for c in FALLBACK_CASES]
)
def test_fallbacks_from_spec_routing(
    case: str, specs: list[dict[str, Any]], want: tuple[Any, ...], problems: list[str]
) -> None:
    objs = [md("big", served="big-chat", fallbacks=specs), md("small", served="small-chat")]
    got = build_routes(objs, [], lookup)
    route = next(r for r in got.routes if r.model == "big-chat")
    assert route.fallbacks == want, case
    assert len(got.problems) == len(problems)
    for have, fragment in zip(got.problems, problems, strict=True):
        assert fragment in have


def test_a_deployment_in_another_namespace_is_no_fallback() -> None:
    objs = [
        md("big", served="big", fallbacks=[{"modelDeployment": "small"}]),
        md("small", namespace="dev"),
    ]
    got = build_routes(objs, [], no_secrets)
    assert next(r for r in got.routes if r.model == "big").fallbacks == ()
    assert "no ModelDeployment 'small' serves in ml" in got.problems[0]


def test_secrets_needed_names_every_provider_key() -> None:
    other = {**PROVIDER, "apiKeySecretRef": {"name": "other", "key": "token"}}
    objs = [
        md("a", fallbacks=[{"provider": PROVIDER}, {"modelDeployment": "b"}]),
        md("b", namespace="dev", fallbacks=[{"provider": other}]),
        md("c"),
    ]
    assert secrets_needed(objs) == {
        SecretKey("ml", "example-key", "api-key"),
        SecretKey("dev", "other", "token"),
    }


def test_the_api_key_stays_out_of_repr() -> None:
    (route,) = [
        r for r in build_routes([md("a", fallbacks=[{"provider": PROVIDER}])], [], lookup).routes
    ]
    assert "sk-test" not in repr(route)


@pytest.mark.parametrize(
    ("routing", "want"),
    [(None, None), ({"fallbacks": []}, None), ({"fallbackAfterSeconds": 12}, 12.0)],
)
def test_fallback_deadline_from_spec_routing(
    routing: dict[str, Any] | None, want: float | None
) -> None:
    obj = md("a")
    if routing is not None:
        obj["spec"]["routing"] = routing
    (route,) = build_routes([obj], [], no_secrets).routes
    assert route.fallback_after_s == want


def runs(policy: str | None, **kwargs: Any) -> dict[str, Any]:
    """A runtime pod whose args are the operator's (`--scheduling-policy=P` only when not fcfs)."""
    made = pod(**{"name": "p0", **kwargs})
    flags = [] if policy is None else [f"--scheduling-policy={policy}"]
    made["spec"]["containers"][0]["args"] = ["serve", "--model=/m", *flags, "--port=8000"]
    return made


def with_policy(policy: str | None) -> dict[str, Any]:
    obj = md("llm")
    if policy is not None:
        obj["spec"]["serving"] = {"schedulingPolicy": policy}
    return obj


PRIORITY_CASES = [
    ("no serving: fcfs", None, [runs(None)], False),
    ("fcfs", "fcfs", [runs(None)], False),
    ("priority, its pod runs it", "priority", [runs("priority")], True),
    ("priority, no pod yet (scaled to zero)", "priority", [], True),
    ("priority, an old fcfs pod still serves (rollout)", "priority",
     [runs("priority"), runs(None, name="p1", ip="10.0.0.2")], False),
    ("priority, the old fcfs pod is terminating", "priority",
     [runs("priority"), runs(None, name="p1", ip="10.0.0.2", deleting=True)], True),
    ("priority, the old fcfs pod is not ready", "priority",
     [runs("priority"), runs(None, name="p1", ip="10.0.0.2", ready="False")], True),
    ("back to fcfs, a priority pod still serves", "fcfs", [runs("priority")], False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "policy", "pods", "want"), PRIORITY_CASES, ids=[c[0] for c in PRIORITY_CASES]
)
def test_routes_of_a_priority_deployment_take_priority(
    case: str, policy: str | None, pods: list[dict[str, Any]], want: bool
) -> None:
    (route,) = build_routes([with_policy(policy)], pods, no_secrets).routes
    assert route.takes_priority is want, case
    (slimmed,) = build_routes([with_policy(policy)], list(map(slim_pod, pods)), no_secrets).routes
    assert slimmed.takes_priority is want, f"{case}, as the watch keeps pods"
