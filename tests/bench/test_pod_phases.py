"""A new pod's phases from what a watch saw (bench/pod_phases.py), table-tested: a replacement's
and a scale-up's, and when a model's pods have settled at a count."""

from __future__ import annotations

from typing import Any

import pytest

from bench.pod_phases import (
    PHASES,
    SCALE_UP_PHASES,
    PodSeen,
    first_ready,
    is_settled,
    observe,
    phases,
)

PENDING: dict[str, Any] = {"metadata": {"name": "p"}, "spec": {}, "status": {}}
BOUND = {**PENDING, "spec": {"nodeName": "local-0"}}
RUNNING = {**BOUND, "status": {"containerStatuses": [{"state": {"running": {}}}]}}
READY = {
    **RUNNING,
    "status": {**RUNNING["status"], "conditions": [{"type": "Ready", "status": "True"}]},
}
NOT_READY = {
    **RUNNING,
    "status": {**RUNNING["status"], "conditions": [{"type": "Ready", "status": "False"}]},
}


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        # one version per second: each step is marked when it first shows
        ([PENDING, BOUND, RUNNING, READY], (0.0, 1.0, 2.0, 3.0)),
        # created already bound (a pod with spec.nodeName), Ready later than running
        ([BOUND, NOT_READY, NOT_READY, READY], (0.0, 0.0, 1.0, 3.0)),
        # a step seen once stays at its first time: Ready lost and found again
        ([RUNNING, READY, NOT_READY, READY], (0.0, 0.0, 0.0, 1.0)),
        # never Ready
        ([PENDING, BOUND], (0.0, 1.0, None, None)),
    ],
)
def test_observe_marks_each_step_when_first_seen(
    versions: list[dict[str, Any]], expected: tuple[float | None, ...]
) -> None:
    seen = PodSeen()
    for at, pod in enumerate(versions):
        observe(seen, pod, float(at))
    assert (seen.created, seen.scheduled, seen.running, seen.ready) == expected
    assert seen.pod is versions[-1]


def test_phases_are_the_gaps_between_the_steps_from_the_delete() -> None:
    seen = PodSeen(created=100.1, scheduled=101.0, running=101.3, ready=104.0)
    got = phases(100.0, seen, process_created_at=101.2, engine_ready_at=103.5)
    assert list(got) == list(PHASES)
    assert list(got.values()) == pytest.approx([0.1, 0.9, 0.2, 2.3, 0.5])
    assert sum(got.values()) == pytest.approx(104.0 - 100.0)  # the total, in parts


def test_a_scale_up_s_phases_start_at_the_write_of_the_replicas() -> None:
    seen = PodSeen(created=50.4, scheduled=50.5, running=50.7, ready=53.0)
    got = phases(50.0, seen, process_created_at=50.6, engine_ready_at=52.6, names=SCALE_UP_PHASES)
    assert list(got) == ["written -> created", *PHASES[1:]]
    assert list(got.values()) == pytest.approx([0.4, 0.1, 0.1, 2.0, 0.4])
    assert sum(got.values()) == pytest.approx(53.0 - 50.0)


def test_phases_refuse_a_pod_not_seen_at_every_step() -> None:
    with pytest.raises(ValueError, match="not seen at every step"):
        phases(100.0, PodSeen(created=100.1), 101.2, 103.5)


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        ([], None),
        ([PodSeen(created=90.0, ready=95.0)], None),  # the old pod, Ready before the delete
        ([PodSeen(created=90.0, ready=95.0), PodSeen(created=100.5)], None),  # new, not Ready
        ([PodSeen(created=90.0, ready=95.0), PodSeen(created=100.5, ready=104.0)], 1),
        # two new pods (a rollout): the first to be Ready
        ([PodSeen(created=100.2, ready=106.0), PodSeen(created=100.5, ready=104.0)], 1),
    ],
)
def test_the_replacement_is_a_pod_created_after_the_delete(
    seen: list[PodSeen], expected: int | None
) -> None:
    found = first_ready(seen, created_after=100.0)
    assert found is (None if expected is None else seen[expected])


DELETING = {**READY, "metadata": {"name": "p", "deletionTimestamp": "2026-12-06T23:40:00Z"}}


@pytest.mark.parametrize(
    ("pods", "count", "expected"),
    [
        ([], 0, True),  # scaled to 0 and the pod's object gone: its GPU is free
        ([DELETING], 0, False),  # still being deleted: its GPU is not free yet
        ([READY], 1, True),
        ([READY], 0, False),
        ([READY, READY], 1, False),  # a scale-down not begun
        ([READY, DELETING], 1, False),  # a scale-down not finished
        ([READY, NOT_READY], 2, False),  # a scale-up not Ready yet
        ([READY, BOUND], 2, False),
        ([READY, READY], 2, True),
    ],
)
def test_settled_is_the_count_all_ready_and_none_being_deleted(
    pods: list[dict[str, Any]], count: int, expected: bool
) -> None:
    assert is_settled(pods, count) is expected
