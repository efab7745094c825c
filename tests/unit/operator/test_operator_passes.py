"""The operator's bookkeeping around passes that needs no API: child-event filtering, what a
pass records for re-planning, and the re-planner's baseline.

`Controller.run_pass` (the part that talks to the API) is replaced by a recorder; the work
queue, the thread pool and the indexes (plain dicts, as kopf's look) are real.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kvpilot.operator import inventory, passes
from kvpilot.operator.controller import controller_owner
from kvpilot.operator.passes import Reconciler, Replanner


def node(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {inventory.LABEL_NODE_TYPE: "t4"}}}


class FakeController:
    def __init__(self, missing: frozenset[str] = frozenset(), failing: int = 0) -> None:
        self.passes: list[tuple[str, bool, int]] = []
        self.missing = missing
        self.failing = failing  # passes that fail with an API error before one succeeds

    def run_pass(
        self, namespace: str, name: str, nodes: Any, pods: Any, full: bool, body: Any
    ) -> object:
        self.passes.append((name, full, len(nodes)))
        if name in self.missing:
            raise ApiException(status=404, reason="Not Found")
        if self.failing:
            self.failing -= 1
            raise ApiException(status=500, reason="Internal Server Error")
        # what a pass's Desired says of itself
        return SimpleNamespace(is_invalid_spec=False, needs_retry=False, error=None)


def reconciler(fake: FakeController, nodes: dict[str, list[Any]]) -> Reconciler:
    mds = {"ns": [{"metadata": {"namespace": "ns", "name": n}, "spec": {}} for n in ("a", "b")]}
    return Reconciler(fake, nodes, {}, mds, workers=2)  # type: ignore[arg-type]


async def passed(r: Reconciler, key: tuple[str, str], full: bool) -> None:
    """Ask for a pass and return once the queue is idle again."""
    r.queue.put(key, full)
    async with asyncio.timeout(10):
        while not r.queue.is_idle():
            await asyncio.sleep(0.01)


def deployment(ready: int, generation: int = 1, extra: str = "") -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ns",
            "name": "m-t4",
            "generation": generation,
            "ownerReferences": [{"kind": "ModelDeployment", "name": "m", "controller": True}],
        },
        "spec": {"replicas": 2},
        "status": {
            "observedGeneration": 1,
            "replicas": 2,
            "updatedReplicas": 2,
            "readyReplicas": ready,
            "conditions": [{"type": "Available", "message": extra}],
        },
    }


def test_only_child_events_that_change_the_status_are_news() -> None:
    r = reconciler(FakeController(), {})
    assert r.is_news(deployment(ready=1))
    assert not r.is_news(deployment(ready=1, extra="condition text changed"))
    assert r.is_news(deployment(ready=2))
    assert r.is_news(deployment(ready=2, generation=2))  # someone edited the spec: drift
    assert r.is_news(deployment(ready=2, generation=2), deleted=True)
    assert controller_owner(deployment(0)) == "m"


def test_a_full_pass_records_the_inventory_it_planned_with_and_a_gone_object_forgets_it() -> None:
    async def main() -> None:
        fake = FakeController(missing=frozenset({"gone"}))
        nodes = {"n0": [node("n0")]}
        r = reconciler(fake, nodes)
        task = asyncio.create_task(r.run())
        try:
            await passed(r, ("ns", "a"), False)
            assert r.needs_replan(("ns", "a"), [node("n0")])  # a status pass plans nothing
            await passed(r, ("ns", "a"), True)
            assert not r.needs_replan(("ns", "a"), [node("n0")])
            assert r.needs_replan(("ns", "a"), [node("n0"), node("n1")])
            r.planned_with[("ns", "gone")] = "old"
            await passed(r, ("ns", "gone"), True)  # 404 mid-pass: dropped
            assert ("ns", "gone") not in r.planned_with
        finally:
            task.cancel()
        # The pass ran in a thread with the index's values as a list.
        assert fake.passes[:2] == [("a", False, 1), ("a", True, 1)]

    asyncio.run(main())


def test_a_failed_pass_is_tried_again_with_backoff_until_it_succeeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    delays: list[float] = []
    real_backoff_s = passes.backoff_s

    def quick_backoff(failures: int) -> float:
        delays.append(real_backoff_s(failures))  # what the real schedule would wait
        return 0.01

    monkeypatch.setattr(passes, "backoff_s", quick_backoff)

    async def main() -> None:
        fake = FakeController(failing=3)
        r = reconciler(fake, {})
        task = asyncio.create_task(r.run())
        try:
            r.queue.put(("ns", "a"), True)  # no watch event will ask again: the retry must
            async with asyncio.timeout(10):
                while len(fake.passes) < 4 or not r.queue.is_idle():
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
        assert [p[:2] for p in fake.passes] == [("a", True)] * 4
        assert delays == [1.0, 2.0, 4.0]
        assert ("ns", "a") not in r.failures  # a success resets the backoff

    asyncio.run(main())


@pytest.mark.parametrize(
    ("failures", "seconds"), [(1, 1.0), (2, 2.0), (6, 32.0), (7, 60.0), (50, 60.0)]
)
def test_backoff_doubles_up_to_a_minute(failures: int, seconds: float) -> None:
    assert passes.backoff_s(failures) == seconds


def test_each_object_is_seen_first_once_until_it_is_gone() -> None:
    r = reconciler(FakeController(), {})
    assert r.first_sight(("ns", "a"))
    assert not r.first_sight(("ns", "a"))
    assert r.first_sight(("ns", "b"))
    r.forget(("ns", "a"))
    assert r.first_sight(("ns", "a"))  # deleted and made again: a new object


def test_replanner_acts_on_changes_after_the_baseline() -> None:
    async def main() -> None:
        fake = FakeController()
        nodes = {"n0": [node("n0")]}
        r = reconciler(fake, nodes)
        task = asyncio.create_task(r.run())
        try:
            replanner = Replanner(r)
            replanner.notice()
            # The first inventory is the baseline: first sights plan with it.
            assert not replanner.changed.is_set() and r.inventory_known
            replanner.notice()
            assert not replanner.changed.is_set()
            nodes["n1"] = [node("n1")]
            replanner.notice()
            assert replanner.changed.is_set()
            await passed(r, ("ns", "b"), True)  # b was planned with the new inventory
            replanner.replan_all()
            async with asyncio.timeout(5):
                while not r.queue.is_idle():
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
        assert fake.passes == [("b", True, 2), ("a", True, 2)]

    asyncio.run(main())
