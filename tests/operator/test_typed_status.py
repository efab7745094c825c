"""Status parsed once where the object comes in: valid, missing and garbled statuses."""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any

import pytest

from kvpilot.operator import api
from kvpilot.operator.reconcile import typed_status

READY = {"type": "Ready", "status": "True", "reason": "Ready", "lastTransitionTime": "t0"}
PLAN_ENTRY = {"nodeType": "l4", "fits": True, "quantization": "bf16", "replicas": 2}
CACHED = {"claimName": "cache-1", "phase": "Cached", "bytes": 10}
COST = {
    "pricePerHour": 1.5,
    "requestsPerSecond": 2.0,
    "outputTokensPerSecond": 40.0,
    "perThousandRequests": 0.2,
    "window": "5m",
    "measuredAt": "2026-12-04T10:00:00Z",
}
AUTOSCALING = {
    "desiredReplicas": 3,
    "replicasPerNodeType": {"l4": 2, "t4": 1},
    "lastDecisionTime": "2026-12-04T10:00:00Z",  # written by the loop, kept out of the CRD
    "state": {"recommendations": [[1.0, 3]]},
}
VALID = {
    "observedGeneration": 4,
    "conditions": [READY],
    "plan": [PLAN_ENTRY],
    "replicas": 2,
    "readyReplicas": 1,
    "autoscaling": AUTOSCALING,
    "cache": CACHED,
    "cost": COST,
}


def summary(status: api.ModelDeploymentStatus) -> dict[str, Any]:
    """What the readers use, flattened for a table."""
    return {
        "generation": status.observed_generation,
        "conditions": [c.type for c in status.conditions],
        "plan": [(e.node_type, e.replicas) for e in status.plan],
        "desired": status.autoscaling.desired_replicas,
        "spread": dict(status.autoscaling.replicas_per_node_type),
        "cache": None if status.cache is None else status.cache.phase,
        "cost": None if status.cost is None else status.cost.per_thousand_requests,
    }


EMPTY_SUMMARY = summary(typed_status.EMPTY)
VALID_SUMMARY = {
    "generation": 4,
    "conditions": ["Ready"],
    "plan": [("l4", 2)],
    "desired": 3,
    "spread": {"l4": 2, "t4": 1},
    "cache": "Cached",
    "cost": 0.2,
}


@pytest.mark.parametrize(
    ("name", "raw", "expected", "warns"),
    [
        ("valid", VALID, VALID_SUMMARY, False),
        ("read-only mapping (kopf's body)", MappingProxyType(VALID), VALID_SUMMARY, False),
        ("missing: never reconciled", None, EMPTY_SUMMARY, False),
        ("empty", {}, EMPTY_SUMMARY, False),
        ("unknown top-level field (another writer)", {**VALID, "foo": 1}, VALID_SUMMARY, False),
        ("not an object", "garbled", EMPTY_SUMMARY, True),
        ("a list", [1, 2], EMPTY_SUMMARY, True),
        (
            "one malformed condition: only it goes",
            {**VALID, "conditions": [READY, {"type": "X", "status": "maybe"}, {"bad": 1}, 7]},
            VALID_SUMMARY,
            True,
        ),
        (
            "a plan entry without nodeType: only it goes",
            {**VALID, "plan": [{"fits": True}, PLAN_ENTRY]},
            VALID_SUMMARY,
            True,
        ),
        (
            "observedGeneration garbled: its default",
            {**VALID, "observedGeneration": "four"},
            {**VALID_SUMMARY, "generation": 0},
            True,
        ),
        (
            "one node type's count garbled: only it goes",
            {
                **VALID,
                "autoscaling": {**AUTOSCALING, "replicasPerNodeType": {"l4": "two", "t4": 1}},
            },
            {**VALID_SUMMARY, "spread": {"t4": 1}},
            True,
        ),
        (
            "a dropped node type's null (merge-patch leftover)",
            {**VALID, "autoscaling": {**AUTOSCALING, "replicasPerNodeType": {"l4": 2, "t4": None}}},
            {**VALID_SUMMARY, "spread": {"l4": 2}},
            True,
        ),
        (
            "cache without its required phase: the cache goes",
            {**VALID, "cache": {"claimName": "cache-1"}},
            {**VALID_SUMMARY, "cache": None},
            True,
        ),
        (
            "cache with a field an old version wrote: that field goes",
            {**VALID, "cache": {**CACHED, "node": "n1"}},
            VALID_SUMMARY,
            True,
        ),
        (
            "cost garbled: the cost goes, the rest stays",
            {**VALID, "cost": {"window": "5m"}},
            {**VALID_SUMMARY, "cost": None},
            True,
        ),
    ],
)
def test_parse(
    name: str, raw: Any, expected: dict[str, Any], warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=typed_status.__name__):
        parsed = typed_status.parse(raw)
    assert summary(parsed) == expected, name
    assert bool(caplog.records) is warns, name


def test_of_reads_the_objects_status() -> None:
    assert summary(typed_status.of({"metadata": {}, "status": VALID})) == VALID_SUMMARY
    assert typed_status.of({"metadata": {}}) == typed_status.EMPTY


def test_the_autoscalers_own_keys_are_kept() -> None:
    """status.autoscaling preserves unknown fields: the policy state must survive a parse."""
    extra = typed_status.parse(VALID).autoscaling.model_extra or {}
    assert extra["state"] == {"recommendations": [[1.0, 3]]}
    assert extra["lastDecisionTime"] == "2026-12-04T10:00:00Z"


@pytest.mark.parametrize(
    ("part", "raw", "expected"),
    [
        ("cache", {"cache": CACHED}, {**CACHED, "message": "", "variant": ""}),
        ("autoscaling", {"autoscaling": AUTOSCALING}, {**AUTOSCALING, "metrics": {}}),
        ("cost", {"cost": COST}, {**COST, "currency": "USD", "reason": "", "nodeTypes": {}}),
        # no nulls: in a merge patch one would delete, and in a list the apiserver prunes it
        ("plan", {"plan": [{**PLAN_ENTRY, "qualityLoss": None}]}, None),
    ],
)
def test_wire_writes_back_what_was_read(part: str, raw: dict[str, Any], expected: Any) -> None:
    written = typed_status.wire(typed_status.parse(raw))
    if expected is not None:
        assert written[part] == expected
    else:
        assert "qualityLoss" not in written[part][0]
