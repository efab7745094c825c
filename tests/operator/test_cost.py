"""planning/cost.py: cost per 1,000 requests and per 1M output tokens from replicas, prices and
traffic."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator import api, crdgen
from kvpilot.operator.autoscaling import cost_recording
from kvpilot.operator.autoscaling import loop as autoscaling_loop
from kvpilot.operator.planning.cost import Traffic, cost_status, merge_patch, per_unit
from kvpilot.operator.reconcile import typed_status
from kvpilot.runtime.bench.stats import cost_per_1k_requests


@pytest.mark.parametrize(
    ("price", "rate", "scale", "expected"),
    [
        (3.6, 1.0, 1e3, 1.0),  # $3.60/h = $0.001/s; 1 req/s -> $0.001 a request -> $1 per 1k
        (3.6, 10.0, 1e3, 0.1),
        (3.6, 1000.0, 1e6, 1.0),
        (0.0, 5.0, 1e3, 0.0),
        (3.6, 0.0, 1e3, None),
    ],
)
def test_per_unit(price: float, rate: float, scale: float, expected: float | None) -> None:
    assert per_unit(price, rate, scale) == (None if expected is None else pytest.approx(expected))


def test_the_same_arithmetic_as_kvpilot_bench() -> None:
    """What status says and what `kvpilot bench --price-per-gpu-hour` says agree on one load."""
    completed, duration_s, gpus, price_per_gpu = 600, 120.0, 2, 2.5
    bench = cost_per_1k_requests(price_per_gpu, gpus, duration_s, completed)
    status = cost_status({"a": 1}, {"a": gpus * price_per_gpu}, {"a": Traffic(5.0, 0.0)}, "2m")
    assert status["perThousandRequests"] == pytest.approx(bench)


CASES = [
    # (replicas, prices, traffic, per 1k requests, per 1M tokens, reason contains)
    ({"l4": 2}, {"l4": 1.8}, {"l4": Traffic(2.0, 200.0)}, 0.5, 5.0, ""),
    (
        {"l4": 1, "a100": 1},
        {"l4": 1.8, "a100": 5.4},
        {"l4": Traffic(1.0, 100.0), "a100": Traffic(3.0, 300.0)},
        0.5,
        5.0,
        "",
    ),
    ({"l4": 2}, {"l4": 1.8}, {}, None, None, "no requests completed in the last 5m"),
    ({"l4": 1}, {"l4": 0.0}, {"l4": Traffic(1.0, 1.0)}, None, None, "no price for node type(s) l4"),
    ({"l4": 0}, {"l4": 1.8}, {"l4": Traffic(1.0, 1.0)}, None, None, "no replicas running"),
    ({}, {}, {}, None, None, "no replicas running"),
]


@pytest.mark.parametrize(("replicas", "prices", "traffic", "per_1k", "per_1m", "reason"), CASES)
def test_cost_status(
    replicas: dict[str, int],
    prices: dict[str, float],
    traffic: dict[str, Traffic],
    per_1k: float | None,
    per_1m: float | None,
    reason: str,
) -> None:
    status = cost_status(replicas, prices, traffic, "5m")
    assert status["perThousandRequests"] == (None if per_1k is None else pytest.approx(per_1k))
    assert status["perMillionOutputTokens"] == (None if per_1m is None else pytest.approx(per_1m))
    assert reason in status.get("reason", "") and bool(reason) == ("reason" in status)
    assert status["window"] == "5m" and status["currency"] == "USD"
    assert set(status["nodeTypes"]) == {nt for nt, n in replicas.items() if n > 0}


def test_each_node_type_has_its_own_figures() -> None:
    status = cost_status(
        {"l4": 1, "a100": 1},
        {"l4": 1.8, "a100": 5.4},
        {"l4": Traffic(1.0, 100.0), "a100": Traffic(1.0, 100.0)},
        "5m",
    )
    l4, a100 = status["nodeTypes"]["l4"], status["nodeTypes"]["a100"]
    assert l4["perThousandRequests"] == pytest.approx(0.5)
    assert a100["perThousandRequests"] == pytest.approx(1.5)  # three times the price, same load
    assert l4["replicas"] == 1 and a100["pricePerHour"] == pytest.approx(5.4)


@pytest.mark.parametrize(
    ("old", "new", "patch"),
    [
        (None, {"window": "5m", "nodeTypes": {}}, {"window": "5m", "nodeTypes": {}}),
        (
            {"reason": "no requests", "nodeTypes": {"l4": {"replicas": 1}}},
            {"nodeTypes": {"l4": {"replicas": 2}}},
            {"reason": None, "nodeTypes": {"l4": {"replicas": 2}}},
        ),
        (
            {"nodeTypes": {"l4": {"replicas": 1}, "a100": {"replicas": 1}}},
            {"nodeTypes": {"a100": {"replicas": 1}}},
            {"nodeTypes": {"l4": None, "a100": {"replicas": 1}}},
        ),
    ],
)
def test_merge_patch_removes_what_no_longer_holds(
    old: dict[str, object] | None, new: dict[str, object], patch: dict[str, object]
) -> None:
    assert merge_patch(old, new) == patch


def pod(node_type: str, deleting: bool = False) -> dict[str, object]:
    meta: dict[str, object] = {"labels": {"kvpilot.dev/node-type": node_type}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    return {"metadata": meta}


def test_replicas_billed_are_the_pods_not_being_deleted() -> None:
    pods = [pod("l4"), pod("l4"), pod("a100"), pod("l4", deleting=True)]
    assert cost_recording.replicas_by_node_type(pods) == {"l4": 2, "a100": 1}


def test_replica_prices_come_from_the_plan() -> None:
    plan = [
        api.PlanEntry(node_type="l4", fits=True, price_per_hour=0.98),
        api.PlanEntry(node_type="h100", fits=False),
    ]
    assert cost_recording.replica_prices(plan) == {"l4": 0.98, "h100": 0.0}


@pytest.mark.parametrize(
    ("measured_at", "now", "due"),
    [
        (None, 1000.0, True),
        ("1970-01-01T00:16:40Z", 1000.0 + 59, False),  # window 300 s: every 60 s
        ("1970-01-01T00:16:40Z", 1000.0 + 60, True),
    ],
)
def test_cost_is_refreshed_five_times_per_window(
    measured_at: str | None, now: float, due: bool
) -> None:
    old = (
        api.CostStatus(
            price_per_hour=0.0,
            requests_per_second=0.0,
            output_tokens_per_second=0.0,
            per_thousand_requests=None,
            window="5m",
            measured_at=measured_at,
        )
        if measured_at
        else None
    )
    assert cost_recording.cost_is_due(old, now, 300) is due


NO_TRAFFIC = {
    "pricePerHour": 0.98,
    "requestsPerSecond": 0.0,
    "outputTokensPerSecond": 0.0,
    "perThousandRequests": None,
}


def listed(name: str, mode: str, fits: bool = True, measured_at: str = "") -> dict[str, object]:
    """A ModelDeployment as the tick LISTs it: its mode, its plan, when its cost was measured."""
    status: dict[str, object] = {"plan": [{"nodeType": "l4", "fits": fits, "pricePerHour": 0.98}]}
    if measured_at:
        status["cost"] = {**NO_TRAFFIC, "window": "5m", "measuredAt": measured_at}
    return {
        "metadata": {"namespace": "ns", "name": name},
        "spec": {"autoscaling": {"mode": mode}},
        "status": status,
    }


NOW = 1000.0
RECENT = "1970-01-01T00:16:30Z"  # 10 s before NOW: a 300 s window refreshes every 60 s


@pytest.mark.parametrize(
    ("md", "scaled", "costed"),
    [
        (listed("a", "builtin"), True, True),
        (listed("a", "off"), False, True),  # fixed replicas: traffic all the same
        (listed("a", "external"), False, True),  # an HPA or KEDA scales it
        (listed("a", "off", measured_at=RECENT), False, False),  # measured 10 s ago
        (listed("a", "external", fits=False), False, False),  # no plan, no pods to bill
    ],
)
def test_cost_is_recorded_whatever_scales(
    md: dict[str, object], scaled: bool, costed: bool
) -> None:
    looked_at = autoscaling_loop.planned([md])
    assert bool(autoscaling_loop.to_scale(looked_at)) is scaled
    assert bool(cost_recording.to_cost(looked_at, NOW, 300)) is costed


def test_the_cost_patch_holds_the_cost_alone() -> None:
    """The recorder's patch writes status.cost and nothing else: no replica count, no
    status.autoscaling, whatever the mode."""
    old = api.CostStatus.model_validate({**NO_TRAFFIC, "window": "5m", "reason": "no requests"})
    plan = [api.PlanEntry(node_type="l4", fits=True, price_per_hour=1.8)]
    traffic = {"l4": Traffic(2.0, 200.0)}
    patch = cost_recording.cost_patch(old, [pod("l4"), pod("l4")], plan, traffic, "5m", "t")
    assert set(patch) == {"cost"}
    assert patch["cost"]["reason"] is None  # held no longer: removed
    assert patch["cost"]["perThousandRequests"] == pytest.approx(0.5)
    assert patch["cost"]["nodeTypes"]["l4"]["replicas"] == 2
    assert patch["cost"]["measuredAt"] == "t"


def merged(target: dict[str, Any] | None, patch: dict[str, Any]) -> dict[str, Any]:
    """`patch` applied to `target` as the apiserver applies a JSON merge patch (RFC 7386)."""
    result = dict(target or {})
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = merged(result.get(key) if isinstance(result.get(key), dict) else None,
                                 value)  # fmt: skip
        else:
            result[key] = value
    return result


def missing_required(obj: dict[str, Any], schema: dict[str, Any], at: str) -> list[str]:
    """The fields the CRD's structural schema requires that `obj` lacks, nested maps too."""
    missing = [f"{at}.{name}" for name in schema.get("required", []) if name not in obj]
    entries = schema.get("additionalProperties")
    for key, value in obj.items():
        inner = schema.get("properties", {}).get(key) or (entries if isinstance(entries, dict)
                                                          else None)  # fmt: skip
        if isinstance(value, dict) and inner:
            missing += missing_required(value, inner, f"{at}.{key}")
    return missing


