"""The demo's routing figures: counters of the gateway's real metrics, summed and differenced."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from hack.demo import by_key, counter_sums, growth, routing_rows, tenant_prompts
from kvpilot.gateway.metrics import GatewayMetrics


def exposition(picks: dict[str, int], codes: dict[str, int]) -> str:
    """/metrics of one gateway pod (its real registry) after these picks and answers."""
    metrics = GatewayMetrics()
    for backend, count in picks.items():
        metrics.picks.labels("tiny-llama", backend).inc(count)
    for code, count in codes.items():
        metrics.requests.labels("tiny-llama", "tiny-llama", code).inc(count)
    return generate_latest(metrics.registry).decode()


def test_picks_and_codes_add_up_over_the_gateway_pods() -> None:
    texts = [
        exposition({"ns/a": 3, "ns/b": 1}, {"200": 4}),
        exposition({"ns/a": 2}, {"200": 1, "503": 1}),
    ]
    assert counter_sums(texts, "kvpilot_gateway_picks", "backend") == {"ns/a": 5, "ns/b": 1}
    assert counter_sums(texts, "kvpilot_gateway_requests", "code") == {"200": 5, "503": 1}
    assert counter_sums(texts, "kvpilot_gateway_picks", None) == {"all": 6}
    assert counter_sums(texts, "kvpilot_gateway_retries", "reason") == {}


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ({"a": 5.0}, {"a": 8.0}, {"a": 3.0}),
        ({}, {"a": 2.0}, {"a": 2.0}),  # a replica that came up during the burst
        ({"a": 1.0, "gone": 4.0}, {"a": 1.0}, {"a": 0.0}),  # one that went away
    ],
)
def test_growth(
    before: dict[str, float], after: dict[str, float], expected: dict[str, float]
) -> None:
    assert growth(before, after) == expected


def test_routing_rows_per_replica_and_overall() -> None:
    rows = routing_rows(
        picks={"ns/a": 30, "ns/b": 10, "ns/idle": 0},
        hits={"ns/a": 90, "ns/b": 0, "ns/idle": 0},
        queries={"ns/a": 100, "ns/b": 100, "ns/idle": 0},
    )
    assert rows == [
        ["REPLICA", "PICKS", "PREFIX-CACHE HIT RATE"],
        ["ns/a", "30", "90%"],
        ["ns/b", "10", "0%"],
        ["all", "40", "45%"],
    ]
    assert routing_rows({}, {}, {})[-1] == ["all", "0", "-"]


def test_tenants_share_a_preamble_longer_than_the_prefix_key() -> None:
    records = tenant_prompts(tenants=3, per_tenant=2, output_len=16)
    assert len(records) == 6 and {r["max_tokens"] for r in records} == {16}
    prefixes = [r["prompt"][:256] for r in records]  # the gateway's default prefix key
    assert prefixes[0] == prefixes[3] and prefixes[0] != prefixes[1]  # tenant 0, tenants 0/1
    assert len({r["prompt"] for r in records}) == 6  # every question differs


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ({}, "0"),
        ({"connect": 0.0}, "0"),
        ({"connect": 2.0, "503": 1.0}, "3 (503: 1, connect: 2)"),
    ],
)
def test_by_key(counts: dict[str, float], expected: str) -> None:
    assert by_key(counts) == expected
