"""bench.operator_scale's figures: where a create's latency goes (the operator's process times the
apply of each Deployment, bench.operator_writes; the bench the create and its watch), and which
of several bursts is reported."""

from __future__ import annotations

import pytest

from bench.operator_scale import PARTS, latency_parts, median_burst, p50_p95
from bench.operator_writes import deployment_of

SENT, ROUND_TRIP, SEEN = (label for label, _, _ in PARTS)


@pytest.mark.parametrize(
    ("method", "url", "name"),
    [
        ("PATCH", "https://h:6443/apis/apps/v1/namespaces/ns/deployments/md-1-l4?force=true",
         "md-1-l4"),
        ("patch", "https://h/apis/apps/v1/namespaces/ns/deployments/md-1-l4", "md-1-l4"),
        ("PATCH", "https://h/apis/apps/v1/namespaces/ns/deployments/md-1-l4/status", None),
        ("GET", "https://h/apis/apps/v1/namespaces/ns/deployments/md-1-l4", None),
        ("PATCH", "https://h/api/v1/namespaces/ns/services/md-1", None),
    ],
)  # fmt: skip
def test_deployment_of_names_a_deployments_patch_only(
    method: str, url: str, name: str | None
) -> None:
    assert deployment_of(method, url) == name


def test_latency_parts_split_each_create_at_the_apply() -> None:
    created = {f"d{i}": 10.0 + i for i in range(20)}
    applies = {f"d{i}": (10.1 + i, 10.4 + i + i / 100) for i in range(20)}
    seen = {f"d{i}": 10.9 + i for i in range(20)}
    parts = latency_parts(created, applies, seen)
    assert parts[SENT] == pytest.approx((0.1, 0.1))
    assert parts[ROUND_TRIP] == pytest.approx((0.3 + 0.10, 0.3 + 0.18))
    assert parts[SEEN] == pytest.approx((0.5 - 0.09, 0.5 - 0.01))


def test_latency_parts_leave_out_what_was_not_timed() -> None:
    parts = latency_parts({"a": 1.0, "b": 2.0}, {"a": (1.5, 2.0)}, {"a": 2.5, "b": 3.0})
    assert parts == {SENT: (0.5, 0.5), ROUND_TRIP: (0.5, 0.5), SEEN: (0.5, 0.5)}
    assert latency_parts({"a": 1.0}, {}, {"a": 2.0}) == {}


def test_the_median_burst_is_reported_whole_with_every_bursts_p95() -> None:
    bursts = [{"p95_s": 1.4, "ready_s": 9.0}, {"p95_s": 0.9, "ready_s": 12.0},
              {"p95_s": 1.1, "ready_s": 8.0}]  # fmt: skip
    assert median_burst(bursts) == {"p95_s": 1.1, "ready_s": 8.0, "burst_p95s": [1.4, 0.9, 1.1]}


@pytest.mark.parametrize(
    ("values", "p50", "p95"),
    [
        ([0.5], 0.5, 0.5),  # one value is both
        ([float(i) for i in range(1, 21)], 11.0, 19.0),  # nearest rank: the 19th of 20
        ([float(i) for i in range(1, 201)], 101.0, 190.0),  # the 190th of 200
    ],
)
def test_p50_p95_of_sorted_values(values: list[float], p50: float, p95: float) -> None:
    assert p50_p95(values) == (p50, p95)
