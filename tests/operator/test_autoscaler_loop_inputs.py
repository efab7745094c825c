"""The autoscaler loop's inputs: where replicas are asked for and stuck (spill-over), and the
CRD's autoscaling settings as the policy gets them (pure)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.operator import api, config
from kvpilot.operator.autoscaling import recording
from kvpilot.operator.autoscaling.loop import free_gpus, pods_by_model, slo_ttft_s
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.reconcile import desired_state, typed_status

T0 = "2026-12-02T10:00:00Z"
T0_UNIX = 1796205600.0


def plan_entry(node_type: str, replicas: int, fits: bool = True, tp: int = 1) -> dict[str, Any]:
    return {"nodeType": node_type, "fits": fits, "replicas": replicas, "tensorParallel": tp}


def pod(
    node_type: str,
    scheduled: bool,
    since: str = T0,
    reason: str = "Unschedulable",
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {"kvpilot.dev/node-type": node_type}}
    if deleting:
        meta["deletionTimestamp"] = T0
    condition = {
        "type": "PodScheduled",
        "status": "True" if scheduled else "False",
        "lastTransitionTime": since,
    }
    if not scheduled:
        condition["reason"] = reason
    return {
        "metadata": meta,
        "spec": {"nodeName": "n1"} if scheduled else {},
        "status": {"conditions": [condition]},
    }


UNSCHEDULABLE_SINCE = [
    ("scheduled", pod("a", True), None),
    ("unschedulable", pod("a", False), T0_UNIX),
    ("not yet looked at", pod("a", False, reason="SchedulerError"), None),
    ("being deleted", pod("a", False, deleting=True), None),
    ("no conditions yet", {"metadata": {}, "spec": {}, "status": {}}, None),
]


@pytest.mark.parametrize(
    ("pod_obj", "expected"),
    [row[1:] for row in UNSCHEDULABLE_SINCE],
    ids=[row[0] for row in UNSCHEDULABLE_SINCE],
)
def test_unschedulable_since(pod_obj: dict[str, Any], expected: float | None) -> None:
    assert recording.unschedulable_since(pod_obj) == expected


def test_placement_reads_the_plan_and_counts_stuck_pods_per_type() -> None:
    status = {
        "plan": [
            plan_entry("a", 2, tp=2),
            plan_entry("big", 0, fits=False),
            plan_entry("b", 1),
        ]
    }
    pods = [
        pod("a", False, since="2026-12-02T10:00:30Z"),
        pod("a", False),
        pod("a", True),
        pod("b", True),
        pod("big", False),  # not a fitting type: ignored
    ]
    where = recording.placement(typed_status.parse(status), pods)
    assert where.order == ("a", "b")
    assert where.gpus_per_replica == {"a": 2, "b": 1}
    assert where.current == {"a": 2, "b": 1}
    assert where.pending == {"a": 2}
    assert where.unschedulable_since == {"a": T0_UNIX}  # the earliest


def test_placement_prefers_the_autoscalers_last_spread_over_the_plan() -> None:
    status = {
        "plan": [plan_entry("a", 2), plan_entry("b", 0)],
        "autoscaling": {"replicasPerNodeType": {"a": 0, "b": 3}},
    }
    assert recording.placement(typed_status.parse(status), []).current == {"a": 0, "b": 3}


SPILLING = [
    ("nothing stuck", {}, {}, 1000.0, []),
    ("stuck, not long enough", {"a": 1}, {"a": 900.0}, 1000.0, []),
    ("stuck exactly the threshold", {"a": 1}, {"a": 820.0}, 1000.0, ["a"]),
    ("two types stuck", {"a": 1, "b": 2}, {"a": 0.0, "b": 10.0}, 1000.0, ["a", "b"]),
]


@pytest.mark.parametrize(
    ("pending", "since", "now", "expected"),
    [row[1:] for row in SPILLING],
    ids=[row[0] for row in SPILLING],
)
def test_spilling_after_the_threshold(
    pending: dict[str, int], since: dict[str, float], now: float, expected: list[str]
) -> None:
    where = recording.Placement(("a", "b"), {"a": 1, "b": 1}, {"a": 2, "b": 2}, pending, since)
    assert where.spilling(now, spill_after_s=180) == expected


def test_spread_moves_stuck_replicas_to_the_next_type_with_room() -> None:
    where = recording.Placement(
        ("a", "b"), {"a": 1, "b": 2}, {"a": 2, "b": 0}, {"a": 2}, {"a": 0.0}
    )
    assert where.spread(2, {"a": 2, "b": 4}, now=200.0, spill_after_s=180) == {"a": 0, "b": 2}
    # before the threshold the replicas wait where they are
    assert where.spread(2, {"a": 2, "b": 4}, now=100.0, spill_after_s=180) == {"a": 2, "b": 0}


def test_free_gpus_count_whole_replicas_per_node() -> None:
    node_types = [
        NodeType(
            name="a",
            product="NVIDIA-L4",
            gpu_memory_mib=23034,
            gpus_per_node=4,
            price_per_hour=1.0,
            node_selector={},
            nodes=("n1", "n2"),
            free_gpus_per_node=(3, 1),
        ),
        NodeType(
            name="other",
            product="NVIDIA-L4",
            gpu_memory_mib=23034,
            gpus_per_node=4,
            price_per_hour=1.0,
            node_selector={},
            nodes=("n3",),
            free_gpus_per_node=(4,),
        ),
    ]
    where = recording.Placement(("a",), {"a": 2}, {"a": 0}, {}, {})
    # 3 + 1 free GPUs on two nodes hold one 2-GPU replica, not two
    assert free_gpus_from(node_types, where) == {"a": 2}


def free_gpus_from(node_types: list[NodeType], where: recording.Placement) -> dict[str, int]:
    nodes = [
        {
            "metadata": {
                "name": name,
                "labels": {
                    "kvpilot.dev/node-type": t.name,
                    "nvidia.com/gpu.product": t.product,
                    "nvidia.com/gpu.memory": str(t.gpu_memory_mib),
                    "nvidia.com/gpu.count": str(t.gpus_per_node),
                },
            },
            "spec": {},
            "status": {"allocatable": {"nvidia.com/gpu": str(t.gpus_per_node)}},
        }
        for t in node_types
        for name in t.nodes
    ]
    pods = [
        {
            "metadata": {"name": f"{name}-busy{i}", "namespace": "x", "labels": {}},
            "spec": {
                "nodeName": name,
                "containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}],
            },
            "status": {"phase": "Running"},
        }
        for t in node_types
        for name, free in zip(t.nodes, t.free_gpus_per_node, strict=True)
        for i in range(t.gpus_per_node - free)
    ]
    return free_gpus(nodes, pods, where)


PER_TYPE_PATCH = [
    ("same types", {"a": 1}, {"a": 2}, {"a": 2}),
    ("a type left the plan", {"a": 1, "gone": 2}, {"a": 3}, {"gone": None, "a": 3}),
    ("first spread", {}, {"a": 1, "b": 0}, {"a": 1, "b": 0}),
]


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [row[1:] for row in PER_TYPE_PATCH],
    ids=[row[0] for row in PER_TYPE_PATCH],
)
def test_per_type_patch(
    old: dict[str, int], new: dict[str, int], expected: dict[str, int | None]
) -> None:
    assert recording.per_type_patch(old, new) == expected


def test_spill_message_names_what_moved() -> None:
    message = recording.spill_message({"a": 2, "b": 0}, {"a": 0, "b": 2}, ["a"])
    assert message == ("Pods Unschedulable on a past the spill-over threshold: a 2->0, b 0->2")


def md_with(per_type: dict[str, int], desired: int, max_replicas: int = 4) -> dict[str, Any]:
    return {
        "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {
            "model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
            "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": max_replicas},
        },
        "status": {"autoscaling": {"desiredReplicas": desired, "replicasPerNodeType": per_type}},
    }


def l4_types() -> list[NodeType]:
    return [
        NodeType(
            name="cheap",
            product="NVIDIA-L4",
            gpu_memory_mib=23034,
            gpus_per_node=1,
            price_per_hour=0.5,
            node_selector={"t": "cheap"},
            nodes=("c1",),
            free_gpus_per_node=(1,),
        ),
        NodeType(
            name="dear",
            product="NVIDIA-L4",
            gpu_memory_mib=23034,
            gpus_per_node=1,
            price_per_hour=0.9,
            node_selector={"t": "dear"},
            nodes=("d1", "d2", "d3"),
            free_gpus_per_node=(1, 1, 1),
        ),
    ]


RECONCILE_SPREAD = [
    ("the autoscaler's spread is applied", {"cheap": 0, "dear": 2}, 2, 4, [0, 2]),
    # it no longer adds up (maxReplicas lowered since): reconcile spreads the total itself
    ("a stale spread is not", {"cheap": 0, "dear": 3}, 3, 2, [1, 1]),
]


@pytest.mark.parametrize(
    ("per_type", "desired", "max_replicas", "expected"),
    [row[1:] for row in RECONCILE_SPREAD],
    ids=[row[0] for row in RECONCILE_SPREAD],
)
def test_reconcile_applies_the_spread_only_while_it_adds_up(
    per_type: dict[str, int], desired: int, max_replicas: int, expected: list[int]
) -> None:
    md = md_with(per_type, desired, max_replicas)
    status = typed_status.of(md)
    seen = desired_state.Observed(node_types=tuple(l4_types()), status=status)
    outcome = desired_state.desire(md, config.OperatorConfig(), seen)
    assert outcome.error is None, outcome.error
    assert [e.node_type for e in outcome.plan] == ["cheap", "dear"]
    assert [e.replicas for e in outcome.plan] == expected


OPERATOR_CONFIG_ERRORS = [
    ({"KVPILOT_SPILL_AFTER": "-1"}, "spillAfterSeconds (KVPILOT_SPILL_AFTER) must be >= 0"),
    ({"KVPILOT_AUTOSCALER_INTERVAL": "0"}, "autoscalerIntervalSeconds"),
    ({"KVPILOT_COST_WINDOW": "10"}, "costWindowSeconds (KVPILOT_COST_WINDOW) must be between 30"),
]


@pytest.mark.parametrize(("env", "message"), OPERATOR_CONFIG_ERRORS)
def test_bad_timings_are_rejected_naming_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.from_mapping({}, env)


def test_spill_after_comes_from_the_file_or_the_environment() -> None:
    assert config.from_mapping({"spillAfterSeconds": 60}, {}).spill_after_seconds == 60
    assert (
        config.from_mapping(
            {"spillAfterSeconds": 60}, {"KVPILOT_SPILL_AFTER": "5"}
        ).spill_after_seconds
        == 5
    )
    assert config.from_mapping({}, {}).spill_after_seconds == 180


def test_cost_window_comes_from_the_file_or_the_environment() -> None:
    assert config.from_mapping({}, {}).cost_window_seconds == 300
    assert config.from_mapping({"costWindowSeconds": 120}, {}).cost_window_seconds == 120
    env = {"KVPILOT_COST_WINDOW": "60"}
    assert config.from_mapping({"costWindowSeconds": 120}, env).cost_window_seconds == 60


def test_every_autoscaling_setting_of_the_crd_reaches_the_policy() -> None:
    # The spec as the apiserver stores it (CRD defaults applied), one setting changed at a time:
    # each change must show in the policy's Bounds, or a field of the CRD does nothing.
    given = {"minReplicas": 0, "slo": {"ttftSeconds": 2}}
    stored = api.Autoscaling.model_validate(given).model_dump(by_alias=True)
    before = recording.bounds_from_spec(api.Autoscaling.model_validate(stored))
    settings = set(stored) - {"mode", "replicas", "slo"}  # mode, replicas: for off/external
    # (the spec changed, the setting, its new value)
    changes: list[tuple[dict[str, Any], str, float]] = []
    for setting in settings:
        value = _changed(setting, stored[setting])
        changes.append(({**stored, setting: value}, setting, value))
    for setting, old in stored["slo"].items():  # the SLO's own settings, one at a time
        value = _changed(setting, old)
        changes.append(({**stored, "slo": {**stored["slo"], setting: value}}, setting, value))
    for spec, setting, value in changes:
        after = recording.bounds_from_spec(api.Autoscaling.model_validate(spec))
        moved = [k for k, v in asdict(after).items() if v != asdict(before)[k]]
        assert len(moved) == 1, (setting, moved)
        assert getattr(after, moved[0]) == value, setting


def _changed(setting: str, value: float | None) -> float:
    if setting == "targetKVCacheUtilization":
        return 0.5
    return 0.05 if value is None else value + 1  # an optional target (tpotSeconds) set


def test_without_an_slo_the_policy_sizes_on_queue_and_kv_alone() -> None:
    bounds = recording.bounds_from_spec(api.Autoscaling.model_validate({}))
    assert bounds.ttft_slo_s is None


@pytest.mark.parametrize(
    ("autoscaling", "error"),
    [
        ({"slo": {}}, "ttftSeconds"),
        ({"slo": {"ttftSeconds": 0}}, "ttftSeconds"),
        ({"slo": {"ttftSeconds": 2, "percentile": 100}}, "percentile"),
        ({"slo": {"ttftSeconds": 2, "percentile": 40}}, "percentile"),
        ({"slo": {"ttftSeconds": 2, "tpotSeconds": 0}}, "tpotSeconds"),
        ({"slo": {"ttftSeconds": 2, "tpotSeconds": 61}}, "tpotSeconds"),
        ({"slo": {"tpotSeconds": 0.05}}, "ttftSeconds"),
        ({"mode": "external", "slo": {"ttftSeconds": 2}}, "builtin autoscaler only"),
        ({"mode": "off", "slo": {"ttftSeconds": 2}}, "builtin autoscaler only"),
    ],
)
def test_an_slo_the_policy_cannot_hold_is_refused_naming_why(
    autoscaling: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValidationError, match=error):
        api.Autoscaling.model_validate(autoscaling)


def test_pods_are_grouped_by_their_model_deployment() -> None:
    def labelled(namespace: str, model: str | None, name: str) -> dict[str, Any]:
        labels = {"kvpilot.dev/model": model} if model else {}
        return {"metadata": {"namespace": namespace, "name": name, "labels": labels}}

    pods = [
        labelled("a", "m", "p1"),
        labelled("b", "m", "p2"),  # same name, other namespace: another ModelDeployment
        labelled("a", "m", "p3"),
        labelled("a", None, "p4"),
    ]
    grouped = {
        key: [p["metadata"]["name"] for p in found] for key, found in pods_by_model(pods).items()
    }
    assert grouped == {("a", "m"): ["p1", "p3"], ("b", "m"): ["p2"]}


def fitting(node_type: str, max_concurrency: int, fits: bool = True) -> dict[str, Any]:
    return {"nodeType": node_type, "fits": fits, "maxConcurrency": max_concurrency}


# (case, spec.serving, plan, expected (slots, max_num_seqs) or None)
PRIORS = [
    ("no plan", {}, [], None),
    ("nothing fits", {}, [fitting("a", 0, fits=False)], None),
    # 20 sequences at 4096 tokens: a batch of 20, and 80 requests of 1024 tokens in the pool
    (
        "first fitting type",
        {},
        [fitting("a", 0, False), fitting("b", 20), fitting("c", 99)],
        (20, 20),
    ),
    ("the user's batch cap", {"maxNumSeqs": 4}, [fitting("b", 20)], (4, 4)),
    ("capped batch", {}, [fitting("b", 1000)], (256, 256)),
    # 2 sequences of 512 tokens: the batch is the target concurrency (8), the pool 1 request
    ("the KV pool binds", {"maxContextLength": 512}, [fitting("b", 2)], (1, 8)),
]


@pytest.mark.parametrize(
    ("case", "serving", "plan", "expected"), PRIORS, ids=[p[0] for p in PRIORS]
)
def test_the_planner_prior_is_the_runtimes_batch_and_kv_pool(
    case: str,
    serving: dict[str, Any],
    plan: list[dict[str, Any]],
    expected: tuple[float, int] | None,
) -> None:
    entries = [api.PlanEntry.model_validate(e) for e in plan]
    prior = recording.planner_prior(api.Serving.model_validate(serving), entries)
    assert (None if prior is None else (prior.slots, prior.max_num_seqs)) == expected, case


@pytest.mark.parametrize(
    ("autoscaling", "expected"),
    [
        (None, None),
        ({"mode": "builtin"}, None),
        ({"mode": "builtin", "slo": {"ttftSeconds": 1.5}}, 1.5),
    ],
)
def test_the_fleet_rates_are_read_only_for_a_ttft_slo(
    autoscaling: dict[str, Any] | None, expected: float | None
) -> None:
    spec = {} if autoscaling is None else {"autoscaling": autoscaling}
    assert slo_ttft_s({"spec": spec}) == expected
