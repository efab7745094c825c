"""The autoscaler's Lease against the real apiserver: one holder, take-over, release, races."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvpilot.contract import k8s
from kvpilot.operator.lease import LEASE_API_VERSION, LeaderLease

pytestmark = [pytest.mark.cluster]
DURATION_S = 2


@pytest.fixture
def lease_name(cluster: Any) -> Iterator[str]:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    yield name
    cluster.kubectl("delete", "lease", name, "-n", "default", "--wait=false", check=False)


def instance(cluster: Any, lease_name: str, identity: str) -> LeaderLease:
    return LeaderLease(cluster.api_client(), "default", identity, DURATION_S, lease_name)


def holder(cluster: Any, name: str) -> str | None:
    found = k8s.get(cluster.api_client(), LEASE_API_VERSION, "Lease", "default", name)
    return None if found is None else (found.get("spec") or {}).get("holderIdentity")


def test_one_holder_until_it_stops_renewing(cluster: Any, lease_name: str) -> None:
    a, b = instance(cluster, lease_name, "a"), instance(cluster, lease_name, "b")
    assert not a.state_known  # nothing asked yet: the operator is not ready
    assert a.hold() and not b.hold()
    assert holder(cluster, lease_name) == "a"
    assert a.state_known and b.state_known  # holding or not, each knows who does

    # a keeps renewing: b never takes over, however long it waits
    deadline = time.monotonic() + 2 * DURATION_S
    while time.monotonic() < deadline:
        a._renewed_at = None  # renew on every call, not every third of the duration
        assert a.hold()
        last_renewal = time.monotonic()
        assert not b.hold()
        time.sleep(0.3)

    # a stops (crashes): b takes over once the record has not changed for the duration
    while not b.hold():
        assert time.monotonic() - last_renewal < 3 * DURATION_S, "b never took over"
        time.sleep(0.2)
    assert time.monotonic() - last_renewal >= DURATION_S
    assert holder(cluster, lease_name) == "b"
    a._renewed_at = None
    assert not a.hold()  # the old holder learns it has lost it


def test_release_hands_over_at_once(cluster: Any, lease_name: str) -> None:
    a, b = instance(cluster, lease_name, "a"), instance(cluster, lease_name, "b")
    assert a.hold() and not b.hold()
    a.release()
    assert holder(cluster, lease_name) is None
    assert b.hold()
    lease = k8s.get(cluster.api_client(), LEASE_API_VERSION, "Lease", "default", lease_name)
    assert lease is not None and lease["spec"]["leaseTransitions"] == 0  # released, not lost


def test_instances_racing_for_a_new_lease_elect_one(cluster: Any, lease_name: str) -> None:
    instances = [instance(cluster, lease_name, f"i{n}") for n in range(6)]
    results: dict[str, bool] = {}
    start = threading.Barrier(len(instances))

    def race(lease: LeaderLease) -> None:
        start.wait()
        results[lease.identity] = lease.hold()

    threads = [threading.Thread(target=race, args=(lease,)) for lease in instances]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    winners = [identity for identity, won in results.items() if won]
    assert len(results) == len(instances) and winners == [holder(cluster, lease_name)]


def test_an_unreachable_api_leaves_the_lease_state_unknown(cluster: Any, lease_name: str) -> None:
    client = cluster.api_client()
    client.configuration.host = "https://127.0.0.1:1"  # nothing listens there
    lease = LeaderLease(client, "default", "a", DURATION_S, lease_name)
    assert not lease.hold()
    assert not lease.state_known
