"""Table tests for kvpilot.operator.autoscaling.replica_capacity: seed, learn, size."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpilot.operator.autoscaling.replica_capacity import (
    FleetSample,
    ReplicaCapacity,
    StepFit,
    learn,
    replicas_for,
    seed,
    staffing_z,
    within_tpot,
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
    assert seeded.service_s(0.0) is None  # unknown until requests complete


PRIOR = ReplicaCapacity(slots=48.0, max_num_seqs=64)
# 400 tokens a request at 0.05 s a step: 20 s a request, whatever the batch (flat)
FLAT = ReplicaCapacity(
    slots=48.0, max_num_seqs=64, tokens_per_request=400.0, step=StepFit(20, 0.05)
)
# the same at batch 20, plus 0.001 s a step per extra sequence
SLOPED = replace(FLAT, step=StepFit(20.0, 0.05, batch_var=99.0, covariance=0.1))


def sample(ready: int, running: float, kv: float, completions: float, tokens: float) -> FleetSample:
    return FleetSample(ready, running, kv, completions, tokens)


LEARN = [
    # (case id, capacity, sample, weight, expected slots, tokens/request, step time at 20)
    (
        # 2 replicas x 30 running at 0.75 usage: a full cache holds 40; 1200 tokens/s over 60
        # running: a step every 0.05 s; 1200 tokens/s over 3 completions/s: 400 tokens
        "first traffic sets tokens and step time, the KV moves the slots",
        PRIOR,
        sample(2, 60.0, 0.75, 3.0, 1200.0),
        0.5,
        44.0,
        400.0,
        0.05,
    ),
    (
        "later samples are averaged in",
        FLAT,
        sample(2, 40.0, 0.5, 2.0, 400.0),  # 200 tokens a request, 0.1 s a step at batch 20
        0.5,
        44.0,
        300.0,
        0.075,
    ),
    (
        "the batch limit caps what a small-request cache suggests",
        FLAT,
        sample(1, 20.0, 0.1, 1.0, 400.0),
        1.0,
        64.0,
        400.0,
        0.05,
    ),
    (
        "an almost empty cache says nothing about the KV per sequence",
        FLAT,
        sample(1, 1.0, 0.01, 0.05, 20.0),
        1.0,
        48.0,
        400.0,
        0.05,
    ),
    ("no traffic: nothing learned", FLAT, sample(3, 0.0, 0.0, 0.0, 0.0), 1.0, 48.0, 400.0, 0.05),
    (
        "no ready replica: nothing learned",
        FLAT,
        sample(0, 5.0, 0.5, 1.0, 100.0),
        1.0,
        48.0,
        400.0,
        0.05,
    ),
]


@pytest.mark.parametrize(
    ("capacity", "fleet", "weight", "slots", "tokens", "step_s"),
    [case[1:] for case in LEARN],
    ids=[case[0] for case in LEARN],
)
def test_learn_table(
    capacity: ReplicaCapacity,
    fleet: FleetSample,
    weight: float,
    slots: float,
    tokens: float,
    step_s: float,
) -> None:
    learned = learn(capacity, fleet, weight)
    assert learned.slots == pytest.approx(slots)
    assert learned.tokens_per_request == pytest.approx(tokens)
    assert learned.step is not None
    assert learned.step.at(20.0) == pytest.approx(step_s)


def test_the_step_time_is_fitted_as_a_line_in_the_batch() -> None:
    """Samples from step = 0.03 + 0.0006 x batch at batches 10..40 recover the line."""
    capacity = PRIOR
    for batch in [10, 40, 20, 30, 15, 35, 25] * 6:
        step = 0.03 + 0.0006 * batch
        capacity = learn(capacity, sample(1, batch, 0.5, 1.0, batch / step))
    assert capacity.step is not None
    assert capacity.step.slope() == pytest.approx(0.0006, rel=0.05)
    assert capacity.step.at(41.0) == pytest.approx(0.03 + 0.0006 * 41, rel=0.02)


def test_a_batch_that_never_varied_gives_a_flat_step_time() -> None:
    capacity = PRIOR
    for _ in range(20):
        capacity = learn(capacity, sample(2, 40.0, 0.5, 2.0, 800.0))
    assert capacity.step is not None
    assert capacity.step.slope() == 0.0
    assert capacity.service_s(40.0) == capacity.service_s(0.0) == pytest.approx(20.0)


SIZING = [
    # (case id, demand/s, capacity, z, expected replicas)
    # 4/s x 20 s = 80 in flight, + 1.645 x sqrt(80) = 94.7, / 48 slots -> 2
    ("p95 margin over the mean in flight", 4.0, FLAT, 1.645, 2),
    # + 2.326 x sqrt(80) = 100.8 -> 3
    ("a stricter percentile adds a replica", 4.0, FLAT, 2.326, 3),
    ("no margin: the mean alone", 4.8, FLAT, 0.0, 2),
    # 4.8/s with steps 0.001 s slower per sequence above 20: on 2 or 3 replicas the batch grows
    # past the 48 slots (its own steps slow it down); 4 settle at 27.7 each
    ("bigger batches step slower: the fleet is solved at its own batch", 4.8, SLOPED, 0.0, 4),
    ("no demand: no replicas (min replicas is the policy's floor)", 0.0, FLAT, 2.326, 0),
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
    for capacity in (PRIOR, FLAT, SLOPED):
        assert ReplicaCapacity.from_dict(capacity.to_dict()) == capacity


@pytest.mark.parametrize(
    "bad",
    [
        lambda: ReplicaCapacity(slots=0.0, max_num_seqs=64),
        lambda: ReplicaCapacity(slots=4.0, max_num_seqs=0),
        lambda: ReplicaCapacity(slots=4.0, max_num_seqs=8, tokens_per_request=0.0),
        lambda: seed(64, 0),
    ],
)
def test_invalid_capacity_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        bad()  # type: ignore[operator]


# Around a batch of 30 the step takes 0.05 s and grows 1 ms per sequence (slope 0.1 / (100 + 1)).
SLOPED_STEP = StepFit(30.0, 0.05, batch_var=100.0, covariance=0.1)
AT_40_MS = 30.0 - 0.01 / (0.1 / 101)  # the batch whose step the slope brings to 0.04 s
TPOT_CASES = [
    # (case id, step fit, TPOT target, expected slots of a 48-slot replica)
    ("nothing measured yet: the slots stand", None, 0.01, 48.0),
    ("a flat step that meets the target: no cap", StepFit(30.0, 0.05), 0.06, 48.0),
    ("a flat step that misses it: one slot, as close as it gets", StepFit(30.0, 0.05), 0.04, 1.0),
    ("a sloped step: the batch where it reaches 0.04 s", SLOPED_STEP, 0.04, AT_40_MS),
    ("a cap above the slots changes nothing", SLOPED_STEP, 0.2, 48.0),
    ("a target below even one sequence's step: one slot", SLOPED_STEP, 0.001, 1.0),
]


@pytest.mark.parametrize(
    ("step", "tpot_s", "slots"),
    [case[1:] for case in TPOT_CASES],
    ids=[case[0] for case in TPOT_CASES],
)
def test_a_tpot_target_caps_the_slots(step: StepFit | None, tpot_s: float, slots: float) -> None:
    capacity = ReplicaCapacity(48.0, 64, tokens_per_request=400.0, step=step)
    capped = within_tpot(capacity, tpot_s)
    assert capped.slots == pytest.approx(slots)
    assert replace(capped, slots=capacity.slots) == capacity  # only the slots change
