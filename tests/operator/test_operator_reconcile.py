"""One pass as data: desire() and build_status(), and the conditions they carry."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvpilot.contract.memory import ModelFacts
from kvpilot.operator.api import Condition
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.reconcile import conditions, desired_state, typed_status

CONFIG = OperatorConfig()
T4 = NodeType(
    name="t4-16gb",
    product="Tesla-T4",
    gpu_memory_mib=15360,
    gpus_per_node=1,
    price_per_hour=0.53,
    node_selector={"kvpilot.dev/node-type": "t4-16gb"},
    nodes=("t0", "t1"),
    free_gpus_per_node=(1, 1),
)
H100 = NodeType(
    name="h100-80gb",
    product="H100",
    gpu_memory_mib=81559,
    gpus_per_node=8,
    price_per_hour=98.32,
    node_selector={"kvpilot.dev/node-type": "h100-80gb"},
    nodes=("h0",),
    free_gpus_per_node=(8,),
)


def seen(*node_types: NodeType, **observed: Any) -> desired_state.Observed:
    """What a pass observed: these node types, and the other Observed fields given."""
    return desired_state.Observed(node_types=node_types, **observed)


def md(spec: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 2},
        "spec": spec,
        "status": status or {},
    }


LLAMA_70B = {
    "model": {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
    "serving": {"maxContextLength": 8192},
}


def test_spread_over_node_types_honours_free_gpus() -> None:
    spec = {**LLAMA_70B, "autoscaling": {"mode": "off", "replicas": 3}}
    desired = desired_state.desire(md(spec), CONFIG, seen(T4, H100))
    assert desired.error is None
    # H100 holds two tp-4 replicas on its 8 free GPUs; T4 does not fit, so the third waits there.
    assert [(e.node_type, e.replicas, e.fits) for e in desired.plan] == [
        ("h100-80gb", 3, True),
        ("t4-16gb", 0, False),
    ]
    assert desired.num_unplaceable == 1
    assert [c["metadata"]["name"] for c in desired.children] == ["m-h100-80gb", "m"]


def test_nothing_fits_reports_every_node_type_with_numbers() -> None:
    desired = desired_state.desire(md(LLAMA_70B), CONFIG, seen(T4))
    assert desired.children == [] and not desired.is_invalid_spec
    assert desired.error == (
        "no node type fits: t4-16gb: int4 needs 57.7 GiB per GPU (weights 34.9 + KV 20.0"
        " + overhead 2.7) > 13.5 GiB usable"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"model": {"uri": "pvc://weights/mine"}},
            "set spec.model parameters, layers, kvHeads, headDim",
        ),
        (
            {"model": {"uri": "hf://a/b"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 1}},
            "minReplicas",
        ),
    ],
)
def test_invalid_spec_is_permanent(spec: dict[str, Any], message: str) -> None:
    desired = desired_state.desire(md(spec), CONFIG, seen(H100))
    assert desired.is_invalid_spec
    assert desired.error is not None and message in desired.error


def test_status_of_a_pass() -> None:
    spec = {**LLAMA_70B, "autoscaling": {"mode": "external", "replicas": 1}}
    obj = md(spec)
    desired = desired_state.desire(obj, CONFIG, seen(H100))
    deployment = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {
            "observedGeneration": 1,
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": 1,
        },
    }
    status = desired_state.build_status(
        obj, typed_status.EMPTY, desired, [deployment], CONFIG, "2026-01-01T00:00:00Z"
    )
    assert status["observedGeneration"] == 2
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert status["selector"] == "kvpilot.dev/model=m"
    assert status["quantization"] == "bf16"
    assert status["endpoint"] == "http://m.ns.svc:8000/v1"
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["Ready"]["status"] == "True"
    assert by_type["Progressing"]["status"] == "False"
    assert by_type["Degraded"]["status"] == "False"
    assert "h100-80gb: bf16 on 4 GPU(s) x1" in by_type["Planned"]["message"]
    assert status["plan"][0]["weightsGiB"] == pytest.approx(32.85, abs=0.01)


def test_merge_keeps_transition_time_of_unchanged_conditions() -> None:
    old = [
        Condition(type="Ready", status="True", last_transition_time="t0"),
        Condition(type="MetricsAvailable", status="True", last_transition_time="t0"),
    ]
    new = [Condition(type="Ready", status="True"), Condition(type="Degraded", status="False")]
    merged = {c.type: c for c in conditions.merge(old, new, "t1")}
    assert merged["Ready"].last_transition_time == "t0"
    assert merged["Degraded"].last_transition_time == "t1"
    assert merged["MetricsAvailable"].last_transition_time == "t0"  # the autoscaler's, untouched
    flipped = conditions.merge(old, [Condition(type="Ready", status="False")], "t2")
    assert flipped[0].last_transition_time == "t2"


@pytest.mark.parametrize(
    ("deployments", "expected"),
    [
        ([], conditions.Rollout(0, 0, 0, True)),
        (
            [
                {
                    "metadata": {"generation": 2},
                    "spec": {"replicas": 2},
                    "status": {
                        "observedGeneration": 1,
                        "replicas": 2,
                        "updatedReplicas": 2,
                        "readyReplicas": 2,
                    },
                }
            ],
            conditions.Rollout(2, 2, 2, False),  # a new generation not yet observed
        ),
        (
            [
                {
                    "metadata": {"generation": 1},
                    "spec": {"replicas": 2},
                    "status": {
                        "observedGeneration": 1,
                        "replicas": 3,
                        "updatedReplicas": 1,
                        "readyReplicas": 2,
                    },
                }
            ],
            conditions.Rollout(2, 2, 1, False),  # old and new pods side by side
        ),
    ],
)
def test_summarize(deployments: list[dict[str, Any]], expected: conditions.Rollout) -> None:
    assert conditions.summarize(deployments) == expected


def test_plan_changed() -> None:
    obj = md(LLAMA_70B)
    desired = desired_state.desire(obj, CONFIG, seen(H100))
    assert desired_state.plan_changed(typed_status.of(obj), desired)
    obj["status"]["plan"] = [e.model_dump(by_alias=True) for e in desired.plan]
    assert not desired_state.plan_changed(typed_status.of(obj), desired)


@pytest.mark.parametrize(
    ("mode", "autoscaling_status", "expected"),
    [
        ("builtin", {}, [1, 0]),  # minReplicas
        ("builtin", {"desiredReplicas": 3}, [3, 0]),
        ("builtin", {"desiredReplicas": 9}, [4, 0]),  # clamped to maxReplicas
        (
            "builtin",
            {"desiredReplicas": 2, "replicasPerNodeType": {"h100-80gb": 2, "t4-16gb": 5}},
            [2, 0],
        ),  # the autoscaler's spread; t4 does not fit the model
        (
            "builtin",
            {"desiredReplicas": 3, "replicasPerNodeType": {"h100-80gb": 2}},
            [3, 0],
        ),  # a spread that no longer adds up is spread again
        (
            "off",
            {"desiredReplicas": 3, "replicasPerNodeType": {"h100-80gb": 2}},
            [2, 0],
        ),  # spec wins
    ],
)
def test_replicas_follow_the_autoscaler_or_the_scale_subresource(
    mode: str, autoscaling_status: dict[str, Any], expected: list[int]
) -> None:
    spec = {**LLAMA_70B, "autoscaling": {"mode": mode, "replicas": 2, "maxReplicas": 4}}
    obj = md(spec, {"autoscaling": autoscaling_status})
    desired = desired_state.desire(obj, CONFIG, seen(H100, T4, status=typed_status.of(obj)))
    assert [e.replicas for e in desired.plan] == expected


def test_status_written_by_the_autoscaler_is_carried_not_parsed() -> None:
    autoscaler_status = {
        "conditions": [
            {"type": "MetricsAvailable", "status": "False", "reason": "MetricsMissing"},
            {"bad": 1},
        ],
        "autoscaling": {"desiredReplicas": 1, "lastScaleTime": None, "state": {"x": [1, 2]}},
    }
    obj = md(LLAMA_70B, autoscaler_status)
    old = typed_status.of(obj)
    desired = desired_state.desire(obj, CONFIG, seen(H100, status=old))
    status = desired_state.build_status(obj, old, desired, [], CONFIG, "t")
    assert "autoscaling" not in status  # the autoscaler's to write; a merge patch leaves it
    assert {c["type"] for c in status["conditions"]} >= {"Ready", "MetricsAvailable"}


def test_a_new_failure_is_news_once() -> None:
    obj = md({"model": {"uri": "pvc://weights/mine"}})
    desired = desired_state.desire(obj, CONFIG, seen(H100))
    assert desired_state.plan_changed(typed_status.of(obj), desired)
    obj["status"] = desired_state.build_status(obj, typed_status.of(obj), desired, [], CONFIG, "t")
    assert not desired_state.plan_changed(typed_status.of(obj), desired)


@pytest.mark.parametrize(
    ("generation", "observed", "monitoring", "expected"),
    [
        (1, 0, False, False),  # first pass: nothing made yet
        (3, 3, False, False),  # spec unchanged since the last pass: no extra reads
        (4, 3, False, True),  # spec changed and wants none: look for one to delete
        (4, 3, True, False),  # spec changed and still wants one
    ],
)
def test_may_have_dropped_pod_monitor(
    generation: int, observed: int, monitoring: bool, expected: bool
) -> None:
    obj = md(
        {**LLAMA_70B, "monitoring": {"podMonitor": monitoring}}, {"observedGeneration": observed}
    )
    obj["metadata"]["generation"] = generation
    desired = desired_state.desire(obj, CONFIG, seen(H100, has_pod_monitor_crd=True))
    assert (
        desired_state.may_have_dropped_pod_monitor(obj, typed_status.of(obj), desired) is expected
    )


UNCATALOGUED = {"model": {"uri": "hf://acme/in-house-8b"}, "serving": {"maxContextLength": 4096}}


def test_an_uncatalogued_model_is_planned_from_facts_read_at_the_source() -> None:
    read = ModelFacts(parameters=8_000_000_000, layers=32, kv_heads=8, head_dim=128)
    desired = desired_state.desire(md(UNCATALOGUED), CONFIG, seen(H100, source_facts=read))
    assert desired.error is None and desired.plan[0].fits
    assert desired.plan[0].weights_gi_b == pytest.approx(8e9 * 2 / 2**30, rel=0.01)


def test_a_source_that_cannot_be_read_fails_the_plan_for_now_not_for_good() -> None:
    why = "cannot read the model's config.json: hf://acme/in-house-8b: 404 repository not found"
    desired = desired_state.desire(md(UNCATALOGUED), CONFIG, seen(H100, source_facts=why))
    assert desired.needs_retry and not desired.is_invalid_spec
    assert desired.error is not None and why in desired.error and "spec.model" in desired.error


DRAFTED = {
    **UNCATALOGUED,
    "serving": {
        "maxContextLength": 4096,
        "speculative": {"method": "draft_model", "model": "hf://acme/in-house-draft"},
    },
}
IN_HOUSE_8B = ModelFacts(parameters=8_000_000_000, layers=32, kv_heads=8, head_dim=128)


def test_a_draft_model_is_planned_from_its_facts_read_at_the_source() -> None:
    draft = ModelFacts(parameters=500_000_000, layers=16, kv_heads=2, head_dim=64)
    alone = desired_state.desire(md(UNCATALOGUED), CONFIG, seen(H100, source_facts=IN_HOUSE_8B))
    desired = desired_state.desire(
        md(DRAFTED), CONFIG, seen(H100, source_facts=IN_HOUSE_8B, draft_facts=draft)
    )
    assert desired.error is None and desired.plan[0].fits
    added = desired.plan[0].weights_gi_b - alone.plan[0].weights_gi_b
    assert added == pytest.approx(500_000_000 * 2 / 2**30, abs=0.01)


@pytest.mark.parametrize(
    ("draft_facts", "retried"),
    [
        ("cannot read the draft model's config.json: hf://acme/in-house-draft: 404", True),
        (None, False),  # nothing read (the operator did not look): the spec cannot plan
    ],
)
def test_a_draft_without_facts_fails_the_plan_saying_which_model(
    draft_facts: str | None, retried: bool
) -> None:
    desired = desired_state.desire(
        md(DRAFTED), CONFIG, seen(H100, source_facts=IN_HOUSE_8B, draft_facts=draft_facts)
    )
    assert desired.error is not None and "draft model hf://acme/in-house-draft" in desired.error
    assert desired.needs_retry == retried and desired.is_invalid_spec != retried
    if draft_facts is not None:
        assert draft_facts in desired.error


def test_facts_in_the_spec_win_over_the_source() -> None:
    facts = {"parameters": 1_000_000, "layers": 2, "kvHeads": 1, "headDim": 8}
    spec = {**UNCATALOGUED, "model": {"uri": "hf://acme/in-house-8b", **facts}}
    read = ModelFacts(parameters=8_000_000_000, layers=32, kv_heads=8, head_dim=128)
    desired = desired_state.desire(md(spec), CONFIG, seen(H100, source_facts=read))
    assert desired.plan[0].weights_gi_b < 0.01


def _scaled(
    per_type: dict[str, int | None] | None,
    desired: int | None,
    applied: dict[str, int],
    mode: str = "builtin",
) -> dict[str, Any]:
    autoscaling: dict[str, Any] = {"desiredReplicas": desired}
    if per_type is not None:
        autoscaling["replicasPerNodeType"] = per_type
    plan = [{"nodeType": t, "fits": True, "replicas": n} for t, n in applied.items()]
    return md({"autoscaling": {"mode": mode}}, {"autoscaling": autoscaling, "plan": plan})


@pytest.mark.parametrize(
    ("obj", "pending"),
    [
        (_scaled({"l4": 2}, 2, {"l4": 2}), False),  # applied
        (_scaled({"l4": 3}, 3, {"l4": 2}), True),  # scaled up, not applied yet
        (_scaled({"l4": 1, "t4": 1}, 2, {"l4": 2, "t4": 0}), True),  # spilled over
        (_scaled({"l4": 2, "t4": None}, 2, {"l4": 2}), False),  # a dropped type is null
        (_scaled(None, 4, {"l4": 3}), True),  # a count without a spread
        (_scaled(None, None, {"l4": 1}), False),  # no decision yet
        (_scaled({"l4": 3}, 3, {"l4": 2}, mode="off"), False),  # not the autoscaler's to scale
    ],
)
def test_scale_pending_compares_the_decision_with_what_was_applied(
    obj: dict[str, Any], pending: bool
) -> None:
    assert desired_state.scale_pending(obj) is pending


def _generations(generation: int, observed: int | None, **status: Any) -> dict[str, Any]:
    obj = md({"autoscaling": {"mode": "off"}}, status)
    obj["metadata"]["generation"] = generation
    if observed is not None:
        obj["status"]["observedGeneration"] = observed
    return obj


def _spec_applied(obj: dict[str, Any]) -> dict[str, Any]:
    obj["status"]["observedGeneration"] = obj["metadata"]["generation"]
    return obj


NEEDS_FULL_PASS = [
    ("new: never passed", _generations(1, None), False, True),
    ("spec applied, nothing pending", _generations(3, 3), False, False),
    ("spec changed since the last full pass", _generations(4, 3), False, True),
    ("first seen since the operator started", _generations(3, 3), True, True),
    (
        "an autoscaler decision to apply",
        _spec_applied(_scaled({"l4": 3}, 3, {"l4": 2})),
        False,
        True,
    ),
    (
        "an autoscaler decision applied",
        _spec_applied(_scaled({"l4": 2}, 2, {"l4": 2})),
        False,
        False,
    ),
]


@pytest.mark.parametrize(
    ("obj", "first_sight", "expected"),
    [row[1:] for row in NEEDS_FULL_PASS],
    ids=[row[0] for row in NEEDS_FULL_PASS],
)
def test_needs_full_pass(obj: dict[str, Any], first_sight: bool, expected: bool) -> None:
    assert desired_state.needs_full_pass(obj, first_sight) is expected


def _routing(*fallbacks: dict[str, Any]) -> dict[str, Any]:
    return {**LLAMA_70B, "routing": {"fallbacks": list(fallbacks)}}


def _fallbacks_status(obj: dict[str, Any], missing: tuple[str, ...]) -> dict[str, Any] | None:
    desired = dataclasses.replace(
        desired_state.desire(obj, CONFIG, seen(H100)), missing_fallbacks=missing
    )
    status = desired_state.build_status(obj, typed_status.of(obj), desired, [], CONFIG, "t")
    return next((c for c in status["conditions"] if c["type"] == "FallbacksResolved"), None)


@pytest.mark.parametrize(
    ("fallbacks", "missing", "expected"),
    [
        ((), (), None),  # no ModelDeployment fallbacks: no condition
        (({"provider": {"baseURL": "https://x.example/v1", "model": "m2"}},), (), None),
        (({"modelDeployment": "small"},), (), ("True", "FallbacksFound", "1/1 fallback")),
        (
            ({"modelDeployment": "small"}, {"modelDeployment": "tiny"}),
            ("tiny",),
            ("False", "FallbackMissing", "1/2 fallback ModelDeployments found; missing: tiny"),
        ),
    ],
)
def test_fallbacks_resolved_condition(
    fallbacks: tuple[dict[str, Any], ...],
    missing: tuple[str, ...],
    expected: tuple[str, str, str] | None,
) -> None:
    found = _fallbacks_status(md(_routing(*fallbacks)), missing)
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert (found["status"], found["reason"]) == expected[:2]
    assert found["message"].startswith(expected[2])


def test_the_condition_goes_with_the_fallbacks() -> None:
    obj = md(_routing({"modelDeployment": "small"}))
    obj["status"] = {"conditions": [_fallbacks_status(obj, ("small",))]}
    assert _fallbacks_status(md(LLAMA_70B, obj["status"]), ()) is None


def test_missing_fallbacks_are_news_once() -> None:
    obj = md(_routing({"modelDeployment": "small"}))
    desired = dataclasses.replace(
        desired_state.desire(obj, CONFIG, seen(H100)), missing_fallbacks=("small",)
    )
    assert desired_state.fallbacks_news(typed_status.of(obj), desired) == (
        "spec.routing.fallbacks name missing ModelDeployments: small"
    )
    obj["status"] = desired_state.build_status(obj, typed_status.of(obj), desired, [], CONFIG, "t")
    assert desired_state.fallbacks_news(typed_status.of(obj), desired) is None
    found = dataclasses.replace(desired, missing_fallbacks=())
    assert desired_state.fallbacks_news(typed_status.of(obj), found) is None


def test_a_fallback_to_itself_is_an_invalid_spec() -> None:
    desired = desired_state.desire(md(_routing({"modelDeployment": "m"})), CONFIG, seen(H100))
    assert desired.is_invalid_spec
    assert desired.error == "spec.routing.fallbacks: m cannot fall back to itself"
    fine = desired_state.desire(md(_routing({"modelDeployment": "small"})), CONFIG, seen(H100))
    assert fine.error is None and fine.fallback_names == ("small",)


@pytest.mark.parametrize(
    ("routing", "generation", "observed", "expected"),
    [
        ({"endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}, 4, 3, False),
        ({}, 4, 3, True),  # the spec changed and wants no pool: look for one to delete
        ({}, 3, 3, False),  # unchanged since the last pass: no extra reads
    ],
)
def test_a_dropped_inference_pool_is_looked_for_after_a_spec_change(
    routing: dict[str, Any], generation: int, observed: int, expected: bool
) -> None:
    obj = md({**LLAMA_70B, "routing": routing}, {"observedGeneration": observed})
    obj["metadata"]["generation"] = generation
    desired = desired_state.desire(obj, CONFIG, seen(H100, has_inference_pool_crd=True))
    assert (
        desired_state.may_have_dropped(obj, typed_status.of(obj), desired, "InferencePool")
        is expected
    )


def test_prefer_cost_plans_by_the_cost_status_measured_on_real_traffic() -> None:
    """7B at 8k context: t4 at int4 is the cheaper estimate per sequence; measured traffic says
    h100 serves a request for less (and t4 for more), so the pass plans h100 first."""
    spec = {
        "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"},
        "serving": {"maxContextLength": 8192, "targetConcurrency": 4},
        "placement": {"prefer": "cost"},
        "autoscaling": {"mode": "off", "replicas": 1},
    }
    estimated = desired_state.desire(md(spec), CONFIG, seen(T4, H100))
    assert [e.node_type for e in estimated.plan] == ["t4-16gb", "h100-80gb"]
    cost = {
        **_figures(None),
        "window": "5m",
        "nodeTypes": {
            "t4-16gb": {**_figures(0.9), "replicas": 1},
            "h100-80gb": {**_figures(0.4), "replicas": 1},
            "a100-40gb": {**_figures(None), "replicas": 0},  # no traffic: no figure
        },
    }
    status = typed_status.parse({"cost": cost})
    assert desired_state.measured_cost(status) == (("h100-80gb", 0.4), ("t4-16gb", 0.9))
    measured = desired_state.desire(md(spec), CONFIG, seen(T4, H100, status=status))
    assert [e.node_type for e in measured.plan] == ["h100-80gb", "t4-16gb"]
    assert desired_state.measured_cost(typed_status.EMPTY) == ()


def _figures(per_thousand_requests: float | None) -> dict[str, Any]:
    """status.cost's figures as planning/cost.py writes them (the ones the test reads, and
    zeros)."""
    return {
        "pricePerHour": 0.0,
        "requestsPerSecond": 0.0,
        "outputTokensPerSecond": 0.0,
        "perThousandRequests": per_thousand_requests,
    }
