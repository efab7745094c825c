"""The Lease rules of lease.py, as tables (the API part is tested on the control plane)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator import lease

HELD_BY_B = {"holderIdentity": "b", "leaseDurationSeconds": 15, "renewTime": "t0"}

MAY_TAKE = [
    ("no Lease spec yet", {}, 0.0, True),
    ("let go", {"leaseDurationSeconds": 15}, 0.0, True),
    ("already ours", {**HELD_BY_B, "holderIdentity": "a"}, 0.0, True),
    ("another holder renewing", HELD_BY_B, 5.0, False),
    ("unchanged exactly its duration", HELD_BY_B, 15.0, False),
    ("unchanged longer than its duration", HELD_BY_B, 15.5, True),
]


@pytest.mark.parametrize(
    ("spec", "unchanged_for_s", "expected"),
    [row[1:] for row in MAY_TAKE],
    ids=[row[0] for row in MAY_TAKE],
)
def test_may_take(spec: dict[str, Any], unchanged_for_s: float, expected: bool) -> None:
    assert lease.may_take(spec, "a", unchanged_for_s) is expected


TAKEN = [
    (
        "first holder",
        {},
        {
            "holderIdentity": "a",
            "leaseDurationSeconds": 30,
            "acquireTime": "t1",
            "renewTime": "t1",
            "leaseTransitions": 0,
        },
    ),
    (
        "renewal keeps acquireTime and transitions",
        {"holderIdentity": "a", "acquireTime": "t0", "renewTime": "t0", "leaseTransitions": 2},
        {
            "holderIdentity": "a",
            "leaseDurationSeconds": 30,
            "acquireTime": "t0",
            "renewTime": "t1",
            "leaseTransitions": 2,
        },
    ),
    (
        "take-over counts a transition",
        {"holderIdentity": "b", "acquireTime": "t0", "renewTime": "t0", "leaseTransitions": 2},
        {
            "holderIdentity": "a",
            "leaseDurationSeconds": 30,
            "acquireTime": "t1",
            "renewTime": "t1",
            "leaseTransitions": 3,
        },
    ),
]


@pytest.mark.parametrize(
    ("spec", "expected"), [row[1:] for row in TAKEN], ids=[row[0] for row in TAKEN]
)
def test_taken(spec: dict[str, Any], expected: dict[str, Any]) -> None:
    assert lease.taken(spec, "a", 30, "t1") == expected


def test_released_leaves_no_holder_and_the_rest_as_it_was() -> None:
    assert lease.released(HELD_BY_B) == {"leaseDurationSeconds": 15, "renewTime": "t0"}
    assert lease.may_take(lease.released(HELD_BY_B), "a", 0.0)


NAMESPACE = [
    ("the chart's downward API", {"POD_NAMESPACE": "kvpilot-system"}, "ml-team", "kvpilot-system"),
    ("outside a pod, watching one namespace", {}, "ml-team", "ml-team"),
    ("outside a pod, watching all", {}, "", "default"),
]


@pytest.mark.parametrize(
    ("env", "watched", "expected"),
    [row[1:] for row in NAMESPACE],
    ids=[row[0] for row in NAMESPACE],
)
def test_operator_namespace(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], watched: str, expected: str
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr(lease, "SERVICE_ACCOUNT_NAMESPACE", Path("/nonexistent/namespace"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert lease.operator_namespace(watched) == expected


def test_identity_names_the_pod_and_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "kvpilot-7d9f-abcde")
    identity = lease.default_identity()
    assert identity.startswith("kvpilot-7d9f-abcde_") and identity.split("_")[1].isdigit()


HAS_LOST = [
    ("renewed", True, True, 0.0, False),
    ("renewal failed, API down, still within the deadline", False, False, 9.0, False),
    ("renewal failed, API down past the deadline", False, False, 10.5, True),
    ("another instance holds it now", False, True, 1.0, True),
]


@pytest.mark.parametrize(
    ("held", "holder_known", "since_renewal_s", "expected"),
    [row[1:] for row in HAS_LOST],
    ids=[row[0] for row in HAS_LOST],
)
def test_has_lost(held: bool, holder_known: bool, since_renewal_s: float, expected: bool) -> None:
    assert lease.has_lost(held, holder_known, since_renewal_s, deadline_s=10.0) is expected


def test_the_holder_gives_up_before_a_standby_may_take_over() -> None:
    held = lease.LeaderLease(None, "ns", "a", duration_s=15)  # type: ignore[arg-type]
    assert held.renew_every_s < held.renew_deadline_s < held.duration_s
    assert held.retry_s <= held.renew_every_s
