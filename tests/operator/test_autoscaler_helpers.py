"""Table tests for kvpilot.operator.autoscaling.recording (spread, status) and metrics parsing."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from kvpilot.operator import api
from kvpilot.operator.autoscaling import metrics_reader as metrics
from kvpilot.operator.autoscaling.metrics_reader import PodSample, aggregate, aggregate_by_node_type
from kvpilot.operator.autoscaling.policy import Bounds, Observations, PolicyState, decide
from kvpilot.operator.autoscaling.recording import (
    bounds_from_spec,
    event_message,
    metrics_condition,
    state_from_status,
    status_patch,
)
from kvpilot.operator.autoscaling.spread import spread_replicas
from kvpilot.operator.reconcile import typed_status

NOW = 1_700_000_000.0
ORDER = ["h100", "a100", "l40s"]

# (case, total, free GPUs, current, pending, unschedulable since, expected)
SPREAD = [
    ("fills plan order", 5, {"h100": 4, "a100": 8, "l40s": 8}, {}, {}, {}, [4, 1, 0]),
    ("keeps running replicas", 5, {"h100": 8}, {"a100": 3}, {}, {}, [2, 3, 0]),
    ("shrinks least preferred", 3, {}, {"h100": 2, "a100": 2, "l40s": 2}, {}, {}, [2, 1, 0]),
    ("shrinks pending first", 3, {}, {"h100": 3, "a100": 2}, {"h100": 2}, {}, [1, 2, 0]),
    ("nothing fits: waits on first", 4, {}, {}, {}, {}, [4, 0, 0]),
    (
        "pending stays before the threshold",
        4,
        {"h100": 0, "a100": 8},
        {"h100": 4},
        {"h100": 2},
        {"h100": NOW - 60},
        [4, 0, 0],
    ),
    (
        "spills after the threshold",
        4,
        {"h100": 0, "a100": 8},
        {"h100": 4},
        {"h100": 2},
        {"h100": NOW - 600},
        [2, 2, 0],
    ),
    (
        "spill skips full types",
        4,
        {"h100": 0, "a100": 0, "l40s": 4},
        {"h100": 4},
        {"h100": 3},
        {"h100": NOW - 600},
        [1, 0, 3],
    ),
    (
        "spilled everywhere: waits on next not given up",
        3,
        {},
        {"h100": 3},
        {"h100": 3},
        {"h100": NOW - 600},
        [0, 3, 0],
    ),
    ("zero", 0, {"h100": 8}, {"h100": 2, "a100": 1}, {}, {}, [0, 0, 0]),
]


@pytest.mark.parametrize(
    ("total", "free", "current", "pending", "since", "expected"),
    [row[1:] for row in SPREAD],
    ids=[row[0] for row in SPREAD],
)
def test_spread_replicas(
    total: int,
    free: dict[str, int],
    current: dict[str, int],
    pending: dict[str, int],
    since: dict[str, float | None],
    expected: list[int],
) -> None:
    placed = spread_replicas(
        total, ORDER, free, 1, current, since, NOW, 300.0, pending_per_type=pending
    )
    assert [placed[t] for t in ORDER] == expected
    assert sum(placed.values()) == total


def test_spread_uses_gpus_per_replica_per_type() -> None:
    # h100 runs TP1 (8 free -> 8 replicas), a100 needs TP2 (8 free -> 4)
    placed = spread_replicas(
        10, ["h100", "a100"], {"h100": 8, "a100": 8}, {"h100": 1, "a100": 2}, {}, {}, NOW, 300
    )
    assert placed == {"h100": 8, "a100": 2}
    placed = spread_replicas(
        14, ["a100", "h100"], {"h100": 8, "a100": 8}, {"h100": 1, "a100": 2}, {}, {}, NOW, 300
    )
    assert placed == {"a100": 6, "h100": 8}  # 4 fit on a100, 8 on h100, the rest wait on a100


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, ORDER, {}, 1), "total replicas"),
        ((1, [], {}, 1), "no node type"),
        ((1, ["a", "a"], {}, 1), "repeat"),
        ((1, ORDER, {}, 0), "gpus per replica"),
        ((1, ORDER, {}, {"h100": 1}), "unknown for node types"),
    ],
)
def test_spread_rejects_bad_input(args: tuple[Any, ...], message: str) -> None:
    total, order, free, per = args
    with pytest.raises(ValueError, match=message):
        spread_replicas(total, order, free, per, {}, {}, NOW, 300)


def test_status_patch_round_trips_the_state() -> None:
    # with the default targets: KV demand 0.9 x 30 / 20 = 1.35 -> ceil(2 x 1.35 / 0.85) = 4
    observations = Observations(
        current_replicas=2,
        ready_replicas=2,
        requests_running=20,
        requests_waiting=10,
        kv_cache_usage=0.9,
        sampled_at=NOW,
    )
    decision = decide(observations, Bounds(), PolicyState(), NOW)
    patch = json.loads(json.dumps(status_patch(decision, observations, NOW)))
    assert patch["desiredReplicas"] == decision.replicas == 4
    assert patch["lastDecision"].startswith("scale up 2->4")
    assert patch["lastScaleTime"] == patch["lastDecisionTime"] == "2023-11-14T22:13:20Z"
    assert patch["metrics"]["kvCacheUsage"] == 0.9
    assert patch["metricsAvailable"] is True
    assert state_from_status(typed_status.parse({"autoscaling": patch})) == decision.state
    assert state_from_status(typed_status.EMPTY) == PolicyState()
    assert event_message(2, decision) == f"Scaled from 2 to 4 replicas: {decision.reason}"
    assert event_message(4, replace(decision, replicas=4)) is None


def test_missing_metrics_condition() -> None:
    decision = decide(Observations.unavailable(3, "prometheus: down"), Bounds(), PolicyState(), NOW)
    condition = metrics_condition(decision)
    assert condition["status"] == "False"
    assert "prometheus: down" in condition["message"]
    patch = status_patch(decision, Observations.unavailable(3, "x"), NOW)
    assert patch["metricsAvailable"] is False


def test_bounds_from_spec() -> None:
    spec = {"minReplicas": 0, "maxReplicas": 7, "targetKVCacheUtilization": 0.5, "mode": "builtin"}
    bounds = bounds_from_spec(api.Autoscaling.model_validate(spec))
    assert (bounds.min_replicas, bounds.max_replicas) == (0, 7)
    assert bounds.target_kv_cache_utilization == 0.5
    with pytest.raises(ValueError, match="minReplicas must be <= maxReplicas"):
        bounds_from_spec(api.Autoscaling.model_validate({"minReplicas": 5, "maxReplicas": 2}))


def sample(pod: str, node_type: str = "h100", age: float = 5.0, **values: float) -> PodSample:
    return PodSample(
        pod=pod,
        node_type=node_type,
        waiting=values.get("waiting", 0.0),
        running=values.get("running", 0.0),
        kv_cache_usage=values.get("kv", 0.0),
        sampled_at=NOW - age,
    )


def test_aggregate_counts_only_fresh_ready_pods() -> None:
    samples = [
        sample("a", waiting=4, running=10, kv=0.9),
        sample("b", waiting=2, running=6, kv=0.5),
        sample("c", waiting=100, kv=1.0),  # not ready
        sample("d", waiting=100, kv=1.0, age=300),  # stale
    ]
    observed = aggregate(samples, 5, NOW, ready_pods={"a", "b", "d"})
    assert (observed.ready_replicas, observed.requests_waiting) == (2, 6)
    assert observed.requests_running == 16
    assert observed.kv_cache_usage == pytest.approx(0.7)
    assert observed.sampled_at == NOW - 5


def test_aggregate_without_fresh_samples() -> None:
    stale = aggregate([sample("a", age=300)], 2, NOW)
    assert stale.sampled_at == NOW - 300  # the policy calls this stale and holds
    assert "stale" in decide(stale, Bounds(), PolicyState(), NOW).reason
    assert aggregate([], 2, NOW).error == "no samples from ready pods"
    zero = aggregate([], 0, NOW)
    assert zero.error == "" and zero.sampled_at == NOW


def test_aggregate_by_node_type() -> None:
    samples = [sample("a", "h100", kv=0.8), sample("b", "a100", kv=0.4), sample("c", "a100")]
    by_type = aggregate_by_node_type(samples, {"h100": 1, "a100": 3}, NOW)
    assert by_type["h100"].ready_replicas == 1
    assert by_type["a100"].ready_replicas == 2
    assert by_type["a100"].kv_cache_usage == pytest.approx(0.2)


def test_promql_selects_by_the_relabelled_labels() -> None:
    query = metrics.gauge_query(metrics.KV_USAGE, "prod", 'we"ird', average="1m")
    assert 'kvpilot_model="we\\"ird"' in query
    assert 'namespace="prod"' in query
    assert "avg_over_time(" in query and "[1m]" in query
    assert '__name__="vllm:kv_cache_usage_perc"' in query
    assert '__name__="vllm_kv_cache_usage_perc"' in query  # as Prometheus stores it
    assert query.count("max by (pod, kvpilot_node_type)") == 3
    assert "histogram_quantile(0.95" in metrics.ttft_p95_query("prod", "m")


def test_rate_queries_take_the_first_counter_name_per_node_type() -> None:
    query = metrics.rate_query(metrics.REQUEST_SUCCESS, "prod", "m", "5m")
    parts = query.split(" or ")
    assert len(parts) == 3 and all("sum by (kvpilot_node_type) (rate(" in p for p in parts)
    assert '__name__="kvpilot_request_success_total"' in parts[0]
    assert '__name__="vllm_request_success_total"' in parts[2]  # as Prometheus stores it
    assert all('namespace="prod"' in p and "[5m]" in p for p in parts)


# (FleetRates field, counter or gauge names read, PromQL function, window)
FLEET_QUERIES = [
    ("arrivals_short_per_s", "request_received_total", "rate", "[30s]"),
    ("arrivals_long_per_s", "request_received_total", "rate", "[2m]"),
    ("completions_per_s", "request_success_total", "rate", "[1m]"),
    ("tokens_per_s", "generation_tokens_total", "rate", "[1m]"),
    ("requests_running_1m", "num_requests_running", "avg_over_time", "[1m]"),
]


@pytest.mark.parametrize(("field", "name", "function", "window"), FLEET_QUERIES)
def test_fleet_queries_sum_the_first_name_per_pod_over_the_pods(
    field: str, name: str, function: str, window: str
) -> None:
    query = metrics.fleet_queries("prod", "m")[field]
    assert query.startswith("sum(") and query.endswith(")")
    parts = query[len("sum(") : -1].split(" or ")
    # kvpilot's name, vLLM's as exported and as Prometheus stores it, each summed per pod
    assert len(parts) == 3
    assert all(p.startswith("sum by (pod, kvpilot_node_type) (") for p in parts)
    assert all(f"({function}({{" in p and window in p and 'namespace="prod"' in p for p in parts)
    assert f'"vllm:{name}"' in parts[1] and f'"vllm_{name}"' in parts[2]
    assert '"kvpilot_' in parts[0]


# (FleetRates field, window): the gateways' arrivals, by the ModelDeployment's md_* labels
GATEWAY_FLEET_QUERIES = [
    ("gateway_arrivals_short_per_s", "[30s]"),
    ("gateway_arrivals_long_per_s", "[2m]"),
]


@pytest.mark.parametrize(("field", "window"), GATEWAY_FLEET_QUERIES)
def test_the_gateways_arrivals_are_summed_by_the_modeldeployment(field: str, window: str) -> None:
    assert metrics.fleet_queries("prod", 'we"ird')[field] == (
        'sum(rate({__name__="kvpilot_gateway_requests_arrived_total",md_namespace="prod",'
        f'md_name="we\\"ird"}}{window}))'
    )


def test_every_fleet_rate_has_a_query() -> None:
    fields = set(metrics.FleetRates.__dataclass_fields__)
    tested = {f for f, *_ in FLEET_QUERIES} | {f for f, _ in GATEWAY_FLEET_QUERIES}
    assert set(metrics.fleet_queries("prod", "m")) == fields == tested


# (case, the replicas' received rate, the gateways', the rate to size for)
ARRIVALS_SEEN = [
    ("flow control caps what the replicas receive", 4.0, 9.0, 9.0),
    ("traffic around the gateway reaches the replicas only", 6.0, 2.0, 6.0),
    ("no gateway routes to the ModelDeployment", 4.0, None, 4.0),
    ("vLLM pods (no received counter) behind a gateway", None, 5.0, 5.0),
    ("neither", None, None, None),
]


@pytest.mark.parametrize(("case", "runtime", "gateway", "seen"), ARRIVALS_SEEN)
def test_the_arrival_rate_is_the_larger_of_the_replicas_and_the_gateways(
    case: str, runtime: float | None, gateway: float | None, seen: float | None
) -> None:
    assert metrics.arrivals_seen(runtime, gateway) == seen, case
    rates = metrics.FleetRates(runtime, runtime, 2.5, 300.0, 12.0, gateway, gateway)
    observed = aggregate([sample("a", running=10)], 1, NOW, rates=rates)
    assert observed.arrivals_short_per_s == observed.arrivals_long_per_s == seen


@pytest.mark.parametrize(
    ("vector", "value"),
    [
        ([], None),  # no series: not read
        ([{"metric": {}, "value": [NOW, "2.5"]}], 2.5),
        ([{"metric": {}, "value": [NOW, "0"]}], 0.0),  # an idle fleet: zero, not missing
        ([{"metric": {}, "value": [NOW, "NaN"]}], None),
        ([{"metric": {}, "value": [NOW, "+Inf"]}], None),
    ],
)
def test_scalar_reads_a_one_sample_vector(
    vector: list[dict[str, Any]], value: float | None
) -> None:
    assert metrics.scalar(vector) == value


def test_fleet_rates_reach_the_observations_only_with_fresh_samples() -> None:
    rates = metrics.FleetRates(4.0, 3.0, 2.5, 300.0, 12.0)
    seen = aggregate([sample("a", running=10)], 1, NOW, rates=rates)
    assert (seen.arrivals_short_per_s, seen.arrivals_long_per_s) == (4.0, 3.0)
    assert (seen.completions_per_s, seen.tokens_per_s, seen.requests_running_1m) == (
        2.5,
        300.0,
        12.0,
    )
    stale = aggregate([sample("a", age=300)], 1, NOW, rates=rates)
    assert stale.arrivals_short_per_s is None  # held as stale; nothing to size from
    assert aggregate([sample("a")], 1, NOW).arrivals_short_per_s is None  # none read


@pytest.mark.parametrize(("seconds", "window"), [(300, "5m"), (60, "1m"), (90, "90s"), (30, "30s")])
def test_prom_duration(seconds: int, window: str) -> None:
    assert metrics.prom_duration(seconds) == window


KVPILOT_TEXT = """# TYPE kvpilot_requests_waiting gauge
kvpilot_requests_waiting{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
# TYPE kvpilot_requests_running gauge
kvpilot_requests_running{model_name="m"} 7.0
# TYPE kvpilot_kv_cache_usage_ratio gauge
kvpilot_kv_cache_usage_ratio{model_name="m"} 0.5
"""
VLLM_TEXT = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m",engine="0"} 2.0
vllm:num_requests_waiting{model_name="m",engine="1"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25
vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.75
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (KVPILOT_TEXT, {"waiting": 3.0, "running": 7.0, "kv": 0.5}),  # alias not double counted
        (VLLM_TEXT, {"waiting": 3.0, "kv": 0.75}),  # engines summed, KV at the fullest
        ("", {}),
    ],
    ids=["kvpilot", "vllm", "empty"],
)
def test_parse_exposition(text: str, expected: dict[str, float]) -> None:
    parsed = metrics.parse_exposition(text)
    names = {
        "waiting": metrics.WAITING[0],
        "running": metrics.RUNNING[0],
        "kv": metrics.KV_USAGE[0],
    }
    assert parsed == {names[k]: v for k, v in expected.items()}


def test_held_query_sums_the_gateways_gauge_by_the_modeldeployment() -> None:
    assert metrics.held_query("prod", 'we"ird') == (
        'sum({__name__="kvpilot_gateway_requests_held",md_namespace="prod",md_name="we\\"ird"})'
    )
    # the gateway pod's own namespace/pod labels must not select it
    assert 'namespace="prod"' not in metrics.held_query("prod", "m").replace("md_namespace", "")


def test_queued_query_sums_the_gateways_fair_queues_by_the_modeldeployment() -> None:
    assert metrics.queued_query("prod", "m") == (
        'sum({__name__="kvpilot_gateway_requests_queued",md_namespace="prod",md_name="m"})'
    )


def test_requests_in_the_gateways_fair_queues_are_queue_demand() -> None:
    # Flow control keeps the replicas' own queues short: 1 waiting there, 6 at the gateways.
    seen = aggregate([sample("a", waiting=1, running=4)], 1, NOW, requests_held=2,
                     requests_queued=6)  # fmt: skip
    assert (seen.requests_waiting, seen.requests_held, seen.requests_queued) == (9, 2, 6)
    assert seen.to_dict()["requestsQueued"] == 6
    zero = aggregate([], 0, NOW, requests_queued=3)  # a fleet just scaled to zero, say
    assert (zero.requests_waiting, zero.requests_queued) == (3, 3)


def test_held_requests_are_queue_demand_even_at_zero_replicas() -> None:
    zero = aggregate([], 0, NOW, requests_held=3)
    assert (zero.requests_waiting, zero.requests_held, zero.error) == (3, 3, "")
    bounds = Bounds(min_replicas=0, max_replicas=4, target_queue_length=2)
    woken = decide(zero, bounds, PolicyState(), NOW)
    assert woken.replicas == 2, woken.reason  # ceil(3 held / 2 per replica)
    running = aggregate([sample("a", waiting=1, running=4)], 1, NOW, requests_held=2)
    assert (running.requests_waiting, running.requests_held) == (3, 2)
    assert running.to_dict()["requestsHeld"] == 2
    # nothing held: what it was before
    assert aggregate([], 0, NOW) == replace(zero, requests_waiting=0, requests_held=0)
    assert running.requests_queued == 0 and running.to_dict()["requestsQueued"] == 0
