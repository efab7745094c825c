"""Table tests for kvpilot.operator.autoscaling.replica_capacity: seed, learn, size."""

from __future__ import annotations

import pytest

from kvpilot.operator.autoscaling.replica_capacity import (
    FleetSample,
    ReplicaCapacity,
    learn,
    replicas_for,
    seed,
    staffing_z,
)

SEEDS = [
    # (case id, max_num_seqs, kv_cache_tokens, request tokens, expected slots)
    ("KV-bound: 49152 tokens hold 48 requests of 1024", 64, 49_152, 1024.0, 48.0),
    ("batch-bound: a big cache still runs 16 at once", 16, 49_152, 1024.0, 16.0),
    ("long requests fill the cache sooner", 64, 49_152, 4096.0, 12.0),
]


@pytest.mark.parametrize(
    ("max_seqs", "kv_tokens", "request_tokens", "slots"),
    [case[1:] for case in SEEDS],
    ids=[case[0] for case in SEEDS],
)
def test_seed_table(max_seqs: int, kv_tokens: int, request_tokens: float, slots: float) -> None:
    seeded = seed(max_seqs, kv_tokens, request_tokens)
    assert seeded.slots == pytest.approx(slots)
    assert seeded.service_s is None  # unknown until requests complete


PRIOR = ReplicaCapacity(slots=48.0, max_num_seqs=64, service_s=None)
KNOWN = ReplicaCapacity(slots=48.0, max_num_seqs=64, service_s=20.0)

LEARN = [
    # (case id, capacity, sample, weight, expected slots, expected service seconds)
    (
        # 2 replicas x 30 running at 0.75 usage: a full cache holds 40; Little: 60 / 3 = 20 s
        "first completions set the service time, the KV moves the slots",
        PRIOR,
        FleetSample(ready=2, running=60.0, kv_usage=0.75, completions_per_s=3.0),
        0.5,
        44.0,
        20.0,
    ),
    (
        "later samples are averaged in",
        KNOWN,
        FleetSample(ready=2, running=60.0, kv_usage=0.75, completions_per_s=2.0),
        0.5,
        44.0,
        25.0,
    ),
    (
        "the batch limit caps what a small-request cache suggests",
        KNOWN,
        FleetSample(ready=1, running=20.0, kv_usage=0.1, completions_per_s=1.0),
        1.0,
        64.0,
        20.0,
    ),
    (
        "an almost empty cache says nothing about the KV per sequence",
        KNOWN,
        FleetSample(ready=1, running=1.0, kv_usage=0.01, completions_per_s=0.1),
        1.0,
        48.0,
        10.0,
    ),
    (
        "no traffic: nothing learned",
        KNOWN,
        FleetSample(ready=3, running=0.0, kv_usage=0.0, completions_per_s=0.0),
        1.0,
        48.0,
        20.0,
    ),
    (
        "no ready replica: nothing learned",
        KNOWN,
        FleetSample(ready=0, running=5.0, kv_usage=0.5, completions_per_s=1.0),
        1.0,
        48.0,
        20.0,
    ),
]


@pytest.mark.parametrize(
    ("capacity", "sample", "weight", "slots", "service"),
    [case[1:] for case in LEARN],
    ids=[case[0] for case in LEARN],
)
def test_learn_table(
    capacity: ReplicaCapacity, sample: FleetSample, weight: float, slots: float, service: float
) -> None:
    learned = learn(capacity, sample, weight)
    assert learned.slots == pytest.approx(slots)
    assert learned.service_s == pytest.approx(service)


SIZING = [
    # (case id, demand/s, capacity, z, expected replicas)
    # 4/s x 20 s = 80 in flight, + 1.645 x sqrt(80) = 94.7, / 48 slots -> 2
    ("p95 margin over the mean in flight", 4.0, KNOWN, 1.645, 2),
    # + 2.326 x sqrt(80) = 100.8 -> 3
    ("a stricter percentile adds a replica", 4.0, KNOWN, 2.326, 3),
    ("no margin: the mean alone", 4.8, KNOWN, 0.0, 2),
    ("no demand: no replicas (min replicas is the policy's floor)", 0.0, KNOWN, 2.326, 0),
    ("service time unknown: no sizing", 4.0, PRIOR, 2.326, None),
]


@pytest.mark.parametrize(
    ("demand", "capacity", "z", "replicas"),
    [case[1:] for case in SIZING],
    ids=[case[0] for case in SIZING],
)
def test_replicas_for_table(
    demand: float, capacity: ReplicaCapacity, z: float, replicas: int | None
) -> None:
    assert replicas_for(demand, capacity, z) == replicas


def test_staffing_z_is_the_normal_quantile_of_the_percentile() -> None:
    assert staffing_z(95) == pytest.approx(1.645, abs=1e-3)
    assert staffing_z(99) == pytest.approx(2.326, abs=1e-3)
    for bad in (49.0, 100.0):
        with pytest.raises(ValueError):
            staffing_z(bad)


def test_capacity_round_trips_through_status() -> None:
    for capacity in (PRIOR, KNOWN):
        assert ReplicaCapacity.from_dict(capacity.to_dict()) == capacity


@pytest.mark.parametrize(
    "bad",
    [
        lambda: ReplicaCapacity(slots=0.0, max_num_seqs=64),
        lambda: ReplicaCapacity(slots=4.0, max_num_seqs=0),
        lambda: ReplicaCapacity(slots=4.0, max_num_seqs=8, service_s=0.0),
        lambda: seed(64, 0),
    ],
)
def test_invalid_capacity_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        bad()  # type: ignore[operator]
