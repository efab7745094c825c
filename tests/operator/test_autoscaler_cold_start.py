"""Cold starts measured on a ModelDeployment's pods (autoscaling/cold_start.py), table-tested,
and their round trip through status.autoscaling.coldStart."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.contract import timestamps
from kvpilot.contract.resource import LABEL_NODE_TYPE
from kvpilot.operator import api
from kvpilot.operator.autoscaling import cold_start, recording
from kvpilot.operator.autoscaling.cold_start import Sample
from kvpilot.operator.autoscaling.loop import measured_cold_start
from kvpilot.operator.reconcile import typed_status

T0 = 1_800_000_000.0


def at(seconds: float) -> str:
    return timestamps.rfc3339_from_unix(T0 + seconds)


def pod(
    name: str,
    created: float | None = 0,
    ready: float | None = 12,
    ready_status: str = "True",
    restarts: int = 0,
    deleting: bool = False,
    node_type: str | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if node_type is not None:
        meta["labels"] = {LABEL_NODE_TYPE: node_type}
    if created is not None:
        meta["creationTimestamp"] = at(created)
    if deleting:
        meta["deletionTimestamp"] = at(100)
    conditions = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": at(1)}]
    if ready is not None:
        conditions.append(
            {"type": "Ready", "status": ready_status, "lastTransitionTime": at(ready)}
        )
    status = {"conditions": conditions, "containerStatuses": [{"restartCount": restarts}]}
    return {"metadata": meta, "status": status}


# (case, pod, seconds sampled or None)
PODS = [
    ("ready", pod("a", created=0, ready=12), 12.0),
    ("ready after a slow start", pod("a", created=5, ready=114), 109.0),
    ("still starting", pod("a", ready_status="False"), None),
    ("no Ready condition yet", pod("a", ready=None), None),
    ("going away", pod("a", deleting=True), None),
    ("restarted: its Ready time is not its first", pod("a", restarts=1), None),
    ("no creation time", pod("a", created=None), None),
    ("Ready before created (clock skew)", pod("a", created=20, ready=10), None),
]


@pytest.mark.parametrize(("case", "found", "seconds"), PODS, ids=[p[0] for p in PODS])
def test_a_pod_gives_a_sample_once_it_is_ready(
    case: str, found: dict[str, Any], seconds: float | None
) -> None:
    sample = cold_start.sample_of(found)
    assert (None if sample is None else sample.seconds) == seconds, case


def test_merge_keeps_a_pods_first_sample_and_the_newest_ones() -> None:
    kept = [Sample("a", T0 + 12, 12.0), Sample("old", T0 - 500, 90.0)]
    pods = [pod("a", created=50, ready=55), pod("b", created=20, ready=30)]
    merged = cold_start.merge(kept, pods)
    assert [(s.pod, s.seconds) for s in merged] == [("old", 90.0), ("a", 12.0), ("b", 10.0)]
    assert [s.pod for s in cold_start.merge(kept, pods, keep=2)] == ["a", "b"]


# (case, seconds, median, p95 by nearest rank)
SUMMARIES = [
    ("one", [30.0], 30.0, 30.0),
    ("two", [10.0, 30.0], 20.0, 30.0),
    ("a slow outlier moves the p95, not the median", [10.0] * 19 + [100.0], 10.0, 10.0),
    ("twenty", [float(i) for i in range(1, 21)], 10.5, 19.0),
    ("two slow of twenty", [10.0] * 18 + [100.0, 120.0], 10.0, 100.0),
]


@pytest.mark.parametrize(
    ("case", "seconds", "median", "p95"), SUMMARIES, ids=[s[0] for s in SUMMARIES]
)
def test_summary_median_and_p95(case: str, seconds: list[float], median: float, p95: float) -> None:
    samples = [Sample(f"p{i}", T0 + i, s) for i, s in enumerate(seconds)]
    summary = cold_start.summarize(samples)
    assert summary is not None
    assert (summary.median_s, summary.p95_s) == (median, p95), case


def test_no_samples_no_summary() -> None:
    assert cold_start.summarize([]) is None
    assert cold_start.measure(None, [pod("a", ready_status="False")]) is None


def test_status_round_trip_and_the_loop_adds_new_pods_to_what_status_holds() -> None:
    first = cold_start.measure(None, [pod("a", created=0, ready=12)])
    assert first is not None
    written = {"autoscaling": {"coldStart": first.to_dict()}}
    status = typed_status.parse(written)
    assert status.autoscaling.cold_start == api.ColdStartStatus.model_validate(first.to_dict())
    # pod a is gone; pod b started in 30 s: both count
    later = measured_cold_start(status, [pod("b", created=100, ready=130)])
    assert later is not None
    assert later.to_dict()["samples"] == 2 and later.median_s == 21.0
    assert later.to_dict()["recent"][0] == {"pod": "a", "readyAt": T0 + 12, "seconds": 12.0}
    assert later.to_dict()["byNodeType"] == {}  # pods without a node type label


@pytest.mark.parametrize(
    "stored",
    [
        None,
        {},
        {"recent": None},
        {"recent": [{"pod": "a"}]},
        {"recent": [{"pod": "a", "readyAt": "x", "seconds": 1}]},
    ],
)
def test_samples_that_do_not_parse_are_measured_again(stored: dict[str, Any] | None) -> None:
    assert cold_start.samples_from_status(stored) == ()


def test_each_node_type_has_its_own_spread_and_the_lead_is_where_replicas_go() -> None:
    pods = [pod("h1", created=0, ready=8, node_type="h100"),
            pod("h2", created=0, ready=12, node_type="h100"),
            pod("l1", created=0, ready=90, node_type="l4"),
            pod("x", created=0, ready=30)]  # fmt: skip
    summary = cold_start.measure(None, pods)
    assert summary is not None
    assert summary.median_s == 21.0  # the fleet: 8, 12, 30, 90
    assert {t: (s.median_s, s.count) for t, s in summary.by_node_type.items()} == {
        "h100": (10.0, 2),
        "l4": (90.0, 1),
    }
    assert summary.lead_s("h100") == 10.0 and summary.lead_s("l4") == 90.0
    assert summary.lead_s("a10g") == 21.0 and summary.lead_s(None) == 21.0  # no samples yet
    # Written and read back, the node types come with the samples
    status = typed_status.parse({"autoscaling": {"coldStart": summary.to_dict()}})
    stored = status.autoscaling.cold_start
    assert stored is not None and stored.by_node_type["l4"].median_seconds == 90.0
    again = measured_cold_start(status, [])
    assert again is not None and again.by_node_type == summary.by_node_type


def test_the_forecast_looks_ahead_by_the_first_fitting_node_types_cold_start() -> None:
    plan = [
        api.PlanEntry(node_type="t4", fits=False),
        api.PlanEntry(node_type="l4", fits=True),
        api.PlanEntry(node_type="h100", fits=True),
    ]
    assert recording.first_fitting_node_type(plan) == "l4"
    assert recording.first_fitting_node_type(plan[:1]) is None