@pytest.mark.parametrize(
    ("old", "traffic", "prices"),
    [
        (None, {}, {"l4": 1.8}),  # first write, no traffic yet (pods not Ready): figures null
        (None, {"l4": Traffic(2.0, 200.0)}, {}),  # no price for the node type
        ({**NO_TRAFFIC, "window": "5m", "perThousandRequests": 0.5}, {}, {"l4": 1.8}),  # quiet
        (None, {"l4": Traffic(2.0, 200.0)}, {"l4": 1.8}),
    ],
)
def test_every_cost_patch_leaves_a_status_the_crd_accepts(
    old: dict[str, Any] | None, traffic: dict[str, Traffic], prices: dict[str, float]
) -> None:
    """A figure that is null is removed by the merge patch, so the CRD must not require it: it
    did, and every write without traffic or price was a 422 (found by test_cost_cluster)."""
    plan = [api.PlanEntry(node_type="l4", fits=True, price_per_hour=p) for p in prices.values()]
    previous = None if old is None else api.CostStatus.model_validate(old)
    patch = cost_recording.cost_patch(previous, [pod("l4")], plan, traffic, "5m", "t")
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    cost_schema = schema["properties"]["status"]["properties"]["cost"]
    written = None if previous is None else typed_status.wire(previous, exclude_defaults=True)
    assert missing_required(merged(written, patch["cost"]), cost_schema, "cost") == []
