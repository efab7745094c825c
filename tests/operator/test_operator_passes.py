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

from kvpilot.operator.planning import inventory
from kvpilot.operator.reconcile import passes
from kvpilot.operator.reconcile.controller import controller_owner
from kvpilot.operator.reconcile.passes import PassScheduler, Replanner


def node(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {inventory.LABEL_NODE_TYPE: "t4"}}}


class FakeController:
    def __init__(
        self,
        missing: frozenset[str] = frozenset(),
        failing: int = 0,
        new: frozenset[str] = frozenset(),
    ) -> None:
        self.passes: list[tuple[str, bool, int]] = []
        self.missing = missing
        self.failing = failing  # passes that fail with an API error before one succeeds
        self.new = set(new)  # objects whose next pass is a first one (applies Deployments only)
        self.handed: list[tuple[str, Any]] = []  # each pass's applied_first argument

    def run_pass(
        self,
        namespace: str,
        name: str,
        nodes: Any,
        pods: Any,
        full: bool,
        body: Any,
        applied_first: Any = None,
    ) -> object:
        self.passes.append((name, full, len(nodes)))
        self.handed.append((name, applied_first))
        if name in self.missing:
            raise ApiException(status=404, reason="Not Found")
        if self.failing:
            self.failing -= 1
            raise ApiException(status=500, reason="Internal Server Error")
        first: dict[tuple[str, str], Any] | None = (
            {("Deployment", f"{name}-t4"): {}} if name in self.new else None
        )
        self.new.discard(name)
        # what a pass's Desired says of itself
        return SimpleNamespace(
            is_invalid_spec=False, needs_retry=False, error=None, applied_first=first
        )


def pass_scheduler(fake: FakeController, nodes: dict[str, list[Any]]) -> PassScheduler:
    mds = {"ns": [{"metadata": {"namespace": "ns", "name": n}, "spec": {}} for n in ("a", "b")]}
    return PassScheduler(fake, nodes, {}, mds, workers=2)  # type: ignore[arg-type]


async def passed(r: PassScheduler, key: tuple[str, str], full: bool) -> None:
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
    r = pass_scheduler(FakeController(), {})
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
        r = pass_scheduler(fake, nodes)
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
        r = pass_scheduler(fake, {})
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
    r = pass_scheduler(FakeController(), {})
    assert r.first_sight(("ns", "a"))
    assert not r.first_sight(("ns", "a"))
    assert r.first_sight(("ns", "b"))
    r.forget(("ns", "a"))
    assert r.first_sight(("ns", "a"))  # deleted and made again: a new object


def test_replanner_acts_on_changes_after_the_baseline() -> None:
    async def main() -> None:
        fake = FakeController()
        nodes = {"n0": [node("n0")]}
        r = pass_scheduler(fake, nodes)
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


def test_a_first_pass_is_finished_shortly_after_with_what_it_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(passes, "FINISH_QUIET_SECONDS", 0.3)

    async def settled(r: PassScheduler, fake: FakeController, passes_made: int) -> None:
        async with asyncio.timeout(10):
            while len(fake.passes) < passes_made or not r.queue.is_idle():
                await asyncio.sleep(0.01)

    async def main() -> None:
        fake = FakeController(new=frozenset({"a", "b"}))
        r = pass_scheduler(fake, {"n0": [node("n0")]})
        r.queue.status_delay = 0.0  # b's status requests below are ready at once
        task = asyncio.create_task(r.run())
        try:
            r.queue.put(("ns", "a"), True)  # its finishing pass comes by itself
            await settled(r, fake, 2)
            assert not r.needs_replan(("ns", "a"), [node("n0")])  # planned once finished
            r.queue.put(("ns", "b"), True)
            await settled(r, fake, 3)
            r.queue.put(("ns", "b"), False)  # a child's event before the finishing pass: left
            await asyncio.sleep(0.1)  # to the finishing pass, which reports the child as it is
            assert len(fake.passes) == 3
            await settled(r, fake, 4)
            r.queue.put(("ns", "b"), False)  # finished: a child's event is a status pass again
            await settled(r, fake, 5)
        finally:
            task.cancel()
        applied: dict[tuple[str, str], Any] = {("Deployment", "a-t4"): {}}
        assert fake.handed[:2] == [("a", None), ("a", applied)]
        assert [p[:2] for p in fake.passes] == [
            ("a", True), ("a", True), ("b", True), ("b", True), ("b", False)
        ]  # fmt: skip
        assert fake.handed[3] == ("b", {("Deployment", "b-t4"): {}})
        assert r.unfinished == {}

    asyncio.run(main())


async def finish_waves(names: list[str], gap: float) -> tuple[list[tuple[float, set[str]]], float]:
    """New objects created `gap` seconds apart: each finish() that asked for finishing passes
    (when, whose), and when the last create came."""
    fake = FakeController(new=frozenset(names))
    r = pass_scheduler(fake, {})
    task = asyncio.create_task(r.run())
    loop = asyncio.get_running_loop()
    waves: list[tuple[float, set[str]]] = []
    real_finish = r.finish

    def recorded_finish() -> None:
        waves.append((loop.time(), {name for _, name in r.unfinished.keys() - r.finish_asked}))
        real_finish()

    r.finish = recorded_finish  # type: ignore[method-assign]
    last_put = loop.time()
    try:
        for name in names:
            r.queue.put(("ns", name), True)
            last_put = loop.time()
            await asyncio.sleep(gap)
        async with asyncio.timeout(10):
            while r.unfinished or not r.queue.is_idle():
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert sorted(p[0] for p in fake.passes) == sorted(names * 2)  # first, then finishing
    assert sorted(n for _, wave in waves for n in wave) == sorted(names)  # each finished once
    return waves, last_put


def test_finishing_passes_wait_for_first_passes_to_stop_coming(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(passes, "FINISH_QUIET_SECONDS", 0.3)
    waves, last_put = asyncio.run(finish_waves(["m0", "m1", "m2"], gap=0.1))
    assert len(waves) == 1 and waves[0][0] >= last_put + 0.3


def test_a_long_burst_is_finished_as_it_goes_at_the_latest_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(passes, "FINISH_QUIET_SECONDS", 0.3)
    monkeypatch.setattr(passes, "FINISH_LATEST_SECONDS", 0.4)
    names = [f"m{i}" for i in range(10)]
    # Creates 0.1 s apart are never 0.3 s quiet: the first finishing passes come mid-burst.
    waves, last_put = asyncio.run(finish_waves(names, gap=0.1))
    assert waves[0][0] < last_put and "m0" in waves[0][1]
