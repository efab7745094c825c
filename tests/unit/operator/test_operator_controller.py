"""The controller's bookkeeping that needs no API: coalescing, child-event filtering, re-planning.

`_pass` (the part that talks to the API) is replaced by a recorder; everything else is real.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.controller import Controller, Replanner, controller_owner


class Recorder(Controller):
    def __init__(self) -> None:
        super().__init__(client=None, config=OperatorConfig())  # type: ignore[arg-type]
        self.calls: list[tuple[str, bool]] = []
        self.during_pass: Any = None

    def _pass(
        self,
        namespace: str,
        name: str,
        nodes: Any,
        pods: Any,
        apply_children: bool,
        body: Any = None,
    ) -> None:
        self.calls.append((name, apply_children))
        if self.during_pass is not None:
            action, self.during_pass = self.during_pass, None
            action()


def test_refresh_during_a_pass_runs_exactly_one_more() -> None:
    c = Recorder()

    # Three status events arrive while the first refresh is running: one extra pass, not three.
    def three_events() -> None:
        for _ in range(3):
            c.refresh_status("ns", "m", [], [])

    c.during_pass = three_events
    c.refresh_status("ns", "m", [], [])
    assert c.calls == [("m", False), ("m", False)]
    assert not c._lock(("ns", "m")).locked()


def test_refresh_during_a_full_pass_runs_after_it_before_the_lock_is_released() -> None:
    c = Recorder()
    c.during_pass = lambda: c.refresh_status("ns", "m", [], [])  # returns at once: lock held
    c.run_pass("ns", "m", [], [])
    # The full pass read the Deployment before the event; the holder refreshes once more.
    assert c.calls == [("m", True), ("m", False)]
    assert not c._lock(("ns", "m")).locked()
    c.run_pass("ns", "m", [], [])
    assert c.calls[2:] == [("m", True)]  # nothing left pending


def test_a_failing_pass_releases_the_lock() -> None:
    c = Recorder()

    def fail() -> None:
        raise RuntimeError("API down")

    c.during_pass = fail
    with pytest.raises(RuntimeError, match="API down"):
        c.run_pass("ns", "m", [], [])
    assert not c._lock(("ns", "m")).locked()


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
    c = Recorder()
    assert c.is_news(deployment(ready=1))
    assert not c.is_news(deployment(ready=1, extra="condition text changed"))
    assert c.is_news(deployment(ready=2))
    assert c.is_news(deployment(ready=2, generation=2))  # someone edited the spec: drift
    assert c.is_news(deployment(ready=2, generation=2), deleted=True)
    assert controller_owner(deployment(0)) == "m"


class FakeController:
    def __init__(self) -> None:
        self.passes: list[str] = []
        self.planned: dict[str, Any] = {}

    def list_model_deployments(self) -> list[dict[str, Any]]:
        return [{"metadata": {"namespace": "ns", "name": n}} for n in ("a", "b")]

    def needs_replan(self, namespace: str, name: str, nodes: Any) -> bool:
        return name != "b"

    def run_pass(self, namespace: str, name: str, nodes: Any, pods: Any) -> None:
        self.passes.append(name)


def test_replanner_acts_on_changes_after_the_baseline() -> None:
    fake = FakeController()
    replanner = Replanner(fake, list)  # type: ignore[arg-type]
    node = {"metadata": {"name": "n0", "labels": {"kvpilot.dev/node-type": "t4"}}}
    replanner.notice([node], [node], [])
    assert replanner._due is None  # the first inventory is the baseline, resume plans with it
    replanner.notice([node], [node], [])
    assert replanner._due is None
    added = {"metadata": {"name": "n1", "labels": {"kvpilot.dev/node-type": "t4"}}}
    replanner.notice([node, added], [node, added], [])
    assert replanner._due is not None
    replanner._replan_all([node, added], [])
    assert fake.passes == ["a"]  # b was already planned with this inventory
