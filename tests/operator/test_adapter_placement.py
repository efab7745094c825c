"""Which pod loads or unloads which adapter, and what status says: tables (adapters/placement.py
and the pure parts of adapters/sync.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator import api
from kvpilot.operator.adapters import placement, pod_api, sync
from kvpilot.operator.adapters.placement import Action, Outcome, PodAdapters

A, B, C = "hf://org/a", "s3://bucket/b", "file:///srv/c"


EVERYWHERE = {"p0": {"a", "b", "c"}, "p1": {"a", "b", "c"}}


@pytest.mark.parametrize(
    ("want", "plan", "pods", "expected"),
    [
        ({}, {}, [], []),
        ({"a": A}, EVERYWHERE, [PodAdapters("p0", {})], [Action("p0", "load", "a", A)]),
        ({"a": A}, EVERYWHERE, [PodAdapters("p0", {"a": A})], []),  # held: nothing to do
        (  # each pod gets what it lacks, in the spec's order
            {"a": A, "b": B},
            EVERYWHERE,
            [PodAdapters("p0", {"b": B}), PodAdapters("p1", {})],
            [
                Action("p0", "load", "a", A),
                Action("p1", "load", "a", A),
                Action("p1", "load", "b", B),
            ],
        ),
        (  # only what the plan gives each pod
            {"a": A, "b": B},
            {"p0": {"a"}, "p1": {"b"}},
            [PodAdapters("p0", {}), PodAdapters("p1", {})],
            [Action("p0", "load", "a", A), Action("p1", "load", "b", B)],
        ),
        (  # removed from the spec: unloaded
            {"a": A},
            EVERYWHERE,
            [PodAdapters("p0", {"a": A, "c": C})],
            [Action("p0", "unload", "c")],
        ),
        (  # its URI changed: unloaded, then loaded from the new one
            {"a": B},
            EVERYWHERE,
            [PodAdapters("p0", {"a": A})],
            [Action("p0", "unload", "a"), Action("p0", "load", "a", B)],
        ),
        (  # unloads first, to free host memory before loading
            {"b": B},
            EVERYWHERE,
            [PodAdapters("p0", {"a": A})],
            [Action("p0", "unload", "a"), Action("p0", "load", "b", B)],
        ),
        (  # moved from p0 to p1: p0 keeps it until p1 holds it (make before break)
            {"a": A},
            {"p0": set(), "p1": {"a"}},
            [PodAdapters("p0", {"a": A}), PodAdapters("p1", {})],
            [Action("p1", "load", "a", A)],
        ),
        (  # ... and lets it go once p1 does
            {"a": A},
            {"p0": set(), "p1": {"a"}},
            [PodAdapters("p0", {"a": A}), PodAdapters("p1", {"a": A})],
            [Action("p0", "unload", "a")],
        ),
        (  # fewer copies, another holder planned and holding: unloaded at once
            {"a": A},
            {"p0": {"a"}, "p1": set()},
            [PodAdapters("p0", {"a": A}), PodAdapters("p1", {"a": A})],
            [Action("p1", "unload", "a")],
        ),
    ],
)
def test_decide(
    want: dict[str, str],
    plan: dict[str, set[str]],
    pods: list[PodAdapters],
    expected: list[Action],
) -> None:
    assert placement.decide(want, plan, pods) == expected


def test_after_keeps_what_failed_as_it_was() -> None:
    pods = [PodAdapters("p0", {"c": C}), PodAdapters("p1", {})]
    outcomes = [
        Outcome(Action("p0", "unload", "c")),
        Outcome(Action("p0", "load", "a", A)),
        Outcome(Action("p1", "load", "a", A), "400 cannot fetch"),
    ]
    assert placement.after(pods, outcomes) == [
        PodAdapters("p0", {"a": A}),
        PodAdapters("p1", {}),
    ]


def test_statuses_name_the_pods_and_the_first_refusal() -> None:
    want = {"a": A, "b": B}
    held = [PodAdapters("p1", {"a": A, "b": A}), PodAdapters("p0", {"a": A})]
    outcomes = [
        Outcome(Action("p0", "load", "b", B), "400 rank 64 above --max-lora-rank 16"),
        Outcome(Action("p1", "load", "b", B), "400 later"),
        Outcome(Action("p1", "unload", "x"), "500 ignored: not a load"),
    ]
    assert placement.statuses(want, held, outcomes) == [
        api.AdapterStatus(name="a", uri=A, pods=["p0", "p1"]),
        # p1 holds b from another URI: not served from the spec's
        api.AdapterStatus(
            name="b", uri=B, pods=[], message="p0: 400 rank 64 above --max-lora-rank 16"
        ),
    ]


def adapter(name: str, pods: list[str], message: str = "") -> api.AdapterStatus:
    return api.AdapterStatus(name=name, uri=A, pods=pods, message=message)


ON_BOTH = {"p0": {"a", "b"}, "p1": {"a", "b"}}


@pytest.mark.parametrize(
    ("status", "plan", "num_pods", "expected"),
    [
        (
            [adapter("a", ["p0", "p1"])],
            ON_BOTH,
            2,
            ("True", "AllLoaded", "1 adapter(s), each on 2-2 of 2"),
        ),
        (  # a cold adapter on the one pod its plan names is loaded
            [adapter("a", ["p0", "p1"]), adapter("b", ["p1"])],
            {"p0": {"a"}, "p1": {"a", "b"}},
            2,
            ("True", "AllLoaded", "2 adapter(s), each on 1-2 of 2"),
        ),
        ([], {"p0": set()}, 1, ("True", "AllLoaded", "0 adapter(s)")),
        ([adapter("a", [])], {}, 0, ("Unknown", "NoReadyPods", "no ready pod")),
        (
            [adapter("a", ["p0"])],
            ON_BOTH,
            2,
            ("False", "Loading", "not on every pod placed for it yet: a"),
        ),
        (
            [adapter("a", ["p0"]), adapter("b", [], "p0: 400 no such repo")],
            {"p0": {"a", "b"}},
            1,
            ("False", "AdapterLoadFailed", "adapter b: p0: 400 no such repo (1 other"),
        ),
    ],
)
def test_condition(
    status: list[api.AdapterStatus],
    plan: dict[str, set[str]],
    num_pods: int,
    expected: tuple[str, str, str],
) -> None:
    got = placement.condition(status, plan, num_pods, generation=3)
    assert (got.type, got.status, got.reason) == (placement.ADAPTERS_LOADED, *expected[:2])
    assert expected[2] in got.message and got.observed_generation == 3


def pod(name: str, ready: bool = True, ip: str | None = "10.0.0.1", **meta: Any) -> dict[str, Any]:
    state = "True" if ready else "False"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": state}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, **meta}, "status": status}


def test_ready_pod_bases() -> None:
    pods = [
        pod("up"),
        pod("starting", ready=False),
        pod("no-ip", ip=None),
        pod("going", deletionTimestamp="2026-01-01T00:00:00Z"),
    ]
    assert sync.ready_pod_bases(pods, 8000) == {"up": "http://10.0.0.1:8000"}


NOW = "2026-12-06T16:00:00Z"


def test_status_patch_writes_only_changes_and_clears_when_lora_is_off() -> None:
    ready = api.Condition(type="Ready", status="True")
    loaded = placement.condition([adapter("a", ["p0"])], {"p0": {"a"}}, 1, 1)
    old = api.ModelDeploymentStatus(conditions=[ready])
    patch = sync.status_patch(old, [adapter("a", ["p0"])], loaded, NOW)
    assert patch is not None
    assert patch["adapters"] == [{"name": "a", "uri": A, "pods": ["p0"], "message": ""}]
    assert [c["type"] for c in patch["conditions"]] == [placement.ADAPTERS_LOADED, "Ready"]
    written = api.ModelDeploymentStatus.model_validate(patch)
    assert sync.status_patch(written, [adapter("a", ["p0"])], loaded, NOW) is None
    cleared = sync.status_patch(written, [], None, NOW)
    assert cleared == {"adapters": [], "conditions": [{**patch["conditions"][1]}]}


@pytest.mark.parametrize(
    ("spec", "status", "expected"),
    [
        ({}, {}, False),
        ({"lora": {}}, {}, True),
        ({"adapters": [{"name": "a", "uri": A}]}, {}, True),
        ({}, {"adapters": [{"name": "a", "uri": A}]}, True),  # to be cleared
        ({}, {"conditions": [{"type": placement.ADAPTERS_LOADED, "status": "True"}]}, True),
    ],
)
def test_has_lora_work(spec: dict[str, Any], status: dict[str, Any], expected: bool) -> None:
    md = {"spec": spec, "status": status}
    parsed = api.ModelDeploymentStatus.model_validate(status)
    assert sync.has_lora_work(md, parsed) is expected


RUNTIME_METRICS = """# HELP kvpilot_lora_requests_received_total Requests received per LoRA adapter.
# TYPE kvpilot_lora_requests_received_total counter
kvpilot_lora_requests_received_total{lora_name="sql",model_name="tiny"} 12.0
kvpilot_lora_requests_received_total{lora_name="chat",model_name="tiny"} 3.0
kvpilot_lora_requests_received_created{lora_name="sql",model_name="tiny"} 1.7e+09
kvpilot_request_received_total{model_name="tiny"} 20.0
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (RUNTIME_METRICS, {"sql": 12.0, "chat": 3.0}),  # _created and other counters ignored
        ('vllm:num_requests_running{model_name="tiny"} 1.0\n', {}),  # vLLM: none counted
        ("", {}),
    ],
)
def test_parse_requests_by_adapter(text: str, expected: dict[str, float]) -> None:
    assert pod_api.parse_requests_by_adapter(text) == expected


@pytest.mark.parametrize(
    ("lora", "expected"),
    [
        ({"maxLoras": 2, "maxCpuLoras": 6}, 6),  # the host cache's adapters per pod
        ({"maxLoras": 3}, 3),  # the runtime's default --max-cpu-loras: --max-loras
        ({}, api.DEFAULT_MAX_LORAS),
    ],
)
def test_slots_of(lora: dict[str, int], expected: int) -> None:
    spec = api.parse_spec({"model": {"uri": "hf://org/base"}, "lora": lora})
    assert sync.slots_of(spec) == expected
